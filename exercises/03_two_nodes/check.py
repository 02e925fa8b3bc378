"""Exercise 03_two_nodes's claims, from one job on two "nodes": two torchrun agents on this machine, 2 workers each,
meeting through c10d rendezvous over loopback, each node with a folder of its own (as a node-local disk) and one
folder both see (as a shared filesystem). Global rank 0 alone writes the checkpoint and prints; local rank 0 of each
node alone prepares that node's data; each process would drive the GPU numbered by its local rank."""
import json
import os
import re
import socket
import tempfile
from pathlib import Path

from _grading import TORCHRUN, finish, start

FILE = "roles.py"
LECTURE = "notebooks/03_multinode.ipynb"
NODES = ("nodeA", "nodeB")
STARTER_FAILS = "exactly one process wrote the checkpoint to the shared folder: global rank 0"
CLAIMS = ["two torchrun agents (--nnodes=2 --nproc_per_node=2) make one job: ranks 0-3, local ranks 0 and 1 on each "
          "node",
          STARTER_FAILS,
          "exactly one summary line was printed for the whole job, by global rank 0",
          "each node's data was prepared exactly once, by its local rank 0, and every process found it there",
          "each process would drive the GPU numbered by its local rank: cuda:0 and cuda:1 on each node"]
SECTION = "notebooks/03_multinode.ipynb, section '{}'"
WORDS, FILES, THE_DIFF = (SECTION.format(name) for name in ("1. Words first", "4. Where files live: shared and "
                                                              "node-local filesystems", "6. The diff, hunk by hunk"))


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def node_command(learner_file, endpoint, shared, node_local):
    """One node's agent, the same command on both (c10d numbers the nodes); a rendezvous id of this check's own,
    so that no other job's agents on the endpoint join it; --local-addr: the workers' store is announced at
    127.0.0.1 rather than at this host's name, which a laptop may not resolve."""
    return [TORCHRUN, "--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}",
            f"--rdzv_id=ex03-{os.getpid()}", "--rdzv_conf=join_timeout=30", "--local-addr=127.0.0.1",
            learner_file, "--shared", shared, "--node-local", node_local, "--timeout", 20]


def notes(folder, what):
    return [json.loads(path.read_text()) for path in sorted(folder.glob(f"{what}-by-*.json"))]


def check(learner_file, grade):
    with tempfile.TemporaryDirectory(prefix="ex03-") as folder:
        shared = Path(folder) / "shared"
        shared.mkdir()
        for node in NODES:
            (Path(folder) / node).mkdir()
        endpoint = f"127.0.0.1:{free_port()}"
        # as the course's multi-node commands do: the workers' store hosted by global rank 0, fresh for this job,
        # not by node 0's agent (notebooks/03_multinode.ipynb, section '2. Two ways to meet: static and c10d')
        agents = [start(node_command(learner_file, endpoint, shared, Path(folder) / node),
                        TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) for node in NODES]
        results = [finish(agent, timeout=50) for agent in agents]
        records = [json.loads(path.read_text()) for path in sorted(shared.glob("process-*.json"))]
        layout = {node: sorted(record["local_rank"] for record in records if record["node"] == node) for node in NODES}
        formed = (all(result.ok for result in results) and sorted(record["rank"] for record in records) == [0, 1, 2, 3]
                  and all(record["world_size"] == 4 for record in records)
                  and all(local == [0, 1] for local in layout.values()))
        observed = "\n".join(f"{node}: local ranks {layout[node]}, ranks "
                             f"{sorted(record['rank'] for record in records if record['node'] == node)}"
                             for node in NODES)
        for node, result in zip(NODES, results, strict=True):
            if not result.ok:
                observed += f"\n{node}'s agent: {result.summary()}"
        grade.claim(CLAIMS[0], formed, observed=observed,
                    expected="both agents exit 0; ranks 0-3 in a world of 4, local ranks 0 and 1 on each node: does "
                             "every worker finish, taking RANK, LOCAL_RANK and WORLD_SIZE from torchrun?", see=WORDS)
        if not formed:
            grade.not_checked(CLAIMS[1:], "needs the job of the first claim")
            return
        rank_of = {record["pid"]: record for record in records}

        def who(notes_):
            return ", ".join(f"rank {note['rank']} (local rank {note['local_rank']} on "
                             f"{rank_of[note['pid']]['node'] if note['pid'] in rank_of else '?'})"
                             for note in notes_) or "none"

        writers = notes(shared, "saved")
        grade.claim(CLAIMS[1], [writer["rank"] for writer in writers] == [0], observed=f"written by: {who(writers)}",
                    expected="by global rank 0 alone: every node sees the shared folder, so one writer for the whole "
                             "job (local rank 0 would be one per node, racing on the same file); is the condition "
                             "on RANK?", see=FILES)

        output = "\n".join(result.output for result in results)
        summaries = re.findall(r"job summary: .*printed by rank (\d+)", output)
        grade.claim(CLAIMS[2], summaries == ["0"], observed=f"{len(summaries)} summary line(s), printed by rank(s) "
                    f"{', '.join(summaries) or 'none'}", expected="one, by global rank 0: is the print under a "
                    "condition on RANK, not LOCAL_RANK (one per node)?", see=THE_DIFF)

        preparers = {node: notes(Path(folder) / node, "prepared") for node in NODES}
        missing = sorted(str(record["rank"]) for record in records if not record["found_data"])
        grade.claim(CLAIMS[3], all([note["local_rank"] for note in preparers[node]] == [0] for node in NODES)
                    and not missing,
                    observed="\n".join(f"{node}: prepared by {who(preparers[node])}" for node in NODES)
                             + f"\nranks that found no data after the barrier: {', '.join(missing) or 'none'}",
                    expected="on each node, once, by its local rank 0, and every rank finding it: each node has a "
                             "disk of its own, so a condition on RANK (0 on one node only) leaves the other node "
                             "without data; is the condition on LOCAL_RANK?", see=FILES)

        wrong = [f"rank {record['rank']} (local rank {record['local_rank']} on {record['node']}): cuda:"
                 f"{record['device_index']}" for record in records if record["device_index"] != record["local_rank"]]
        grade.claim(CLAIMS[4], not wrong, observed="\n".join(wrong), expected="cuda:LOCAL_RANK: every node numbers its "
                    "own GPUs from 0, so RANK would name cuda:2 and cuda:3, which a 2-GPU node does not have, and "
                    "one index for all would put both of a node's processes on one GPU",
                    see=WORDS)
