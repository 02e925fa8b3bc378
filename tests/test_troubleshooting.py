"""The failures docs/troubleshooting.md describes, reproduced: each one fails the way the guide says, with
the message the guide quotes, in bounded time."""
import re
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from helpers import PYTHON, finish, free_port, kill_tree, run, run_group, start
from test_multinode import TRAIN, node_command
from torch import nn
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.nn.parallel import DistributedDataParallel as DDP


def wait_until_joined(endpoint, rdzv_id, timeout=60):
    """Waits until the first agent has joined the rendezvous, so that the second one joins after it.
    Reads torchrun's c10d rendezvous state in its TCPStore (a private layout: a key per run id, holding a
    sentinel until the first node adds itself)."""
    host, port = endpoint.split(":")
    key, empty = "torch.rendezvous." + rdzv_id, C10dRendezvousBackend._NULL_SENTINEL.encode()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5))
            if store.check([key]) and store.get(key) != empty:
                return
        except (RuntimeError, TimeoutError):
            pass  # the agent has not opened its store yet
        time.sleep(0.2)
    raise AssertionError(f"no node joined rendezvous {rdzv_id} at {endpoint} within {timeout} s")

def mismatched_nodes(first_nnodes, second_nnodes):
    """Two agents that disagree on --nnodes, the second started once the first has joined."""
    endpoint, rdzv_id = f"127.0.0.1:{free_port()}", f"mismatch-{first_nnodes}-{second_nnodes}"
    began = time.monotonic()
    first = start(node_command(endpoint, rdzv_id, *TRAIN, nnodes=first_nnodes, join_timeout=15))
    try:
        wait_until_joined(endpoint, rdzv_id)
    except AssertionError:
        kill_tree(first.pid)
        raise
    second = start(node_command(endpoint, rdzv_id, *TRAIN, nnodes=second_nnodes, join_timeout=15))
    results = [finish(agent, timeout=120) for agent in (first, second)]
    return results, time.monotonic() - began

@pytest.mark.multihost
def test_mismatched_nnodes_fails_on_both_nodes_when_the_smaller_count_joins_first():
    results, seconds = mismatched_nodes(2, 3)
    assert [result.returncode != 0 for result in results] == [True, True], results[1].stdout[-2000:]
    assert "RendezvousTimeoutError" in results[0].stdout
    assert seconds < 90

@pytest.mark.multihost
def test_mismatched_nnodes_trains_on_the_smaller_count_when_it_joins_last():
    results, _ = mismatched_nodes(3, 2)
    assert [result.returncode for result in results] == [0, 0], results[0].stdout[-2000:]
    # The node told --nnodes=3 ran as one of 2 ranks: only the start-up line shows it.
    assert re.search(r"local rank 0: rank \d of 2\b", results[0].stdout)

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
