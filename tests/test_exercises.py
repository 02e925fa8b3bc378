"""The exercises (exercises/): each check passes on its solution, fails on the untouched starter at the claim it
declares, and fails on every forbidden shortcut (tests/exercise_shortcuts/NAME__what.diff: the solution with the
shortcut taken, as a patch whose first line names the claim that must fail, then why); each exercise has a task
text with hints and a lecture to read; the handout ships starters, tasks and checks, never a solution."""
import importlib.util
import re
import subprocess
import sys

import pytest
from helpers import REPO

EXERCISES = REPO / "exercises"
sys.path.insert(0, str(EXERCISES))  # as exercises/grade.py does: a check imports _grading
NAMES = sorted(path.parent.name for path in EXERCISES.glob("*/check.py"))
SHORTCUTS = sorted((REPO / "tests" / "exercise_shortcuts").glob("*__*.diff"))


def check_module(name):
    spec = importlib.util.spec_from_file_location(f"check_{name}", EXERCISES / name / "check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def grade(name, file):
    """The grader as a learner runs it, on `file`; its own deadlines end every process it starts, and this one
    is a last resort."""
    return subprocess.run([sys.executable, EXERCISES / "grade.py", name, "--file", file], cwd=REPO, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=240)


def first_failure(output):
    found = re.search(r"^FAIL  (.*)$", output, re.M)
    return found.group(1) if found else None


@pytest.mark.exercises
@pytest.mark.parametrize("name", NAMES)
def test_the_check_passes_on_the_solution(name):
    result = grade(name, EXERCISES / name / "solution.py")
    assert result.returncode == 0 and "FAIL" not in result.stdout, result.stdout
    assert re.search(r"^PASS  ", result.stdout, re.M), result.stdout


@pytest.mark.exercises
@pytest.mark.parametrize("name", NAMES)
def test_the_check_fails_on_the_untouched_starter_at_the_claim_it_declares(name):
    check = check_module(name)
    result = grade(name, EXERCISES / name / check.FILE)
    assert result.returncode == 1, result.stdout
    assert first_failure(result.stdout) == check.STARTER_FAILS, result.stdout


@pytest.mark.exercises
@pytest.mark.parametrize("shortcut", SHORTCUTS, ids=[path.stem for path in SHORTCUTS])
def test_a_forbidden_shortcut_fails_at_the_claim_its_first_line_names(shortcut, tmp_path):
    name = shortcut.stem.split("__")[0]
    expected = shortcut.read_text().splitlines()[0].strip()
    taken = tmp_path / f"{shortcut.stem}.py"  # the solution, patched: a shortcut is written once, as its difference
    patched = subprocess.run(["patch", "--quiet", "--output", taken, EXERCISES / name / "solution.py", shortcut],
                             capture_output=True, text=True, timeout=30)
    assert patched.returncode == 0, patched.stdout + patched.stderr
    result = grade(name, taken)
    assert result.returncode == 1, result.stdout
    assert first_failure(result.stdout) == expected, result.stdout


@pytest.mark.parametrize("name", NAMES)
def test_each_exercise_has_a_task_with_hints_a_lecture_a_starter_a_solution_and_a_shortcut(name):
    check = check_module(name)
    task = (EXERCISES / name / "TASK.md").read_text()
    assert task.startswith("# "), "the first line is the title"
    assert len(re.findall(r"^\d\. ", task.split("## Hints", 1)[-1], re.M)) >= 2, "two or more numbered hints"
    assert (REPO / check.LECTURE).is_file(), f"LECTURE names a lecture: {check.LECTURE}"
    for file in (check.FILE, "solution.py"):
        assert (EXERCISES / name / file).is_file()
    assert check.FILE in task, "the task names the file to edit"
    assert any(path.stem.startswith(f"{name}__") for path in SHORTCUTS), "a forbidden shortcut is tested"


def test_the_exercise_list_and_the_readmes_course_tables_name_every_exercise_beside_its_lecture():
    listed = (EXERCISES / "README.md").read_text()
    course = (REPO / "README.md").read_text()
    for name in NAMES:
        lecture = check_module(name).LECTURE
        assert f"[{name}]({name}/TASK.md) | [{lecture.split('/')[1].removesuffix('.ipynb')}](../{lecture})" in listed
        row = next(line for line in course.splitlines() if f"(exercises/{name}/TASK.md)" in line)
        assert f"({lecture})" in row, f"README: {name} is not beside its lecture"
