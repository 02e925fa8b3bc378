"""benchmarks/step_split.py: each rank's DDP step split into computing, waiting and communicating names the rank
made slow on purpose, and the time the others lose shows as waiting, not as communication. The split's arithmetic,
on records made by hand; then the tool itself, on 2 ranks with rank 1 slowed by 100 ms a step."""
import re
import sys

import pytest
from helpers import REPO, run_ok, torchrun

sys.path.insert(0, str(REPO / "benchmarks"))
import step_split  # noqa: E402


def test_a_step_splits_into_computing_then_waiting_for_the_last_rank_then_communicating():
    """Rank 0 hands its last bucket over at 10 ms, rank 1 at 70 ms; both backward() calls return at 75 ms and the
    steps end at 80 ms: rank 0 waited 60 ms and communicated 5; rank 1 waited for nobody."""
    records = {0: [(0.000, 0.010, 0.075, 0.080)], 1: [(0.000, 0.070, 0.075, 0.080)]}
    table = step_split.split(records, 2)
    assert table[0] == pytest.approx((0.080, 0.015, 0.060, 0.005))
    assert table[1] == pytest.approx((0.080, 0.075, 0.000, 0.005))
    assert step_split.slowest(table) == 1
    alike = {0: [(0.0, 0.010, 0.015, 0.020)], 1: [(0.0, 0.011, 0.015, 0.020)]}
    assert step_split.slowest(step_split.split(alike, 2)) is None


def rows(output, title):
    """{rank: (step, computing, waiting, communicating)} in ms, from the table under `title`."""
    part = output.split(title, 1)[1].split("slow rank:", 1)[0]
    return {int(m[0]): tuple(map(float, m[1:])) for m in re.findall(r"^\s+(\d)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+"
                                                                     r"([\d.]+)$", part, re.M)}


@pytest.mark.launch
def test_the_tool_names_the_slow_rank_and_the_others_time_moves_into_waiting():
    output = run_ok([*torchrun(2, "benchmarks/step_split.py", "--steps", 10, "--slow-rank", 1, "--slow-ms", 100)],
                    timeout=120).stdout
    alike, slowed = rows(output, "every rank alike"), rows(output, "rank 1 slowed by 100 ms a step")
    assert "slow rank: 1 (it computes longest; the others wait for it)" in output
    assert slowed[1][1] - alike[1][1] > 70  # rank 1 computes ~100 ms longer
    assert slowed[0][2] - alike[0][2] > 70 and slowed[1][2] < 30  # rank 0 waits for it; rank 1 for nobody
    assert slowed[0][1] - alike[0][1] < 30  # rank 0 computes what it did
