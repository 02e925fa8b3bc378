"""The ported GPT's training throughput (tokens/s) on 1 and 2 processes, beside what this machine can give.

    .venv/bin/python benchmarks/gpt_throughput.py                  # about 3 minutes on 2 cores (3 repeats)
    .venv/bin/python benchmarks/gpt_throughput.py --repeats 5
    .venv/bin/python benchmarks/gpt_throughput.py --table-only     # redo the table from gpt_throughput.json

As benchmarks/run.py measures the CNN: every configuration runs once per repeat, in an order that turns with each
repeat; each ratio is taken within a repeat, and the table reports the median over repeats with the smallest and
largest. Throughput is the median of the per-step tokens/s the scripts write (--metrics), steps after the
first few (which pay for warm-up); start-up is not in it. The ceiling is what 2 independent single-thread
gpt_single.py processes reach together against one alone: no DDP, no communication, only the shared machine.
Writes benchmarks/gpt_throughput.json (every repeat's figures) and benchmarks/gpt_throughput.md.
"""
import argparse
import json
import statistics
import sys
import tempfile
from datetime import date
from pathlib import Path

from _verdict import verdict
from run import REPO, TORCHRUN, collect, launch, machine

STEPS, SKIP = 30, 5  # optimizer steps per run; the first SKIP are left out of the median
BATCH = 16  # windows of 64 bytes per process per step: 1024 tokens
COMMON = ["--steps", str(STEPS), "--eval-every", str(STEPS), "--eval-windows", "1", "--sample-bytes", "0",
          "--log-every", str(STEPS)]


def command(script, nproc, batch, metrics):
    launcher = [sys.executable] if nproc == 0 else [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}"]
    return [*launcher, f"port/{script}", *COMMON, "--batch-size", str(batch), "--metrics", str(metrics)]


def steady(metrics):
    rates = [json.loads(line)["tokens_per_s"] for line in Path(metrics).read_text().splitlines()]
    return statistics.median(rates[SKIP:])


CONFIGS = {  # name: [(script, processes (0: plain python), batch per process)], started together
    "gpt_single, 1 process x 1 thread, batch 32": [("gpt_single.py", 0, 2 * BATCH)],
    "gpt_ddp, 1 process x 1 thread, batch 32": [("gpt_ddp.py", 1, 2 * BATCH)],
    "gpt_ddp, 2 processes x 1 thread, batch 16 each (global 32)": [("gpt_ddp.py", 2, BATCH)],
    "gpt_single, 1 process x 1 thread, batch 16": [("gpt_single.py", 0, BATCH)],
    "two separate gpt_single processes at once x 1 thread, batch 16 each": [("gpt_single.py", 0, BATCH)] * 2,
}
RATIOS = {
    "DDP at 1 process: gpt_ddp / gpt_single, batch 32":
        lambda r: r["gpt_ddp, 1 process x 1 thread, batch 32"] / r["gpt_single, 1 process x 1 thread, batch 32"],
    "scaling: 2 processes / 1 process, same global batch (limit 2.0)":
        lambda r: r["gpt_ddp, 2 processes x 1 thread, batch 16 each (global 32)"]
        / r["gpt_ddp, 1 process x 1 thread, batch 32"],
    "the machine's ceiling for that: two separate processes / one (no DDP)":
        lambda r: r["two separate gpt_single processes at once x 1 thread, batch 16 each"]
        / r["gpt_single, 1 process x 1 thread, batch 16"],
}


def one_repeat(folder, repeat):
    results, names = {}, list(CONFIGS)
    for name in names[repeat % len(names):] + names[:repeat % len(names)]:
        metrics = [folder / f"{repeat}-{names.index(name)}-{i}.jsonl" for i in range(len(CONFIGS[name]))]
        started = [launch(command(*config, path), threads=1) for config, path in zip(CONFIGS[name], metrics,
                                                                                      strict=True)]
        for begun in started:
            collect(*begun)
        results[name] = sum(steady(path) for path in metrics)  # tokens/s of all of them together
    return results


def summarize(measured):
    repeats = measured["repeats"]
    median = {name: statistics.median(r[name] for r in repeats) for name in CONFIGS}
    ratios = {name: [ratio(r) for r in repeats] for name, ratio in RATIOS.items()}
    header = (f"Measured {measured['date']} on {measured['machine']}; median of {len(repeats)} repeats, the "
              f"default GPT (4 blocks, width 128, 64-byte windows), {STEPS} steps per run, steps {SKIP + 1}-{STEPS}. "
              "Ratios: median of the per-repeat ratios (smallest–largest).")
    table = ["| measurement | value |", "|---|---|"]
    table += [f"| {name} | {value:.0f} tokens/s ({min(r[name] for r in repeats):.0f}–"
              f"{max(r[name] for r in repeats):.0f}) |" for name, value in median.items()]
    unresolved = " not resolved: the spread includes 1.0"  # benchmarks/_verdict.py: the spread decides
    words = {name: verdict(min(values), max(values), 1.0, above="", below="", neither=unresolved)
             for name, values in ratios.items()}
    table += [f"| **{name}** | **{statistics.median(values):.3f}** ({min(values):.3f}–{max(values):.3f}){words[name]} |"
              for name, values in ratios.items()]
    unresolved = [name.split(":")[0] for name, word in words.items() if word]
    footer = (f"\nNot resolved on this machine (spread includes 1.0): {'; '.join(unresolved)}. In a repeat "
              "where two independent processes together ran no faster than one, the 2 cores were not 2 free cores: "
              "the ceiling's ratio is then not read as a ceiling.\n"
              if unresolved else "")
    return header + "\n\n" + "\n".join(table) + "\n" + footer


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--table-only", action="store_true", help="measure nothing: redo the table")
    args = parser.parse_args()
    raw = REPO / "benchmarks/gpt_throughput.json"
    if args.table_only:
        measured = json.loads(raw.read_text())
    else:
        folder = Path(tempfile.mkdtemp(prefix="ddp-steps-gpt-bench-"))
        measured = {"date": str(date.today()), "machine": machine(), "repeats": []}
        for repeat in range(args.repeats):
            print(f"repeat {repeat + 1}/{args.repeats} ...", flush=True)
            measured["repeats"].append(one_repeat(folder, repeat))
            raw.write_text(json.dumps(measured, indent=1) + "\n")
    table = summarize(measured)
    print("\n" + table)
    (REPO / "benchmarks/gpt_throughput.md").write_text(table)
    print("wrote benchmarks/gpt_throughput.md")


if __name__ == "__main__":
    main()
