"""Exercise 04_resume's claims: an uninterrupted run and a run killed with kill -9 mid-epoch (restarted by torchrun)
end bitwise equal; the restart continued from the last snapshot instead of starting over; a writer killed mid-write
leaves the previous snapshot whole; a snapshot that would run code is refused."""
import re
import tempfile
from pathlib import Path

import torch
from _grading import PYTHON, TORCHRUN, finish, start

FILE = "train.py"
LECTURE = "notebooks/04_fault_tolerant.ipynb"
STEPS_PER_EPOCH, STEPS = 6, 12  # train.py's 96 samples, 8 per rank, 2 ranks, 2 epochs
SAVE_EVERY, KILL_AFTER = 4, 10  # snapshots after steps 4, 8, 12; rank 1 dies after step 10, 2 batches into epoch 1
RESUMED = [(1, batch) for batch in range(2, STEPS_PER_EPOCH)]  # after the snapshot of step 8: epoch 1, batches 2-5
STARTER_FAILS = "the restart resumed from the snapshot of step 8: it trained steps 9-12 (epoch 1, batches 2-5) only"
CLAIMS = ["an uninterrupted 2-process run finishes",
          f"a run whose rank 1 is killed with kill -9 after step {KILL_AFTER} is restarted by torchrun and finishes",
          STARTER_FAILS,
          "the resumed run ends with parameters bitwise equal to the uninterrupted run's",
          "a writer killed with SIGKILL halfway through a snapshot leaves the previous snapshot whole at its path",
          "load_snapshot refuses a file whose unpickling would run code"]
SEE_SNAPSHOT = "notebooks/04_fault_tolerant.ipynb, section '3. What a snapshot must hold, and why each part'"
SEE_SAFELY = "notebooks/04_fault_tolerant.ipynb, section '4. Writing a snapshot safely, and reading it safely'"
SEE_EPOCH = "notebooks/04_fault_tolerant.ipynb, section '5. Resuming in the middle of an epoch'"

# Imports the learner's file (main() does not run) and calls its two functions in this one process: first
# load_snapshot on a pickle that would create a marker file, then save_snapshot twice, the second time with a
# torch.save that writes half of its bytes and then SIGKILLs this process, as a crash mid-write would.
WRITER = """
import importlib.util, io, os, pickle, signal, sys
import torch
learner_file, folder = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location("learner", learner_file)
learner = importlib.util.module_from_spec(spec)
spec.loader.exec_module(learner)

class Payload:
    def __reduce__(self):
        return (open, (os.path.join(folder, "pwned"), "w"))

with open(os.path.join(folder, "evil.pt"), "wb") as f:
    pickle.dump({"model": Payload()}, f)
try:
    learner.load_snapshot(os.path.join(folder, "evil.pt"))
except Exception:
    pass
path = os.path.join(folder, "snapshot.pt")
learner.save_snapshot(path, {"step": 1, "weights": torch.arange(4096.0)})
save = torch.save

def dying_save(obj, f, *args, **kwargs):
    buffer = io.BytesIO()
    save(obj, buffer, *args, **kwargs)
    half = buffer.getvalue()[:len(buffer.getvalue()) // 2]
    if isinstance(f, (str, os.PathLike)):
        with open(f, "wb") as file:
            file.write(half)
    else:
        f.write(half)
        f.flush()
    os.kill(os.getpid(), signal.SIGKILL)

torch.save = dying_save
learner.save_snapshot(path, {"step": 2, "weights": torch.zeros(4096)})
print("save_snapshot returned without calling torch.save")
"""


def launch(learner_file, folder, *extra):
    folder.mkdir()
    # one restart allowed; a fresh workers' store per attempt (04_fault_tolerant.py's docstring says why)
    return start([TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=1", learner_file,
                  "--snapshot", folder / "snapshot.pt", "--save-every", SAVE_EVERY, "--out", folder, *extra],
                 TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")


def trained(folder):
    """{attempt: [(epoch, batch), ...]} from the steps.txt the given code writes."""
    steps = {}
    path = folder / "steps.txt"
    for attempt, epoch, batch in re.findall(r"attempt (\d+) epoch (\d+) batch (\d+)", path.read_text()
                                            if path.exists() else ""):
        steps.setdefault(int(attempt), []).append((int(epoch), int(batch)))
    return steps


def described(steps):
    if not steps:
        return "no step"
    first, last = steps[0], steps[-1]
    return f"{len(steps)} steps, from epoch {first[0]} batch {first[1]} to epoch {last[0]} batch {last[1]}"


def resume_verdict(steps):
    after = steps.get(1, [])
    if after == RESUMED:
        return True, "", ""
    if not after:
        why = "the restarted processes trained no step: did they fail, or believe the training was over?"
    elif len(after) >= STEPS:
        why = "they trained the whole run again: does the trainer load the snapshot and start at its epoch and batch?"
    elif after[0] == (1, 0):
        why = "they started epoch 1 from its first batch: does the resume skip the batches the epoch already trained?"
    else:
        why = "is the snapshot's position (epoch, batches done in it) saved after the step it follows, and restored?"
    return False, f"after the restart: {described(after)}\n{why}", f"{described(RESUMED)}"


def check(learner_file, grade):
    with tempfile.TemporaryDirectory(prefix="exercise-04-") as folder:
        check_in(learner_file, grade, Path(folder))


def check_in(learner_file, grade, work):
    # the three at once: most of each is starting Python and importing torch, which overlap on 2 cores
    whole = launch(learner_file, work / "whole")
    killed = launch(learner_file, work / "killed", "--kill-after", KILL_AFTER)
    (work / "writer").mkdir()
    writer = start([PYTHON, "-c", WRITER, learner_file, work / "writer"])
    # Deadlines for a hang, not for speed: about 30 s each on a quiet 2-core machine, up to 56 s under heavy load
    whole, killed, writer = finish(whole, 80), finish(killed, 90), finish(writer, 45)

    if not grade.claim(CLAIMS[0], whole.ok, observed=whole.summary(), expected="exit status 0", see=SEE_SNAPSHOT):
        grade.not_checked(CLAIMS[1:4], "the uninterrupted run failed")
    elif not grade.claim(CLAIMS[1], killed.ok and (work / "killed" / "final.pt").exists(),
                         observed=killed.summary(), expected="exit status 0, after one restart",
                         see="notebooks/04_fault_tolerant.ipynb, section '2. The agent's restart loop'"):
        grade.not_checked(CLAIMS[2:4], "the killed run did not finish")
    else:
        ok, observed, expected = resume_verdict(trained(work / "killed"))
        grade.claim(CLAIMS[2], ok, observed=observed, expected=expected, see=SEE_EPOCH)
        reference = torch.load(work / "whole" / "final.pt", weights_only=True)
        resumed = torch.load(work / "killed" / "final.pt", weights_only=True)
        differing = {name: f"{(reference[name] - resumed[name]).abs().max().item():.1e}" for name in reference
                     if not torch.equal(reference[name], resumed[name])}
        grade.claim(CLAIMS[3], not differing, see=SEE_SNAPSHOT,
                    observed=f"largest difference per tensor: {differing}\ndoes the snapshot hold the optimizer's "
                             "momentum and the random state (dropout draws from it), and does the resume restore both?",
                    expected="every tensor equal, element by element (same seed, same batches, CPU: no rounding "
                             "differs)")

    snapshot = work / "writer" / "snapshot.pt"
    if writer.timed_out or (writer.returncode != -9 and "without calling torch.save" not in writer.output):
        grade.not_checked(CLAIMS[4:], f"the writer failed: {writer.summary()}")
        return
    try:
        survivor = torch.load(snapshot, weights_only=True)
        survived = survivor.get("step") == 1 if isinstance(survivor, dict) else False
        observed = f"{snapshot.name} holds {survivor!r:.80}"
    except Exception as error:
        survived, observed = False, f"{snapshot.name}: {type(error).__name__}: {str(error).splitlines()[0][:100]}"
    if "without calling torch.save" in writer.output:
        observed = "save_snapshot returned without calling torch.save: is the snapshot written with torch.save?"
    elif not survived:
        observed += ("\nis the snapshot written to a temporary name first, and renamed over the old one "
                     "(os.replace) only once it is complete?")
    grade.claim(CLAIMS[4], survived, observed=observed, expected="the previous snapshot ({'step': 1, ...}), whole",
                see=SEE_SAFELY)
    grade.claim(CLAIMS[5], not (work / "writer" / "pwned").exists(), see=SEE_SAFELY,
                observed="the file's code ran (it created a file): is torch.load called with weights_only=True?",
                expected="no code from the file runs")
