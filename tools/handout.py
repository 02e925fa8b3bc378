"""Makes a copy of the course to hand out in a workshop: the committed course, without its history, in a new git
repository at DEST with one commit, every lecture's exercise answers taken out, so that attendees predict before
they see them (docs/workshop.md). Push DEST where attendees clone it: no removed answer is left in its files or
its history (tests/test_notebooks.py looks for each line over 50 characters of the answers in words it removed,
and each "# Solution" line of the solution cells; not for their other code lines). The course's scripts, tests
and comments stay as they are, and a curious reader finds some answers there (a test asserts what an exercise asks
to predict).

    .venv/bin/python tools/handout.py DEST        # e.g. ../ddp-steps-handout; DEST must not exist yet

What goes: each cell tagged `solution`, and everything after it up to the next exercise or section heading (the
answer in words, and the code that shows it), replaced by one line saying that the instructor shows it. What
stays: the lectures with their outputs as executed, and each exercise's heading and question. The lesson sources
(notebooks/*.md) go too, for they hold the same answers; so in the handout `make test` fails (its notebook
tests), and links to those sources are dead: run the course's tests in the course. And the port's built-in text,
port/data/ddp_steps_prose.txt, made from earlier lesson sources, loses its exercise sections (questions and answers),
and its shards (port/data/shards) are cut again from what is left, so the port's runs there print other numbers than
the port lecture shows. And the exercises lose their solutions
(exercises/*/solution.py), with the tests that need them and the forbidden shortcuts they are checked against
(near-answers). The handout's README.md says what an attendee runs (make check-setup, make check EX=NAME, not
make test) and all of the above; the course's own README becomes COURSE.md.
"""
import argparse
import io
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import notebooks  # noqa: E402

# Where an answer ends: the next exercise, or the next section (## ...) such as "What this notebook does not cover".
ANSWER_ENDS = re.compile(r"^(### Exercise|## )")
# In a text of lessons: where an exercise section starts, and where the next section or lesson does.
EXERCISES_START = re.compile(r"^(##+ (\d+\. )?Exercises\b|### Exercise \d)")
SECTION_START = re.compile(r"^#{1,2} ")
PROSE = Path("port") / "data" / "ddp_steps_prose.txt"
NOTE = "*(Handout: the solution is not in this copy; your instructor shows it once you have predicted.)*"
README = """# ddp-steps: the workshop handout

The course as committed, without its history, without the lectures' exercise answers and without the exercises'
solutions (made by `tools/handout.py`). The course's own front page is [COURSE.md](COURSE.md).

```bash
make setup              # once, before the day: the venv (about 3 GB to download)
make check-setup        # the first ten minutes: Python, the venv, a 2-process all-reduce; one line each
make check              # the exercises (exercises/README.md) and which you have passed
make check EX=01_ddp    # grade your exercises/01_ddp/: one line per claim, and where to read when one fails
```

The lectures are the notebooks in `notebooks/` (run them in Jupyter, cell by cell; their outputs are committed, so
they also read without running). The answers come on the day; the whole course, with them, after it.

Not for this copy: `make test` (the course's own tests need the lesson sources, `notebooks/*.md`, and the
solutions, which are not here: run them in the course) and `tools/notebooks.py`. Links to `notebooks/*.md` are
dead here. The port's built-in text (`port/data/ddp_steps_prose.txt`, made from earlier lessons) has lost its
exercise sections, so the port's runs print other numbers here than its lecture shows.
"""


def without_answers(notebook):
    """The notebook with each solution cell and what follows it, up to the next exercise or section heading,
    removed. A markdown cell that holds the end of one answer and the next question is cut at the heading."""
    kept, in_answer = [], False
    for cell in notebook.cells:
        if "solution" in cell.metadata.get("tags", []):
            if not in_answer:
                kept.append(nbformat.v4.new_markdown_cell(NOTE))
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


def without_exercises(text):
    """A text of lessons without its exercise sections: from each exercises heading to the next section (## ...)
    or lesson (# ...)."""
    kept, skipping = [], False
    for line in text.splitlines(keepends=True):
        if EXERCISES_START.match(line):
            skipping = True
        elif SECTION_START.match(line):
            skipping = False
        if not skipping:
            kept.append(line)
    return "".join(kept)


def main(destination):
    destination = Path(destination).resolve()
    if destination.exists():
        sys.exit(f"error: {destination} exists; give a new folder")
    committed = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", "HEAD"], capture_output=True,
                               check=True, timeout=300).stdout  # the files of the last commit, no history
    destination.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(committed)) as archive:
        archive.extractall(destination, **({"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}))
    for name in notebooks.names():
        path = destination / "notebooks" / f"{name}.ipynb"
        nbformat.write(without_answers(nbformat.read(path, as_version=4)), path)
        (destination / "notebooks" / f"{name}.md").unlink()
    (destination / PROSE).write_text(without_exercises((destination / PROSE).read_text()))
    subprocess.run([sys.executable, str(destination / "port" / "make_shards.py")], capture_output=True, check=True,
                   timeout=60)  # port/data/shards: the shortened text's shards, for port/gpt_stream.py
    with open(destination / PROSE.parent / "README.md", "a") as readme:
        readme.write("\nIn this handout the text's exercise sections were taken out (tools/handout.py), and shards/ is "
                     "the shortened text's cut.\n")
    # The exercises' answers: each solution, and the tests that need them (the forbidden shortcuts are near-answers).
    for path in [*destination.glob("exercises/*/solution.py"), destination / "tests" / "test_exercises.py"]:
        path.unlink()
    shutil.rmtree(destination / "tests" / "exercise_shortcuts", ignore_errors=True)
    (destination / "README.md").rename(destination / "COURSE.md")  # its links resolve from the same folder
    (destination / "README.md").write_text(README)
    git = ["git", "-C", str(destination), "-c", "user.name=ddp-steps handout", "-c", "user.email=handout@invalid"]
    for command in (["init", "--quiet", "--initial-branch=main"], ["add", "--all"],
                    ["commit", "--quiet", "--message", "ddp-steps: the workshop handout (no exercise answers)"]):
        subprocess.run(git + command, check=True, timeout=120)
    print(f"{destination}: the course without its history, its {len(notebooks.names())} lectures' exercise answers "
          "and the exercises' solutions, one commit: push it where attendees clone it")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("destination", metavar="DEST", help="a new folder for the handout (it must not exist yet)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_args().destination)
