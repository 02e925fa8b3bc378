"""Builds notebooks/NAME.ipynb from its lesson source notebooks/NAME.md and executes it, so that every
committed output was produced by the committed lesson.

    python tools/notebooks.py                  # rebuild and execute every notebook (a few minutes on 2 cores)
    python tools/notebooks.py 01 when_it       # only those whose name starts with 01 or when_it
    python tools/notebooks.py --check          # fail if a notebook is stale

A lesson source is a MyST markdown file in jupytext's format: prose as it reads, each code cell a ```{code-cell}```
block. The lecture of step NN is NN_name (05_fsdp teaches 05_fsdp.py); a lecture that adds no numbered script is
named by its subject. PARTS gives the reading order. Edit the .md, not the .ipynb: the notebook is an output. (With
jupytext installed, Jupyter opens the .md as a notebook too; both files are paired, `formats: ipynb,md:myst`.) Each
executed notebook records a hash of its source, the numbered scripts, notebooks/lessons/*.py and tests/helpers.py
in its metadata, and the torch version it ran with; tests/test_notebooks.py checks cells, hash and version (stale
outputs fail: a new torch means re-executing every notebook), and runs each notebook.
"""
import hashlib
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import jupytext
import nbformat

REPO = Path(__file__).resolve().parents[1]
FOLDER = REPO / "notebooks"
KERNEL = {"name": "python3", "display_name": "Python 3", "language": "python"}


# The reading order, in three parts (the README's ladder shows the same).
PARTS = {
    "The ladder": ["00_single_gpu", "01_mp_spawn", "02_torchrun", "03_multinode", "04_fault_tolerant",
                   "preemption_and_elastic", "05_fsdp"],
    "Inside DDP": ["ddp_under_the_hood", "making_ddp_fast", "build_ddp_yourself"],
    "Your own model, and when it breaks": ["when_it_breaks", "port_your_model", "shard_your_model", "long_job",
                                           "past_fsdp"],
}


def names():
    """The notebooks, in reading order: one per lesson source."""
    return [name for part in PARTS.values() for name in part]


def source(name):
    return FOLDER / f"{name}.md"


def source_hash(name):
    """What a notebook's outputs depend on: its lesson source, the numbered scripts it runs and shows, the
    helpers it imports from notebooks/lessons/ and theirs from each other (and tests/helpers.py, which runs
    imports), and the files of benchmarks/, port/ and tools/ its code cells name (programs, published figures). Any
    of them changing makes the committed outputs stale."""
    code = "\n".join(cell.source for cell in jupytext.read(source(name)).cells if cell.cell_type == "code")
    digest = hashlib.sha256(source(name).read_bytes())
    named = [path for folder in ("benchmarks", "port", "tools") for path in sorted((REPO / folder).glob("*.*"))
             if f"{folder}/{path.name}" in code]
    imported = {"runs"} | {name.strip() for line in re.findall(r"^from lessons import ([\w, ]+)", code, re.M)
                           for name in line.split(",")}  # runs: the others import it
    pending = set(imported)
    while pending:  # and what those import from each other (lessons.shard takes fsdp_mistakes' outcome)
        text = (FOLDER / "lessons" / f"{pending.pop()}.py").read_text()
        found = set(re.findall(r"^from lessons\.(\w+) import", text, re.M)) - imported
        imported |= found
        pending |= found
    support = [FOLDER / "lessons" / f"{module}.py" for module in sorted(imported)]
    support.append(REPO / "tests" / "helpers.py")  # runs imports it (run_group, free_port, load_script...)
    for path in sorted(REPO.glob("[0-9][0-9]_*.py")) + support + named:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def torch_version():
    """The installed torch's version, without importing it (seconds saved in every check)."""
    from importlib.metadata import version

    return version("torch")


def build(name):
    notebook = jupytext.read(source(name))
    notebook.metadata["kernelspec"] = KERNEL
    notebook.metadata["jupytext"] = {"formats": "ipynb,md:myst"}
    notebook.metadata["ddp_steps"] = {"source_sha256": source_hash(name), "source": f"notebooks/{name}.md",
                                      "generated_by": "python tools/notebooks.py", "torch": torch_version()}
    return notebook


def execute(notebook, timeout=600):
    """Runs the notebook in a fresh kernel whose TMPDIR is a folder of its own, deleted afterwards: the lesson's
    scratch folders and its processes' files go with it, even when the kernel is killed at shutdown (its exit
    handlers then never run)."""
    from nbclient import NotebookClient

    with tempfile.TemporaryDirectory(prefix="ddp-steps-kernel-", ignore_cleanup_errors=True) as scratch:
        outer = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = scratch  # the kernel inherits this environment
        try:
            NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                           resources={"metadata": {"path": str(FOLDER)}}).execute()
        finally:
            if outer is None:
                os.environ.pop("TMPDIR")
            else:
                os.environ["TMPDIR"] = outer
    return notebook


def cells(notebook):
    return [(cell.cell_type, cell.source, cell.metadata.get("tags", [])) for cell in notebook.cells]


def check():
    problems = []
    for name in names():
        path = FOLDER / f"{name}.ipynb"
        if not path.exists():
            problems.append(f"{path.name} is missing")
            continue
        committed = nbformat.read(path, as_version=4)
        if cells(committed) != cells(jupytext.read(source(name))) or \
                committed.metadata.get("ddp_steps", {}).get("source_sha256") != source_hash(name):
            problems.append(f"{path.name} is stale (notebooks/{name}.md, the scripts or notebooks/lessons/ changed "
                            f"since it was executed): run python tools/notebooks.py {name}")
        elif (ran_with := committed.metadata.get("ddp_steps", {}).get("torch")) != torch_version():
            problems.append(f"{path.name} was executed with torch {ran_with}, the installed torch is "
                            f"{torch_version()}: run python tools/notebooks.py (docs/versions.md)")
    for problem in problems:
        print("error:", problem, file=sys.stderr)
    return 1 if problems else 0


def main(prefixes):
    for name in names():
        if not prefixes or name.startswith(tuple(prefixes)):
            print(f"executing {name}.ipynb ...", end=" ", flush=True)
            began = time.monotonic()
            nbformat.write(execute(build(name)), FOLDER / f"{name}.ipynb")
            print(f"{time.monotonic() - began:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(check() if "--check" in sys.argv[1:] else main([a for a in sys.argv[1:] if not a.startswith("-")]))
