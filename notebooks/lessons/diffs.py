"""The lesson's code, read from the repository when the notebook runs: the diff between two numbered scripts,
shown whole or hunk by hunk (a hunk that moved or vanished stops the build, and every_hunk_shown() fails on a
hunk the lesson did not explain), and a function's source."""
import difflib

from lessons.runs import REPO


def show_diff(previous, script):
    """The diff between two numbered scripts, read from the repository now: it cannot go stale."""
    return _code("".join(_diff(previous, script)))


def _diff(previous, script):
    old, new = ((REPO / name).read_text().splitlines(keepends=True) for name in (previous, script))
    return list(difflib.unified_diff(old, new, previous, script))  # 3 lines of context, as diffs/ and diff -u


def _code(text):
    from IPython.display import Code

    return Code(text, language="diff")


def hunks(previous, script):
    """The diff's hunks, each a list of lines starting with its @@ header."""
    found = []
    for line in _diff(previous, script)[2:]:
        if line.startswith("@@"):
            found.append([])
        found[-1].append(line)
    return found


_shown = {}  # (previous, script) -> {hunk index: indexes of its lines shown so far}
_last = {}  # the part hunk() or more() showed last: previous, script, hunk index, its last line


def hunk(previous, script, containing, through=None):
    """Shows the one hunk of the diff that adds or removes a line containing `containing`, read from the
    repository now; with `through`, only its lines up to the next line containing `through` (more() shows
    the rest). A hunk that is not there, or is not the only one, is an error: the lesson never shows the
    wrong code."""
    every = hunks(previous, script)
    matches = [index for index, lines in enumerate(every)
               if any(line[0] in "+-" and containing in line for line in lines[1:])]
    if len(matches) != 1:
        raise LookupError(f"{len(matches)} hunks of {previous} -> {script} change a line containing {containing!r} "
                          "(expected exactly 1): the scripts changed, update the lesson")
    return _part(previous, script, matches[0], 1, through)


def more(through=None):
    """Shows the next part of the hunk shown last: up to the next line containing `through`, or to its end."""
    previous, script, index, last = _last["part"]
    return _part(previous, script, index, last + 1, through)


def _part(previous, script, index, first, through):
    lines = hunks(previous, script)[index]
    last = len(lines) - 1
    if through is not None:
        last = next((i for i in range(first, len(lines)) if through in lines[i]), None)
        if last is None:
            raise LookupError(f"no line containing {through!r} in the rest of hunk {lines[0].strip()}: update the "
                              "lesson")
    _shown.setdefault((previous, script), {}).setdefault(index, set()).update(range(first, last + 1))
    _last["part"] = previous, script, index, last
    part = "" if (first, last) == (1, len(lines) - 1) else f"   (lines {first}-{last} of this hunk's {len(lines) - 1})"
    return _code(lines[0].rstrip("\n") + part + "\n" + "".join(lines[first:last + 1]))


def every_hunk_shown(previous, script):
    """Fails unless every changed line of the diff was shown by hunk() in this notebook: a new hunk in the
    scripts must be explained before the lesson builds again."""
    shown = _shown.get((previous, script), {})
    missing = [lines[0].strip() for index, lines in enumerate(hunks(previous, script))
               if any(line[0] in "+-" and i not in shown.get(index, ()) for i, line in enumerate(lines) if i)]
    if missing:
        raise AssertionError(f"hunks of {previous} -> {script} not explained in this notebook: {missing}")
    print(f"all {len(hunks(previous, script))} hunks of the diff {previous} -> {script} are explained above")


def show(function):
    """A function's source, to read before it runs."""
    import inspect

    from IPython.display import Code

    return Code(inspect.getsource(function), language="python")


