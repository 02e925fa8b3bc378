"""What DDP costs, how it scales, and what fault tolerance costs, measured with the tutorial's own scripts.

    .venv/bin/python benchmarks/run.py                 # about 12 minutes on 2 cores (5 repeats)
    .venv/bin/python benchmarks/run.py --repeats 3

Every configuration runs once per repeat, all of them side by side in each repeat, and the table reports
medians: ratios measured in the same conditions are what this noisy machine can give. Throughput is the
steady state (epochs after the first, training only); start-up (launch to training: imports, process group,
data, model) is reported apart. Prints a table and writes benchmarks/results.md and benchmarks/results.png.
"""
import argparse
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
DATA = ["--train-samples", "4096", "--val-samples", "256", "--epochs", "3"]


def launch(command, threads, **env):
    """Runs a command from the repository root; returns (wall seconds, [(seconds since launch, line)])."""
    environment = {**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
                   "OMP_NUM_THREADS": str(threads), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **env}
    began = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, env=environment, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)
    return began, process


def collect(began, process, timeout=600):
    lines = []
    timer = threading.Timer(timeout, process.kill)
    timer.start()
    for line in process.stdout:
        lines.append((time.perf_counter() - began, line.rstrip("\n")))
    process.wait()
    timer.cancel()
    if process.returncode != 0:
        sys.exit(f"failed: {process.args}\n" + "\n".join(line for _, line in lines[-30:]))
    return time.perf_counter() - began, lines


def run(command, threads=1, **env):
    return collect(*launch(command, threads, **env))


def steady(lines):
    """Median samples/s of the epochs after the first (the first pays for warm-up)."""
    rates = [json.loads(line)["samples_per_s"] for _, line in lines if line.startswith('{"epoch"')]
    return statistics.median(rates[1:])


def startup(lines):
    return next(t for t, line in lines if re.match(r"\w+ on (cpu|cuda)", line))


def script(name, nproc, *args, metrics):
    launcher = [sys.executable] if nproc == 0 else [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}"]
    return [*launcher, name, *DATA, *args, "--metrics", str(metrics)]


def with_metrics(wall_lines, metrics):
    wall, lines = wall_lines
    return wall, lines + [(0, line) for line in Path(metrics).read_text().splitlines()]


def one_repeat(folder, repeat):
    """All configurations once; returns {name: value}."""
    results = {}
    m = lambda name: folder / f"{name}-{repeat}.jsonl"  # noqa: E731
    # DDP overhead: the same single process, with and without DDP (2 threads each), in alternating order
    pair = [("00, 1 process x 2 threads", script("00_single_gpu.py", 0, metrics=m("00"))),
            ("02, 1 process x 2 threads, DDP", script("02_torchrun.py", 1, metrics=m("02x1t2")))]
    for name, command in pair if repeat % 2 == 0 else reversed(pair):
        results[name] = steady(with_metrics(run(command, threads=2), command[-1])[1])
    # scaling: the same global batch (128) on 1 process x 1 thread and on 2 processes x 1 thread
    _, lines = with_metrics(run(script("02_torchrun.py", 1, "--batch-size", "128", metrics=m("02x1")), threads=1),
                            m("02x1"))
    results["02, 1 process x 1 thread, batch 128"] = steady(lines)
    # the machine's own ceiling for that: two independent single processes at once, no DDP, no communication
    _, lines = with_metrics(run(script("00_single_gpu.py", 0, metrics=m("00t1")), threads=1), m("00t1"))
    results["00, 1 process x 1 thread, batch 64"] = steady(lines)
    pair = [launch(script("00_single_gpu.py", 0, metrics=m(f"00pair{i}")), 1) for i in range(2)]
    for started in pair:
        collect(*started)
    results["two separate 00 processes at once x 1 thread, batch 64 each"] = sum(
        steady(with_metrics((0, []), m(f"00pair{i}"))[1]) for i in range(2))
    wall, lines = with_metrics(run(script("02_torchrun.py", 2, metrics=m("02x2"))), m("02x2"))
    results["02, 2 processes x 1 thread, batch 64 each"] = steady(lines)
    results["start-up: launch to training, 02 x 2 (s)"] = startup(lines)
    # framework overhead: a bare DDP loop on the same model, data and batch
    _, lines = run([TORCHRUN, "--standalone", "--nproc_per_node=2", "benchmarks/bare_ddp.py", *DATA[:2], *DATA[4:]])
    results["bare DDP loop, 2 processes x 1 thread"] = steady(lines)
    # fault tolerance: snapshots at the default interval, and the time a killed worker costs
    snapshot = folder / f"snapshot-{repeat}.pt"
    wall_ft, lines = with_metrics(run(script("04_fault_tolerant.py", 2, "--checkpoint", str(snapshot),
                                             metrics=m("04"))), m("04"))
    results["04, 2 processes x 1 thread, snapshots every 50 steps"] = steady(lines)
    writes = [float(x) for x in re.findall(r"saved snapshot .* in ([\d.]+) ms", "\n".join(text for _, text in lines))]
    epochs = [json.loads(line) for _, line in lines if line.startswith('{"epoch"')]
    train_seconds = sum(4096 / e["samples_per_s"] for e in epochs)
    results["snapshot writes / training time (%)"] = 100 * sum(writes) / 1000 / train_seconds
    results["snapshot write, median (ms)"] = statistics.median(writes)
    for path in (snapshot, Path(f"{snapshot}.prev")):
        path.unlink(missing_ok=True)
    killed_run = script("04_fault_tolerant.py", 2, "--checkpoint", str(snapshot), metrics=m("04k"))
    killed_run.insert(3, "--max-restarts=1")  # after: torchrun --standalone --nproc_per_node=2
    began, process = launch(killed_run, threads=1)
    kill_at = results["start-up: launch to training, 02 x 2 (s)"] + 2 + random.Random(repeat).random()
    killer = threading.Timer(kill_at, lambda: random.Random(repeat).choice(psutil.Process(process.pid).children())
                             .kill())
    killer.start()
    wall_killed, _ = collect(began, process)
    killer.cancel()
    results["time lost to one kill -9 (s)"] = wall_killed - wall_ft
    for path in (snapshot, Path(f"{snapshot}.prev")):
        path.unlink(missing_ok=True)
    return results


def machine():
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else \
        platform.processor()
    import torch

    return f"{model}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="ddp-steps-bench-"))
    repeats = []
    for repeat in range(args.repeats):
        print(f"repeat {repeat + 1}/{args.repeats} ...", flush=True)
        repeats.append(one_repeat(folder, repeat))
    median = {name: statistics.median(r[name] for r in repeats) for name in repeats[0]}
    ratios = {
        "DDP overhead: 02 x 1 / 00 (goal >= 0.97)":
            median["02, 1 process x 2 threads, DDP"] / median["00, 1 process x 2 threads"],
        "scaling: 2 x 1 thread / 1 x 1 thread (goal >= 1.85, limit 2.0)":
            median["02, 2 processes x 1 thread, batch 64 each"] / median["02, 1 process x 1 thread, batch 128"],
        "the machine's ceiling for that: two separate processes / one (no DDP)":
            median["two separate 00 processes at once x 1 thread, batch 64 each"]
            / median["00, 1 process x 1 thread, batch 64"],
        "framework overhead: 02 / bare DDP loop (goal >= 0.97)":
            median["02, 2 processes x 1 thread, batch 64 each"] / median["bare DDP loop, 2 processes x 1 thread"],
        "fault tolerance: 04 / 02, same layout":
            median["04, 2 processes x 1 thread, snapshots every 50 steps"]
            / median["02, 2 processes x 1 thread, batch 64 each"],
    }
    ratio_rows = list(ratios.items())
    header = f"Measured {date.today()} on {machine()}; median of {args.repeats} repeats, synthetic data, cnn model."
    table = ["| measurement | value |", "|---|---|"]
    table += [f"| {name} | {value:.2f} |" if name.endswith(")") else f"| {name} | {value:.0f} samples/s |"
              for name, value in median.items()]
    table += [f"| **{name}** | **{value:.3f}** |" for name, value in ratio_rows]
    text = header + "\n\n" + "\n".join(table) + "\n"
    print("\n" + text)
    (REPO / "benchmarks/results.md").write_text(text)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    throughput = {name: value for name, value in median.items() if not name.endswith(")")}
    fig, axis = plt.subplots(figsize=(9, 4))
    axis.barh(list(throughput), list(throughput.values()), color="C0")
    for y, value in enumerate(throughput.values()):
        axis.text(value, y, f" {value:.0f}", va="center")
    axis.invert_yaxis()
    axis.set_xlabel("training samples/s (steady state, median)")
    axis.set_title("\n".join(f"{name.split(' (')[0]}: {value:.2f}" for name, value in ratio_rows), fontsize=9)
    fig.tight_layout()
    fig.savefig(REPO / "benchmarks/results.png", dpi=100)
    print("wrote benchmarks/results.md and benchmarks/results.png")


if __name__ == "__main__":
    main()
