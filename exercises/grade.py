"""Grades your exercise by what it does, never by its text: `make check EX=NAME` (or, from the repository root,
`.venv/bin/python exercises/grade.py NAME`). It runs your file in real processes (gloo on the CPU, GPUs hidden),
then prints one line per claim, PASS or FAIL; for a failed claim, what it saw, what it expected, and where in the
lecture to look. Every process it starts has a deadline, so a hang ends as a failed claim, not a frozen terminal.

    make check                 # the exercises, in order, and which of them your files pass (from your last checks)
    make check EX=01_ddp       # grade exercises/01_ddp/<its file>
    .venv/bin/python exercises/grade.py 01_ddp --file my_copy.py   # grade another file

An exercise is a folder exercises/NAME/ with TASK.md (what to write, where it is taught, hints), the file you edit
(named in TASK.md) and check.py (the claims). Your passes are recorded in exercises/.passed (not in git).
"""
import argparse
import importlib.util
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _grading import EXERCISES, Grade, exercise_names  # noqa: E402

PASSED = EXERCISES / ".passed"


def load_check(name):
    spec = importlib.util.spec_from_file_location(f"check_{name}", EXERCISES / name / "check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def passed_names():
    return set(PASSED.read_text().split()) if PASSED.exists() else set()


def show_progress():
    done = passed_names()
    print("The exercises, in the course's order (make check EX=NAME grades one):")
    for name in exercise_names():
        title = (EXERCISES / name / "TASK.md").read_text().splitlines()[0].lstrip("# ").strip()
        print(f"  [{'x' if name in done else ' '}] {name:<22} {title}")
    print(f"{len(done & set(exercise_names()))} of {len(exercise_names())} passed (as of each one's last check).")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", nargs="?", help="the exercise, e.g. 01_ddp; none: list them and your progress")
    parser.add_argument("--file", type=Path, help="grade this file instead of the exercise's own")
    args = parser.parse_args(argv)
    if not args.name:
        show_progress()
        return 0
    if args.name not in exercise_names():
        parser.error(f"no exercise named {args.name!r}; the exercises: {', '.join(exercise_names())}")
    check = load_check(args.name)
    learner_file = (args.file or EXERCISES / args.name / check.FILE).resolve()
    if not learner_file.is_file():
        parser.error(f"{learner_file} does not exist")
    shown = learner_file.relative_to(Path.cwd()) if learner_file.is_relative_to(Path.cwd()) else learner_file
    print(f"Checking {shown} against exercise {args.name} ({check.LECTURE})")
    began = time.monotonic()
    grade = Grade(lecture=check.LECTURE)
    try:
        check.check(learner_file, grade)
    except Exception as error:  # the check itself broke: say so plainly, never a traceback in place of a verdict
        grade.claim("the check ran to its end", False, observed=f"{type(error).__name__}: {error}",
                    expected="no error in the grader (report it: this is the course's fault, not yours)")
    print(f"{grade.passed} of {grade.total} claims passed in {time.monotonic() - began:.0f} s.")
    if grade.failed:
        return 1
    if args.file is None:
        PASSED.write_text("\n".join(sorted(passed_names() | {args.name})) + "\n")
    print(f"Exercise {args.name} passed.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
