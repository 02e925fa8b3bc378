"""The pipeline bubble: the share of a step that port/gpt_pp.py's 2 stages sit idle, beside (p - 1)/(m + p - 1)
for p stages and m micro-batches, with either schedule.

    .venv/bin/python benchmarks/pipeline_bubble.py                 # about 10 minutes on 2 cores (3 repeats)
    .venv/bin/python benchmarks/pipeline_bubble.py --table-only    # redo the table from pipeline_bubble.json

Each repeat runs, for m = 1, 2, 4 and 8 micro-batches of 8 windows, the default GPT on 1 process (the whole model,
the same m micro-batches: m units of work) and on 2 stages with GPipe and with 1F1B (1F1B needs m >= 2), in an
order that turns with each repeat; each process has 1 thread (2 cores). A step's time is the median over steps 4-20
of the logged tokens/s. Were the stages always busy, 2 stages would take half the one process's time; the share of
that they miss is the measured bubble: 1 - (one process's time) / (2 x the stages' time), taken within a repeat (the
table: median over repeats, smallest–largest). It also holds what the prediction leaves out: the sends between the
stages, stages of unequal work (the last one also computes the head and the loss), the work each stage repeats (the
batch, the step's checks), and two processes computing slower than one alone on a 2-core machine (shared caches and
memory). The last is measured apart, by two one-process runs at once; the bubble against that slower process's time
is the second figure.
Writes benchmarks/pipeline_bubble.json (every run's figures) and benchmarks/pipeline_bubble.md.
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

STAGES, STEPS, SKIP, WINDOWS = 2, 20, 3, 8  # steps 1-SKIP left out (the first steps pay for warm-up)
ONE, TWO = "one process", "one process, two at once"  # two at once: two separate runs, as the 2 stages share the cores
RUNS = [(m, schedule) for m in (1, 2, 4, 8) for schedule in (ONE, TWO, "gpipe", "1f1b")
        if not (schedule == "1f1b" and m < STAGES)]  # torch's Schedule1F1B refuses fewer micro-batches than stages


def one_run(folder, m, schedule):
    """Seconds per step: the median of steps SKIP+1..STEPS (of both runs, for TWO)."""
    nproc, copies = (1, 2) if schedule == TWO else (1, 1) if schedule == ONE else (STAGES, 1)
    files = [folder / f"{m}_{schedule.replace(' ', '_').replace(',', '')}_{copy}.jsonl" for copy in range(copies)]
    started = [launch([TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", "port/gpt_pp.py", "--steps", str(STEPS),
                       "--batch-size", str(WINDOWS), "--grad-accum", str(m), "--warmup-steps", "2", "--eval-every",
                       "1000", "--sample-bytes", "0", "--metrics", str(metrics), "--schedule",
                       schedule if nproc > 1 else "gpipe"], threads=1) for metrics in files]
    for run in started:
        collect(*run)
    rates = [json.loads(line)["tokens_per_s"] for metrics in files for line in metrics.read_text().splitlines()[SKIP:]]
    return WINDOWS * m * 64 / statistics.median(rates)  # seconds per step (64: the default --block-size)


def one_repeat(folder, repeat):
    order = RUNS[repeat % len(RUNS):] + RUNS[:repeat % len(RUNS)]
    (folder / str(repeat)).mkdir()
    return {f"{m} {schedule}": one_run(folder / str(repeat), m, schedule) for m, schedule in order}


def summarize(measured):
    repeats = measured["repeats"]
    header = (f"Measured {measured['date']} on {measured['machine']}; {len(repeats)} repeats, interleaved: the default "
              f"GPT (4 blocks, width 128), micro-batches of {WINDOWS} windows of 64 bytes, on 1 process and on "
              f"{STAGES} stages, 1 thread each; a step's time is the median of steps {SKIP + 1}-{STEPS}. Bubble: "
              f"1 - (one process's step time) / ({STAGES} x the stages' step time), within a repeat; the table gives "
              "the median over repeats (smallest–largest). Predicted: (p - 1)/(m + p - 1), for stages of equal work "
              "that send in no time.")
    table = ["| micro-batches m | schedule | 2 stages, ms a step | one process, ms a step: alone; two at once | "
             "bubble against one process alone | against one of two at once | predicted |", "|---" * 7 + "|"]

    def spread(values, predicted):
        word = verdict(min(values), max(values), predicted, above="above", below="below", neither="met")
        return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f}): {word}"

    for m, schedule in RUNS:
        if schedule in (ONE, TWO):
            continue
        alone, shared = ([r[f"{m} {name}"] for r in repeats] for name in (ONE, TWO))
        mine = [r[f"{m} {schedule}"] for r in repeats]
        predicted = (STAGES - 1) / (m + STAGES - 1)
        bubbles = [[1 - o / (STAGES * t) for o, t in zip(one, mine, strict=True)] for one in (alone, shared)]
        table.append(f"| {m} | {schedule} | {statistics.median(mine) * 1e3:.0f} | "
                     f"{statistics.median(alone) * 1e3:.0f}; {statistics.median(shared) * 1e3:.0f} | "
                     f"{spread(bubbles[0], predicted)} | "
                     f"{spread(bubbles[1], predicted)} | {predicted:.2f} |")
    return header + "\n\n" + "\n".join(table) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--table-only", action="store_true", help="measure nothing: redo the table")
    args = parser.parse_args()
    raw = REPO / "benchmarks/pipeline_bubble.json"
    if args.table_only:
        measured = json.loads(raw.read_text())
    else:
        folder = Path(tempfile.mkdtemp(prefix="ddp-steps-bubble-bench-"))
        measured = {"date": str(date.today()), "machine": machine(), "repeats": []}
        for repeat in range(args.repeats):
            print(f"repeat {repeat + 1}/{args.repeats} ...", flush=True, file=sys.stderr)
            measured["repeats"].append(one_repeat(folder, repeat))
            raw.write_text(json.dumps(measured, indent=1) + "\n")
    table = summarize(measured)
    print("\n" + table)
    (REPO / "benchmarks/pipeline_bubble.md").write_text(table)
    print("wrote benchmarks/pipeline_bubble.md")


if __name__ == "__main__":
    main()
