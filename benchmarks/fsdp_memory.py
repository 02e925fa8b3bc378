"""What FSDP2 (fully_shard) saves against DDP, measured: memory per rank, bytes on the wire per step, step time
and the losses, for 04_fault_tolerant.py's "wide" model (31.5M parameters) at 1, 2 and 4 ranks on CPU with gloo.

    .venv/bin/python benchmarks/fsdp_memory.py                  # about 6 minutes on 2 cores
    .venv/bin/python benchmarks/fsdp_memory.py --model wide-256 --blocks 3   # a quick check

Each (DDP or FSDP2, world size) gets fresh processes for memory and bytes, because a process's peak RSS never
goes down; step time and losses come from one more run per world size holding both, alternating blocks of steps.
Writes benchmarks/fsdp_memory.json (raw) and benchmarks/fsdp_memory.md (made from the json only).
"""
import argparse
import copy
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/, also when this file is loaded as a module (tests/test_repository.py)
import _verdict  # noqa: E402

_spec = importlib.util.spec_from_file_location("step04", HERE.parent / "04_fault_tolerant.py")
step04 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step04)
WORLD_SIZES, MB = (1, 2, 4), 2**20
MALLOC = "MALLOC_MMAP_THRESHOLD_=131072"


def arguments():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="wide")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10, help="steps compared for the losses, and per bytes window")
    parser.add_argument("--blocks", type=int, default=6, help="timed blocks per world size: one ratio each")
    parser.add_argument("--block-steps", type=int, default=4, help="steps of each kind per block")
    parser.add_argument("--table-only", action="store_true", help="rewrite the .md from the .json, run nothing")
    parser.add_argument("--malloc-only", action="store_true", help="run only the memory runs with glibc's mmap "
                        "threshold fixed, and add them to the existing .json")
    parser.add_argument("--worker", choices=["ddp", "fsdp", "pair"], help="(internal) what a torchrun rank runs")
    return parser.parse_args()


def rss():  # (current, peak) resident set in bytes; the peak as the brief's ru_maxrss (KiB on Linux)
    current = int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0])
    return current * 1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def lo_sent():  # bytes sent on loopback, all processes together: where gloo's traffic between local ranks goes
    return int(Path("/proc/net/dev").read_text().split(" lo:")[1].split()[8])


def wrap(model, kind):
    if kind == "ddp":
        return DDP(model, gradient_as_bucket_view=True)  # as in the scripts: grads are views into the buckets
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for child in model:  # as step 05: one unit per child that has parameters, then the root
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def local(t):  # what this rank holds of a tensor: the local shard of a DTensor
    return t.to_local() if hasattr(t, "to_local") else t


def held(model, optimizer):
    """Bytes of parameters, gradients, momentum this rank holds: as tensors (numel) and as distinct storages
    (which shows FSDP2's padding, and that DDP's bucket-view grads share one storage per bucket)."""
    groups = {"params": list(model.parameters()), "grads": [p.grad for p in model.parameters()],
              "momentum": [optimizer.state[p]["momentum_buffer"] for p in model.parameters()]}
    out = {}
    for name, tensors in groups.items():
        tensors = [local(t) for t in tensors if t is not None]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        out[name] = sum(t.numel() * t.element_size() for t in tensors)
        out[name + "_storage"] = sum(storages.values())
    return out


def step(model, optimizer, images, labels):
    optimizer.zero_grad(set_to_none=True)  # first, not last: the grads stay after the step, to be counted
    loss = F.cross_entropy(model(images), labels)
    loss.backward()
    optimizer.step()
    return loss.item()


def count_fsdp_collectives(counts):
    """FSDP2 calls these two from Python (_fsdp_collectives.py): count the bytes each rank hands them."""
    for name in ("all_gather_single", "reduce_scatter_single"):
        original = getattr(dist, name)

        def counted(output, input, *args, _original=original, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + input.numel() * input.element_size()
            return _original(output, input, *args, **kwargs)
        setattr(dist, name, counted)


def worker(args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from _shared import rank_batches  # benchmarks/ is on the path (above)
    batches = rank_batches(args.batch_size)
    torch.manual_seed(0)  # the same seed everywhere: one model, whose shards FSDP2 keeps
    if args.worker == "pair":
        return pair(args, batches, rank, world)
    counts = {}
    count_fsdp_collectives(counts)
    rss_before, peak_before = rss()
    model = wrap(step04.build_model(args.model, 10), args.worker)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)  # after wrapping
    rss_built, peak_built = rss()  # FSDP2: every rank built the whole model before keeping its shard
    # Reset the peak (VmHWM, which ru_maxrss reads) so that the training peak is not hidden by the build's
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    step(model, optimizer, *batches[0])  # the first step allocates grads and momentum (and DDP rebuilds buckets)
    rss_first, peak_first = rss()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    for i in range(1, 3):
        step(model, optimizer, *batches[i])
    rss_steady, peak_steady = rss()
    windows = []  # loopback bytes over --steps steps, several windows: other traffic on lo only adds
    for _ in range(3):
        counts.clear()
        dist.barrier()
        sent = lo_sent()
        for i in range(args.block_steps):
            step(model, optimizer, *batches[i % len(batches)])
        dist.barrier()
        windows.append((lo_sent() - sent) / world / args.block_steps)
    handed = {k: v / args.block_steps for k, v in counts.items()}
    if args.worker == "ddp":  # the C++ reducer all-reduces its buckets once per step: their sizes, in bytes
        handed["all_reduce"] = sum(int(b) for b in str(model._get_ddp_logging_data()["bucket_sizes"]).split(", "))
    report({"kind": args.worker, "world": world, "rank": rank, **held(model, optimizer),
                      "rss_before": rss_before, "peak_before": peak_before, "rss_built": rss_built,
                      "peak_built": peak_built, "rss_first": rss_first, "peak_first": peak_first,
                      "rss_steady": rss_steady, "peak_steady": peak_steady, "lo_sent_per_rank_step": windows,
                      "handed_per_step": handed})


def report(result):  # every rank's result, printed by rank 0 as one JSON line (ranks printing at once interleave)
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    if dist.get_rank() == 0:
        print(json.dumps(results), flush=True)
    dist.destroy_process_group()


def pair(args, batches, rank, world):
    """DDP and FSDP2 from the same initial weights on the same batches: losses, then alternating timed blocks."""
    base = step04.build_model(args.model, 10)
    models = {"ddp": wrap(copy.deepcopy(base), "ddp"), "fsdp": wrap(base, "fsdp")}
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
                  for k, m in models.items()}
    losses = {k: [step(models[k], optimizers[k], *batches[i % len(batches)]) for i in range(args.steps)]
              for k in models}
    ratios, times = [], {"ddp": [], "fsdp": []}
    for block in range(args.blocks):
        for kind in (("ddp", "fsdp") if block % 2 == 0 else ("fsdp", "ddp")):  # who goes first alternates
            dist.barrier()
            began = time.perf_counter()
            for i in range(args.block_steps):
                step(models[kind], optimizers[kind], *batches[i % len(batches)])
            times[kind].append((time.perf_counter() - began) / args.block_steps)
        ratios.append(times["fsdp"][-1] / times["ddp"][-1])
    wire = {}  # gloo's algorithms, seen from the wire: loopback bytes per rank for one call on 16 MiB
    data = torch.ones(4 * MB)
    calls = {"all_reduce": lambda: dist.all_reduce(data),
             "all_gather_single": lambda: dist.all_gather_single(data, data[rank::world].clone()),
             "reduce_scatter_single": lambda: dist.reduce_scatter_single(data[:len(data) // world].clone(), data)}
    for name, call in calls.items():
        dist.barrier()
        sent = lo_sent()
        call()
        dist.barrier()
        wire[name] = (lo_sent() - sent) / world / data.nbytes  # as a multiple of the full tensor's bytes
    report({"kind": "pair", "world": world, "losses": losses, "step_s": times, "ratios": ratios, "wire": wire})


def launch(args, world, kind, timeout=300, **env):
    command = [str(Path(sys.executable).with_name("torchrun")), "--standalone", f"--nproc_per_node={world}",
               __file__, "--worker", kind, "--model", args.model, "--batch-size", str(args.batch_size),
               "--steps", str(args.steps), "--blocks", str(args.blocks), "--block-steps", str(args.block_steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **env}
    began = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if not done.stdout.startswith("["):  # a crash in teardown, after the results were printed, is only noted
        sys.exit(f"failed: {' '.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    if done.returncode != 0:
        print(f"  exit status {done.returncode} after the results: {done.stderr.strip().splitlines()[-1:]}")
    print(f"  {kind} at {world} rank(s): {time.perf_counter() - began:.0f} s", flush=True)
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("[")))


def verdict(low, high):  # FSDP2 / DDP: benchmarks/_verdict.py, the spread decides
    return _verdict.verdict(low, high, 1.0, above="FSDP2 slower", below="FSDP2 faster",
                            neither="cannot tell on this machine (the spread includes 1.0)")


def padding(ranks):  # storage bytes beyond the tensors' own: FSDP2's dim-0 padding (0 for DDP's bucket views)
    return sum(x[k + "_storage"] - x[k] for x in ranks for k in ("params", "grads", "momentum"))


def markdown(r):
    P, U, mb = r["parameters"], r["largest_unit"], lambda b: f"{b / MB:.1f}"
    lines = [f"# DDP against FSDP2 (fully_shard): memory, bytes, time, losses\n\nMeasured {r['date']} by "
             f"benchmarks/fsdp_memory.py: torch {r['torch']}, {r['cpus']} CPU cores, gloo, 1 thread per process; model "
             f"{r['model']} ({P / 1e6:.1f} M parameters, largest FSDP2 unit {U / 1e6:.2f} M), batch {r['batch_size']} "
             "per rank. 4 ranks on 2 cores are oversubscribed: their times are not speeds; their memory and bytes are."
             " MB = 2^20 bytes.\n", "## Memory per rank (MB; max over ranks)\n",
             "| | N | predicted: 12 B/param (FSDP2: 12 P/N, + 2 x largest unit at peak) | held: params + grads + "
             "momentum | padding, all ranks (bytes) | RSS before the model | peak RSS building - before | peak RSS in "
             f"steps - before | the same, malloc returning what is freed ({MALLOC}) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for world in WORLD_SIZES:
        for kind in ("ddp", "fsdp"):
            ranks, share = r["runs"][f"{kind}{world}"], 12 * P / (1 if kind == "ddp" else world)
            peak = "" if kind == "ddp" else f", {mb(share + 8 * U)} at peak"
            held = max(x["params"] + x["grads"] + x["momentum"] for x in ranks)
            lines.append(f"| {kind.upper()} | {world} | {mb(share)}{peak} | {mb(held)} | {padding(ranks)} | "
                         f"{mb(max(x['rss_before'] for x in ranks))} | "
                         f"{mb(max(x['peak_built'] - x['rss_before'] for x in ranks))} | "
                         f"{mb(max(x['peak_steady'] - x['rss_before'] for x in ranks))} | "
                         f"{mb(max(x['peak_steady'] - x['rss_before'] for x in r['runs'][f'{kind}{world}-malloc']))} |")
    lines += ["\n## Bytes per rank per optimizer step (MB)\n", "Handed: the bytes each rank gives its collectives "
              "(DDP: its buckets, from DDP's logging data; FSDP2: counted in dist.all_gather_single and "
              "dist.reduce_scatter_single, which _fsdp_collectives.py calls). On the wire: loopback bytes sent by "
              f"all ranks / N, headers included, least of 3 windows of {r['args']['block_steps']} steps (other "
              "traffic on lo only adds). Ring: DDP 2(N-1)/N x 4P, FSDP2 3(N-1)/N x 4P. Gloo: the same with each "
              "collective's wire factor measured alone (next table).\n",
              "| | N | handed | ring prediction | gloo prediction | on the wire |", "|---|---|---|---|---|---|"]
    for world in WORLD_SIZES:
        wire = r["runs"][f"pair{world}"][0]["wire"]
        for kind in ("ddp", "fsdp"):
            ranks = r["runs"][f"{kind}{world}"]
            ring = (2 if kind == "ddp" else 3) * (world - 1) / world * 4 * P
            gloo = 4 * P * (wire["all_reduce"] if kind == "ddp" else
                            2 * wire["all_gather_single"] + wire["reduce_scatter_single"])
            handed = sum(ranks[0]["handed_per_step"].values())
            lines.append(f"| {kind.upper()} | {world} | {mb(handed)} | {mb(ring)} | {mb(gloo)} | "
                         f"{mb(min(ranks[0]['lo_sent_per_rank_step']))} |")
    lines += ["\nGloo's collectives alone, one call on 16 MiB: loopback bytes per rank / the tensor's bytes.\n",
              "| N | all_reduce (ring: 2(N-1)/N) | all_gather_single (ring: (N-1)/N) | reduce_scatter_single "
              "(ring: (N-1)/N) |", "|---|---|---|---|"]
    for world in WORLD_SIZES:
        w, ring = r["runs"][f"pair{world}"][0]["wire"], (world - 1) / world
        lines.append(f"| {world} | {w['all_reduce']:.3f} ({2 * ring:.3f}) | {w['all_gather_single']:.3f} "
                     f"({ring:.3f}) | {w['reduce_scatter_single']:.3f} ({ring:.3f}) |")
    lines += [f"\n## Step time: FSDP2 / DDP\n\n{r['args']['blocks']} blocks per N, each {r['args']['block_steps']} "
              "DDP steps and as many FSDP2 steps in the same processes (who goes first alternates); one ratio per "
              "block, rank 0's clock.\n", "| N | DDP ms/step | FSDP2 ms/step | ratio median (min-max) | verdict |",
              "|---|---|---|---|---|"]
    for world in WORLD_SIZES:
        pair = r["runs"][f"pair{world}"][0]
        low, high, ratios = min(pair["ratios"]), max(pair["ratios"]), pair["ratios"]
        note = " (oversubscribed: not a speed)" if world > r["cpus"] else ""
        lines.append(f"| {world} | {1000 * statistics.median(pair['step_s']['ddp']):.0f} | "
                     f"{1000 * statistics.median(pair['step_s']['fsdp']):.0f} | {statistics.median(ratios):.2f} "
                     f"({low:.2f}-{high:.2f}) | {verdict(low, high)}{note} |")
    lines += [f"\n## Losses: same initial weights, same batches, {r['args']['steps']} steps, every rank's own loss\n",
              "| N | max abs difference | max relative difference | steps bitwise equal |", "|---|---|---|---|"]
    for world in WORLD_SIZES:
        losses = [x["losses"] for x in r["runs"][f"pair{world}"]]
        pairs = [(a, b) for x in losses for a, b in zip(x["ddp"], x["fsdp"], strict=True)]
        lines.append(f"| {world} | {max(abs(a - b) for a, b in pairs):.3g} | "
                     f"{max(abs(a - b) / abs(a) for a, b in pairs):.3g} | "
                     f"{sum(a == b for a, b in pairs)} of {len(pairs)} |")
    lines += ["\n## Where measurement departs from prediction, and why (checked in the installed torch source)\n",
              *why(r, mb, P)]
    return "\n".join(lines) + "\n"


def why(r, mb, P):
    def peak(kind, world, suffix):
        return mb(max(x["peak_steady"] - x["rss_before"] for x in r["runs"][f"{kind}{world}{suffix}"]))

    def fixed(kind, world):
        return peak(kind, world, "-malloc")

    def free(kind, world):
        return peak(kind, world, "")
    src, wire = "torch/distributed/fsdp/_fully_shard/", r["runs"]["pair2"][0]["wire"]["reduce_scatter_single"]
    return [f"- **This benchmark builds the whole model on every rank.** Its peak while building is the full fp32 "
            f"model ({mb(4 * P)} MB), not 4P/N: build_model runs in full on each rank, then fully_shard copies the "
            f"rank's chunk into new storage ({src}_fsdp_param.py, FSDPParam._init_sharded_param: _chunk_with_empty, "
            "new_zeros(padded_sharded_size), copy_). Step 05 has built on the meta device since 2026-11-28: "
            "benchmarks/fsdp_build_memory.md measures both ways.",
            "- **More than one gathered unit at the FSDP2 peak.** Backward all-gathers the next unit while the current "
            f"one computes ({src}_fsdp_param_group.py, FSDPParamGroup._backward_prefetch); foreach_reduce "
            f"({src}_fsdp_collectives.py) copies a unit's gradients into a full-size reduce_scatter_input before it "
            "frees them; and gloo's reduce-scatter is an all-reduce of that whole input (next items), whose working "
            "copy is C++ (ProcessGroupGloo, not in the wheel): inferred from its bytes, not read.",
            "- **RSS above the tensors, DDP and FSDP2 alike.** SGD's weight decay makes one parameter-sized temporary "
            "at a time (torch/optim/sgd.py, _single_tensor_sgd: grad = grad.add(param, alpha=weight_decay); CPU "
            "tensors get no foreach path), plus activations, gloo's buffers, and memory malloc keeps after torch "
            "frees it. The RSS before the model (torch, gloo, the data) is subtracted; the rest is not all tensors.",
            "- **Memory malloc keeps: most of FSDP2's excess.** FSDP2 frees and allocates every unit's gathered "
            "weights and full-size gradients at every step; DDP keeps its buckets. glibc serves a large allocation "
            "with mmap (returned to the system when freed) only above a threshold, which it raises to the size of "
            "each such block freed (up to 32 MiB: man mallopt, M_MMAP_THRESHOLD): once a unit's 16 MiB block has "
            "been freed, later ones come from the heap, and freed heap memory mostly stays in the process. With "
            f"{MALLOC} (the threshold fixed at 128 KiB), FSDP2's peak RSS in steps at N=2 is {fixed('fsdp', 2)} MB "
            f"against {free('fsdp', 2)} MB without, and DDP's {fixed('ddp', 2)} MB against {free('ddp', 2)} MB. "
            "(A GPU's caching allocator behaves differently.)",
            f"- **Padding.** _init_sharded_param pads dim 0 to the first chunk (\"0th always padded\"); to_local() "
            f"returns the unpadded view, so the counted tensors match 12P/N and the storages hold "
            f"{padding(r['runs']['fsdp4'])} bytes more at N=4, all ranks (Linear(2048, 10): 10 rows in chunks of "
            "3, 3, 3, 1). None at N=2: every dim 0 here is even.",
            "- **Two all-gathers per step.** reshard_after_forward=True frees each unit's unsharded parameters after "
            "its forward (FSDPParamGroup.post_forward calls reshard), so backward gathers them again: handed "
            f"all-gather bytes are 2 x 4P/N. Only the root is exempt ({src}_fsdp_state.py, FSDPState._lazy_init sets "
            "its post_forward_mesh_info = None), and the root here holds no parameters of its own.",
            f"- **Gloo's reduce-scatter is not a ring reduce-scatter.** Alone it puts {wire:.2f} x the tensor on the "
            "wire at N=2, where a ring sends 0.50: all-reduce bytes. So FSDP2 sends about 4(N-1)/N x 4P per step, "
            "not 3(N-1)/N, more than DDP; all_reduce and all_gather_single do match ring. Measured: gloo is C++, not "
            "in the installed source; the pull request that added gloo's reduce_scatter (pytorch/pytorch#149869) "
            "describes it, and the older reduce_scatter_tensor, as built from all-reduces. NCCL on GPUs would differ.",
            "- **Losses.** DDP divides before it sums (its C++ reducer scales each gradient by 1/N into the bucket, as "
            "torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py, _allreduce_fut, does in Python: "
            "tensor.div_ then all_reduce); FSDP2 asks the collective for the mean (_fsdp_collectives.py, "
            "_get_gradient_divide_factors: fp32 without set_gradient_divide_factor gives ReduceOp.AVG; SUM at N=1). "
            "Dividing by 1, 2 or 4 is exact in binary floating point, so only the order of the summands can differ: "
            "two summands add the same either way; four, added in different orders by gloo's all-reduce and its "
            "reduce-scatter, can differ in the last bits, and then grow step by step."]


if __name__ == "__main__":
    args = arguments()
    if args.worker:
        sys.exit(worker(args))
    if args.table_only:
        (HERE / "fsdp_memory.md").write_text(markdown(json.loads((HERE / "fsdp_memory.json").read_text())))
        sys.exit()
    if args.malloc_only:
        results = json.loads((HERE / "fsdp_memory.json").read_text())
    runs = results["runs"] if args.malloc_only else {}
    for world in WORLD_SIZES:
        for kind in ("ddp", "fsdp"):  # memory again, glibc's mmap threshold fixed (fresh processes, as above)
            print(f"{kind} at {world} rank(s), {MALLOC}", flush=True)
            runs[f"{kind}{world}-malloc"] = launch(args, world, kind, MALLOC_MMAP_THRESHOLD_="131072")
    for world in WORLD_SIZES if not args.malloc_only else ():
        for kind in ("ddp", "fsdp", "pair"):
            print(f"{kind} at {world} rank(s){' (4 processes on 2 cores: oversubscribed)' if world == 4 else ''}",
                  flush=True)
            runs[f"{kind}{world}"] = launch(args, world, kind)
    model = step04.build_model(args.model, 10)
    units = [sum(p.numel() for p in child.parameters()) for child in model]
    if not args.malloc_only:
        results = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "model": args.model,
                   "parameters": sum(units), "largest_unit": max(units),
                   "batch_size": args.batch_size, "cpus": os.cpu_count(), "args": vars(args), "runs": runs}
    (HERE / "fsdp_memory.json").write_text(json.dumps(results, indent=1))
    (HERE / "fsdp_memory.md").write_text(markdown(results))
    print((HERE / "fsdp_memory.md").read_text())
