"""Exercise 02_torchrun_env's claims: under torchrun each worker is the process torchrun said it is (its RANK and
LOCAL_RANK), in a world of 2 that an all-reduce spans; started with plain python the program refuses in one line
that names torchrun, at once. The two runs go on side by side."""
import json
import tempfile
from pathlib import Path

from _grading import SLOWER, finish, python, start, torchrun

FILE = "hello.py"
LECTURE = "notebooks/02_torchrun.ipynb"
REFUSAL_SECONDS = 20  # importing torch is most of it: 1-2 s on an idle laptop, up to ~10 s on a busy 2-core machine
STARTER_FAILS = ("under torchrun --standalone --nproc_per_node=2, 2 processes each report the RANK and LOCAL_RANK "
                 "torchrun gave them")
CLAIMS = [STARTER_FAILS,
          "each reports world size 2, the size of the group it joined",
          "an all-reduce of rank + 1 over the group gives 1 + 2 = 3 in each process",
          f"started with plain python, it exits with an error within {REFUSAL_SECONDS * SLOWER:g} s",
          "and says why in one line that names torchrun"]
SECTION = "notebooks/02_torchrun.ipynb, section '{}'"
ENVIRONMENT = SECTION.format("The environment each worker gets")
THE_DIFF = SECTION.format("The diff, hunk by hunk")
WITH_OR_WITHOUT = SECTION.format("With or without torchrun")


def check(learner_file, grade):
    with tempfile.TemporaryDirectory(prefix="ex02-") as folder:
        out = Path(folder)
        workers = start(torchrun(2, learner_file, "--timeout", 15, "--out", out))
        alone = start(python(learner_file, "--timeout", 15, "--out", out / "alone"))
        refusal = finish(alone, timeout=REFUSAL_SECONDS)  # first: its time is then its own
        result = finish(workers, timeout=45)
        records = [json.loads(path.read_text()) for path in sorted(out.glob("process-*.json"))]

        def said(record):
            return (f"process {record['pid']}: rank {record['rank']}, local rank {record['local_rank']}, world size "
                    f"{record['world_size']}; torchrun gave RANK={record['launcher']['RANK']}, LOCAL_RANK="
                    f"{record['launcher']['LOCAL_RANK']}, WORLD_SIZE={record['launcher']['WORLD_SIZE']}")

        told = "\n".join(map(said, records)) or "no process recorded anything"
        if not result.ok:
            told += f"\ntorchrun: {result.summary()}"
        matches = result.ok and len(records) == 2 and all(
            str(record["rank"]) == record["launcher"]["RANK"]
            and str(record["local_rank"]) == record["launcher"]["LOCAL_RANK"] for record in records)
        grade.claim(CLAIMS[0], matches, observed=told,
                    expected="2 records, each rank and local rank as torchrun set them in RANK and LOCAL_RANK: does "
                             "each worker read them from os.environ, and start no processes of its own?",
                    see=ENVIRONMENT)
        if not matches:
            grade.not_checked(CLAIMS[1:3], "needs the 2 workers of the first claim")
        else:
            sizes = [(record["world_size"], record["group_size"]) for record in records]
            grade.claim(CLAIMS[1], all(sizes == (2, 2) for sizes in sizes),
                        observed=", ".join(f"world size {world}, group of {group}" for world, group in sizes),
                        expected="world size 2 and a group of 2 in both: is WORLD_SIZE read from the environment, "
                                 "and does init_process_group take its rank, size and address from there (env://)?",
                        see=THE_DIFF)
            sums = [record["all_reduced"] for record in records]
            grade.claim(CLAIMS[2], sums == [3.0, 3.0], observed=f"all-reduced: {sums}", expected="3.0 in both: are "
                        "both workers in the one group torchrun prepared?", see=THE_DIFF)

        grade.claim(CLAIMS[3], not refusal.timed_out and refusal.returncode != 0,
                    observed=refusal.summary() if refusal.timed_out else f"exit status {refusal.returncode} after "
                    f"{refusal.seconds:.0f} s; its output:\n{refusal.tail()}",
                    expected="a non-zero exit status, at once: does the program look for torchrun's variables "
                             "before anything waits for other processes (joining a group, starting processes)?",
                    see=WITH_OR_WITHOUT)
        lines = [line for line in refusal.output.splitlines() if line.strip()]
        grade.claim(CLAIMS[4], len(lines) == 1 and "torchrun" in lines[0],
                    observed=f"{len(lines)} line(s):\n{refusal.tail()}",
                    expected="one line, naming torchrun (say, the command that starts it right); sys.exit(message) "
                             "prints one, a traceback many", see=WITH_OR_WITHOUT)
