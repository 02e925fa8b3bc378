"""The failures docs/troubleshooting.md describes, reproduced: each one fails the way the guide says, with
the message the guide quotes, in bounded time."""
import re
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from helpers import (
    PYTHON,
    REPO,
    TORCHRUN,
    clean_env,
    finish,
    free_port,
    kill_tree,
    nodes_env,
    run,
    run_group,
    start,
    torchrun,
)
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

def mismatched_nodes(first_nnodes, second_nnodes, join_timeout):
    """Two agents that disagree on --nnodes, the second started once the first has joined."""
    endpoint, rdzv_id = f"127.0.0.1:{free_port()}", f"mismatch-{first_nnodes}-{second_nnodes}"
    began = time.monotonic()
    first = start(node_command(endpoint, rdzv_id, *TRAIN, nnodes=first_nnodes, join_timeout=join_timeout), nodes_env())
    try:
        wait_until_joined(endpoint, rdzv_id)
    except AssertionError:
        kill_tree(first.pid)
        raise
    second = start(node_command(endpoint, rdzv_id, *TRAIN, nnodes=second_nnodes, join_timeout=join_timeout),
                   nodes_env())
    results = [finish(agent, timeout=120) for agent in (first, second)]
    return results, time.monotonic() - began

@pytest.mark.multihost
def test_mismatched_nnodes_fails_on_both_nodes_when_the_smaller_count_joins_first():
    results, seconds = mismatched_nodes(2, 3, join_timeout=10)  # the first's timeout ends it, whenever the second joins
    assert [result.returncode != 0 for result in results] == [True, True], results[1].stdout[-2000:]
    assert "RendezvousTimeoutError" in results[0].stdout
    assert seconds < 90

@pytest.mark.multihost
def test_mismatched_nnodes_trains_on_the_smaller_count_when_it_joins_last():
    results, _ = mismatched_nodes(3, 2, join_timeout=15)  # time for the second to start and join (import torch)
    assert [result.returncode for result in results] == [0, 0], results[0].stdout[-2000:]
    # The node told --nnodes=3 ran as one of 2 ranks: only the start-up line shows it.
    assert re.search(r"local rank 0: rank \d of 2\b", results[0].stdout)

@pytest.mark.launch
def test_a_script_flag_that_begins_two_torchrun_options_stops_torchrun_before_anything_starts():
    """torchrun parses its command line with argparse, which looks up every --word among its options, abbreviations
    included, even after the script's name: 01's --nproc begins both --nproc-per-node and --nproc_per_node, and
    torchrun stops before starting anything. After `--` it goes to the script (tests/test_launch_and_bad_input.py
    runs that)."""
    result = run(torchrun(1, "01_mp_spawn.py", "--nproc", "1"), timeout=60)
    assert result.returncode == 2
    assert "torchrun: error: ambiguous option: --nproc could match --nproc-per-node, --nproc_per_node" in result.stdout


@pytest.mark.launch
def test_legacy_launcher_passes_a_local_rank_argument_the_scripts_do_not_take():
    result = run([PYTHON, "-m", "torch.distributed.launch", "--nproc_per_node=1", "02_torchrun.py"], timeout=60)
    assert result.returncode != 0
    assert "unrecognized arguments: --local-rank=0" in result.stdout

@pytest.mark.launch
def test_a_second_job_on_the_same_master_port_fails_at_once_naming_the_port():
    """Two jobs on one machine, both given the same --master_port P: the second agent cannot open its store there
    and stops at once; the first goes on. (Without --master_port, torch 2.15's torchrun gives a one-node job a free
    port, as --standalone does; on 2.9.1, or for a multi-node static job, both would take 29500.)"""
    port = free_port()
    job = [TORCHRUN, "--nnodes=1", "--nproc_per_node=1", f"--master_port={port}", "02_torchrun.py", *TRAIN]
    first = start(job, nodes_env())
    try:
        deadline = time.monotonic() + 60
        while not listening(port):  # the first agent's store is open
            assert first.poll() is None and time.monotonic() < deadline, "the first job did not open its store"
            time.sleep(0.2)
        began = time.monotonic()
        second = finish(start(job, nodes_env()), timeout=60)
        assert second.returncode != 0 and time.monotonic() - began < 30
        assert f"port: {port}, useIpv6: false, code: -98, name: EADDRINUSE" in second.stdout, second.stdout[-2000:]
        assert first.poll() is None, "the first job goes on"
    finally:
        kill_tree(first.pid)


def listening(port):
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0

class Crafted:
    """What a sender can put in a pickle: unpickling it calls any function the sender names, with its arguments
    (here a harmless one, str.upper)."""
    def __reduce__(self):
        return str.upper, ("this call was chosen by the sender",)


def send_objects_from_rank0(rank, world_size):
    settings = [{"lr": 0.1, "warmup": ["linear", 100]} if rank == 0 else None]  # equal-length lists on every rank
    dist.broadcast_object_list(settings, src=0)
    crafted = [Crafted() if rank == 0 else None]
    dist.broadcast_object_list(crafted, src=0)
    try:
        dist.broadcast_object_list([Crafted() if rank == 0 else None], src=0, weights_only=True)
        refused = None
    except Exception as error:  # noqa: BLE001 (what the receiving rank gets)
        refused = f"{type(error).__name__}: {error}"
    return settings[0], crafted[0] if isinstance(crafted[0], str) else type(crafted[0]).__name__, refused


@pytest.mark.multiproc
def test_broadcast_object_list_sends_rank0s_objects_and_unpickling_runs_what_the_sender_chose():
    """broadcast_object_list pickles rank 0's objects and every other rank unpickles them: a plain dict arrives
    equal; an object whose pickle names a function makes the receiving rank call it (that is why a pickle is only
    for data you trust); with weights_only=True (torch 2.15.0) the receiving rank refuses it instead."""
    results = run_group(send_objects_from_rank0, 2)
    assert [result[0] for result in results] == [{"lr": 0.1, "warmup": ["linear", 100]}] * 2
    assert results[0][1] == "Crafted", "rank 0 keeps its own object"
    assert results[1][1] == "THIS CALL WAS CHOSEN BY THE SENDER", "rank 1 ran the call"
    assert results[0][2] is None and results[1][2].startswith("UnpicklingError: Weights only load failed"), results


LOCAL_WORKER_INIT = """
import torch
from torch.utils.data import DataLoader, TensorDataset


def seed_worker(worker_id):  # at module level: a worker finds it by name
    pass


def main():
    def local_seed_worker(worker_id):  # defined inside a function: a local object, which has no name to find
        pass
    for init in (local_seed_worker, seed_worker):
        loader = DataLoader(TensorDataset(torch.zeros(4)), num_workers=1, worker_init_fn=init,
                            multiprocessing_context="forkserver")  # as the numbered scripts' loaders
        try:
            print(init.__name__, "works:", next(iter(loader))[0].tolist(), flush=True)
        except AttributeError as error:
            print(init.__name__, "fails:", error, flush=True)


if __name__ == "__main__":
    main()
"""


@pytest.mark.launch
def test_a_loader_worker_needs_what_it_runs_at_module_level(tmp_path):
    """The scripts' loaders start workers from a fork server, so the dataset and worker_init_fn travel to each
    worker by pickle, which finds a function by its name: one defined inside another function cannot be sent."""
    (tmp_path / "workers.py").write_text(LOCAL_WORKER_INIT)
    output = run([PYTHON, tmp_path / "workers.py"], timeout=120).stdout
    assert "local_seed_worker fails: Can't pickle local object 'main.<locals>.local_seed_worker'" in output, output
    assert "seed_worker works: [0.0]" in output, output


def skip_a_collective(rank, world_size):
    if rank == 1:  # e.g. an all_reduce hidden inside `if rank == 0:`; run_group keeps this rank in the group
        return "skipped"  # until rank 0 is done
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

def unused_parameters(rank, world_size):
    """Two steps of a model with an unused head, first without find_unused_parameters, then (a fresh model, the
    same group: the refusal comes before any collective of the second step) with it: {find_unused: outcome}."""
    said = {}
    for find_unused in (False, True):
        torch.manual_seed(0)
        model = DDP(TwoHeads(), find_unused_parameters=find_unused)
        try:
            for _ in range(2):
                model(torch.randn(3, 4)).sum().backward()
            said[find_unused] = "ok"
        except RuntimeError as error:
            said[find_unused] = str(error)
    return said

@pytest.mark.multiproc
def test_unused_parameters_need_find_unused_parameters():
    said = run_group(unused_parameters, 2)
    assert all("find_unused_parameters=True" in ranks_said[False] for ranks_said in said), said
    assert [ranks_said[True] for ranks_said in said] == ["ok", "ok"]

class WithAMethod(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 2)

    def forward(self, x):
        return self.layer(x)

    def embed(self, x):  # a method of the model's own, besides forward
        return self.layer(x)

def ddp_mistakes(rank, world_size):
    """Two mistakes in one group: a model built differently on one rank, and a custom method called through DDP."""
    said = {}
    try:
        DDP(nn.Sequential(nn.Linear(4, 2), *[nn.Linear(2, 2)] * (rank == 1)))  # e.g. a head added `if rank == 1:`
    except RuntimeError as error:
        said["different model"] = str(error)
    model = DDP(WithAMethod())
    try:
        model.embed(torch.ones(1, 4))
    except AttributeError as error:
        said["custom method"] = str(error)
    said["through module"] = tuple(model.module.embed(torch.ones(1, 4)).shape)
    x = torch.full((1, 4), float(rank))  # other data on each rank
    for how, forward in (("module", model.module.embed), ("DDP", model)):
        model.zero_grad()
        forward(x).sum().backward()
        said[f"gradient through {how}"] = model.module.layer.weight.grad.sum().item()
    for how in ("its own loss", "the loss all ranks agree on"):  # a finite spike in rank 1's batch, skipped by...
        layer = nn.Linear(4, 1)
        with torch.no_grad():
            layer.weight.fill_(0.5), layer.bias.zero_()  # output 2, loss 4; rank 1's spike: 4000
        spiky = DDP(layer)
        optimizer = torch.optim.SGD(spiky.parameters(), lr=0.01)
        loss = spiky(torch.ones(2, 4)).pow(2).mean() * (1000 if rank == 1 else 1)
        loss.backward()  # the gradients are averaged: rank 0's hold the spike too
        agreed = loss.detach().clone()
        dist.all_reduce(agreed)  # the mean loss over the ranks, the same on every rank
        if (loss.item() if how == "its own loss" else agreed.item() / world_size) < 100:  # skip a spiked step
            optimizer.step()
        said[f"weights after a skip on {how}"] = layer.weight.sum().item()
    return said

@pytest.fixture(scope="module")
def ddp_mistakes_said():
    return run_group(ddp_mistakes, 2, collective_timeout=20)

@pytest.mark.multiproc
def test_a_model_built_differently_on_one_rank_is_refused_by_ddp(ddp_mistakes_said):
    assert [said["different model"] for said in ddp_mistakes_said] == [
        "DDP expects same model across all ranks, but Rank 0 has 2 params, while rank 1 has inconsistent 4 params.",
        "DDP expects same model across all ranks, but Rank 1 has 4 params, while rank 0 has inconsistent 2 params."]

@pytest.mark.multiproc
def test_a_custom_method_is_reached_through_module(ddp_mistakes_said):
    said = ddp_mistakes_said[0]
    assert said["custom method"] == "'DistributedDataParallel' object has no attribute 'embed'"
    assert said["through module"] == (1, 2)
    # but DDP averages only the gradients of work done through its forward: through .module, ranks drift apart
    assert [said["gradient through module"] for said in ddp_mistakes_said] == [0.0, 8.0]
    assert [said["gradient through DDP"] for said in ddp_mistakes_said] == [4.0, 4.0]

@pytest.mark.multiproc
def test_a_loss_spike_skipped_on_one_rank_s_own_loss_leaves_the_ranks_with_different_weights(ddp_mistakes_said):
    """Rank 1's batch spikes the loss (finite); rank 0 steps with the averaged gradient, which holds the spike."""
    own = [said["weights after a skip on its own loss"] for said in ddp_mistakes_said]
    agreed = [said["weights after a skip on the loss all ranks agree on"] for said in ddp_mistakes_said]
    assert own[1] == 2.0  # rank 1 skipped; rank 0 stepped with the averaged gradient, 2002 per weight: 4 x 0.5 - 0.01
    assert own[0] == pytest.approx(2.0 - 4 * 0.01 * 2002)  # x 2002. No longer the same model, and no error said
    assert agreed == [2.0, 2.0]  # both skipped: the same weights as before the step


def late_collective(rank, world_size):
    """Rank 1 comes late to two all_reduces, as a rank still compiling its first step would: 1 s late (within the
    3 s timeout), then 5 s late (past it)."""
    said = []
    for late in (1.0, 5.0):
        time.sleep(late if rank == 1 else 0.0)
        began = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1))
            said.append(f"{time.monotonic() - began:.1f} s: done")
        except RuntimeError as error:
            said.append(f"{time.monotonic() - began:.1f} s: {error}")
            break
    return said

@pytest.mark.multiproc
def test_a_rank_later_than_the_collective_timeout_fails_the_collective_on_the_others():
    on_time, late = run_group(late_collective, 2, collective_timeout=3)[0]
    assert on_time.endswith(" s: done") and 0.5 < float(on_time.split(" s:")[0]) < 3  # it waited for rank 1
    assert "Timed out waiting 3000ms" in late and float(late.split(" s:")[0]) < 4.5, late

SPAWN = """import torch.multiprocessing as mp


def work(rank):
    print("worker", rank)


{}mp.spawn(work, nprocs=1)
"""

@pytest.mark.launch
def test_mp_spawn_without_the_main_guard_fails_at_once(tmp_path):
    """spawn starts a fresh interpreter that imports the script again: unguarded, the import calls mp.spawn again."""
    (tmp_path / "train.py").write_text(SPAWN.format(""))
    result = run([PYTHON, tmp_path / "train.py"], timeout=60)
    assert result.returncode != 0
    assert ("RuntimeError: An attempt has been made to start a new process before the current process has finished "
            "its bootstrapping phase.") in " ".join(result.stdout.split())
    assert "ProcessExitedException: process 0 terminated with exit code 1" in result.stdout

@pytest.mark.launch
def test_mp_spawn_of_a_function_defined_in_a_notebook_fails_at_once(tmp_path):
    """Code run from a notebook cell (here `python -c`: the same, __main__ has no file) defines `work` where the
    spawned process cannot import it. The guard is no help: __name__ is "__main__" in a notebook."""
    result = run([PYTHON, "-c", SPAWN.format('if __name__ == "__main__":\n    ')], timeout=60, cwd=tmp_path)
    assert result.returncode != 0
    assert "AttributeError: Can't get attribute 'work' on <module '__main__' (built-in)>" in result.stdout

FAILING_WORKERS = """import os, signal, sys, time
from pathlib import Path

rank, folder = int(os.environ["RANK"]), Path(sys.argv[1])
if rank < 4:  # the failing ones end their own way even if torchrun, seeing another fail first, sends SIGTERM
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
(folder / str(rank)).touch()
while len(list(folder.iterdir())) < int(os.environ["WORLD_SIZE"]):  # all started: they fail together
    time.sleep(0.01)
if rank == 0:
    raise ValueError("a bug")
if rank < 4:
    os.kill(os.getpid(), (signal.SIGKILL, signal.SIGBUS, signal.SIGABRT)[rank - 1])
time.sleep(60)  # still running when the others fail: torchrun stops it
"""

@pytest.mark.launch
def test_torchrun_names_each_failed_workers_exit_code(tmp_path):
    """One launch, five workers: an exception, SIGKILL (the OOM killer), SIGBUS (/dev/shm full), SIGABRT (an
    abort), and one still running that torchrun stops with SIGTERM. No @record: no error file, no traceback."""
    (tmp_path / "workers.py").write_text(FAILING_WORKERS)
    (tmp_path / "started").mkdir()
    result = run([TORCHRUN, "--standalone", "--nproc_per_node=5", tmp_path / "workers.py", tmp_path / "started"],
                 timeout=90)
    assert result.returncode == 1
    summary = re.sub(r"pid: \d+", "pid: PID", result.stdout[result.stdout.index("workers.py FAILED"):])
    ends = [(1, ""), (-9, "SIGKILL"), (-7, "SIGBUS"), (-6, "SIGABRT"), (-15, "SIGTERM")]  # by rank
    for rank, (exitcode, signal) in enumerate(ends):
        shown = f" ({signal})" if signal else ""
        assert (f"  rank      : {rank} (local_rank: {rank})\n  exitcode  : {exitcode} (pid: PID) {shown}\n"
                "  error_file: <N/A>\n") in summary, summary
    assert "traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html" in summary
    assert "traceback : Signal 9 (SIGKILL) received by PID" in summary

@pytest.mark.launch
def test_with_record_torchrun_names_the_exception_and_its_line(tmp_path):
    """02-04 decorate main with @record: a worker's exception reaches torchrun's summary through its error file.
    The exception here: the test hook DATA_PREPARE_DELAY given a value that is not a number."""
    result = run([TORCHRUN, "--standalone", "--nproc_per_node=1", "02_torchrun.py", "--train-samples", "256"],
                 env=clean_env(DATA_PREPARE_DELAY="oops"), timeout=90)
    assert result.returncode == 1
    root_cause = result.stdout[result.stdout.index("Root Cause (first observed failure)"):]
    assert "error_file: <N/A>" not in root_cause and "error.json" in root_cause
    line = next(number for number, text in enumerate((REPO / "02_torchrun.py").read_text().splitlines(), 1)
                if "DATA_PREPARE_DELAY" in text)
    assert f'02_torchrun.py", line {line}, in main' in root_cause, root_cause
    assert "ValueError: could not convert string to float: 'oops'" in root_cause


class Numbers(torch.utils.data.Dataset):
    """Sample i: four copies of i (module level: what a loader's worker runs must be found by name)."""

    def __len__(self):
        return 10_000

    def __getitem__(self, index):
        return torch.full((4,), float(index))


@pytest.mark.multiproc
def test_batches_kept_from_loader_workers_run_out_of_file_descriptors_and_copies_of_them_do_not():
    """A batch from a worker arrives in shared memory whose file descriptor stays open while the tensor (or a view of
    it) lives: keeping 400 of them under a limit of 100 more open files than this process holds fails with torch's
    message; keeping copies does not (in this process, the limit restored after)."""
    import os
    import resource

    def keep(copy, count=400):
        kept, loader = [], torch.utils.data.DataLoader(Numbers(), batch_size=2, num_workers=2,
                                                       multiprocessing_context="fork")
        for batch in loader:
            kept.append(batch.clone() if copy else batch)
            if len(kept) == count:
                return kept

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(len(os.listdir("/proc/self/fd")) + 100, soft), hard))
    try:
        assert len(keep(copy=True)) == 400
        with pytest.raises(RuntimeError, match=re.escape(
                "Too many open files. Communication with the workers is no longer possible. Please increase the limit "
                "using `ulimit -n` in the shell or change the sharing strategy by calling "
                "`torch.multiprocessing.set_sharing_strategy('file_system')` at the beginning of your code")):
            keep(copy=False)
    finally:
        import gc

        gc.collect()  # the failed loader's tensors and queues, before the limit goes back up
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
