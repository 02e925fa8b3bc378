"""The GPU check: every test marked `gpu` (tests/test_gpu.py) and the GPU benchmark, run with the Python this
script is started with (a GPU machine's own: no venv, nothing installed, nothing downloaded), then one report.

    make test-gpu PYTHON=/usr/bin/python3 OUT=gpu-check      # or: python3 tools/gpu_check.py --out gpu-check

It writes into OUT (few files, so that a machine lent for minutes hands them all back):
- log.txt: everything pytest and the benchmark printed;
- report.json: the machine (Python, torch, CUDA, GPUs), each test's outcome, time and message, what the tests
  found out (tests/test_gpu.py's findings: a warning seen or not, a difference measured), the benchmark's figures;
- junit.xml: pytest's own record.
On a machine without CUDA every test skips, saying so, the benchmark is skipped, and it exits 0: CI runs it there
to prove the plumbing (docs/ci.md); the GPU half needs a GPU machine (the record of GPU runs:
docs/gpu-runs/README.md).

What it takes on one H200 (16 cores, torch 2.11, 2026-11-28, docs/gpu-runs/README.md): the tests about 6 minutes (15
tests, 362 s between them: each launch pays several seconds of start-up, the resume test 71 s), the benchmark about
2.5. Each part is stopped at its limit (6 min 40 s and 2 min 30 s), then given 20 s to write its files; the machine's
facts are stopped at 60 s; and the benchmark's limit is shortened where needed so that it, its 20 s included, ends 9.5
minutes after the start. So the whole check ends within 10 minutes whatever happens (a lent machine's one command may
run 10); a stopped part still reports what it had.
It needs torch, pytest and numpy (the determinism test); not torchvision (the runs use the built-in data and models),
psutil, py-spy, pytest-timeout or pytest-xdist.
"""
import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from helpers import descendants  # noqa: E402  (psutil's, or /proc's where this Python lacks psutil)

TESTS_SECONDS = 400  # pytest is stopped here; the benchmark at BENCHMARK_SECONDS, or sooner to end by DEADLINE
BENCHMARK_SECONDS = 150
GRACE_SECONDS = 20  # after SIGINT, for pytest to end its session and write its junit file
MACHINE_SECONDS = 60
DEADLINE = 570  # seconds from the start, graces included: 30 s to spare under a lent machine's 10-minute command
BENCHMARK = REPO / "benchmarks" / "gpu_throughput.py"


MACHINE = """
import json, platform, shutil, sys, sysconfig, torch
gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0)]
print(json.dumps({"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
                  "torch": torch.__version__, "cuda": torch.version.cuda, "gpus": gpus,
                  "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpus else None,
                  # torch.compile on a GPU builds Triton's launcher with a C compiler and Python's headers
                  "c_compiler": shutil.which("cc") or shutil.which("gcc"),
                  "python_headers": os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))}))
"""


def machine():
    """The machine's facts, from a child process: CUDA initialised here would hold memory on GPU 0 all along."""
    try:  # a hung CUDA initialisation must not take the time the tests need, nor end the check without a report
        result = subprocess.run([sys.executable, "-c", "import os" + MACHINE], capture_output=True, text=True,
                                timeout=MACHINE_SECONDS)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped after {MACHINE_SECONDS} s"}
    return json.loads(result.stdout) if result.returncode == 0 else {"error": result.stderr[-2000:]}


def run(command, seconds, log, env=None):
    """Runs a command with its output appended to the log. At `seconds`: SIGINT (pytest then ends its session and
    writes its junit file), GRACE_SECONDS later SIGKILL to it and everything it started (the tests' launches run in
    sessions of their own: they would keep the GPU busy). Returns (exit status, seconds)."""
    began = time.monotonic()
    log.write(f"\n$ {' '.join(map(str, command))}\n")
    log.flush()
    process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env,
                               start_new_session=True)
    try:
        status = process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        log.write(f"\nstopped after {seconds} s\n")
        log.flush()
        family = descendants(process.pid)
        process.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=GRACE_SECONDS)
        for pid in [process.pid, *family, *descendants(process.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait()
        status = "timed out"
    return status, round(time.monotonic() - began, 1)


def outcomes(junit, log):
    """Each test's outcome, seconds and message, from pytest's junit file; from its -v lines in the log when it
    was stopped before writing that file."""
    if not junit.exists():
        found = re.findall(r"^tests/test_gpu.py::(\S+(?: \S+)*?) (PASSED|FAILED|SKIPPED|ERROR)", log, re.M)
        return [{"test": test, "outcome": outcome.lower(), "seconds": None, "message": "(from the log)"}
                for test, outcome in found]
    tests = []
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        verdict = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        tests.append({"test": case.get("name"), "outcome": "passed" if verdict is None else verdict.tag,
                      "seconds": float(case.get("time", 0)),
                      "message": None if verdict is None else (verdict.get("message") or "")[:2000]})
    return tests


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for log.txt, report.json, junit.xml")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    findings = args.out / "findings.jsonl"
    findings.unlink(missing_ok=True)
    report = {"machine": machine(), "began": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    print(f"GPU check on {report['machine']}", flush=True)
    env = {**os.environ, "DDP_STEPS_GPU_FINDINGS": str(findings.resolve())}
    with open(args.out / "log.txt", "w") as log:
        left = round(DEADLINE - GRACE_SECONDS - (time.monotonic() - began))
        status, seconds = run([sys.executable, "-m", "pytest", "tests/test_gpu.py", "-m", "gpu", "-rA", "-v",
                               "-p", "no:cacheprovider", f"--junitxml={(args.out / 'junit.xml').resolve()}"],
                              min(TESTS_SECONDS, left), log, env)
        log.flush()
        report["tests"] = {"exit": status, "seconds": seconds,
                           "each": outcomes(args.out / "junit.xml", (args.out / "log.txt").read_text(errors="replace"))}
        report["findings"] = [json.loads(line) for line in findings.read_text().splitlines()] if findings.exists() \
            else []
        (args.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")  # again below, with the benchmark
        left = round(DEADLINE - GRACE_SECONDS - (time.monotonic() - began))
        if report["machine"].get("gpus") and BENCHMARK.exists() and left > 0:
            benchmark = args.out / "benchmark.json"
            status, seconds = run([sys.executable, BENCHMARK, "--out", benchmark.resolve()],
                                  min(BENCHMARK_SECONDS, left), log)
            report["benchmark"] = {"exit": status, "seconds": seconds,
                                   "figures": json.loads(benchmark.read_text()) if benchmark.exists() else None}
        else:
            report["benchmark"] = {"skipped": "no GPU" if not report["machine"].get("gpus") else
                                   f"no {BENCHMARK.name}" if not BENCHMARK.exists() else "no time left"}
    findings.unlink(missing_ok=True)  # in the report now: fewer files to hand back
    (args.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    counts = {}
    for test in report["tests"]["each"]:
        counts[test["outcome"]] = counts.get(test["outcome"], 0) + 1
    print(f"tests: {counts} in {report['tests']['seconds']} s (exit {report['tests']['exit']}); "
          f"benchmark: {report['benchmark']}; report: {args.out / 'report.json'}")
    failed = report["tests"]["exit"] != 0 or report["benchmark"].get("exit", 0) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
