"""Memory per rank of the GPT port under DDP (port/gpt_ddp.py), ZeRO-1 (port/gpt_zero.py) and FSDP2 (port/gpt_fsdp.py):
plain, with activation checkpointing, with the bf16 mixed-precision policy, with bf16 autocast instead, and HSDP, at
1, 2 and 4 processes, each beside the training state it must hold; with tokens/s against DDP's and the loss each ends
with; and the peak while the model is built: gpt_ddp.py's whole model on every rank (eager) against gpt_fsdp.py's
meta-device build.

    .venv/bin/python benchmarks/gpt_fsdp_memory.py                      # about 15 minutes on 2 cores
    .venv/bin/python benchmarks/gpt_fsdp_memory.py --n-layer 2 --repeats 1   # a quick check

Every run is the real script under torchrun, in fresh processes, a few optimizer steps of a GPT of --n-layer blocks
of width --n-embd, --batch-size windows of 64 bytes per process. This program polls each worker's /proc/PID/status
every 20 ms and keeps its peak resident set (VmHWM, which the kernel tracks; the polling only has to see it before
the process ends). What the processes hold without the model (torch, the group, the text, the allocator) is
measured the same way on a GPT of one block of width 16, and subtracted. glibc's mmap threshold is fixed
(MALLOC_MMAP_THRESHOLD_=131072), so that freed tensors go back to the system. On this CPU host and device memory
are one. Runs are interleaved (each repeat runs every configuration once, the order alternating).
The build is measured inside each worker by a sitecustomize.py on PYTHONPATH (BUILD_HOOK): at the script's first
torch.manual_seed (the line before the model is built) it reads the resident set and resets the peak (Linux:
/proc/self/clear_refs), and when AdamW is made (the model built, materialised, wrapped or sharded, its weights
set) it reads the peak: the build's peak over what the process held before it.
The activations are counted, not measured: the bytes autograd saves for backward in one forward and loss of the
same GPT in this process (activations()).
Writes benchmarks/gpt_fsdp_memory.json (raw) and benchmarks/gpt_fsdp_memory.md (made from the json only).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO, MB = HERE.parent, 2**20
sys.path.insert(0, str(HERE))  # benchmarks/, also when this file is loaded as a module (tests/test_repository.py)
sys.path.insert(0, str(REPO / "tools"))  # tools/sizing.py: the formulas, written once
import _verdict  # noqa: E402
import sizing  # noqa: E402

# name: (script, its extra flags, process counts): what each configuration runs
CONFIGS = {
    "DDP": ("port/gpt_ddp.py", [], (1, 2, 4)),
    "FSDP2": ("port/gpt_fsdp.py", [], (1, 2, 4)),
    "FSDP2, activation checkpointing": ("port/gpt_fsdp.py", ["--activation-checkpointing"], (1, 2, 4)),
    "FSDP2, --param-dtype bf16": ("port/gpt_fsdp.py", ["--param-dtype", "bf16"], (2,)),
    "FSDP2, --amp (bf16 autocast)": ("port/gpt_fsdp.py", ["--amp"], (2,)),
    "HSDP, 2 copies": ("port/gpt_fsdp.py", ["--replicas", "2"], (4,)),
    "ZeRO-1": ("port/gpt_zero.py", [], (1, 2, 4)),
}
BASELINE = ["--n-layer", "1", "--n-embd", "16", "--n-head", "1"]
# Each worker's build, measured from inside (the module docstring): written to $BUILD_PEAK_DIR/RANK.json
BUILD_HOOK = """
import json, os
if os.environ.get("BUILD_PEAK_DIR") and "RANK" in os.environ:
    import torch

    def _memory():
        status = open("/proc/self/status").read()
        return {key: int(status.split(key + ":")[1].split()[0]) * 1024 for key in ("VmRSS", "VmHWM")}

    _seed, _adamw, _before = torch.manual_seed, torch.optim.AdamW.__init__, {}

    def manual_seed(*args, **kwargs):
        if not _before:
            _before.update(_memory())
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # the peak (VmHWM) reset to the present resident set
        return _seed(*args, **kwargs)

    def adamw(self, *args, **kwargs):
        if _before and "peak" not in _before:
            now = _memory()
            _before.update(peak=now["VmHWM"], after=now["VmRSS"])
            with open(os.path.join(os.environ["BUILD_PEAK_DIR"], os.environ["RANK"] + ".json"), "w") as f:
                json.dump({"before": _before["VmRSS"], "peak": _before["peak"], "after": _before["after"]}, f)
        return _adamw(self, *args, **kwargs)

    torch.manual_seed, torch.optim.AdamW.__init__ = manual_seed, adamw
"""


def flags(args):
    return ["--block-size", "64", "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--warmup-steps",
            "1", "--eval-every", "1000", "--eval-windows", "8", "--log-every", "1000", "--sample-bytes", "0"]


def model(args):
    return ["--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--n-head", str(args.n_embd // 64)]


def peak(pid):
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        return int(status.split("VmHWM:")[1].split()[0]) * 1024
    except (OSError, IndexError):
        return None


def run_once(script, extra, nproc, args, baseline=False):
    """One torchrun launch: each worker's peak RSS (bytes), rank 0's metrics (one dict per step), and each rank's
    build (bytes: resident before it, peak during it, resident after it), in rank order."""
    import psutil

    with tempfile.TemporaryDirectory() as scratch:
        metrics = Path(scratch) / "metrics.jsonl"
        (Path(scratch) / "sitecustomize.py").write_text(BUILD_HOOK)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   str(REPO / script), *flags(args), *(BASELINE if baseline else model(args)), *extra,
                   "--metrics", str(metrics)]
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1", "BUILD_PEAK_DIR": scratch,
               "PYTHONPATH": os.pathsep.join(filter(None, [scratch, os.environ.get("PYTHONPATH")]))}
        with open(Path(scratch) / "log.txt", "w+") as log:  # a file, not a pipe: a full pipe would stall the run
            agent = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
            peaks, deadline = {}, time.monotonic() + 600
            while agent.poll() is None and time.monotonic() < deadline:
                try:
                    children = psutil.Process(agent.pid).children(recursive=True)
                except psutil.Error:  # torchrun ended between the poll and here
                    children = []
                for child in children:
                    value = peak(child.pid)
                    if value:
                        peaks[child.pid] = max(value, peaks.get(child.pid, 0))
                time.sleep(0.02)
            agent.wait(timeout=60)
            log.seek(0)
            output = log.read()
        if agent.returncode != 0:
            sys.exit(f"{' '.join(command)} failed:\n{output[-3000:]}")
        builds = [json.loads((Path(scratch) / f"{rank}.json").read_text()) for rank in range(nproc)]
        return sorted(peaks.values()), [json.loads(line) for line in metrics.read_text().splitlines()], builds


def parameters(args):
    """The GPT's parameter count (the tied matrix once), and its largest FSDP2 unit's (a block, or the root)."""
    d, layers = args.n_embd, args.n_layer
    block = 12 * d * d + 13 * d  # qkv 3d^2+3d, proj d^2+d, mlp 8d^2+5d, two LayerNorms 4d
    root = 256 * d + 64 * d + 2 * d  # the tied token matrix, the position table, the final LayerNorm
    return layers * block + root, max(block, root)


def predicted_state(name, nproc, args):
    """(Bytes a rank holds between steps; those plus every gradient and, under FSDP2, three whole units.)
    Between steps: fp32 weights and AdamW's two moments, 12 B a parameter, and DDP's gradient buckets, 4 B (DDP
    keeps them; the gradients themselves are freed by zero_grad(set_to_none=True)); under ZeRO-1 (gpt_zero.py, DDP
    with ZeroRedundancyOptimizer) the moments' 1/N share; under FSDP2 the pieces of each (1/N; under HSDP with 2
    copies, 1/(N/2)). The second adds the gradients (4 B a parameter, or its pieces), and
    under FSDP2 three whole units (4 B x the largest unit each: the one computing, its gradients in backward, the
    next one gathered early). It is not the peak less the activations: the gradients are made in backward while
    the activations are freed, and at the end of forward, when every activation is held, no gradient exists yet."""
    total, largest = parameters(args)
    kind = {"DDP": "ddp", "ZeRO-1": "zero"}.get(name, "fsdp")  # ZeRO-1: whole parameters dealt out: 1/N about
    return sizing.state_bytes(kind, total, largest, nproc // 2 if name.startswith("HSDP") else nproc)


def predicted_build(name, nproc, rank, args):
    """Bytes a rank's build adds at its peak. Eager (gpt_ddp.py): the whole model in fp32 on every rank, 4 B a
    parameter, and DDP's gradient buckets, allocated when it wraps the model, 4 B more. Meta (gpt_fsdp.py): each
    rank's pieces (4 B a parameter / N), one whole tensor at a time as rank 0's weights arrive (the largest, an MLP
    matrix of 4 x width^2), and on rank 0 also its one whole build (4 B a parameter)."""
    total, _ = parameters(args)
    if name == "DDP":
        return 8 * total
    return 4 * total / nproc + 4 * 4 * args.n_embd ** 2 + (4 * total if rank == 0 else 0)


def activations(args):
    """Bytes autograd saves for backward in one forward and loss of port/gpt_fsdp.py's GPT with one process's batch,
    each storage once, the parameters left out: {"plain": ..., "checkpointed": ...}. With activation checkpointing
    each block keeps only its input (and backward then holds one block's again while it recomputes it). The same at
    every N: the batch per process is fixed."""
    import importlib.util

    import torch
    import torch.nn.functional as F

    spec = importlib.util.spec_from_file_location("gpt_fsdp", REPO / "port" / "gpt_fsdp.py")
    port = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(port)
    counts = {}
    for recompute in (False, True):
        torch.manual_seed(0)
        model = port.GPT(64, args.n_layer, args.n_embd // 64, args.n_embd, 0.0, recompute=recompute)
        weights, saved = {p.untyped_storage().data_ptr() for p in model.parameters()}, {}

        def pack(tensor, weights=weights, saved=saved):  # views share a storage: q, k and v are one
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in weights:
                saved[storage.data_ptr()] = storage.nbytes()
            return tensor

        tokens = torch.randint(0, 256, (args.batch_size, 65))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        counts["checkpointed" if recompute else "plain"] = sum(saved.values())
        del loss
    return counts


def spread(values, digits=1):
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def table(raw):
    args = argparse.Namespace(**raw["args"])
    total, largest = parameters(args)
    lines = ["# The GPT port's memory per rank: DDP, ZeRO-1, FSDP2, activation checkpointing, mixed precision, HSDP\n",
             f"Measured {raw['date']} by benchmarks/gpt_fsdp_memory.py: torch {raw['torch']}, {raw['cpus']} CPU cores, "
             f"gloo, 1 thread per process; a GPT of {args.n_layer} blocks of width {args.n_embd} ({total / 1e6:.1f} M "
             f"parameters, largest unit {largest / 1e6:.2f} M), {args.batch_size} windows of 64 bytes per process, "
             f"{args.steps} optimizer steps; {raw['repeats']} repeats, interleaved. MB = 2^20 bytes. 4 processes on 2 "
             "cores are oversubscribed: their tokens/s are not speeds; their memory is.\n",
             "Peak: the largest of the ranks' peak resident sets, less the same script's on a one-block GPT of "
             "width 16 (what the processes hold without the model): median (min-max) of the repeats. Predicted: the "
             "training state a rank holds between steps; and that plus every gradient and, under FSDP2, three "
             "gathered units (benchmarks/gpt_fsdp_memory.py, predicted_state). The latter is not the peak less the "
             "activations: the gradients are made in backward while the activations are freed, and at the end of "
             "forward, when every activation is held, no gradient exists yet. The activations, counted (not "
             "measured in these runs; activations()): one forward and loss of this GPT saves "
             f"{raw['activations']['plain'] / MB:.1f} MB for backward per rank, the same at every N (the batch per "
             f"process is fixed); with activation checkpointing {raw['activations']['checkpointed'] / MB:.1f} MB, "
             "and backward holds one block's again while it recomputes it. "
             "Tokens/s: rank 0's median over the steps after the first, as a ratio to DDP's at the same N in the "
             "same repeat. Loss: the last step's training loss (the batch per process is fixed: at N=4 the global "
             "batch is twice N=2's, and so the loss differs). A window of 64 bytes is 64 tokens (the port's tokens "
             "are bytes). The prediction counts everything at fp32: under --param-dtype bf16 its three gathered "
             "units would take 2 bytes a parameter, and it does not model that.\n",
             "| configuration | N | predicted: held between steps | "
             "predicted: held + every gradient (+ 3 units under FSDP2) | measured peak | tokens/s / DDP's | "
             "last loss |",
             "|---|---|---|---|---|---|---|"]
    for name, (_, _, counts) in CONFIGS.items():
        for nproc in counts:
            runs = [r for r in raw["runs"] if r["config"] == name and r["nproc"] == nproc]
            ddp = {r["repeat"]: r for r in raw["runs"] if r["config"] == "DDP" and r["nproc"] == nproc}
            base = statistics.median(r["peak"] for r in raw["runs"] if r["config"] == f"baseline {CONFIGS[name][0]}"
                                     and r["nproc"] == nproc)
            held, at_peak = predicted_state(name, nproc, args)
            ratios = [r["tokens_per_s"] / ddp[r["repeat"]]["tokens_per_s"] for r in runs]
            lines.append(f"| {name} | {nproc} | {held / MB:.1f} | {at_peak / MB:.1f} | "
                         f"{spread([(r['peak'] - base) / MB for r in runs])} | "
                         f"{'1' if name == 'DDP' else spread(ratios, 2)} | {spread([r['loss'] for r in runs], 4)} |")
    lines.append("")
    words = dict(above="more memory in every repeat", below="less memory in every repeat",
                 neither="cannot tell from these repeats")
    for name, counts in (("FSDP2, activation checkpointing", (1, 2, 4)), ("FSDP2, --param-dtype bf16", (2,)),
                         ("FSDP2, --amp (bf16 autocast)", (2,))):
        for nproc in counts:
            change = paired(raw, "FSDP2", name, nproc)
            drift = [abs(r["loss"] - f["loss"]) for r, f in zip(select(raw, name, nproc), select(raw, "FSDP2", nproc),
                                                                 strict=True)]
            lines.append(f"- {name}, N={nproc}: its peak minus fp32 FSDP2's, repeat by repeat, {spread(change)} MB: "
                         f"{_verdict.verdict(min(change), max(change), 0, **words)}; its last loss "
                         f"{spread(drift, 4)} from fp32 FSDP2's.")
    lines.append("")
    lines += ["## While the model is built\n",
              f"Each rank's peak while the script builds the model (from its first torch.manual_seed to its AdamW: "
              f"built, materialised, wrapped or sharded, weights set) over what it held just before, less the same "
              f"on the one-block GPT of width 16 (what building costs without the model: DDP's constructor imports "
              f"torch._dynamo, for one), beside the prediction (benchmarks/gpt_fsdp_memory.py, predicted_build); the "
              f"whole model's fp32 weights are {4 * total / MB:.1f} MB. DDP is gpt_ddp.py, built whole on every "
              "rank; FSDP2 is gpt_fsdp.py, built on the meta device, rank 0 building the whole model once to send "
              "it. Other ranks: the largest of ranks 1 and up. Median (min-max) of the repeats.\n",
              "| configuration | N | rank | predicted | measured: the build's peak over before, less the one-block "
              "model's |",
              "|---|---|---|---|---|"]

    def built(run, rank):  # bytes: the build's peak over before, on rank 0 or the largest of the others
        return max(b["peak"] - b["before"] for b in (run["builds"][:1] if rank == 0 else run["builds"][1:]))

    for name in ("DDP", "FSDP2"):
        for nproc in CONFIGS[name][2]:
            for rank, label in ((0, "0"), (1, "others")):
                if rank >= nproc:
                    continue
                base = statistics.median(built(r, rank) for r in raw["runs"] if r["nproc"] == nproc
                                         and r["config"] == f"baseline {CONFIGS[name][0]}")
                measured = [(built(r, rank) - base) / MB for r in select(raw, name, nproc)]
                lines.append(f"| {name} | {nproc} | {label} | {predicted_build(name, nproc, rank, args) / MB:.1f} | "
                             f"{spread(measured)} |")
    return "\n".join(lines) + "\n"


def select(raw, name, nproc):
    return sorted((r for r in raw["runs"] if r["config"] == name and r["nproc"] == nproc), key=lambda r: r["repeat"])


def paired(raw, reference, name, nproc):
    """MB of peak that `name` holds more than `reference`, repeat by repeat (the same repeat: interleaved runs)."""
    return [(b["peak"] - a["peak"]) / MB for a, b in zip(select(raw, reference, nproc), select(raw, name, nproc),
                                                          strict=True)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    import torch

    raw = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "cpus": os.cpu_count(), "args": vars(args),
           "repeats": args.repeats, "activations": activations(args), "runs": []}
    plan = [(name, script, extra, nproc) for name, (script, extra, counts) in CONFIGS.items() for nproc in counts]
    plan += [(f"baseline {script}", script, [], nproc) for script in ("port/gpt_ddp.py", "port/gpt_fsdp.py",
                                                                       "port/gpt_zero.py") for nproc in (1, 2, 4)]
    for repeat in range(args.repeats):
        for name, script, extra, nproc in plan if repeat % 2 == 0 else reversed(plan):
            began = time.monotonic()
            peaks, metrics, builds = run_once(script, extra, nproc, args, baseline=name.startswith("baseline"))
            rates = [m["tokens_per_s"] for m in metrics[1:]] or [metrics[0]["tokens_per_s"]]
            raw["runs"].append({"config": name, "nproc": nproc, "repeat": repeat, "peak": max(peaks),
                                "peaks": peaks, "tokens_per_s": statistics.median(rates), "loss": metrics[-1]["loss"],
                                "builds": builds})
            print(f"repeat {repeat} {name} N={nproc}: peak {max(peaks) / MB:.1f} MB, "
                  f"{time.monotonic() - began:.0f} s", flush=True)
    (HERE / "gpt_fsdp_memory.json").write_text(json.dumps(raw, indent=1) + "\n")
    (HERE / "gpt_fsdp_memory.md").write_text(table(raw))
    print(table(raw))


if __name__ == "__main__":
    main()
