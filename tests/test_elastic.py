"""04 is elastic: started with --nnodes=1:2, a job survives a node that dies whole (agent and workers together)
and takes in a node that joins while it runs. Either way it reshards the rest of the interrupted epoch over the
new world size, and the epoch's samples are all trained exactly once: those before the change (the snapshot's
count) plus those after (the metrics) make the whole epoch. Two torchrun agents over loopback, c10d."""
import re
import time

import pytest
from helpers import TORCHRUN, clean_env, finish, free_port, kill_tree, nodes_env, read_metrics, start
from test_multinode import node_command as two_node_command
from test_refused_input import assert_refused

pytestmark = pytest.mark.multihost

BATCH = 32
TRAIN = ["--val-samples", "64", "--epochs", "1", "--batch-size", str(BATCH), "--save-every-steps", "1"]


def node_command(endpoint, hosts_store, snapshot, metrics, samples):
    """The README's elastic command, one process per node. is_host names the node that keeps the rendezvous
    store (on one machine both would claim it); the store's node is the one that must stay up. A node that stops
    sending heartbeats is dropped from the rendezvous after keep_alive_interval x keep_alive_max_attempt seconds:
    15 by default, 3 here."""
    return [TORCHRUN, "--nnodes=1:2", "--nproc_per_node=1", "--max-restarts=3", "--rdzv_backend=c10d",
            f"--rdzv_endpoint={endpoint}", "--rdzv_id=elastic",
            "--rdzv_conf=join_timeout=60,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3,"
            f"is_host={str(hosts_store).lower()}",
            "04_fault_tolerant.py", *TRAIN, "--train-samples", samples, "--checkpoint", snapshot, "--metrics", metrics]


# Snapshots every step, each held 0.1 s by rank 0: an epoch lasts long enough to change the world in it.
ENV = nodes_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, SNAPSHOT_WRITE_DELAY=0.1)


def launch(tmp_path, name, hosts_store, endpoint, samples):
    log = tmp_path / f"{name}.log"
    command = node_command(endpoint, hosts_store, tmp_path / "snapshot.pt", tmp_path / "metrics.jsonl", samples)
    with open(log, "w") as output:
        agent = start(command, ENV, output=output)
    return agent, log


def wait_for(pattern, *logs, timeout=90):
    """Until one of the logs shows `pattern` (global rank 0 logs for the job, on whichever node it runs)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(re.search(pattern, log.read_text()) for log in logs):
            return
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} not logged within {timeout} s:\n" + "\n".join(
        log.read_text()[-2000:] for log in logs))


SNAPSHOT_IN_EPOCH_1 = r"saved snapshot \S+ \(epoch 0, \+\d*[1-9]\d* samples\)"


def check_the_epoch_is_trained_exactly_once(output, metrics, samples, before, after):
    """The resumed run says how far the epoch had come and in which world; the metrics say how many samples
    were trained after that. Together: every sample once, bar fewer than one global batch dropped at the end."""
    (done, then, now), = {tuple(map(int, found)) for found in re.findall(
        r"resumed from \S+: epoch 1, (\d+) samples into it; world size (\d+) then, (\d+) now", output)}
    assert (then, now) == (before, after), "the log says the world size changed"
    assert 0 < done < samples and done % (BATCH * before) == 0
    (epoch,) = metrics
    assert epoch["world_size"] == after
    global_batch = BATCH * after
    assert epoch["train_samples"] == (samples - done) // global_batch * global_batch
    assert 0 <= samples - done - epoch["train_samples"] < global_batch, "only the last partial batch is dropped"


def test_a_node_that_dies_whole_leaves_a_world_of_one_that_resumes_and_finishes(tmp_path):
    endpoint, samples = f"127.0.0.1:{free_port()}", 1536  # after the kill, one process trains the rest alone
    survivor, survivor_log = launch(tmp_path, "survivor", True, endpoint, samples)
    victim, victim_log = launch(tmp_path, "victim", False, endpoint, samples)
    try:
        wait_for(SNAPSHOT_IN_EPOCH_1, survivor_log, victim_log)  # training together
        time.sleep(1)  # a few steps more, to be redone after the restart
    finally:
        kill_tree(victim.pid)  # the agent and its worker: torchrun starts workers in sessions of their own
    result = finish(survivor, timeout=150)
    assert result.returncode == 0, survivor_log.read_text()[-3000:]
    output = survivor_log.read_text()
    assert "rank 0 of 1" in output
    check_the_epoch_is_trained_exactly_once(output, read_metrics(tmp_path / "metrics.jsonl"), samples, 2, 1)


def test_a_node_that_joins_a_running_job_trains_with_it_in_a_world_of_two(tmp_path):
    endpoint, samples = f"127.0.0.1:{free_port()}", 3072  # alone for long enough to see the second node join
    first, first_log = launch(tmp_path, "first", True, endpoint, samples)
    try:
        wait_for(SNAPSHOT_IN_EPOCH_1, first_log)  # training alone
        second, second_log = launch(tmp_path, "second", False, endpoint, samples)
    except BaseException:
        kill_tree(first.pid)
        raise
    results = [finish(agent, timeout=150) for agent in (first, second)]
    outputs = [first_log.read_text(), second_log.read_text()]
    for result, output in zip(results, outputs, strict=True):
        assert result.returncode == 0, output[-3000:]
    assert "rank 0 of 1" in outputs[0], "the first node trained alone"
    assert "stopped by a signal in epoch 1" in outputs[0], "torchrun stopped it for the new member: a snapshot"
    assert sorted(re.findall(r"rank (\d) of 2", "".join(outputs))) == ["0", "1"], "then a world of two"
    check_the_epoch_is_trained_exactly_once("".join(outputs), read_metrics(tmp_path / "metrics.jsonl"), samples, 1, 2)


def test_two_nodes_without_a_fresh_store_per_attempt_are_refused_in_bounded_time(tmp_path):
    """Without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, 04's per-attempt key prefix is the restart count, which each
    agent keeps for itself: on two nodes it is refused before the process group forms, on both, in one line.
    --max-restarts=0: torchrun would otherwise restart the refused workers."""
    command = two_node_command(f"127.0.0.1:{free_port()}", "refused", "--checkpoint", tmp_path / "snapshot.pt",
                               join_timeout=30, script="04_fault_tolerant.py")
    command.insert(1, "--max-restarts=0")
    env = {key: value for key, value in clean_env().items() if key != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    began = time.monotonic()
    agents = [start(command, env), start(command, env)]
    results = [finish(agent, timeout=120) for agent in agents]
    for result in results:
        assert_refused(result, "error: on more than one node, set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every "
                       "node", tmp_path)
        assert "rank 0 of" not in result.stdout, "refused before init_process_group"
    assert time.monotonic() - began < 90
