"""Makes a copy of the course to hand out in a workshop: the repository as committed, cloned into DEST, with every
lecture's exercise answers taken out, so that attendees predict before they see them (docs/workshop.md).

    python tools/handout.py DEST        # e.g. ../ddp-steps-handout; DEST must not exist yet

What goes: each cell tagged `solution`, and everything after it up to the next exercise or section heading (the
answer in words, and the code that shows it). What stays: the lectures with their outputs as executed, and each
exercise's heading and question. The lesson sources (notebooks/*.md) go too, for they hold the same answers; the
handout's notebooks are therefore its own, and its tests of the notebooks fail (run the course's tests in the
course, not in the handout). `git diff` in DEST shows exactly what was removed.
"""
import re
import subprocess
import sys
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import notebooks  # noqa: E402

# Where an answer ends: the next exercise, or the next section (## ...) such as "What this notebook does not cover".
ANSWER_ENDS = re.compile(r"^(### Exercise|## )")


def without_answers(notebook):
    """The notebook with each solution cell and what follows it, up to the next exercise or section heading,
    removed. A markdown cell that holds the end of one answer and the next question is cut at the heading."""
    kept, in_answer = [], False
    for cell in notebook.cells:
        if "solution" in cell.metadata.get("tags", []):
            in_answer = True
        elif cell.cell_type == "markdown":
            lines = cell.source.splitlines(keepends=True)
            start = next((i for i, line in enumerate(lines) if ANSWER_ENDS.match(line)), None) if in_answer else 0
            if start is not None:
                in_answer = False
                if start:
                    cell = nbformat.from_dict({**cell, "source": "".join(lines[start:])})
                kept.append(cell)
        elif not in_answer:
            kept.append(cell)
    return nbformat.from_dict({**notebook, "cells": kept})


def main(destination):
    destination = Path(destination).resolve()
    if destination.exists():
        sys.exit(f"error: {destination} exists; give a new folder")
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(destination)], check=True, timeout=300)
    for name in notebooks.names():
        path = destination / "notebooks" / f"{name}.ipynb"
        nbformat.write(without_answers(nbformat.read(path, as_version=4)), path)
        (destination / "notebooks" / f"{name}.md").unlink()
    print(f"{destination}: the course without its {len(notebooks.names())} lectures' exercise answers "
          f"(git -C {destination} diff --stat shows what went)")


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit(__doc__)
    main(sys.argv[1])
