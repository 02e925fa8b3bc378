"""Runs one test many times in a row, with the Python that runs this script, and counts how each run ended (issue
34: the loader-workers test hung about once in 12 runs on torch 2.9.1 and once in 55 on 2.4.1, a DataLoader worker
stuck at its start, before the loaders got a fork server; its claims are now checked in the preemption test below,
which runs the loader's workers too). Not a test: 200 runs take hours on 2 cores.

    .venv-oldest/bin/python tools/repeat_test.py --runs 200 \\
        "tests/test_fault_tolerance.py::test_two_preemption_signals_each_save_a_snapshot_and_the_reruns_resume"

A run counts as passed when pytest exits 0, failed when it exits otherwise (the test's own deadlines turn a hang
into a failure that prints every process's stacks), and hung when it is still running after --timeout seconds (then
its processes are killed). It writes tools/repeat_test.md (the counts, the durations, each bad run's last lines)
unless --out says otherwise, after every run, so an interrupted loop still leaves its counts.
"""
import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from helpers import kill_tree  # noqa: E402


def run_once(test, timeout):
    began = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
        outcome = "passed" if process.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        output, _ = process.communicate()
        outcome = "hung"
    return outcome, time.monotonic() - began, output


def report(test, results, began, path):
    import torch

    counts = {outcome: sum(1 for result in results if result[0] == outcome) for outcome in ("passed", "failed", "hung")}
    durations = [result[1] for result in results]
    lines = [f"# {Path(test.split('::')[0]).name}, {len(results)} runs in a row", "",
             f"`{test}`", "",
             f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} cores; "
             f"started {began}, {len(results)} runs in {sum(durations) / 60:.0f} min.", "",
             f"**{counts['passed']} passed, {counts['failed']} failed, {counts['hung']} hung.** "
             f"Each run: median {statistics.median(durations):.0f} s, "
             f"range {min(durations):.0f}-{max(durations):.0f} s.", ""]
    for number, (outcome, seconds, output) in enumerate(results, 1):
        if outcome != "passed":
            lines += [f"## Run {number}: {outcome} after {seconds:.0f} s", "", "```", output[-3000:].rstrip(), "```",
                      ""]
    path.write_text("\n".join(lines))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("test", help="one pytest node id")
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=600, help="seconds before a run counts as hung")
    parser.add_argument("--out", type=Path, default=REPO / "tools" / "repeat_test.md")
    args = parser.parse_args()
    began, results = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), []
    for number in range(1, args.runs + 1):
        results.append(run_once(args.test, args.timeout))
        print(f"run {number}: {results[-1][0]} in {results[-1][1]:.0f} s", flush=True)
        report(args.test, results, began, args.out)
    return 0 if all(result[0] == "passed" for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
