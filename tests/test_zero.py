"""port/gpt_zero.py, the DDP port with ZeRO-1 (AdamW's state split across the processes), computes gpt_ddp.py's numbers
bit for bit, holds about 1/N of AdamW's state per process, and its snapshot (gathered on rank 0 by every process) is
gpt_ddp.py's format, which it resumes bit for bit. Three launches, made once (`zero_runs`): gpt_ddp.py uninterrupted;
gpt_zero.py stopped after step 3, then resumed. And the classic mistake, in a gloo group: the snapshot's gathering
called by rank 0 alone waits for the others until the collective timeout."""
import re
import time

import pytest
import torch
from helpers import read_metrics, run_group, run_ok, torchrun
from test_port import make_text
from test_tensor_parallel import FLAGS

ZERO, PORTED = "port/gpt_zero.py", "port/gpt_ddp.py"


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("zero")
    common = [*FLAGS, "--data", make_text(folder / "text.txt"), "--batch-size", 4]
    ddp = run_ok(torchrun(2, PORTED, *common, "--metrics", folder / "ddp.jsonl", "--checkpoint", folder / "ddp.pt"),
                 timeout=180).stdout
    checkpoint = folder / "zero.pt"
    stopped = run_ok(torchrun(2, ZERO, *common, "--metrics", folder / "zero.jsonl", "--checkpoint", checkpoint,
                              "--stop-after-steps", 3), timeout=180).stdout
    snapshot = torch.load(checkpoint, weights_only=True)  # as the stopped run left it
    resumed = run_ok(torchrun(2, ZERO, *common, "--metrics", folder / "zero.jsonl", "--checkpoint", checkpoint),
                     timeout=180).stdout
    return {"ddp": (ddp, read_metrics(folder / "ddp.jsonl"), torch.load(folder / "ddp.pt", weights_only=True)),
            "zero": (stopped + resumed, read_metrics(folder / "zero.jsonl"), snapshot)}


def final_checksum(output):
    return {float(found) for found in re.findall(r"rank \d done: parameter checksum ([-\d.e]+)", output)}


@pytest.mark.launch
@pytest.mark.past_fsdp
def test_zero_1_computes_ddps_numbers_bit_for_bit_stopped_and_resumed(zero_runs):
    (ddp_output, ddp, _), (output, zero, _) = zero_runs["ddp"], zero_runs["zero"]
    assert "stopped after step 3" in output and "resumed from" in output, output[-3000:]
    drop = {"tokens_per_s"}  # the clock's, not the training's
    assert [{k: v for k, v in m.items() if k not in drop} for m in zero] == \
        [{k: v for k, v in m.items() if k not in drop} for m in ddp]  # every step's loss, norm, lr, validation
    assert len(final_checksum(ddp_output)) == 1 and final_checksum(output) == final_checksum(ddp_output)


@pytest.mark.launch
@pytest.mark.past_fsdp
def test_zero_1_holds_a_share_of_adamws_state_per_process_and_its_snapshot_is_gpt_ddps_format(zero_runs):
    (_, _, ddp_snapshot), (output, _, snapshot) = zero_runs["ddp"], zero_runs["zero"]
    shares = re.search(r"AdamW's state per process: ([\d.]+), ([\d.]+) MB; whole \(on every process under DDP\): "
                       r"([\d.]+) MB", output)
    assert shares, output[-3000:]
    first, second, _ = map(float, shares.groups())
    mine, theirs = snapshot["optimizer"], ddp_snapshot["optimizer"]
    whole = sum(value.numel() * value.element_size() for state in theirs["state"].values()  # what DDP holds on each
                for value in state.values()) / 2**20
    assert abs(first + second - whole) <= 0.011 and max(first, second) < 0.6 * whole  # whole parameters dealt out
    assert set(mine) == set(theirs) == {"state", "param_groups"}
    assert [g["params"] for g in mine["param_groups"]] == [g["params"] for g in theirs["param_groups"]]
    assert {i: {k: v.shape for k, v in state.items()} for i, state in mine["state"].items()} == \
        {i: {k: v.shape for k, v in state.items()} for i, state in theirs["state"].items()}  # every moment, whole


def consolidate_on_rank_0_alone(rank, world_size):
    """ZeroRedundancyOptimizer over a small model, one step; then rank 0 alone gathers the state, as a snapshot
    written under `if rank == 0:` would; rank 1 goes on (sleeps past the timeout). Rank 0's outcome."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    if rank != 0:
        time.sleep(6)
        return None
    began = time.monotonic()
    try:
        optimizer.consolidate_state_dict(to=0)
        return "returned", time.monotonic() - began
    except RuntimeError as error:
        return str(error), time.monotonic() - began


@pytest.mark.multiproc
@pytest.mark.past_fsdp
def test_zero_1s_snapshot_gathered_by_rank_0_alone_waits_for_the_others_until_the_timeout():
    (said, seconds), _ = run_group(consolidate_on_rank_0_alone, 2, collective_timeout=3)
    assert "Timed out" in said and 2.5 < seconds < 5.5, (said, seconds)
