"""The bytes each process hands its collectives per optimizer step in the ports past FSDP, by mesh dimension, beside
the prediction: port/gpt_tp.py on a 2 x 2 grid (tensor parallelism within a row, FSDP2 across), port/gpt_pp.py on 2
stages, port/gpt_zero.py on 2 processes.

    .venv/bin/python benchmarks/parallel_bytes.py            # about 2 minutes on 2 cores

Counted inside the real scripts under torchrun: a sitecustomize.py on PYTHONPATH pushes a TorchDispatchMode that sees
every collective that reaches torch's dispatcher (c10d's ops, as DDP, FSDP2, the pipeline's sends and the scripts' own
calls issue them, and the functional collectives DTensor issues for tensor parallelism: DTensor's ops are let through,
NotImplemented, so that the collectives inside them come back to the mode) and adds up, by operation and by the ranks
of its group, the bytes of what each call is handed (a send's tensor, not what a receive fills). One run of 4 steps
and one of 2 per port: their difference over 2 is one step's, without what comes once (the start, the validation and
sampling at the end, the snapshot checks). The default GPT (4 blocks of width 128, 4 heads), 4 windows of 64 bytes a
micro-batch (per process; per row under TP; gpt_pp.py's 4 micro-batches a step), fp32. Every rank's counts are
kept; the report gives rank 0's and whether each rank's group of the same shape was handed the same bytes.
Writes benchmarks/parallel_bytes.json and benchmarks/parallel_bytes.md (made from the json only).
"""
import json
import os
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tools"))
import sizing  # noqa: E402  (the GPT's parameter count, written once)

LAYERS, WIDTH, CONTEXT, WINDOWS, VOCAB, MICRO = 4, 128, 64, 4, 256, 4  # MICRO: gpt_pp.py's default --grad-accum
FLAGS = ["--block-size", str(CONTEXT), "--batch-size", str(WINDOWS), "--warmup-steps", "1", "--eval-every", "1000",
         "--eval-windows", "4", "--log-every", "1000", "--sample-bytes", "0"]
PORTS = {"tensor parallelism, 2 x 2 (gpt_tp.py --tp 2)": ("port/gpt_tp.py", 4, ["--tp", "2"]),
         "pipeline, 2 stages, 1F1B (gpt_pp.py)": ("port/gpt_pp.py", 2, []),
         "ZeRO-1, 2 processes (gpt_zero.py)": ("port/gpt_zero.py", 2, [])}
COUNTER = '''
import json, os
if os.environ.get("BYTES_DIR") and "RANK" in os.environ:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    path, totals = os.path.join(os.environ["BYTES_DIR"], f"rank{os.environ['RANK']}.json"), {}

    def ranks(group):  # c10d's ops carry the group itself, the functional ones its name (their last string)
        group = dist.ProcessGroup.unbox(group) if isinstance(group, torch.ScriptObject) else \\
            dist.distributed_c10d._resolve_process_group(group)
        return ",".join(map(str, dist.get_process_group_ranks(group)))

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):  # DTensor runs the op; the collectives in it come back
                return NotImplemented
            name = str(func).removesuffix(".default")
            if name.startswith(("c10d.", "_c10d_functional.")) and not name.endswith(
                    ("wait_tensor", "_wrap_tensor_autograd", "recv_", "barrier")):
                objects = [a for a in args if isinstance(a, torch.ScriptObject)]  # (no truth value)
                group = objects[0] if objects else [a for a in args if isinstance(a, str)][-1]
                handed = args[1] if any(word in name for word in ("_base_", "allgather_", "reduce_scatter_")) \\
                    else args[0]  # (output, input, ...) or (input or inputs, ...)
                flat = handed if isinstance(handed, (list, tuple)) else [handed]
                flat = [t for item in flat for t in (item if isinstance(item, (list, tuple)) else [item])]
                sizes = totals.setdefault(f"{name} {ranks(group)}", {})
                for tensor in flat:
                    key = str(tensor.numel() * tensor.element_size())
                    sizes[key] = sizes.get(key, 0) + 1
                with open(path, "w") as f:
                    json.dump(totals, f)
            return func(*args, **(kwargs or {}))

    Count().__enter__()
'''


def counted(script, nproc, extra, steps, data):
    with tempfile.TemporaryDirectory() as scratch:
        (Path(scratch) / "sitecustomize.py").write_text(COUNTER)
        env = {**os.environ, "PYTHONPATH": scratch, "BYTES_DIR": scratch, "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   str(REPO / script), *FLAGS, "--data", data, "--steps", str(steps), *extra]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
        if done.returncode != 0:
            sys.exit(done.stdout[-3000:] + done.stderr[-3000:])
        return [json.loads((Path(scratch) / f"rank{rank}.json").read_text()) for rank in range(nproc)]


def per_step(four, two):
    """{key: {bytes: calls}} of one step: (4 steps - 2 steps) / 2, calls of each size."""
    step = {}
    for key, sizes in four.items():
        diff = {size: (calls - two.get(key, {}).get(size, 0)) / 2 for size, calls in sizes.items()}
        if any(diff.values()):
            step[key] = {size: calls for size, calls in diff.items() if calls}
    return step


def predicted():
    """{port: [(group, collective, what, bytes per step)]}: what each process hands per step, from the model's
    shapes (fp32, 4 bytes a number). B T h: one micro-batch's activations between blocks."""
    h, activation, (total, _) = WIDTH, 4 * WINDOWS * CONTEXT * WIDTH, sizing.parameters(LAYERS, WIDTH, VOCAB, CONTEXT)
    # TP on 2: q, k, v, the MLP's first matrix and their biases split; the output projection and the MLP's second
    # matrix split, their biases whole; the norms whole. The root: the tied matrix split by vocabulary.
    block = 12 * h * h // 2 + (3 * h + 4 * h) // 2 + 2 * h + 4 * h
    root = VOCAB * h // 2 + CONTEXT * h + 2 * h
    local = LAYERS * block + root
    return {
        "tensor parallelism, 2 x 2 (gpt_tp.py --tp 2)": [
            ("tensor (0,1)", "all_reduce", f"activations: {6 * LAYERS + 2} of B T h (forward: each block's 2 "
             "row-split outputs, the embedding's; backward: the input gradients of each block's 4 column-split "
             "matrices (q, k, v, the MLP's first) and the head's)", (6 * LAYERS + 2) * activation),
            ("data (0,2)", "_allgather_base_", "FSDP2: this process's piece (half) of each unit's TP share, every "
             "unit in forward, the blocks again in backward", 4 * (2 * local - root) / 2),
            ("data (0,2)", "_reduce_scatter_base_", "FSDP2: each unit's whole gradient (this row's split)",
             4 * local)],
        "pipeline, 2 stages, 1F1B (gpt_pp.py)": [
            ("stages (0,1)", "send", f"{MICRO} sends of B T h: stage 0 each micro-batch's activations, stage 1 "
             "their gradients back", MICRO * activation),
            ("stages (0,1)", "allreduce_", "the tied matrix's gradient, 256 x h", 4 * VOCAB * h)],
        "ZeRO-1, 2 processes (gpt_zero.py)": [
            ("world (0,1)", "allreduce_", "DDP's gradient buckets: every parameter's gradient", 4 * total),
            ("world (0,1)", "broadcast_", "every parameter, from the process that stepped it", 4 * total)]}


def shape(key):
    """(operation, group size, the step between its ranks): a group's place in the grid, the same on every rank."""
    ranks = [int(r) for r in key.split()[-1].split(",")]
    return key.split()[0], len(ranks), ranks[1] - ranks[0] if len(ranks) > 1 else 0


def every_rank(ranks, key):
    """Each rank's bytes per step in the group of `key`'s shape that holds it (rank 0's key)."""
    return [sum(int(size) * calls for k, sizes in step.items() if shape(k) == shape(key)
                for size, calls in sizes.items()) for step in ranks]


def table(raw):
    lines = ["# The bytes per step of the ports past FSDP, by mesh dimension\n",
             f"Measured {raw['date']} by benchmarks/parallel_bytes.py: torch {raw['torch']}, gloo on CPU; the "
             f"default GPT ({LAYERS} blocks of width {WIDTH}), micro-batches of {WINDOWS} windows of {CONTEXT} bytes "
             f"per process (per row under TP; {MICRO} a step under the pipeline, 1 otherwise), fp32; counted in every "
             "rank, (4-step run - 2-step run) / 2. Bytes handed: the tensors each "
             "call is given (what a ring then sends of them: benchmarks/gpt_hsdp_bytes.md). Each predicted row beside "
             "every call counted in its group and collective, and how much of that came in calls of under 4 kB (a "
             "few numbers each: the loss check, the gradient norm's parts, loss_parallel's maxima and sums; under "
             "ZeRO-1 also the biases and norms broadcast).\n",
             "| port | group | collective | what | predicted (bytes) | counted, rank 0 (bytes) | of which in calls "
             "under 4 kB | every rank alike |",
             "|---|---|---|---|---|---|---|---|"]
    for port, rows in predicted().items():
        step = raw["ports"][port][0]
        for group, collective, what, expected in rows:
            ranks = group.split("(")[1].rstrip(")")
            key = next(k for k in step if k.split()[0].split(".")[-1] == collective and
                       k.split()[-1] == ranks)
            every = sum(int(size) * calls for size, calls in step[key].items())
            small = sum(int(size) * calls for size, calls in step[key].items() if int(size) < 4096)
            alike = "yes" if len(set(every_rank(raw["ports"][port], key))) == 1 else "no: " + ", ".join(
                f"{value:,}" for value in every_rank(raw["ports"][port], key))
            lines.append(f"| {port} | {group} | {key.split()[0]} | {what} | {expected:,.0f} | {every:,.0f} | "
                         f"{small:,.0f} | {alike} |")
    others = [f"{port}: {key} {sum(int(s) * c for s, c in sizes.items()):,.0f}" for port, ranks in raw["ports"].items()
              for key, sizes in ranks[0].items() if not any(
                  key.split()[0].split(".")[-1] == c and key.split()[-1] == g.split("(")[1].rstrip(")")
                  for g, c, _, _ in predicted()[port])]
    lines += ["", "Not predicted above (rank 0; each step's loss check, and under TP the gradient norm's parts across "
              "the rows): " + "; ".join(others) + "."]
    return "\n".join(lines) + "\n"


def main():
    if "--table-only" in sys.argv[1:]:  # redo the report from the json
        (HERE / "parallel_bytes.md").write_text(table(json.loads((HERE / "parallel_bytes.json").read_text())))
        return
    import torch

    data = str(REPO / "port" / "data" / "ddp_steps_prose.txt")
    raw = {"date": str(date.today()), "torch": torch.__version__, "ports": {}}
    for port, (script, nproc, extra) in PORTS.items():
        print(f"{port} ...", flush=True, file=sys.stderr)
        four, two = (counted(script, nproc, extra, steps, data) for steps in (4, 2))
        raw["ports"][port] = [per_step(mine, before) for mine, before in zip(four, two, strict=True)]  # by rank
    (HERE / "parallel_bytes.json").write_text(json.dumps(raw, indent=1) + "\n")
    (HERE / "parallel_bytes.md").write_text(table(raw))
    print(table(raw))


if __name__ == "__main__":
    main()
