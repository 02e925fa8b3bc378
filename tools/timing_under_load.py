"""Runs the lessons' timing-sensitive experiments many times while two busy-loop processes load both cores, and
checks each time that what the prose says still happened (issue 34, item 6). Not a test: a few minutes.

    .venv/bin/python tools/timing_under_load.py            # 10 rounds
    .venv/bin/python tools/timing_under_load.py --rounds 3

Each experiment is a rank that goes on with other work while the other rank waits in a collective; the
collective's timeout must end the wait first, whatever the load. So each check asks for gloo's "Timed out" in rank
0's error and for rank 0's failure before rank 1's work ends (a late timeout would fail otherwise: when rank 1
leaves, the group's connections close and rank 0 fails with "Connection closed by peer" instead):
- lesson 01, mistake 3: rank 0 all-reduces alone (timeout 3 s), rank 1 works 9 s;
- lesson ddp_under_the_hood, uneven inputs without Join: rank 0's third backward waits (timeout 3 s), rank 1 works 9 s;
- lesson when_it_breaks, the NaN seen by one rank: rank 0's backward waits (timeout 3 s), rank 1 works 3 + 6 s.
"""
import argparse
import multiprocessing
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "notebooks"))


def busy():
    while True:
        pass


def timed_out_within(said, seconds_pattern, work=9):
    """gloo's timeout, not another error, ended rank 0's wait, and before rank 1's `work` seconds were over."""
    seconds = re.search(seconds_pattern, said)
    return "Timed out" in said and seconds is not None and float(seconds.group(1)) < work


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    from lessons import ddp_concepts, ddp_machinery, diagnosis, runs

    loaders = [multiprocessing.Process(target=busy, daemon=True) for _ in range(2)]
    for loader in loaders:
        loader.start()
    group, failures, began = runs.Processes(2), [], time.monotonic()
    try:
        for round_ in range(1, args.rounds + 1):
            rank0, rank1 = group.run(ddp_concepts.collective_on_rank_0_only, collective_timeout=3)
            lesson01 = timed_out_within(rank0, r"after (\d+) s") and "never called" in rank1
            no_join = [result["outcome"] for result in group.run(ddp_machinery.uneven_inputs, False,
                                                                  collective_timeout=3)]
            lesson05 = "rank 0, step 3" in no_join[0] and timed_out_within(no_join[0], r"after (\d+) s") and \
                "finished" in no_join[1]
            (step0, lines0), (step1, lines1) = group.run(diagnosis.nan_loss_check, False, 3 + 6,
                                                         collective_timeout=3, timeout=60)
            failed = [line for line in lines0 if "backward() failed" in line]
            lesson07 = step0 == 3 and len(failed) == 1 and timed_out_within(failed[0], r"^\s*([\d.]+) s") and \
                any("done with" in line for line in lines1)
            print(f"round {round_} ({time.monotonic() - began:.0f} s): lesson 01 {'ok' if lesson01 else 'FAILED'}, "
                  f"ddp_under_the_hood {'ok' if lesson05 else 'FAILED'}, "
                  f"when_it_breaks {'ok' if lesson07 else 'FAILED'}", flush=True)
            for name, ok, said in (("01", lesson01, [rank0, rank1]), ("ddp_under_the_hood", lesson05, no_join),
                                   ("when_it_breaks", lesson07, [lines0, lines1])):
                if not ok:
                    failures.append((round_, name, said))
    finally:
        group.close()
        for loader in loaders:
            loader.kill()
    for round_, name, said in failures:
        print(f"round {round_}, lesson {name}:", *said, sep="\n  ")
    print(f"{len(failures)} failures in {args.rounds} rounds of 3 experiments, with both cores busy")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
