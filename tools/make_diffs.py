"""Writes diffs/NN_name.diff: each numbered script against the one before it, the tutorial's lessons.

    python tools/make_diffs.py            # regenerate diffs/
    python tools/make_diffs.py --check    # fail if diffs/ is stale or a step is over its budget (CI)

A step's size is the number of lines it adds to the previous script. The budgets below are the one place
they are kept: a step that grows past its budget is teaching more than one thing, or the scripts' shared
parts have drifted apart.
"""
import difflib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DIFFS = REPO / "diffs"
BUDGET = {  # lines added by each step
    "01_mp_spawn.py": 69,  # aimed at 60; preparing the data once costs 7, checking inputs 1, CPU affinity 1
    "02_torchrun.py": 30,
    "03_multinode.py": 40,
    "04_fault_tolerant.py": 150,
}


def steps():
    """(previous script, script) pairs, in order."""
    scripts = sorted(path.name for path in REPO.glob("[0-9][0-9]_*.py"))
    return list(zip(scripts, scripts[1:], strict=False))


def render(previous, script):
    old, new = ((REPO / name).read_text().splitlines(keepends=True) for name in (previous, script))
    return "".join(difflib.unified_diff(old, new, previous, script))


def added_lines(diff):
    return sum(line.startswith("+") and not line.startswith("+++") for line in diff.splitlines())


def main(check):
    problems = []
    DIFFS.mkdir(exist_ok=True)
    for previous, script in steps():
        diff, target = render(previous, script), DIFFS / script.replace(".py", ".diff")
        if added_lines(diff) > BUDGET[script]:
            problems.append(f"{script} adds {added_lines(diff)} lines to {previous}; budget {BUDGET[script]}")
        if check and (not target.exists() or target.read_text() != diff):
            problems.append(f"{target.relative_to(REPO)} is stale: run python tools/make_diffs.py")
        elif not check:
            target.write_text(diff)
        print(f"{previous} -> {script}: {added_lines(diff)} lines added (budget {BUDGET[script]})")
    for problem in problems:
        print("error:", problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(check="--check" in sys.argv[1:]))
