"""How long training waits for a snapshot, written in place (port/gpt_async.py as gpt_fsdp.py writes it) or in the
background (--async-save), and whether host memory grows over many snapshots, against a run that takes none.

    .venv/bin/python benchmarks/snapshot_stall.py                 # about 8 minutes on 2 cores (3 repeats)
    .venv/bin/python benchmarks/snapshot_stall.py --table-only    # redo the table from snapshot_stall.json

Each repeat runs the three, in an order that turns with each repeat: 2 processes x 1 thread, the default GPT, 100
steps, a snapshot after every step (in place, or in the background) or none. The wait is what each snapshot's log
line says ("training waited"): the whole write in place; the copy into host memory (and a wait for the write before,
if it is still going) in the background, and in both the state dict gathered and a barrier: the call, not the copy
alone. Per run, its median over the snapshots after the first 10 (the first ones pay for DCP's first plans); the
ratio background / in place is taken within a repeat, and the table gives the median over repeats with the smallest
and largest. What the logged wait leaves out (the writing thread competing with training for the cores, rank 0
putting each written snapshot in place between two steps) shows in the training speed: the steps' tokens/s, against
the run without snapshots of the same repeat. Memory: the resident set of both ranks together (psutil), read
when each step's log line appears; its growth from step 10 to step 100, beside the run without snapshots (which
grows too: the allocator, the logs). The snapshot's size on disk is printed beside it.
Writes benchmarks/snapshot_stall.json (every run's figures) and benchmarks/snapshot_stall.md.
"""
import argparse
import json
import re
import statistics
import sys
import tempfile
from datetime import date
from pathlib import Path

import psutil
from _verdict import verdict
from run import REPO, TORCHRUN, launch, machine

STEPS, SKIP = 100, 10  # steps (a snapshot after each); the first SKIP steps and snapshots are left out
MODES = {"no snapshots": None, "in place": [], "background": ["--async-save"]}  # None: no --checkpoint


def one_run(folder, name):
    checkpoint = folder / name.replace(" ", "_")
    _, process = launch([TORCHRUN, "--standalone", "--nproc_per_node=2", "port/gpt_async.py", "--steps", str(STEPS),
                         "--save-every-steps", "1", "--eval-every", "1000", "--log-every", "1", "--sample-bytes", "0",
                         *([] if MODES[name] is None else ["--checkpoint", str(checkpoint), *MODES[name]])], threads=1)
    waits, memory, rates = [], [], []
    lines = []
    for line in process.stdout:  # read here, not by collect(): the ranks' memory is sampled at each step's line
        lines.append(line)
        if found := re.match(r"snapshot of step \d+: training waited (\d+) ms", line):
            waits.append(float(found[1]))
        if found := re.match(r"step \d+/\d+  loss .* (\d+) tokens/s", line):
            rates.append(float(found[1]))  # over the time since the step before's line: its snapshot included
            ranks = [child for child in psutil.Process(process.pid).children(recursive=True)
                     if "gpt_async.py" in " ".join(child.cmdline())]
            memory.append(sum(child.memory_info().rss for child in ranks) / 1e6)
    if process.wait() != 0:
        errors = "".join(line for line in lines if "rror" in line)[-3000:]
        sys.exit(f"failed: {process.args}\n{errors}" + "".join(lines[-10:]))
    size = sum(path.stat().st_size for path in checkpoint.rglob("*") if path.is_file()) / 1e6
    return {"waits_ms": waits, "rss_mb": memory, "snapshot_mb": size, "tokens_per_s": rates}


def one_repeat(folder, repeat):
    names = list(MODES)[repeat % 3:] + list(MODES)[:repeat % 3]
    (folder / str(repeat)).mkdir()
    return {name: one_run(folder / str(repeat), name) for name in names}


def summarize(measured):
    repeats = measured["repeats"]
    wait = {name: [statistics.median(r[name]["waits_ms"][SKIP:]) for r in repeats] for name in MODES
            if MODES[name] is not None}
    growth = {name: [r[name]["rss_mb"][-1] - r[name]["rss_mb"][SKIP - 1] for r in repeats] for name in MODES}
    ratios = [b / p for b, p in zip(wait["background"], wait["in place"], strict=True)]
    rate = {name: [statistics.median(r[name]["tokens_per_s"][SKIP:]) for r in repeats] for name in MODES}
    kept = {name: [rate[name][i] / rate["no snapshots"][i] for i in range(len(repeats))] for name in MODES}
    header = (f"Measured {measured['date']} on {measured['machine']}; {len(repeats)} repeats of each, interleaved: "
              f"2 processes x 1 thread, the default GPT, {STEPS} steps, a snapshot after each (or none). Each run's "
              f"wait is its median over snapshots {SKIP + 1}-{STEPS}; the table gives the median over repeats "
              f"(smallest–largest). Training speed: the median of the steps' tokens/s, steps {SKIP + 1}-{STEPS} (a "
              "step's figure counts the time since the step before's log line: that step's snapshot, and rank 0 "
              "putting a written one in place, included), and its ratio to the run without snapshots in the same "
              f"repeat. Memory: both ranks' resident set, its growth from step {SKIP} to {STEPS}.")
    table = ["| snapshots written | training waited per snapshot (logged) | training speed | of the speed without "
             "snapshots | memory growth over the snapshots | snapshot on disk |", "|---|---|---|---|---|---|"]
    for name in MODES:
        size = statistics.median(r[name]["snapshot_mb"] for r in repeats)
        waited = (f"{statistics.median(wait[name]):.0f} ms ({min(wait[name]):.0f}–{max(wait[name]):.0f})" if name in
                  wait else "-")
        grew = (f"{statistics.median(growth[name]):+.1f} MB ({min(growth[name]):+.1f} to "
                f"{max(growth[name]):+.1f})")
        speed = f"{statistics.median(rate[name]):.0f} tokens/s ({min(rate[name]):.0f}–{max(rate[name]):.0f})"
        share = (f"{statistics.median(kept[name]):.2f} ({min(kept[name]):.2f}–{max(kept[name]):.2f}): " + verdict(
            min(kept[name]), max(kept[name]), 1.0, above="faster", below="slower", neither="not resolved")
                 if name != "no snapshots" else "-")
        table.append(f"| {name} | {waited} | {speed} | {share} | {grew} | " + (f"{size:.1f} MB |" if size else "- |"))
    word = verdict(min(ratios), max(ratios), 1.0, above="longer than in place", below="shorter than in place",
                   neither="not resolved: the spread includes 1.0")
    table.append(f"| **background / in place** | **{statistics.median(ratios):.2f}** ({min(ratios):.2f}–"
                 f"{max(ratios):.2f}): {word} | | | | |")
    return header + "\n\n" + "\n".join(table) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--table-only", action="store_true", help="measure nothing: redo the table")
    args = parser.parse_args()
    raw = REPO / "benchmarks/snapshot_stall.json"
    if args.table_only:
        measured = json.loads(raw.read_text())
    else:
        folder = Path(tempfile.mkdtemp(prefix="ddp-steps-snapshot-bench-"))
        measured = {"date": str(date.today()), "machine": machine(), "repeats": []}
        for repeat in range(args.repeats):
            print(f"repeat {repeat + 1}/{args.repeats} ...", flush=True)
            measured["repeats"].append(one_repeat(folder, repeat))
            raw.write_text(json.dumps(measured, indent=1) + "\n")
    table = summarize(measured)
    print("\n" + table)
    (REPO / "benchmarks/snapshot_stall.md").write_text(table)
    print("wrote benchmarks/snapshot_stall.md")


if __name__ == "__main__":
    main()
