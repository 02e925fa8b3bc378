"""The failures docs/troubleshooting.md describes, reproduced: each one fails the way the guide says, with
the message the guide quotes, in bounded time."""
import time

import pytest
import torch
import torch.distributed as dist
from helpers import PYTHON, finish, free_port, run, run_group, start
from test_multinode import TRAIN, node_command
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


@pytest.mark.multihost
def test_mismatched_nnodes_fails_on_both_nodes_after_the_join_timeout():
    endpoint = f"127.0.0.1:{free_port()}"
    began = time.monotonic()
    agents = [start(node_command(endpoint, "mismatch", *TRAIN, nnodes=nnodes, join_timeout=15)) for nnodes in (2, 3)]
    results = [finish(agent, timeout=120) for agent in agents]
    assert all(result.returncode != 0 for result in results)
    assert "RendezvousTimeoutError" in results[0].stdout
    assert time.monotonic() - began < 90

@pytest.mark.launch
def test_legacy_launcher_passes_a_local_rank_argument_the_scripts_do_not_take():
    result = run([PYTHON, "-m", "torch.distributed.launch", "--nproc_per_node=1", "02_torchrun.py"], timeout=60)
    assert result.returncode != 0
    assert "unrecognized arguments: --local-rank=0" in result.stdout

def skip_a_collective(rank, world_size):
    if rank == 1:  # e.g. an all_reduce hidden inside `if rank == 0:`
        time.sleep(6)
        return "skipped"
    began = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError as error:
        return f"{time.monotonic() - began:.1f} s: {error}"
    return "no error"

@pytest.mark.multiproc
def test_a_skipped_collective_fails_at_the_timeout_instead_of_hanging():
    waited = run_group(skip_a_collective, 2, collective_timeout=3)[0]
    assert "Timed out" in waited or "timed out" in waited, waited
    assert float(waited.split(" s:")[0]) < 6

def mismatched_collectives(rank, world_size):
    try:
        dist.all_reduce(torch.ones(1)) if rank == 0 else dist.barrier()
    except RuntimeError as error:
        return str(error)
    return "no error"

@pytest.mark.multiproc
def test_debug_detail_names_mismatched_collectives(monkeypatch):
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")  # the spawned ranks inherit it
    message = run_group(mismatched_collectives, 2, collective_timeout=10)[0]
    assert "Detected mismatch between collectives" in message, message

class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x):
        return self.used(x)

def unused_parameters(rank, world_size, find_unused):
    torch.manual_seed(0)
    model = DDP(TwoHeads(), find_unused_parameters=find_unused)
    try:
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
    except RuntimeError as error:
        return str(error)
    return "ok"

@pytest.mark.multiproc
def test_unused_parameters_need_find_unused_parameters():
    assert "find_unused_parameters=True" in run_group(unused_parameters, 2, False)[0]
    assert run_group(unused_parameters, 2, True) == ["ok", "ok"]
