"""Where each rank's step time went, and which rank is the slow one, from the split that port/gpt_timed.py --timings
PATH wrote (one JSON line per rank and step; how a step is split: gpt_timed.py's docstring).

    python tools/step_times.py times.jsonl              # medians over every step but the first 5
    python tools/step_times.py times.jsonl --skip 0     # every step

Per rank it prints the median step and its three parts (computing, waiting for the other ranks, communicating), and
how much of the all-reduce ran hidden behind backward() against the most that could have (every bucket but the
last one handed over; nothing computes after it). Then it names the slow rank: the one that computes longest, when
it computes longer than every other by more than a quarter of the median step. The others' time then shows as
waiting, not as communicating: a slow rank is not a slow network (communicating would grow on every rank). What
happens between steps (validation, the log, snapshots) is in no part: a rank slow there is not named.
Give gpt_timed.py a fresh --timings file per run; a resumed run may append to its own (where a step is there twice,
the later line counts: the resumed run's).
"""
import argparse
import json
import statistics
import sys
from collections import defaultdict

PARTS = ("step", "computing", "waiting", "communicating", "allreduce", "hidden", "hideable")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timings", help="the file gpt_timed.py --timings wrote")
    parser.add_argument("--skip", type=int, default=5, help="leave out steps up to this one: the first ones build "
                        "DDP's buckets, warm the allocator and, with --profile, start the profiler")
    return parser.parse_args(argv)


def medians(lines, skip):
    """{rank: {part: median ms}} over the steps after `skip`."""
    last = {(line["step"], line["rank"]): line for line in lines}  # a step there twice: the later line
    by_rank = defaultdict(list)
    for (step, rank), line in last.items():
        if step > skip:
            by_rank[rank].append(line)
    return {rank: {part: statistics.median(step[f"{part}_ms"] for step in steps) for part in PARTS}
            for rank, steps in sorted(by_rank.items())}


def slowest(table, margin=0.25):
    """The rank that computes longest, if it computes longer than every other by more than `margin` of the median
    step; else None (no rank stands out)."""
    computing = {rank: parts["computing"] for rank, parts in table.items()}
    rank = max(computing, key=computing.get)
    others = [value for other, value in computing.items() if other != rank]
    step = statistics.median(parts["step"] for parts in table.values())
    return rank if others and computing[rank] - max(others) > margin * step else None


def report(table, steps):
    lines = [f"ms per step, medians of {steps} steps per rank:",
             f"{'rank':>4} {'step':>8} {'computing':>10} {'waiting':>8} {'communicating':>14}   all-reduce hidden"]
    for rank, parts in table.items():
        hidden = (f"{parts['hidden']:.1f} of {parts['allreduce']:.1f} ms, at most {parts['hideable']:.1f}"
                  if parts["allreduce"] else "-")
        lines.append(f"{rank:>4} {parts['step']:8.1f} {parts['computing']:10.1f} {parts['waiting']:8.1f} "
                     f"{parts['communicating']:14.1f}   {hidden}")
    slow = slowest(table)
    lines.append(f"slow rank: {slow} (it computes longest; the others wait for it)" if slow is not None else
                 "slow rank: none stands out")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    try:
        with open(args.timings) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        table = medians(lines, args.skip)
    except (OSError, ValueError, KeyError, TypeError) as error:
        sys.exit(f"error: {args.timings}: not a file of gpt_timed.py --timings ({type(error).__name__}: {error})")
    if not table:
        sys.exit(f"error: {args.timings}: no step after --skip {args.skip}")
    print(report(table, len({line["step"] for line in lines if line["step"] > args.skip})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
