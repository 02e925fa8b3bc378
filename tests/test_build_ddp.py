"""The from-scratch DDP of lesson build_ddp_yourself (notebooks/lessons/my_ddp.py) against torch's
DistributedDataParallel, in real gloo groups of 2 and 3 processes: bitwise equal where the bucket layout and the
division are the same, equal within float32 rounding where they are not, no_sync, and the unused-parameter hang
ended by a timeout."""
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import REPO, free_port, start_group

sys.path.insert(0, str(REPO / "notebooks"))
from lessons import build_ddp  # noqa: E402
from lessons.my_ddp import MyDDP  # noqa: E402

pytestmark = pytest.mark.multiproc

COLLECTIVE_TIMEOUT = 3  # seconds: the unused-parameter wait ends here, not never


@pytest.fixture(scope="module")
def groups():
    """Every experiment of the lesson in a group of 2 and one of 3, both at once (helpers.run_group runs one
    group at a time; each costs seconds to start, and the unused-parameter experiment waits out the timeout)."""
    import torch

    folder, contexts = Path(tempfile.mkdtemp(prefix="ddp-steps-build-ddp-")), {}
    for size in (2, 3):
        (folder / str(size)).mkdir()
        contexts[size] = start_group(size, free_port(), str(folder / str(size)), build_ddp.lesson, (),
                                     COLLECTIVE_TIMEOUT)
    deadline = time.monotonic() + 90
    try:
        for size, context in contexts.items():
            while not context.join(timeout=max(0.1, deadline - time.monotonic())):
                assert time.monotonic() < deadline, f"the group of {size} did not finish within 90 s"
    finally:
        for context in contexts.values():
            for process in context.processes:
                if process.is_alive():
                    process.kill()
    results = {size: [torch.load(folder / str(size) / f"{rank}.pt", weights_only=False) for rank in range(size)]
               for size in contexts}
    shutil.rmtree(folder)
    return results


@pytest.fixture(params=[2, 3], ids=["2 ranks", "3 ranks"])
def lesson(request, groups):
    return request.param, groups[request.param]


def test_the_class_fits_one_screen():
    import inspect

    assert len(inspect.getsource(MyDDP).splitlines()) <= 80


def test_same_layout_is_bitwise_equal_to_torch_ddp(lesson):
    world_size, results = lesson
    for rank in results:
        equality = rank["equality"]
        assert equality["buckets (MyDDP)"]["bitwise"], equality["buckets (MyDDP)"]
        rebuilt = equality["torch buckets"]
        assert rebuilt["rebuilt_bucket_sizes"] == ", ".join(map(str, equality["my buckets"]["sizes"]))
        assert rebuilt["rebuilt_per_bucket_param_indices"] == ", ".join(
            " ".join(map(str, bucket)) for bucket in equality["my buckets"]["indices"])
        assert len(equality["my buckets"]["sizes"]) == 2, "the test needs more than one bucket"


def test_other_layouts_and_division_orders_are_equal_within_rounding_and_bitwise_only_on_2_ranks(lesson):
    """Two addends commute exactly, three do not associate: on 2 ranks every layout and division order gives
    DDP's bits (with its default options); on 3, only DDP's own default path's (its bucket layout, x 1/world
    size before the sum)."""
    world_size, results = lesson
    equality, division = results[0]["equality"], results[0]["division"]
    others = [equality[name] for name in ("naive", "hook per parameter", "buckets, torch without warm-up",
                                          "buckets, torch's default cap")]
    orders = [division["/ world size, then sum"], division["sum, then / world size"]]
    assert division["x 1/world size, then sum"]["bitwise"]
    for name in ("DDP, allreduce_hook", "DDP, batched_grad_copy", "DDP, gradient_as_bucket_view, .grad kept"):
        # DDP's other paths divide (div_): the second order, not its default path's bits on 3 ranks
        assert division[name]["bitwise"] == (world_size == 2), name
        assert division[name]["differ"] == division["/ world size, then sum"]["differ"], name
    for result in others + orders:
        assert result["max_abs"] < 1e-7, result  # parameters ~0.1: a few float32 ulps
        assert result["bitwise"] == (world_size == 2), result


def test_classic_mistakes_show(lesson):
    world_size, results = lesson
    mistakes = results[0]["mistakes"]
    low, high = mistakes["no division: gradient / DDP's"]
    assert abs(low - world_size) < 1e-3 and abs(high - world_size) < 1e-3
    # "exactly 2 on 2 ranks", by torch.equal: halving is exact; on 3 ranks x (1/3) rounds
    assert mistakes["no division: gradient == world size x DDP's, bitwise"] == (world_size == 2)
    assert mistakes["broadcast=True: ranks agree after training"]
    assert not mistakes["broadcast=False: ranks agree after training"]
    assert mistakes["step before the wait=False: ranks agree"]
    assert not mistakes["step before the wait=True: ranks agree"]


def test_no_sync_accumulation_is_bitwise_equal_to_torch_ddp(lesson):
    world_size, results = lesson
    for rank in results:
        accumulation = rank["accumulation"]
        assert accumulation["mine vs torch"]["bitwise"], accumulation["mine vs torch"]
        assert accumulation["mine: ranks' gradients differ inside no_sync"]
        assert accumulation["torch: ranks' gradients differ inside no_sync"]


def test_no_sync_is_read_at_forward_time_as_torch_does(lesson):
    """Where the forward ran decides, in torch's DDP and in MyDDP alike; nested no_sync restores the outer one."""
    world_size, results = lesson
    expected = {"forward and backward inside": False, "forward inside, backward outside": False,
                "forward outside, backward inside": True, "nested: forward after the inner one exits": False}
    assert set(expected) == set(build_ddp.NO_SYNC_PATTERNS)
    for rank in results:
        patterns = rank["no_sync patterns"]
        for pattern, synced in expected.items():
            assert patterns[f"torch: {pattern}: synced"] is synced, pattern
            assert patterns[f"mine: {pattern}: synced"] is synced, pattern
            assert patterns[f"{pattern}: mine == torch's, bitwise"], pattern


def test_broadcast_source_is_the_groups_first_rank_not_global_rank_0(groups):
    """In the group of 3: a subgroup of global ranks 1 and 2, which does not hold global rank 0."""
    assert [rank["subgroup broadcast"] for rank in groups[3]] == [None, True, True]


def test_torch_find_unused_parameters_completes_without_rebuilding_its_buckets(lesson):
    world_size, results = lesson
    for rank in results:
        run = rank["unused"]["torch, find_unused_parameters=True"]
        assert run["seconds"] < 2 and run["rebuilt_bucket_sizes"] is None
        # DDP's assignment by size: registration order, list of buckets reversed; not MyDDP's rule
        assert run["bucket_sizes"] == "256, 16424, 11008"


def test_unused_parameter_is_a_clear_error_within_seconds_not_a_hang(lesson):
    world_size, results = lesson
    *waiting, skipped = [rank["unused"] for rank in results]
    assert skipped["outcome"].startswith("RuntimeError: a bucket never completed")
    assert skipped["seconds"] < 1
    for rank in waiting:  # launched the bucket's all-reduce, waited for the rank that never did
        assert rank["outcome"].startswith("RuntimeError") and "bucket never completed" not in rank["outcome"]
        assert COLLECTIVE_TIMEOUT - 0.5 < rank["seconds"] < COLLECTIVE_TIMEOUT + 3, rank


def test_timing_words_need_the_whole_paired_interval_to_clear_zero():
    assert build_ddp.paired([1, 2, 3], [2, 3, 4])[3] == "below"
    assert build_ddp.paired([3, 4, 5], [2, 3, 4])[3] == "above"
    assert build_ddp.paired([1, 2, 5], [2, 3, 4])[3] == "overlaps"
    bounds = build_ddp.summary({"no communication": [4, 6], "communication alone": [5, 1]})
    assert bounds["bound: compute + communication"] == [9, 7]
    assert bounds["bound: max(compute, communication)"] == [5, 6]
    assert set(build_ddp.WORDS) == {"below", "above", "overlaps"}
    assert build_ddp.pairing_helped([10, 20], [11, 21]) == (0, 10, 10, True)
    assert build_ddp.pairing_helped([10, 20], [21, 11])[3] is False


def test_timeline_verdict_reads_which_buckets_finished_before_the_last_gradient():
    events = [("gradient", None, 1.0), ("launch", 0, 1.0), ("gradient", None, 3.0), ("done", 0, 2.5),
              ("launch", 1, 3.0), ("done", 1, 4.0)]
    assert build_ddp.timeline_verdict(events, 4.5) == {"last gradient": 3.0, "hidden": [0], "not hidden": [1],
                                                        "tail": 1.5}


def test_the_lesson_states_no_timing_verdict_of_its_own():
    """Timing words come from the printed numbers (build_ddp.WORDS, printed by the cells), never from a heading
    or a hard-coded sentence that a re-run could contradict."""
    text = (REPO / "notebooks" / "build_ddp_yourself.md").read_text()
    headings = [line for line in text.splitlines() if line.startswith("#")]
    assert not [line for line in headings if any(word in line.lower() for word in ("faster", "slower"))]
    for stale in ("still faster", '("cannot tell": this machine', "cannot tell them apart"):
        assert stale not in text
