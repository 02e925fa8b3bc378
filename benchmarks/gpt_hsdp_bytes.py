"""The bytes each rank hands FSDP2's collectives per optimizer step of port/gpt_fsdp.py, along each mesh dimension:
1-D FSDP2 on 4 processes against HSDP (2 copies x 2 pieces), predicted and counted, and what a ring sends of them.

    .venv/bin/python benchmarks/gpt_hsdp_bytes.py            # about 2 minutes on 2 cores
    sudo .venv/bin/python benchmarks/gpt_hsdp_bytes.py --wire   # then on two hosts: the bytes between them

Counted inside the real script under torchrun: a sitecustomize.py on PYTHONPATH wraps the three functions FSDP2
calls from Python (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py: dist.all_gather_single,
dist.reduce_scatter_single, and dist.all_reduce across the copies) and adds up the bytes of each call's input by the
group it runs on: "shard" (a group of consecutive ranks: the pieces of one copy), "replicate" (ranks a copy's size
apart: the same piece in each copy), or the script's own world group (its loss check: not FSDP2's). Each process
writes its running totals after every call. One run of 4 steps and one of 2 per layout: their difference over 2 is
one step's, without what comes once (validation's forward, the start).
With --wire (root: network namespaces), each layout also runs on two hosts (the tests' own, tests/helpers.py
separate_hosts: namespaces joined by a veth pair), 2 processes on each, one copy per host under HSDP; the bytes both
ends of the veth pair sent (their tx_bytes counters, headers included), again (4 steps - 2 steps) / 2, are added to
the json.
Writes benchmarks/gpt_hsdp_bytes.json (raw) and benchmarks/gpt_hsdp_bytes.md (made from the json only).
"""
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO, MB = HERE.parent, 2**20
sys.path.insert(0, str(HERE))
import gpt_fsdp_memory  # noqa: E402  (the same GPT, and its parameter count)

MODEL = ["--n-layer", "6", "--n-embd", "512", "--n-head", "8"]
LAYOUTS = {"1-D FSDP2, 4 pieces": [], "HSDP, 2 copies x 2 pieces": ["--replicas", "2"]}
COUNTER = '''
import json, os
import torch.distributed as dist

totals, path = {}, os.path.join(os.environ["BYTES_DIR"], f"rank{os.environ.get('RANK', 'x')}.json")


def kind(group):
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    if len(ranks) == dist.get_world_size():
        return "world"
    return "shard" if ranks == list(range(ranks[0], ranks[0] + len(ranks))) else "replicate"


def wrap(name):
    original = getattr(dist, name)

    def counted(*args, **kwargs):
        if name == "all_reduce":  # (tensor, ...); the others (output, input, ...), by position or by name
            tensor = args[0] if args else kwargs["tensor"]
        else:
            tensor = args[1] if len(args) > 1 else kwargs.get("input", kwargs.get("input_tensor"))
        key = f"{name} {kind(kwargs.get('group'))}"
        totals[key] = totals.get(key, 0) + tensor.numel() * tensor.element_size()
        with open(path, "w") as f:
            json.dump(totals, f)
        return original(*args, **kwargs)
    setattr(dist, name, counted)


for name in ("all_gather_single", "reduce_scatter_single", "all_reduce"):
    wrap(name)
'''


def counted(extra, steps):
    with tempfile.TemporaryDirectory() as scratch:
        (Path(scratch) / "sitecustomize.py").write_text(COUNTER)
        env = {**os.environ, "PYTHONPATH": scratch, "BYTES_DIR": scratch, "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                   str(REPO / "port/gpt_fsdp.py"), *run_flags(steps), *extra]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
        if done.returncode != 0:
            sys.exit(done.stdout[-3000:] + done.stderr[-3000:])
        return [json.loads((Path(scratch) / f"rank{rank}.json").read_text()) for rank in range(4)]


def between_hosts(extra, steps, prefix="bytes"):
    """Bytes that crossed the veth pair (both directions) while gpt_fsdp.py ran 2 processes on each of two hosts."""
    sys.path.insert(0, str(REPO / "tests"))
    from helpers import hosts_unavailable, in_host, kill_tree, on_host, separate_hosts

    problem = hosts_unavailable(prefix)
    if problem:
        sys.exit(f"--wire: {problem}")
    env = {key: value for key, value in os.environ.items()
           if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    with separate_hosts(prefix=prefix) as hosts:
        def sent():
            return sum(int(on_host(name, "cat", f"/sys/class/net/veth-{name}/statistics/tx_bytes", prefix=prefix))
                       for name in hosts)

        before, agents = sent(), []
        try:
            for rank, name in enumerate(hosts):
                node = [torchrun, "--nnodes=2", "--nproc_per_node=2", f"--node_rank={rank}", "--master_addr=nodeA",
                        "--master_port=29500", "port/gpt_fsdp.py", *run_flags(steps), *extra]
                agents.append(subprocess.Popen(in_host(name, node, prefix=prefix), cwd=REPO, env=env, text=True,
                                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                               start_new_session=True))
            outputs = [agent.communicate(timeout=600)[0] for agent in agents]
            if any(agent.returncode for agent in agents):
                sys.exit("\n".join(output[-2000:] for output in outputs))
        finally:
            for agent in agents:
                kill_tree(agent.pid)
        return sent() - before


def run_flags(steps):
    return [*MODEL, "--block-size", "64", "--batch-size", "4", "--steps", str(steps), "--warmup-steps", "1",
            "--eval-every", "1000", "--eval-windows", "4", "--log-every", "1000", "--sample-bytes", "0"]


def predicted(layout):
    """Bytes a rank hands per step (padding aside), P parameters, R of them in the root unit, S pieces a copy:
    all-gathers take each unit's piece, 4P/S in the forward and 4(P-R)/S again in the backward (the blocks are freed
    after their forward; the root is not); reduce-scatters take each unit's whole fp32 gradient, 4P; HSDP's
    all-reduce across the copies takes the reduced piece, 4P/S."""
    args = type("A", (), {"n_embd": 512, "n_layer": 6})
    total, _ = gpt_fsdp_memory.parameters(args)
    root = 256 * 512 + 64 * 512 + 2 * 512
    pieces = 4 if layout.startswith("1-D") else 2
    gather, scatter = 4 * (2 * total - root) / pieces, 4 * total
    if layout.startswith("1-D"):
        return {"all_gather_single world": gather, "reduce_scatter_single world": scatter}
    return {"all_gather_single shard": gather, "reduce_scatter_single shard": scatter, "all_reduce replicate":
            4 * total / pieces}


RING = {"all_gather_single": lambda size: size - 1,  # of its input: a ring all-gather sends (size-1) pieces
        "reduce_scatter_single": lambda size: (size - 1) / size,  # of its input
        "all_reduce": lambda size: 2 * (size - 1) / size}  # of its input


def table(raw):
    lines = ["# HSDP against 1-D FSDP2: the bytes each rank hands FSDP2's collectives per step, by mesh dimension\n",
             f"Measured {raw['date']} by benchmarks/gpt_hsdp_bytes.py: torch {raw['torch']}, port/gpt_fsdp.py on 4 "
             "processes (gloo, CPU), a GPT of 6 blocks of width 512 (19.1 M parameters); counted in the script's own "
             "processes, (4-step run - 2-step run) / 2, largest over the ranks. MB = 2^20 bytes. Sent by a ring: "
             "what a ring algorithm sends of those inputs (all-gather (n-1) x its input, reduce-scatter (n-1)/n, "
             "all-reduce 2(n-1)/n, n the group's size); gloo's own algorithms may send more "
             "(benchmarks/fsdp_memory.md measured them).\n",
             "| layout | collective, group | predicted (MB) | counted (MB) | sent by a ring (MB) |",
             "|---|---|---|---|---|"]
    for layout, per_rank in raw["layouts"].items():
        expected = predicted(layout)
        size = {"world": 4, "shard": 4 if layout.startswith("1-D") else 2, "replicate": 2}
        for key in sorted(set(expected) | {k for k in per_rank if not k.endswith(" world") or "all_reduce" not in k}):
            name, group = key.split()
            value = per_rank.get(key, 0)
            lines.append(f"| {layout} | {name}, {group} | {expected.get(key, 0) / MB:.1f} | {value / MB:.1f} | "
                         f"{value * RING[name](size[group]) / MB:.1f} |")
    flat, hsdp = raw["layouts"]["1-D FSDP2, 4 pieces"], raw["layouts"]["HSDP, 2 copies x 2 pieces"]
    flat_sent = sum(flat[f"{name} world"] * RING[name](4) for name in ("all_gather_single", "reduce_scatter_single"))
    across = hsdp["all_reduce replicate"] * RING["all_reduce"](2)
    lines += ["", "Between two nodes (ranks 0-1 on one, 2-3 on the other), by the ring model, not measured on a wire: "
              f"1-D FSDP2's rings run through all 4 ranks, and 2 of their 4 links cross between the nodes, each "
              f"carrying what one rank sends, {flat_sent / MB:.1f} MB: {2 * flat_sent / MB:.1f} MB cross per step. "
              "HSDP's gathers and reduce-scatters stay within a node; only the all-reduce across the copies crosses, "
              f"each rank's {across / MB:.1f} MB: {4 * across / MB:.1f} MB per step, "
              f"{2 * flat_sent / (4 * across):.1f} times less."]
    if "wire" in raw:
        wire = raw["wire"]
        lines += ["", "Measured on a wire (--wire, " + raw["wire_date"] + "): two hosts (network namespaces joined by "
                  "a veth pair), 2 processes on each, one copy per host under HSDP; the bytes both ends sent per step, "
                  "headers included: " + ", ".join(f"{layout} {value / MB:.1f} MB" for layout, value in wire.items())
                  + f"; 1-D FSDP2 / HSDP {wire['1-D FSDP2, 4 pieces'] / wire['HSDP, 2 copies x 2 pieces']:.1f}."]
    return "\n".join(lines) + "\n"


def main():
    import torch

    if "--wire" in sys.argv[1:]:  # adds the wire figures to the counted ones
        raw = json.loads((HERE / "gpt_hsdp_bytes.json").read_text())
        raw["wire_date"], raw["wire"] = time.strftime("%Y-%m-%d"), {}
        for layout, extra in LAYOUTS.items():
            raw["wire"][layout] = (between_hosts(extra, 4) - between_hosts(extra, 2)) / 2
            print(layout, raw["wire"][layout] / MB, "MB per step between the hosts", flush=True)
        (HERE / "gpt_hsdp_bytes.json").write_text(json.dumps(raw, indent=1) + "\n")
        (HERE / "gpt_hsdp_bytes.md").write_text(table(raw))
        print(table(raw))
        return
    raw = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "layouts": {}}
    for layout, extra in LAYOUTS.items():
        four, two = counted(extra, 4), counted(extra, 2)
        keys = {key for rank in four for key in rank}
        raw["layouts"][layout] = {key: max((a.get(key, 0) - b.get(key, 0)) / 2 for a, b in zip(four, two, strict=True))
                                  for key in keys}
        print(layout, raw["layouts"][layout], flush=True)
    (HERE / "gpt_hsdp_bytes.json").write_text(json.dumps(raw, indent=1) + "\n")
    (HERE / "gpt_hsdp_bytes.md").write_text(table(raw))
    print(table(raw))


if __name__ == "__main__":
    main()
