"""Times every lecture as a workshop runs it: each notebook executed from a clean kernel, one at a time (run it on
an otherwise idle machine), with the seconds of the whole run and of its exercises' solution cells, and its prose
counted in words. Writes docs/workshop_times.json, from which docs/workshop.md's table is made (and checked:
tests/test_notebooks.py). About 8 minutes on 2 cores.

    .venv/bin/python tools/workshop_times.py --all      # all lectures, in reading order
    .venv/bin/python tools/workshop_times.py NAME ...   # only these (a new or changed lecture), the others kept
    .venv/bin/python tools/workshop_times.py --table    # print the table from the committed figures, no runs

With no argument it prints its usage and changes nothing: replacing every committed figure takes `--all`.
"""
import argparse
import json
import os
import platform
import re
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import notebooks  # noqa: E402

FIGURES = REPO / "docs" / "workshop_times.json"
WORDS_PER_MINUTE = 150  # an assumed pace for reading technical prose aloud or alone: not measured
EXERCISE_MINUTES = 5  # an assumed time for attendees to predict an exercise's answer, before its solution runs
# The two plans of docs/workshop.md: which lectures, and how many of each one's exercises (which ones: its prose).
PLANS = {
    "Half day": {"00_single_gpu": 1, "01_mp_spawn": 2, "02_torchrun": 1, "04_fault_tolerant": 1},
    "Full day": {"00_single_gpu": 1, "01_mp_spawn": 2, "02_torchrun": 1, "03_multinode": 1, "04_fault_tolerant": 2,
                 "ddp_under_the_hood": 1, "when_it_breaks": 1, "05_fsdp": 1},
}
# Talks that are not lectures, in a plan before the lecture named, with their minutes (assumed): the half day
# skips 03, whose ideas 04's lecture assumes.
BRIDGES = {"Half day": {"04_fault_tolerant": ("a bridge: 03's sections 1 and 2, told", 10)}}


def seconds(cell):
    times = cell.metadata.get("execution", {})
    if "iopub.execute_input" not in times or "shell.execute_reply" not in times:
        return 0.0
    began, ended = (datetime.fromisoformat(times[key].replace("Z", "+00:00"))
                    for key in ("iopub.execute_input", "shell.execute_reply"))
    return (ended - began).total_seconds()


def measure(name):
    began = time.monotonic()
    executed = notebooks.execute(notebooks.build(name), timeout=600)
    total = time.monotonic() - began
    prose = " ".join(cell.source for cell in executed.cells if cell.cell_type == "markdown")
    solutions = [cell for cell in executed.cells if "solution" in cell.metadata.get("tags", [])]
    return {"run_s": round(total, 1), "solutions_s": round(sum(seconds(cell) for cell in solutions), 1),
            "exercises": sum(1 for cell in executed.cells
                             if cell.cell_type == "markdown" and re.search(r"^### Exercise", cell.source, re.M)),
            "words": len(re.findall(r"\w+", re.sub(r"`[^`]*`", "x", prose)))}


def table(figures):
    rows = ["| part | lecture | runs in | its exercises' solutions run in | prose | reading at "
            f"{WORDS_PER_MINUTE} words/min (assumed) |", "|---|---|---|---|---|---|"]
    for part, names in notebooks.PARTS.items():
        for name in names:
            figure = figures["lectures"][name]
            rows.append(f"| {part} | [{name}](../notebooks/{name}.ipynb) | {figure['run_s']:.0f} s | "
                        f"{figure['solutions_s']:.0f} s ({figure['exercises']} exercises) | {figure['words']} words | "
                        f"{figure['words'] / WORDS_PER_MINUTE:.0f} min |")
    return "\n".join(rows)


def plans(figures):
    """Each plan's minutes per lecture: reading (assumed pace) + the lecture's run less its solution cells
    (measured) + its chosen exercises (assumed minutes each, plus their share of the solutions' measured run)."""
    out = []
    for plan, chosen in PLANS.items():
        rows = [f"**{plan}**", "", "| lecture | reading (assumed) | running (measured) | exercises | total |",
                "|---|---|---|---|---|"]
        total = 0
        for name, exercises in chosen.items():
            if name in BRIDGES.get(plan, {}):
                talk, minutes = BRIDGES[plan][name]
                total += minutes
                rows.append(f"| {talk} | {minutes} min (assumed) | | | {minutes} min |")
            figure = figures["lectures"][name]
            reading = figure["words"] / WORDS_PER_MINUTE
            running = (figure["run_s"] - figure["solutions_s"]) / 60  # the solutions count with their exercises
            share = exercises / figure["exercises"]
            practice = exercises * EXERCISE_MINUTES + share * figure["solutions_s"] / 60
            minutes = reading + running + practice
            total += minutes
            rows.append(f"| {name} | {reading:.0f} min | {running:.1f} min | {exercises} of {figure['exercises']}: "
                        f"{practice:.0f} min | {minutes:.0f} min |")
        breaks = 15 * int(total // 90)
        rows += [f"| **all** | | | | **{total / 60:.1f} h**, with {breaks} min of breaks (15 per 90 min) "
                 f"**{(total + breaks) / 60:.1f} h** |", ""]
        out += rows
    return "\n".join(out)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help="measure only these lectures (notebooks/NAME.md) and keep the others' figures")
    parser.add_argument("--all", action="store_true",
                        help="measure every lecture and replace all of docs/workshop_times.json (about 8 minutes)")
    parser.add_argument("--table", action="store_true", help="print the tables from the committed figures, no runs")
    args = parser.parse_args(argv)
    # The committed figures took minutes of an idle machine to measure: nothing replaces them by accident.
    if args.all + args.table + bool(args.names) != 1:
        parser.error("give exactly one of: NAME ..., --all, --table")
    unknown = set(args.names) - set(notebooks.names())
    if unknown:
        parser.error(f"no lecture named {', '.join(sorted(unknown))} (the lectures: {', '.join(notebooks.names())})")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.table:
        figures = json.loads(FIGURES.read_text())
        print(table(figures) + "\n\n" + plans(figures))
        return 0
    today = time.strftime("%Y-%m-%d", time.gmtime())
    if args.names:  # these lectures measured now (each says when), the others' figures kept as they were
        figures = json.loads(FIGURES.read_text())
        lectures = {name: figures["lectures"].get(name) for name in notebooks.names()}
        for name in args.names:
            lectures[name] = {**measure(name), "measured": today}
            print(f"{name}: {lectures[name]}", flush=True)
        figures["lectures"] = lectures
    else:
        figures = {"measured": today, "python": platform.python_version(), "torch": notebooks.torch_version(),
                   "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                   "lectures": {}}  # macOS has no sched_getaffinity
        for name in notebooks.names():
            figures["lectures"][name] = measure(name)
            print(f"{name}: {figures['lectures'][name]}", flush=True)
    FIGURES.write_text(json.dumps(figures, indent=1) + "\n")
    print(table(figures) + "\n\n" + plans(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
