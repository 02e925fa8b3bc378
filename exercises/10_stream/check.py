"""Exercise 10_stream's claims: two ranks with two loader workers each read a stream of shards: one epoch is every
window once, each step the two ranks read the stream's next windows together; and a run resumed at a position, with
another number of ranks, loader workers and windows per rank, reads the stream on from there."""
import json
import tempfile
from pathlib import Path

from _grading import finish, load_learner, start, torchrun

FILE = "train.py"
LECTURE = "notebooks/long_job.ipynb"
RANKS, WORKERS, BATCH, STEPS = 2, 2, 4, 24  # train.py's defaults: 8 windows a step, an epoch of 152 is 19 steps
RESUME_AFTER = 10  # the resumed run starts at position 10 x 8 = 80
# and has other numbers of ranks, loader workers and windows per rank: a split that holds for the first run's only
# fails there
RESUMED_RANKS, RESUMED_WORKERS, RESUMED_BATCH, RESUMED_STEPS = 3, 0, 2, 12  # 0: the training loop reads
STARTER_FAILS = ("over the first 19 steps (one epoch of 152 windows), the ranks and loader workers together read "
                 "every window once")
CLAIMS = ["the 2-process run with 2 loader workers per rank finishes",
          STARTER_FAILS,
          "every step, each rank reads 4 windows and the 2 ranks together the stream's next 8 (what one process taking "
          "8 a step reads)",
          f"a run resumed at position {RESUME_AFTER * RANKS * BATCH} on {RESUMED_RANKS} processes without loader "
          f"workers, {RESUMED_BATCH} windows each, finishes and reads each step the stream's next "
          f"{RESUMED_RANKS * RESUMED_BATCH}, {RESUMED_BATCH} per rank"]
SEE_IDEAS = "notebooks/long_job.ipynb, section '1. The ideas' (the stream's split by rank and by loader worker)"
SEE_MISTAKES = ("notebooks/long_job.ipynb, section '4. The classic mistakes, run live', parts 'Every rank reading the "
                "whole stream' and 'Whole shard files split between ranks: an uneven end'")
SEE_DIFF = "notebooks/long_job.ipynb, section '3. The diffs, hunk by hunk': ShardStream.__iter__ in gpt_stream.py"


def stream_numbers(learner, count):
    """The numbers of the stream's first `count` windows, from the given window_at and the given shards' layout (the
    window numbers of shard k start after those of the shards before it)."""
    starts = [sum(learner.SHARDS[:shard]) for shard in range(len(learner.SHARDS))]
    return [starts[shard] + window for shard, window in map(learner.window_at, range(count))]


def read(folder, ranks=RANKS):
    try:
        return [json.loads((folder / f"rank{rank}.json").read_text())["seen"] for rank in range(ranks)]
    except (OSError, ValueError, KeyError):
        return None


def why_not_finished(result):
    if "StopIteration" in result.output:
        return ("\na rank's stream ended (StopIteration) while the other still trained: did the ranks get different "
                "numbers of windows (whole shard files per rank)? The stream is endless: window_at goes on into the "
                "next epoch")
    return ""


def check(learner_file, grade):
    with tempfile.TemporaryDirectory(prefix="exercise-10-") as folder:
        whole, resumed = Path(folder) / "whole", Path(folder) / "resumed"
        runs = [start(torchrun(RANKS, learner_file, "--out", whole)),
                start(torchrun(RESUMED_RANKS, learner_file, "--out", resumed, "--position",
                               RESUME_AFTER * RANKS * BATCH, "--steps", RESUMED_STEPS, "--num-workers",
                               RESUMED_WORKERS, "--batch-size", RESUMED_BATCH))]
        try:  # meanwhile, the stream one process would read, from the given parts of the learner's file
            learner = load_learner(learner_file)
            reference = stream_numbers(learner, max(STEPS * RANKS * BATCH, RESUME_AFTER * RANKS * BATCH
                                                    + RESUMED_STEPS * RESUMED_RANKS * RESUMED_BATCH))  # both runs
            epoch = sum(learner.SHARDS)
        except Exception as error:  # the given parts broken: said after the runs' own verdict
            reference = error
        first, second = (finish(run, 60) for run in runs)
        seen = read(whole)
        if not grade.claim(CLAIMS[0], first.ok and seen, see=SEE_MISTAKES,
                           observed=first.summary() + why_not_finished(first),
                           expected="exit status 0, and rank0.json and rank1.json"):
            grade.not_checked(CLAIMS[1:], "the run failed")
            return
        if isinstance(reference, Exception):
            grade.not_checked(CLAIMS[1:], "the given parts of your file (SHARDS, window_at) failed in one process: "
                                          f"{type(reference).__name__}: {reference}")
            return

        steps = epoch // (RANKS * BATCH)
        read_in_epoch = sorted(number for rank in seen for batch in rank[:steps] for number in batch)
        twice = sorted({number for number in read_in_epoch if read_in_epoch.count(number) > 1})
        missed = sorted(set(range(epoch)) - set(read_in_epoch))
        same = seen[0][:steps] == seen[1][:steps]
        hint = ("\nrank 0 and rank 1 read the same micro-batches: does each rank take its own share of each step's "
                "windows?" if same else "\na window read twice within one rank: does each loader worker make its own "
                "micro-batches (get_worker_info())?" if any(len(set(sum(rank[:steps], []))) < len(sum(rank[:steps], []))
                                                            for rank in seen) else "")
        grade.claim(CLAIMS[1], not twice and not missed and len(read_in_epoch) == epoch,
                    see=SEE_IDEAS if "get_worker_info" in hint else SEE_MISTAKES,
                    observed=f"{len(read_in_epoch)} windows read in steps 1-{steps}; read more than once: "
                             f"{len(twice)} windows ({twice[:8]}...); never read: {len(missed)} ({missed[:8]}...)"
                             + hint,
                    expected=f"{epoch} windows, each of 0-{epoch - 1} once")

        per_step = RANKS * BATCH
        lengths = [len(rank) for rank in seen]

        def right(step):
            stream = sorted(reference[step * per_step:(step + 1) * per_step])
            return all(len(rank[step]) == BATCH for rank in seen) and sorted(seen[0][step] + seen[1][step]) == stream

        wrong = next((step for step in range(STEPS) if not right(step)), None) if lengths == [STEPS] * RANKS else -1
        if wrong is None:
            observed = expected = ""
        elif wrong < 0:
            observed, expected = f"steps per rank: {lengths}", f"{STEPS} on each rank"
        else:
            observed = (f"step {wrong + 1}: rank 0 read {seen[0][wrong]}, rank 1 {seen[1][wrong]}\ndoes micro-batch m "
                        "begin at position + m x batch size x ranks, does each rank take batch size of its windows, "
                        "and does worker w of W make micro-batches w, w + W, ...?")
            expected = (f"4 windows on each rank, together the stream's next 8: "
                        f"{sorted(reference[wrong * per_step:(wrong + 1) * per_step])}")
        grade.claim(CLAIMS[2], wrong is None, observed=observed, expected=expected, see=SEE_IDEAS)

        later, first = read(resumed, RESUMED_RANKS), RESUME_AFTER * RANKS * BATCH
        per_step = RESUMED_RANKS * RESUMED_BATCH
        if not second.ok or later is None:
            observed = second.summary() + why_not_finished(second)
        else:
            steps_ok = [len(rank) for rank in later] == [RESUMED_STEPS] * RESUMED_RANKS
            wrong = next((step for step in range(RESUMED_STEPS) if not steps_ok or any(
                len(rank[step]) != RESUMED_BATCH for rank in later) or sorted(sum((rank[step] for rank in later), []))
                != sorted(reference[first + step * per_step:first + (step + 1) * per_step])), None)
            observed = "" if wrong is None else (
                f"step {wrong + 1}: " + ", ".join(f"rank {r} read {rank[wrong]}" for r, rank in enumerate(later))
                + f"; the stream's windows {first + wrong * per_step}-{first + (wrong + 1) * per_step - 1} are "
                f"{sorted(reference[first + wrong * per_step:first + (wrong + 1) * per_step])}\n"
                + ("does the stream start at `position`, counted in windows of all ranks? Does nothing in __iter__ "
                   "assume 2 ranks, loader workers or 4 windows (get_worker_info() is None without them)?"))
        grade.claim(CLAIMS[3], second.ok and later is not None and not observed, observed=observed, see=SEE_DIFF,
                    expected=f"each step, {RESUMED_BATCH} windows on each of {RESUMED_RANKS} ranks, together the "
                             f"stream's next {per_step}, from window {first} on")
