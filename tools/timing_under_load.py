"""Runs the lessons' timing-sensitive experiments (or the timing-sensitive tests) many times under a full load.

Two busy-loop processes load both cores meanwhile, and each round checks that what the prose says still happened
(issue 34, item 6), or that the tests pass. Not a test: a few minutes (the tests: 7 min for 10 rounds, 18 with
--writers; --lessons: 7 min a round).

    .venv/bin/python tools/timing_under_load.py            # 10 rounds
    .venv/bin/python tools/timing_under_load.py --rounds 3
    .venv/bin/python tools/timing_under_load.py --tests    # the timing-sensitive tests instead (TIMING_TESTS)
    .venv/bin/python tools/timing_under_load.py --tests --writers   # and the snapshot-writer kills
    .venv/bin/python tools/timing_under_load.py --tests --lessons   # and the timing-sensitive lessons' executions

Each experiment is a rank that goes on without a collective while the other rank waits in it; the ranks leave the
group together (runs.Processes), so the collective's timeout must end the wait, whatever the load. Each check asks
for gloo's "Timed out" in rank 0's error, within a few seconds of the 3 s timeout:
- lesson 01, mistake 3: rank 0 all-reduces alone (timeout 3 s);
- lesson ddp_under_the_hood, uneven inputs without Join: rank 0's third backward waits (timeout 3 s);
- lesson when_it_breaks, the NaN seen by one rank: rank 0's backward waits (timeout 3 s).
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
    """gloo's timeout, not another error, ended rank 0's wait, within `work` seconds."""
    seconds = re.search(seconds_pattern, said)
    return "Timed out" in said and seconds is not None and float(seconds.group(1)) < work


# The tests whose outcome depends on a wait ending before another: a collective timeout of a few seconds against a
# rank that sleeps or works longer, or a snapshot write held open while a process is killed.
TIMING_TESTS = [
    "tests/test_build_ddp.py",  # the unused-parameter wait ends at its 3 s timeout, inside [2.5, 6] s
    "tests/test_fsdp_mistakes.py",  # a rank-0-only collective ends at its 3 s timeout
    "tests/test_troubleshooting.py::test_a_skipped_collective_fails_at_the_timeout_instead_of_hanging",  # 3 s
    "tests/test_troubleshooting.py::test_debug_detail_names_mismatched_collectives",  # DETAIL's check before 10 s
    "tests/test_refused_input.py::test_a_preparation_slower_than_the_collective_timeout_does_not_time_out_the_others",
]
# A kill that must land inside a snapshot write held open for 1.5 s (the writer tests of test_fault_tolerance.py
# and test_fsdp.py): with --writers too.
WRITER_TESTS = [
    "tests/test_fault_tolerance.py::test_killing_the_writer_mid_write_keeps_the_previous_snapshot",
    "tests/test_fsdp.py::test_killing_the_writer_mid_write_keeps_the_previous_snapshot",
]


# The lessons whose outputs show a wait ending before another (timeouts against sleeping or working ranks, kills
# and signals at chosen moments), each executed from a clean kernel as tests/test_notebooks.py does: with --lessons.
LESSON_TESTS = [f"tests/test_notebooks.py::test_notebook_runs_from_a_clean_kernel[{name}]" for name in (
    "01_mp_spawn", "03_multinode", "04_fault_tolerant", "05_fsdp", "ddp_under_the_hood", "build_ddp_yourself",
    "preemption_and_elastic", "when_it_breaks")]


def run_tests(rounds, tests):
    """Each round runs `tests` in one pytest process; returns the rounds' failed test ids."""
    import subprocess

    repo, failed, began = Path(__file__).resolve().parents[1], [], time.monotonic()
    for round_ in range(1, rounds + 1):
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", *tests],
                                cwd=repo, capture_output=True, text=True, timeout=1800)
        failures = re.findall(r"^FAILED (\S+)", result.stdout, re.M)
        summary = result.stdout.strip().splitlines()[-1]
        print(f"round {round_} ({time.monotonic() - began:.0f} s): {summary}", flush=True)
        failed += [(round_, test) for test in failures] or ([(round_, summary)] if result.returncode else [])
    return failed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--tests", action="store_true", help="run TIMING_TESTS instead of the lesson experiments")
    parser.add_argument("--writers", action="store_true", help="with --tests: WRITER_TESTS too")
    parser.add_argument("--lessons", action="store_true", help="with --tests: LESSON_TESTS too (long: ~5 min a round)")
    args = parser.parse_args()
    from lessons import ddp_concepts, ddp_machinery, diagnosis, runs

    loaders = [multiprocessing.Process(target=busy, daemon=True) for _ in range(2)]
    for loader in loaders:
        loader.start()
    if args.tests:
        try:
            tests = TIMING_TESTS + (WRITER_TESTS if args.writers else []) + (LESSON_TESTS if args.lessons else [])
            failed = run_tests(args.rounds, tests)
        finally:
            for loader in loaders:
                loader.kill()
        for round_, test in failed:
            print(f"round {round_}: FAILED {test}")
        print(f"{len(failed)} failures in {args.rounds} rounds of {len(tests)} test ids, with both cores busy")
        return 1 if failed else 0
    group, failures, began = runs.Processes(2), [], time.monotonic()
    try:
        for round_ in range(1, args.rounds + 1):
            rank0, rank1 = group.run(ddp_concepts.collective_on_rank_0_only, collective_timeout=3)
            lesson01 = timed_out_within(rank0, r"after (\d+) s") and "never called" in rank1
            no_join = [result["outcome"] for result in group.run(ddp_machinery.uneven_inputs, False,
                                                                  collective_timeout=3)]
            lesson05 = "rank 0, step 3" in no_join[0] and timed_out_within(no_join[0], r"after (\d+) s") and \
                "finished" in no_join[1]
            (step0, lines0), (step1, lines1) = group.run(diagnosis.nan_loss_check, False, collective_timeout=3,
                                                         timeout=60)
            failed = [line for line in lines0 if "backward() failed" in line]
            lesson07 = step0 == 3 and len(failed) == 1 and timed_out_within(failed[0], r"^\s*([\d.]+) s") and \
                step1 == 3 and "I leave the loop" in lines1[-1]
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
