"""The notebooks: their committed cells are their lesson sources' (notebooks/NN_name.md), their committed
outputs were produced by those cells (and hold the promised plots, and nothing about the machine that made them),
and each one runs from a clean kernel."""
import re
import socket
import sys

import nbformat
import pytest
from helpers import REPO

sys.path.insert(0, str(REPO / "tools"))
import notebooks as builder  # noqa: E402

NAMES = builder.names()
PINNED_TORCH = re.search(r"^torch==(\S+)$", (REPO / "requirements.txt").read_text(), re.M).group(1)


def committed(name):
    return nbformat.read(REPO / "notebooks" / f"{name}.ipynb", as_version=4)


def outputs(notebook):
    return [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]


def test_committed_cells_are_the_lesson_sources_and_were_executed_as_they_are():
    """A changed lesson, script or notebooks/lessons/ module without regenerated outputs fails here: run
    python tools/notebooks.py."""
    assert builder.check() == 0


@pytest.mark.parametrize("name", NAMES)
def test_each_notebook_ran_with_the_pinned_torch(name):
    """The outputs a learner reads come from the torch `make setup` installs (docs/versions.md); moving the pin
    without re-executing every notebook fails here; the staleness check above fails when the installed torch differs."""
    assert committed(name).metadata["ddp_steps"].get("torch") == PINNED_TORCH == builder.torch_version()


@pytest.mark.parametrize("name", NAMES)
def test_committed_outputs_are_complete_and_say_nothing_about_the_machine(name):
    notebook = committed(name)
    assert all(cell.get("execution_count") for cell in notebook.cells if cell.cell_type == "code"), "unexecuted"
    assert not [o for o in outputs(notebook) if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs(notebook)), "every notebook draws something"
    text = "\n".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) for o in outputs(notebook))
    for leak in (str(REPO), "/tmp/", "/root/", "/home/", "ddp-steps-notebook-"):
        assert leak not in text, f"absolute path in the outputs: {leak}"
    assert not re.search(rf"\b{re.escape(socket.gethostname())}\b", text), "host name in the outputs"
    assert not re.search(r"^\[[\w.-]+\] ", text, re.M), "a script's [hostname] prefix in the outputs"


# Notebooks with a part only root runs (making_ddp_fast shapes a link between network namespaces; without root it
# shows the published figures instead): `root` puts them in `make test-root` too, so CI runs both paths.
ROOT_PARTS = {"making_ddp_fast"}


@pytest.mark.notebooks
@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.root] if name in ROOT_PARTS else [])
                                  for name in NAMES])
def test_notebook_runs_from_a_clean_kernel(name):
    builder.execute(committed(name), timeout=300)  # raises CellExecutionError on a failing cell


def test_the_lectures_hide_every_gpu_from_what_they_start_whatever_the_attendee_exported():
    """A kernel that imports lessons.runs (every lecture does) starts its processes with no GPU visible: on a
    laptop with one NVIDIA GPU the scripts would otherwise pick CUDA, and 2 processes would need 2 GPUs."""
    import os
    import subprocess

    probe = ("import sys; sys.path.insert(0, 'notebooks'); from lessons import runs; "
             "print(runs.run(['python', '-c', 'import os; print(repr(os.environ[\"CUDA_VISIBLE_DEVICES\"]))']))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})  # as if the attendee had exported one
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "''"


def test_the_lecture_of_step_n_is_notebook_n_and_every_other_is_named_by_its_subject():
    """Every lesson source is in the reading order (tools/notebooks.py's PARTS) once; a name that starts with a
    number is the lecture of the numbered script of that name, and each numbered script has its lecture."""
    assert sorted(NAMES) == sorted(path.stem for path in (REPO / "notebooks").glob("*.md"))
    assert len(set(NAMES)) == len(NAMES)
    numbered = [name for name in NAMES if name[:1].isdigit()]
    assert numbered == sorted(path.stem for path in REPO.glob("[0-9][0-9]_*.py")), numbered


LECTURES = NAMES  # every lecture ends with exercises


@pytest.mark.parametrize("name", LECTURES)
def test_each_lecture_ends_with_exercises_whose_worked_solutions_ran(name):
    """2-4 exercises ("### Exercise N"), each with its solution in cells tagged `solution`: the committed
    outputs show the solutions ran without error, and test_notebook_runs_from_a_clean_kernel runs them again."""
    notebook = committed(name)
    exercises = [cell for cell in notebook.cells if cell.cell_type == "markdown" and "### Exercise" in cell.source]
    solutions = [cell for cell in notebook.cells if "solution" in cell.metadata.get("tags", [])]
    assert 2 <= len(exercises) <= 4, f"{len(exercises)} exercises"
    assert len(solutions) >= len(exercises), "every exercise has a worked solution"
    for cell in solutions:
        assert cell.cell_type == "code" and cell.execution_count and cell.outputs, cell.source[:80]
        assert not [o for o in cell.outputs if o.output_type == "error"], cell.source[:80]


def test_the_workshop_plan_shows_the_measured_figures():
    """docs/workshop.md's tables are what tools/workshop_times.py makes of docs/workshop_times.json, which holds a
    measured figure for every lecture (re-measure after a lecture changes much: python tools/workshop_times.py
    NAME, or --all for every lecture)."""
    import json

    import workshop_times

    figures = json.loads(workshop_times.FIGURES.read_text())
    assert sorted(figures["lectures"]) == sorted(NAMES)
    tables = workshop_times.table(figures) + "\n\n" + workshop_times.plans(figures)
    assert tables in (REPO / "docs" / "workshop.md").read_text(), tables


@pytest.mark.parametrize("name", NAMES)
def test_the_handout_keeps_every_question_and_no_answer(name):
    """tools/handout.py (docs/workshop.md): each exercise's heading and question stay, every solution cell and the
    answer after it go, and nothing before the first solution changes."""
    import handout

    lecture = committed(name)
    given = handout.without_answers(lecture).cells
    first = next(i for i, cell in enumerate(lecture.cells) if "solution" in cell.metadata.get("tags", []))
    assert given[:first] == lecture.cells[:first]
    assert not [cell for cell in given if "solution" in cell.metadata.get("tags", [])]
    text = "\n".join(cell.source for cell in given)
    assert "**Answer.**" not in text and "# Solution" not in text
    headings = re.compile(r"^### Exercise \d+$", re.M)
    assert headings.findall(text) == headings.findall("\n".join(cell.source for cell in lecture.cells))
    notes = [cell for cell in given if cell.source == handout.NOTE]  # one where each exercise's solution was
    assert len(notes) == len(headings.findall(text))
    for cell in given[first:]:  # the rest is the lecture's own text: a whole cell, or its end from a heading on
        assert cell in notes or any(cell.source and original.source.endswith(cell.source) for original in lecture.cells)


def load_check(name):
    import importlib.util

    sys.path.insert(0, str(REPO / "exercises"))  # as exercises/grade.py does: a check imports _grading
    spec = importlib.util.spec_from_file_location(f"check_{name}", REPO / "exercises" / name / "check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_handout_is_a_repository_of_one_commit_without_answers(tmp_path):
    """The tool copies the committed course, without its history (which holds every answer), takes the answers
    out of its notebooks, their sources and the port's text, and the exercises' solutions (the starters, tasks and
    checks stay; its README sends attendees to make check, not make test), and commits that alone: no removed
    answer line is left in any file (of the answers in words, each line over 50 characters; of the solution cells,
    each "# Solution" line); the scripts, tests and comments stay: some tell an answer, docs/workshop.md says so."""
    import subprocess

    done = subprocess.run([sys.executable, str(REPO / "tools" / "handout.py"), str(tmp_path / "handout")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    git = ["git", "-C", str(tmp_path / "handout")]
    log = subprocess.run([*git, "log", "--all", "--format=%s"], capture_output=True, text=True, timeout=30)
    status = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True, timeout=30)
    assert log.stdout.splitlines() == ["ddp-steps: the workshop handout (no exercise answers)"] and not status.stdout
    given = tmp_path / "handout"
    assert (given / "COURSE.md").exists() and (given / "01_mp_spawn.py").exists()
    readme = (given / "README.md").read_text()
    assert "make check-setup" in readme and "make check EX=" in readme and "Not for this copy: `make test`" in readme
    exercises = sorted(path.parent.name for path in (given / "exercises").glob("*/check.py"))  # as committed
    for name in exercises:  # the starters, tasks and checks stay; no solution, nor a shortcut near one
        check = load_check(name)
        assert {path.name for path in (given / "exercises" / name).iterdir()} >= {"TASK.md", "check.py", check.FILE}
        assert not (given / "exercises" / name / "solution.py").exists()
        solution = (REPO / "exercises" / name / "solution.py").read_text()
        assert not [path for path in (given / "exercises").rglob("*.py") if path.read_text() == solution]
    assert not (given / "tests" / "exercise_shortcuts").exists()
    assert not (given / "tests" / "test_exercises.py").exists()
    import handout

    answers = set()  # each removed answer's lines of prose, and each solution's "# Solution: ..." line
    for name in NAMES:
        assert not (tmp_path / "handout" / "notebooks" / f"{name}.md").exists()
        lecture = nbformat.read(tmp_path / "handout" / "notebooks" / f"{name}.ipynb", as_version=4)
        assert not [cell for cell in lecture.cells if "solution" in cell.metadata.get("tags", [])], name
        kept = "\n".join(cell.source for cell in lecture.cells)
        for cell in committed(name).cells:
            if "solution" in cell.metadata.get("tags", []):
                answers.update(line for line in cell.source.splitlines() if line.startswith("# Solution"))
            elif cell.cell_type == "markdown":
                answers.update(line for line in cell.source.splitlines() if len(line) > 50 and line not in kept)
    files = subprocess.run([*git, "ls-files", "-z"], capture_output=True, text=True, timeout=30).stdout.split("\0")
    texts = {path: (tmp_path / "handout" / path).read_bytes().decode(errors="ignore") for path in files if path}
    found = {path: line for path, text in texts.items() for line in answers if line in text}
    assert not found, found  # the port's training text among them: made from earlier lesson sources
    assert re.search(handout.EXERCISES_START.pattern, texts[str(handout.PROSE)], re.M) is None
    again = subprocess.run([sys.executable, str(REPO / "tools" / "handout.py"), str(tmp_path / "handout")],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode != 0 and "exists" in again.stderr  # never writes over a folder that is there
