"""The one rule for a verdict word on a measurement, shared by the benchmarks and the lessons: the spread decides
the word, never the median. An interval (the spread of paired, interleaved repeats: smallest–largest, or the
middle half) earns a word that takes a side of a line (1.0 for a ratio, 0 for a difference, a bound, a goal) only
where the whole interval clears that line; an interval that touches or includes the line earns the other word
("not resolved", "cannot tell").

It imports nothing, so anything may use it: the benchmark programs (benchmarks/ is their path when they run as
scripts), notebooks/lessons/build_ddp.py and the notebooks' cells (which add benchmarks/ to the path, and name
this file, benchmarks/_verdict.py, so that a change to it makes their outputs stale: tools/notebooks.py)."""


def verdict(low, high, line, *, above, below, neither):
    """`above` where the whole interval [low, high] lies above `line`, `below` where it lies wholly below it,
    else `neither`: the spread includes the line (or touches it, or is not a number), and does not resolve the
    side."""
    if low > high:
        raise ValueError(f"not an interval: low {low} > high {high}")
    if low > line:
        return above
    if high < line:
        return below
    return neither
