"""What DDP costs, how it scales, and what fault tolerance costs, measured with the tutorial's own scripts.

    .venv/bin/python benchmarks/run.py                 # about 22 minutes on 2 cores (5 repeats)
    .venv/bin/python benchmarks/run.py --repeats 3

Every configuration runs once per repeat, all of them side by side in each repeat; each ratio is taken
within a repeat, and the table reports the median over repeats with the smallest and largest: ratios measured
in the same conditions are what this noisy machine can give. Throughput is the steady state (epochs after the
first, training only); start-up (launch to training: imports, process group, data, model) is reported apart.
Prints a table and writes benchmarks/results.md, benchmarks/results.png and the raw figures,
benchmarks/results.json (`--table-only` redraws the table and plot from them).
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
    # framework overhead: a bare DDP loop on the same model, data and batch; and where scaling is lost: the
    # same loop without communication, with only the waiting, and without gradient_as_bucket_view. Their order
    # turns with each repeat: in a fixed order the one that ran first was the slowest in 4 of 5 repeats, and
    # order could not be told apart from effect.
    bare = [TORCHRUN, "--standalone", "--nproc_per_node=2", "benchmarks/bare_ddp.py", *DATA[:2], *DATA[4:]]
    variants = [("bare DDP loop, 2 processes x 1 thread", []),
                ("bare loop, 2 x 1 thread, no communication (no_sync)", ["--communication=none"]),
                ("bare loop, 2 x 1 thread, a barrier per step only", ["--communication=barrier"]),
                ("bare DDP loop, 2 x 1 thread, without gradient_as_bucket_view", ["--no-bucket-view"])]
    for name, extra in variants[repeat % 4:] + variants[:repeat % 4]:
        results[name] = steady(run([*bare, *extra])[1])
    # the DDP wrapper's cost to one process, step by step, with and without gradient_as_bucket_view
    wrapper = [TORCHRUN, "--standalone", "--nproc_per_node=1", "benchmarks/ddp_wrapper_cost.py"]
    for suffix, extra in (("", []), (", gradient_as_bucket_view", ["--bucket-view"])):
        _, lines = run([*wrapper, *extra], threads=2)
        step = json.loads(lines[-1][1])
        results[f"1 process x 2 threads{suffix}, step time plain (ms)"] = step["plain_ms"]
        results[f"1 process x 2 threads{suffix}, step time in DDP (ms)"] = step["ddp_ms"]
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


UNITS = ("(s)", "(ms)", "(%)")  # rows in these units; every other row is a throughput in samples/s
RATIOS = {
    "DDP overhead: 02 x 1 / 00 (goal >= 0.97)":
        lambda r: r["02, 1 process x 2 threads, DDP"] / r["00, 1 process x 2 threads"],
    "scaling: 2 x 1 thread / 1 x 1 thread (goal >= 1.85, limit 2.0)":
        lambda r: r["02, 2 processes x 1 thread, batch 64 each"] / r["02, 1 process x 1 thread, batch 128"],
    "the machine's ceiling for that: two separate processes / one (no DDP)":
        lambda r: r["two separate 00 processes at once x 1 thread, batch 64 each"]
        / r["00, 1 process x 1 thread, batch 64"],
    "framework overhead: 02 / bare DDP loop (goal >= 0.97)":
        lambda r: r["02, 2 processes x 1 thread, batch 64 each"] / r["bare DDP loop, 2 processes x 1 thread"],
    "fault tolerance: 04 / 02, same layout":
        lambda r: r["04, 2 processes x 1 thread, snapshots every 50 steps"]
        / r["02, 2 processes x 1 thread, batch 64 each"],
    "DDP wrapper, step by step: plain / DDP, 1 process":
        lambda r: r["1 process x 2 threads, step time plain (ms)"] / r["1 process x 2 threads, step time in DDP (ms)"],
    "same, with gradient_as_bucket_view":
        lambda r: r["1 process x 2 threads, gradient_as_bucket_view, step time plain (ms)"]
        / r["1 process x 2 threads, gradient_as_bucket_view, step time in DDP (ms)"],
    "2 ranks waiting for each other: barrier only / no communication":
        lambda r: r["bare loop, 2 x 1 thread, a barrier per step only"]
        / r["bare loop, 2 x 1 thread, no communication (no_sync)"],
    "2 ranks exchanging gradients: all-reduce / no communication":
        lambda r: r["bare DDP loop, 2 processes x 1 thread"] / r["bare loop, 2 x 1 thread, no communication (no_sync)"],
    "gradient_as_bucket_view, 2 ranks: with / without":
        lambda r: r["bare DDP loop, 2 processes x 1 thread"]
        / r["bare DDP loop, 2 x 1 thread, without gradient_as_bucket_view"],
}


def machine():
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else \
        platform.processor()
    import torch

    return f"{model}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"


def summarize(measured):
    """The medians, the ratios (median, smallest, largest over repeats) and the markdown table of a run's raw
    figures."""
    repeats = measured["repeats"]
    median = {name: statistics.median(r[name] for r in repeats) for name in repeats[0]}
    # Each ratio is taken within each repeat (the two runs it compares ran minutes apart at most), then the
    # median over repeats is reported with the smallest and largest: the spread is this machine's noise.
    per_repeat = {name: [ratio(r) for r in repeats] for name, ratio in RATIOS.items()}
    ratios = {name: (statistics.median(values), min(values), max(values)) for name, values in per_repeat.items()}
    header = (f"Measured {measured['date']} on {measured['machine']}; median of {len(repeats)} repeats, synthetic "
              "data, cnn model. Ratios: median of the per-repeat ratios (smallest–largest).")
    table = ["| measurement | value |", "|---|---|"]
    table += [f"| {name} | {value:.2f} |" if name.endswith(UNITS) else f"| {name} | {value:.0f} samples/s |"
              for name, value in median.items()]
    table += [f"| **{name}** | **{value:.3f}** ({low:.3f}–{high:.3f}) |" for name, (value, low, high) in ratios.items()]
    return median, ratios, header + "\n\n" + "\n".join(table) + "\n"


def plot(median, ratios, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    throughput = {name: value for name, value in median.items() if not name.endswith(UNITS)}
    fig, axis = plt.subplots(figsize=(9, 4.5))
    axis.barh(list(throughput), list(throughput.values()), color="C0")
    for y, value in enumerate(throughput.values()):
        axis.text(value, y, f" {value:.0f}", va="center")
    axis.invert_yaxis()
    axis.set_xlabel("training samples/s (steady state, median)")
    axis.set_title("\n".join(f"{name.split(' (')[0]}: {value:.2f}" for name, (value, _, _) in
                             list(ratios.items())[:6]), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--table-only", action="store_true",
                        help="measure nothing: redo the table and plot from the raw figures of the last run")
    args = parser.parse_args()
    raw = REPO / "benchmarks/results.json"  # every repeat's figures, written as they come
    if args.table_only:
        measured = json.loads(raw.read_text())
    else:
        folder = Path(tempfile.mkdtemp(prefix="ddp-steps-bench-"))
        measured = {"date": str(date.today()), "machine": machine(), "repeats": []}
        for repeat in range(args.repeats):
            print(f"repeat {repeat + 1}/{args.repeats} ...", flush=True)
            measured["repeats"].append(one_repeat(folder, repeat))
            raw.write_text(json.dumps(measured, indent=1) + "\n")
    median, ratios, table = summarize(measured)
    print("\n" + table)
    (REPO / "benchmarks/results.md").write_text(table)
    plot(median, ratios, REPO / "benchmarks/results.png")
    print("wrote benchmarks/results.md and benchmarks/results.png")


if __name__ == "__main__":
    main()
