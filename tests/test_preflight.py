"""preflight.py, run before the first job: launched like the steps, it says whether the nodes can train together
and, when they cannot, why, in bounded time. Real torchrun agents over loopback; two hosts in network
namespaces (as they are, one whose own name resolves to loopback, one whose data link is down); a node that
never arrives; and the sbatch file on the real local Slurm cluster."""
import re
import socket
import time

import helpers
import pytest
from helpers import PYTHON, REPO, clean_env, finish, free_port, in_host, on_host, separate_hosts, start
from test_multinode import node_command

TIMEOUT = 8  # seconds the preflight waits for anybody (--timeout); the failure tests take about this long


def preflight_node(endpoint, rdzv_id, nnodes=2):
    """The README's multi-node command, running the preflight (1 process per node: 2 cores here)."""
    return node_command(endpoint, rdzv_id, "--timeout", TIMEOUT, nnodes=nnodes, script="preflight.py")


def run_nodes(commands, envs=None, timeout=90):
    """Starts every node's command at once; returns their results and the seconds until the last one ended."""
    began = time.monotonic()
    agents = [start(command, env) for command, env in zip(commands, envs or [None] * len(commands), strict=True)]
    return [finish(agent, timeout) for agent in agents], time.monotonic() - began


def the_report(results):
    """Rank 0's report: printed once, by one node, from its first line to the verdict and what follows it."""
    outputs = [result if isinstance(result, str) else result.stdout for result in results]
    reports = [output for output in outputs if "ddp-steps preflight:" in output]
    assert len(reports) == 1, "exactly one report, from rank 0:\n" + "\n".join(out[-2000:] for out in outputs)
    report = reports[0][reports[0].index("ddp-steps preflight:"):]
    assert "== verdict:" in report, report
    return report


def bandwidth(report):
    """[(MB, algbw, busbw)] from the report's bandwidth table."""
    return [(float(mb), float(algbw), float(busbw)) for mb, algbw, busbw in
            re.findall(r"^\s+([\d.]+) MB\s+[\d.]+\s+([\d.]+)\s+([\d.]+)$", report, re.M)]


def hosts_in_table(report):
    """{rank: host} from the report's "who is where" table."""
    return {int(rank): host for rank, host in re.findall(r"^\s+(\d+)\s+\d+\s+\d+\s+(\S+)\s", report, re.M)}


@pytest.mark.multihost
def test_two_nodes_over_loopback_are_ok_with_bandwidth_figures():
    endpoint = f"127.0.0.1:{free_port()}"
    results, _ = run_nodes([preflight_node(endpoint, "pre-loop")] * 2)
    report = the_report(results)
    assert [result.returncode for result in results] == [0, 0], report
    assert "== verdict: OK, 2 node(s) x 1 process(es) can train together" in report
    assert "all-reduce correctness (known values, every rank): OK on all 2 ranks" in report
    rows = bandwidth(report)
    assert [mb for mb, _, _ in rows] == [1, 8, 32], "the default sizes on CPU"
    assert all(algbw > 0 and busbw > 0 for _, algbw, busbw in rows)
    # nccl-tests' bus bandwidth for an all-reduce on n ranks: algbw x 2(n-1)/n, which is algbw itself for n = 2
    assert all(abs(busbw - algbw) < 1e-3 for _, algbw, busbw in rows)
    assert re.search(r"barrier latency \d+\.\d+ ms", report)


@pytest.mark.multihost
def test_different_process_counts_per_node_are_a_warning_that_says_what_breaks():
    """torchrun trains 1 + 2 processes as one world of 3 (tests/test_multinode.py), so the verdict is OK, with a
    warning that names the code that assumes one count on every node."""
    endpoint = f"127.0.0.1:{free_port()}"
    two = preflight_node(endpoint, "pre-uneven")
    two[two.index("--nproc_per_node=1")] = "--nproc_per_node=2"
    results, _ = run_nodes([preflight_node(endpoint, "pre-uneven"), two])
    report = the_report(results)
    assert [result.returncode for result in results] == [0, 0], report
    # the counts are listed in node order, which c10d decides (both agents are on 127.0.0.1 here)
    assert re.search(r"warning \[nproc-per-node\] different processes per node \(--nproc_per_node\): "
                     r"(1 on .*; 2 on|2 on .*; 1 on)", report), report
    assert "RANK // LOCAL_WORLD_SIZE" in report and "2-D device mesh" in report
    assert "same on every node: --nproc_per_node 1 and 2, torch" in report and "(not the same: see below)" in report
    assert "== verdict: OK, 2 node(s) (1 and 2 processes per node, 3 in all) can train together" in report


# What the tests below need of the bandwidth test, smaller than the defaults (which the loopback test checks)
SMALL = ["--sizes-mb", "0.5,1", "--iters", "2"]


@pytest.mark.multihost
def test_three_nodes_name_the_slowest_pair():
    endpoint = f"127.0.0.1:{free_port()}"
    results, _ = run_nodes([preflight_node(endpoint, "pre-three", nnodes=3) + SMALL] * 3)
    report = the_report(results)
    assert [result.returncode for result in results] == [0, 0, 0], report
    pairs = re.search(r"node pairs, ping-pong of 1 MB .* \(GB/s\): (.*)", report).group(1)
    assert len(pairs.split(", ")) == 3, "every pair of 3 nodes, each measured"
    assert re.search(r"slowest pair of nodes: \S+ <-> \S+, \d+\.\d+ GB/s", report)
    rows = bandwidth(report)
    assert [mb for mb, _, _ in rows] == [0.5, 1], "the sizes asked for"
    assert all(abs(busbw - algbw * 4 / 3) < 2e-3 for _, algbw, busbw in rows), "busbw = algbw x 2(n-1)/n, n = 3"


@pytest.mark.launch
def test_plain_python_checks_this_machine_alone():
    results, _ = run_nodes([[PYTHON, "preflight.py", "--timeout", TIMEOUT, *SMALL]])
    report = the_report(results)
    assert results[0].returncode == 0, report
    assert "no launcher: checking this machine alone, 2 processes" in results[0].stdout
    assert "== verdict: OK, 1 node(s) x 2 process(es)" in report
    assert hosts_in_table(report) == {0: socket.gethostname(), 1: socket.gethostname()}


@pytest.mark.multihost
@pytest.mark.root
def test_two_separate_hosts_are_ok_and_both_named():
    with separate_hosts() as hosts:
        results, _ = run_nodes([in_host(name, preflight_node("nodeA:29400", "pre-hosts")) for name in hosts])
    report = the_report(results)
    assert [result.returncode for result in results] == [0, 0], report
    assert sorted(hosts_in_table(report).values()) == ["nodeA", "nodeB"]
    assert "nodeA: resolves to 10.200.0.1; advertises 10.200.0.1" in report
    assert "nodeB: resolves to 10.200.0.2; advertises 10.200.0.2" in report
    assert re.search(r"TCP nodeA -> nodeB \(10\.200\.0\.2:\d+\): connected", report)
    assert re.search(r"TCP nodeB -> nodeA \(10\.200\.0\.1:\d+\): connected", report)
    assert "gloo uses veth-nodeA (10.200.0.1, link up)" in report
    assert "== verdict: OK, 2 node(s)" in report and all(rate > 0 for _, rate, _ in bandwidth(report))


@pytest.mark.multihost
@pytest.mark.root
def test_a_host_whose_name_resolves_to_loopback_is_flagged_with_the_fix():
    """nodeB's hosts file maps its own name to 127.0.1.1 (what Debian's installer writes): the rendezvous still
    works (nodeB only connects out), but gloo on nodeB announces 127.0.1.1, which on nodeA is nodeA itself."""
    with separate_hosts(self_on_loopback={"nodeB"}) as hosts:
        results, elapsed = run_nodes([in_host(name, preflight_node("nodeA:29400", "pre-lo")) for name in hosts])
    report = the_report(results)
    assert all(result.returncode != 0 for result in results), report
    assert "nodeB: resolves to 127.0.1.1; advertises 127.0.1.1" in report
    problem = re.search(r"PROBLEM \[loopback\] nodeB advertises 127\.0\.1\.1, a loopback address.*\n    fix: (.*)",
                        report)
    assert problem, report
    assert "nodeA tried: Connection refused" in problem.group(0)
    for fix in ("/etc/hosts", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "--local_addr", "veth-nodeB 10.200.0.2"):
        assert fix in problem.group(1)
    assert "== verdict: NOT OK" in report
    assert elapsed < 6 * TIMEOUT


@pytest.mark.multihost
@pytest.mark.root
def test_a_cut_link_fails_in_bounded_time_and_says_where():
    """The nodes meet over one network (the rendezvous works) and are told to exchange data over a second one
    (GLOO_SOCKET_IFNAME, as on a cluster with a fast fabric), whose link on nodeB is down."""
    with separate_hosts(data_link=True) as hosts:
        on_host("nodeB", "ip", "link", "set", "data-nodeB", "down")
        results, elapsed = run_nodes([in_host(name, preflight_node("nodeA:29400", "pre-cut")) for name in hosts],
                                     [clean_env(GLOO_SOCKET_IFNAME=f"data-{name}") for name in hosts])
    report = the_report(results)
    assert all(result.returncode != 0 for result in results), report
    assert "nodeB: gloo uses data-nodeB (10.201.0.2, link down)" in report
    assert re.search(r"PROBLEM \[connect\] nodeB cannot open a TCP connection to nodeA at 10\.201\.0\.1:\d+: "
                     r"Network is unreachable", report), report
    assert re.search(r"PROBLEM \[connect\] nodeA cannot open a TCP connection to nodeB at 10\.201\.0\.2:\d+: "
                     r"(timed out|No route to host)", report), report
    assert "PROBLEM [process-group]" in report and "== verdict: NOT OK" in report
    assert elapsed < 6 * TIMEOUT


@pytest.mark.multihost
def test_a_node_that_never_arrives_is_named_within_the_timeout():
    """Rank 0 of two, started the way slurm/03_multinode_srun.sbatch starts its tasks (the launcher's
    variables, no torchrun); the other node never comes. The hosts expected are what the sbatch file passes."""
    env = clean_env(RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, GROUP_RANK=0, MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=free_port(), PREFLIGHT_EXPECTED_HOSTS=f"{socket.gethostname()} nodeB")
    results, elapsed = run_nodes([[PYTHON, "preflight.py", "--timeout", TIMEOUT]], [env])
    report = the_report(results)
    assert results[0].returncode == 1, report
    assert "1 of 2 ranks checked in" in report
    assert "PROBLEM [missing] node nodeB (node 1): rank(s) 1 never checked in within the timeout" in report
    assert TIMEOUT < elapsed < 4 * TIMEOUT


@pytest.mark.slurm
def test_preflight_sbatch_is_ok_on_the_local_cluster(cluster):
    result, job, log = helpers.submit("preflight.sbatch", "--timeout", "30")
    output = helpers.read_log(log)
    assert result.returncode == 0, output[-3000:]
    report = the_report([output])
    assert f"job {job}: preflight of 2 nodes" in output
    hosts = hosts_in_table(report)  # the order in which nodes joined the rendezvous decides who is node 0
    assert sorted(hosts) == [0, 1, 2, 3] and sorted(hosts.values()) == ["n1", "n1", "n2", "n2"]
    assert "4 of 4 ranks checked in, from 2 node(s)" in report
    assert "== verdict: OK, 2 node(s) x 2 process(es) can train together" in report


# --- the documentation points to what the preflight really prints ---------------------------------------------

def test_readme_shows_the_preflight_commands_the_tests_run():
    """The preflight's page (docs/preflight.md, where the README's section moved) shows them."""
    readme = (REPO / "docs/preflight.md").read_text()
    practice = node_command("127.0.0.1:29500", "job1", script="preflight.py")
    assert " ".join(["torchrun", *practice[1:]]) in readme
    assert "python preflight.py" in readme and "sbatch --wait slurm/preflight.sbatch" in readme
    assert "[GPU runs](gpu-runs/README.md)" in readme  # the GPU path: the record of GPU runs, not a claim here


def test_troubleshooting_names_every_tag_the_preflight_prints_and_no_other():
    source = (REPO / "preflight.py").read_text()
    emitted = set(re.findall(r'report\.(?:problem|warning)\("([a-z-]+)"', source))
    same = source[source.index("SAME_EVERYWHERE = "):source.index("def check_same_everywhere")]
    emitted |= set(re.findall(r'\("\w+", "([a-z-]+)", "', same))  # what must be the same on every node
    emitted |= set(re.findall(r"PROBLEM \[([a-z-]+)\]", source))  # printed by a rank itself
    guide = (REPO / "docs/troubleshooting.md").read_text()
    table = guide[guide.index("## Run the preflight first"):guide.index("## The job never starts")]
    assert set(re.findall(r"(?:PROBLEM|warning) \[([a-z-]+)\]", table)) == emitted
