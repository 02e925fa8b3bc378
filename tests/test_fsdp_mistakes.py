"""Step 05's classic FSDP2 mistakes (notebooks/lessons/fsdp_mistakes.py), each run in real gloo groups of 2 CPU
processes beside its correct version: the symptom each shows on this torch, and that the fix removes it."""
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import REPO, free_port, start_group

sys.path.insert(0, str(REPO / "notebooks"))
from lessons import fsdp_mistakes  # noqa: E402

pytestmark = pytest.mark.multiproc

TIMEOUT = fsdp_mistakes.TIMEOUT
GET_FULL, FULL_TENSOR, _ = fsdp_mistakes.RANK0_CALLS


@pytest.fixture(scope="module")
def groups():
    """Two groups of 2 at once, each ending with one group-breaking rank-0-only call (a gloo timeout leaves a
    process's groups unusable: one per group): the whole lesson with get_model_state_dict, and rank0_only alone
    with full_tensor. (dcp.save on rank 0 alone times out alike: not run, as a third group would add two processes.)
    Returns {call: [rank 0's result, rank 1's]} and the scratch folder."""
    import torch

    folder, contexts = Path(tempfile.mkdtemp(prefix="ddp-steps-fsdp-mistakes-")), {}
    runs = {GET_FULL: fsdp_mistakes.lesson, FULL_TENSOR: fsdp_mistakes.rank0_only}
    for index, (call, worker) in enumerate(runs.items()):
        results = folder / f"results-{index}"
        results.mkdir()
        contexts[call] = results, start_group(2, free_port(), str(results), worker, (str(folder), call), TIMEOUT)
    deadline = time.monotonic() + 90
    try:
        for call, (_, context) in contexts.items():
            while not context.join(timeout=max(0.1, deadline - time.monotonic())):
                assert time.monotonic() < deadline, f"the group ending with {call} did not finish within 90 s"
    finally:
        for _, context in contexts.values():
            for process in context.processes:
                if process.is_alive():
                    process.kill()
    outcome = {call: [torch.load(results / f"{rank}.pt", weights_only=False) for rank in range(2)]
               for call, (results, _) in contexts.items()}
    yield outcome, folder
    shutil.rmtree(folder)


@pytest.fixture
def lesson(groups):
    return groups[0][GET_FULL]


def test_optimizer_built_before_fully_shard_silently_trains_nothing(lesson):
    for rank in lesson:
        before, after = rank["optimizer"]["before"], rank["optimizer"]["after"]
        # fully_shard put new DTensor Parameters into the model; the early optimizer still holds the old ones
        assert before["parameters replaced by fully_shard"] and after["parameters replaced by fully_shard"]
        assert before["optimizer's tensors"] == ["Parameter"] and before["model's parameters"] == ["DTensor"]
        assert not before["optimizer holds the model's parameters"]
        # the model's parameters get gradients, the optimizer's never: step() skips them, with no error
        assert before["got a gradient"] == {"optimizer's tensors": False, "model's parameters": True}
        assert not before["weights changed"] and len(set(before["losses"])) == 1
        # built after fully_shard: it holds the DTensors, and the loss falls
        assert after["optimizer holds the model's parameters"] and after["optimizer's tensors"] == ["DTensor"]
        assert after["got a gradient"] == {"optimizer's tensors": True, "model's parameters": True}
        assert after["weights changed"] and after["losses"][-1] < after["losses"][0] - 0.1


def test_plain_state_dict_is_local_and_safe_on_one_rank_and_full_one_gathers_on_every_rank(lesson):
    zero, one = (rank["rank 0 only"] for rank in lesson)
    local = zero["rank 0 alone: model.state_dict()"]
    assert local["seconds"] < 0.5 and zero["group in step after it"] and one["group in step after it"]
    assert local["holds"]["0.weight"] == ("DTensor", (32, 16), (16, 16))  # global shape, this rank's rows
    assert local["holds"]["2.weight"] == ("DTensor", (4, 32), (2, 32))
    # every rank calls it; with cpu_offload only rank 0 receives the full tensors
    assert zero["every rank: get_model_state_dict"]["holds"] == {
        "0.weight": ("Tensor", (32, 16)), "0.bias": ("Tensor", (32,)), "2.weight": ("Tensor", (4, 32)),
        "2.bias": ("Tensor", (4,))}
    assert one["every rank: get_model_state_dict"]["holds"] == {}


@pytest.mark.parametrize("call", [GET_FULL, FULL_TENSOR])
def test_a_gather_on_rank_0_only_ends_in_the_timeout_on_both_ranks(groups, call):
    # the lesson's run nests rank0_only's results under "rank 0 only"; the others are rank0_only's alone
    zero, one = (rank.get("rank 0 only", rank)[f"rank 0 alone: {call}"] for rank in groups[0][call])
    assert zero["waiting in"] == call and one["waiting in"] == "dist.barrier()"
    timed_out = f"RuntimeError: Timed out waiting {TIMEOUT * 1000}ms for "
    # both wait, neither gets an answer: gloo's timeout ends both, milliseconds apart. A rank whose wait times out
    # closes its connections, so the other may fail a moment early with "Connection closed by peer" (once in CI):
    # the same end, at the same time.
    assert timed_out in (zero["outcome"][:len(timed_out)], one["outcome"][:len(timed_out)]), (zero, one)
    for rank in (zero, one):
        assert rank["outcome"].startswith((timed_out, "RuntimeError: Connection closed by peer")), rank
        assert TIMEOUT - 0.5 < rank["seconds"] < TIMEOUT + 3, rank


def test_torch_save_from_rank_0_holds_rank_0s_shards_and_does_not_load_into_a_plain_model(groups):
    zero, one = (rank["checkpoints"] for rank in groups[0][GET_FULL])
    assert zero["sharded file's 0.weight"] == ("DTensor", (32, 16), (16, 16))
    assert zero["its local tensor is rank 0's rows"]
    # opened as an evaluation script would (this process: no group)
    wrong = fsdp_mistakes.open_checkpoint(zero["paths"]["sharded"])
    assert wrong["holds"] == {"0.weight": ("DTensor", (32, 16), (16, 16)), "0.bias": ("DTensor", (32,), (16,)),
                              "2.weight": ("DTensor", (4, 32), (2, 32)), "2.bias": ("DTensor", (4,), (2,))}
    assert wrong["load_state_dict"].startswith("RuntimeError: Error(s) in loading state_dict for Sequential:")
    assert "got mixed torch.Tensor and DTensor" in wrong["load_state_dict"]
    assert not wrong["equal to the trained model"]
    # correct: the full state dict (every rank gathers, rank 0 saves), and DCP (every rank writes its shards)
    for name in ("full", "dcp"):
        right = fsdp_mistakes.open_checkpoint(zero["paths"][name])
        assert right["load_state_dict"] == "loaded" and right["equal to the trained model"], (name, right)
        assert right["holds"]["0.weight"] == ("Tensor", (32, 16)), name
    assert zero["dcp files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert zero["dcp: reloaded sharded model equal"] and one["dcp: reloaded sharded model equal"]


def test_full_views_and_sharded_ones_do_not_mix(lesson):
    views = [rank["mixed views"] for rank in lesson]
    for rank in views:
        loaded = rank["load_state_dict(full tensors)"]
        assert loaded.startswith("RuntimeError: Error(s) in loading state_dict for FSDPSequential:"), loaded
        assert "0.weight" in loaded and "got mixed torch.Tensor and DTensor" in loaded, loaded
        assert 'Missing key(s) in state_dict: "0.weight"' in rank["load_state_dict(DDP's module. keys)"]
        assert rank["DDP(sharded model)"] == ("NotImplementedError: Operator c10d.broadcast_.default does not have "
                                              "a sharding strategy registered.")
        assert rank["set_model_state_dict(broadcast_from_rank0): equal to the checkpoint"]
        assert rank["load plain, then shard: equal to the checkpoint"]
        # the shape says full, the data is this rank's rows; .item() of a Partial sum is this rank's part
        assert rank["weight.shape"] == (32, 16) and rank["weight.to_local().shape"] == (16, 16)
        assert rank["weight.sum(): placements"] == "(Partial(sum),)"
        assert rank["weight.full_tensor().sum().item()"] == pytest.approx(rank["plain model's weight.sum().item()"])
    parts = [rank["weight.sum().item()"] for rank in views]
    assert parts[0] != parts[1] and sum(parts) == pytest.approx(views[0]["weight.full_tensor().sum().item()"])
