"""03_multinode.py across two nodes: two torchrun agents meeting through c10d rendezvous and through static
rendezvous (node ranks given), first over loopback, then as two separate hosts (network namespaces joined by a
veth pair, each with its own hostname). Only global rank 0 writes the checkpoint, node-local work runs once per
node, every rank ends with the same parameters, and a node that never comes makes the other fail in bounded
time instead of hanging."""
import re
import time

import pytest
from helpers import TORCHRUN, finish, free_port, in_host, nodes_env, on_host, start

pytestmark = pytest.mark.multihost

SCRIPT = "03_multinode.py"
TRAIN = ["--train-samples", "1024", "--val-samples", "101", "--epochs", "1"]


def node_command(endpoint, rdzv_id, *script_args, nnodes=2, join_timeout=60, script=SCRIPT):
    """The README's multi-node command, with 1 process per node (2 cores for 2 nodes here)."""
    return [TORCHRUN, f"--nnodes={nnodes}", "--nproc_per_node=1", "--rdzv_backend=c10d",
            f"--rdzv_endpoint={endpoint}", f"--rdzv_id={rdzv_id}", f"--rdzv_conf=join_timeout={join_timeout}",
            script, *script_args]


def static_node_command(node_rank, master_addr, port, *script_args):
    """The README's static form, with 1 process per node: every node is told its own node rank and where node
    0 is (node 0's agent hosts the store there)."""
    return [TORCHRUN, "--nnodes=2", f"--node_rank={node_rank}", "--nproc_per_node=1", f"--master_addr={master_addr}",
            f"--master_port={port}", "--rdzv_conf=timeout=60", SCRIPT, *script_args]


def commands(form, host, port, checkpoints):
    """Each node's command in `form`, node n writing to checkpoints[n]: c10d gives every node the same command;
    static gives node n --node_rank=n."""
    if form == "c10d":
        return [node_command(f"{host}:{port}", form, *TRAIN, "--checkpoint", path) for path in checkpoints]
    return [static_node_command(n, host, port, *TRAIN, "--checkpoint", path) for n, path in enumerate(checkpoints)]


def identities(output):
    """{rank: (hostname, node, local rank)} from the start-up lines every process prints."""
    return {int(rank): (host, node, int(local)) for host, node, local, rank in
            re.findall(r"\[([\w.-]+)\] node (\S+), local rank (\d+): rank (\d+) of 2\b", output)}


def check_two_node_run(outputs, checkpoints, form, hostnames=None):
    """The assertions every two-node test makes, on each node's output and each node's --checkpoint path."""
    ranks = [identities(output) for output in outputs]
    assert sorted(rank for node in ranks for rank in node) == [0, 1], "one rank on each node"
    if form == "static":  # the node ranks were given: node n is node n, and node 0 holds global rank 0
        assert [{node for _, node, _ in ids.values()} for ids in ranks] == [{"0"}, {"1"}]
        assert 0 in ranks[0]
    for node, output in zip(ranks, outputs, strict=True):
        assert output.count("local rank 0 prepared the data for this node") == 1, "node-local work once per node"
        if hostnames:
            (host, _, _), = node.values()
            assert f"[{host}] local rank 0 prepared" in output
    if hostnames:
        assert sorted(host for node in ranks for host, _, _ in node.values()) == sorted(hostnames)
    checksums = set(re.findall(r"rank \d done: parameter checksum ([-+.\deE]+)", "".join(outputs)))
    assert len(checksums) == 1, f"both ranks must end with the same parameters: {checksums}"
    # Each node was given its own --checkpoint path: only the node holding global rank 0 may have written.
    writer = next(index for index, node in enumerate(ranks) if 0 in node)
    assert [path.exists() for path in checkpoints] == [index == writer for index in range(len(checkpoints))]


@pytest.mark.parametrize("form", ["c10d", "static"])
def test_two_nodes_over_loopback(tmp_path, form):
    """Also: the workers' MASTER_PORT (the store init_process_group connects to). Static: the store at
    --master_port. c10d: a second store, which node rank 0's agent starts on a free port, not the endpoint's
    (dynamic_rendezvous.py, next_rendezvous): a firewall must let that port through as well."""
    checkpoints = [tmp_path / "nodeA.pt", tmp_path / "nodeB.pt"]
    port = free_port()
    agents = [start(command, env=nodes_env(LOGLEVEL="INFO"))  # INFO: the agents log the workers' master_port
              for command in commands(form, "127.0.0.1", port, checkpoints)]
    results = [finish(agent, timeout=240) for agent in agents]
    for result in results:
        assert result.returncode == 0, result.stdout[-3000:]
    check_two_node_run([result.stdout for result in results], checkpoints, form)
    (master_port,) = {int(found) for result in results for found in re.findall(r"master_port=(\d+)", result.stdout)}
    assert (master_port == port) == (form == "static"), f"workers' MASTER_PORT {master_port}, endpoint {port}"


def test_nodes_with_different_process_counts_train_as_one_world():
    """torchrun accepts a different --nproc_per_node on each node (c10d rendezvous): 1 process on one node and 2 on
    the other make one world of 3, ranks numbered node after node, LOCAL_RANK per node, and all 3 end with the same
    parameters. (The preflight warns about it, and says what code breaks on it: docs/troubleshooting.md.)"""
    endpoint = f"127.0.0.1:{free_port()}"
    one, two = node_command(endpoint, "uneven", *TRAIN), node_command(endpoint, "uneven", *TRAIN)
    two[two.index("--nproc_per_node=1")] = "--nproc_per_node=2"
    results = [finish(agent, timeout=240) for agent in [start(one, env=nodes_env()), start(two, env=nodes_env())]]
    output = "\n".join(result.stdout for result in results)
    assert [result.returncode for result in results] == [0, 0], output[-3000:]
    ranks = sorted(re.findall(r"node (\d), local rank (\d): rank (\d) of (\d)", output))
    nodes = {node for node, _, _, _ in ranks}
    assert len(ranks) == 3 and {world for _, _, _, world in ranks} == {"3"}, ranks
    assert sorted(rank for _, _, rank, _ in ranks) == ["0", "1", "2"]
    per_node = sorted(sorted(local for node_, local, _, _ in ranks if node_ == node) for node in nodes)
    assert per_node == [["0"], ["0", "1"]], ranks
    first, second = ([int(rank) for node_, _, rank, _ in ranks if node_ == node] for node in ("0", "1"))
    assert sorted(first + second) == [0, 1, 2] and max(first) < min(second), "node 0's ranks, then node 1's"
    assert len(set(re.findall(r"parameter checksum (\S+)", output))) == 1


def test_a_missing_node_fails_in_bounded_time_with_a_clear_message():
    """Only one of two nodes starts: the agent gives up after join_timeout (5 s here: no other node is on its way)
    with a rendezvous timeout error, instead of waiting forever."""
    began = time.monotonic()
    result = finish(start(node_command(f"127.0.0.1:{free_port()}", "lonely", *TRAIN, join_timeout=5)), timeout=120)
    elapsed = time.monotonic() - began
    assert result.returncode != 0
    assert "RendezvousTimeoutError" in result.stdout
    assert elapsed < 90, f"took {elapsed:.0f} s"


# --- two separate hosts (the `two_hosts` fixture, tests/conftest.py) -------------------------------------------


def bytes_sent(name):
    return int(on_host(name, "cat", f"/sys/class/net/veth-{name}/statistics/tx_bytes"))


@pytest.mark.parametrize("form", ["c10d", "static"])
def test_two_separate_hosts(two_hosts, tmp_path, form):
    checkpoints = [tmp_path / f"{name}.pt" for name in two_hosts]
    before = {name: bytes_sent(name) for name in two_hosts}
    agents = [start(in_host(name, command), env=nodes_env()) for name, command in
              zip(two_hosts, commands(form, "nodeA", 29400, checkpoints), strict=True)]
    results = [finish(agent, timeout=240) for agent in agents]
    for result in results:
        assert result.returncode == 0, result.stdout[-3000:]
    check_two_node_run([result.stdout for result in results], checkpoints, form, hostnames=two_hosts)
    for name in two_hosts:  # gradients crossed the link: ~0.4 MB of parameters all-reduced every step
        assert bytes_sent(name) - before[name] > 1_000_000, f"{name} sent too little over the veth pair"
