"""Peak memory per rank while step 05's model is built and sharded: the whole model built on every rank, then
fully_shard (what 05 did until 2026-11-28), against 05's way now: built on the meta device, sharded, to_empty, and
the weights sent from rank 0's one whole build (set_model_state_dict with broadcast_from_rank0).

    .venv/bin/python benchmarks/fsdp_build_memory.py            # about a minute on 2 cores: model wide, 2 ranks
    .venv/bin/python benchmarks/fsdp_build_memory.py --model wide-256 --repeats 1   # a quick check

Each (way, repeat) runs in fresh processes (2 gloo ranks, mp.spawn), since a process's peak RSS never goes down
by itself: each rank writes 5 to /proc/self/clear_refs (Linux: the peak set to the present RSS) once the group
is formed, builds, and reads its peak (VmHWM) and present RSS (VmRSS) after. glibc's mmap threshold is fixed
(MALLOC_MMAP_THRESHOLD_=131072), so that freed tensors go back to the system rather than staying in the heap.
On a CPU the host memory and the device memory are the same, so rank 0's whole build counts against it here; on
a GPU it is in host memory and only the pieces are on the GPU.
Writes benchmarks/fsdp_build_memory.json (raw) and benchmarks/fsdp_build_memory.md (made from the json).
"""
import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MB = 2**20
WAYS = {"eager": "built whole on every rank, then fully_shard",
        "meta": "meta device, fully_shard, to_empty, weights from rank 0's whole build"}


def memory():  # (present, peak) resident set of this process, in bytes
    status = Path("/proc/self/status").read_text()
    return tuple(int(status.split(f"{key}:")[1].split()[0]) * 1024 for key in ("VmRSS", "VmHWM"))


def worker(rank, port, model_name, way, results):
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    spec = importlib.util.spec_from_file_location("step05", HERE.parent / "05_fsdp.py")
    step05 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step05)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
    before, _ = memory()
    torch.manual_seed(0)
    if way == "eager":
        model = step05.build_model(model_name, 10)
    else:
        with torch.device("meta"):
            model = step05.build_model(model_name, 10)
    for layer in model.children():
        if list(layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if way == "meta":
        model.to_empty(device="cpu")
        set_model_state_dict(model, step05.build_model(model_name, 10).state_dict() if rank == 0 else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    after, peak = memory()
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    held = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    results.put({"rank": rank, "way": way, "whole_MB": whole / MB, "own_pieces_MB": held / MB,
                 "peak_over_before_MB": (peak - before) / MB, "held_after_over_before_MB": (after - before) / MB})
    dist.destroy_process_group()


def run_once(model_name, way):
    """One (way) in fresh processes: a child Python with the fixed mmap threshold, which spawns the 2 ranks."""
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import fsdp_build_memory as b; "
            f"b.spawn({model_name!r}, {way!r})")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
    if result.returncode != 0:
        sys.exit(result.stdout[-2000:] + result.stderr[-2000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def spawn(model_name, way):
    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(port, model_name, way, results), nprocs=2)
    print(json.dumps(sorted((results.get() for _ in range(2)), key=lambda r: r["rank"])))


def spread(runs, key):
    values = [entry[key] for entry in runs]
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def table(raw):
    lines = ["# Peak memory while step 05's model is built and sharded\n",
             f"Measured {raw['date']} by benchmarks/fsdp_build_memory.py: torch {raw['torch']}, {raw['cpus']} CPU "
             f"cores, 2 gloo ranks, model {raw['model']}, MALLOC_MMAP_THRESHOLD_=131072; {raw['repeats']} "
             "fresh runs of each way, interleaved; MB = 2^20 bytes. The bounds: the whole model's weights, and "
             "one rank's pieces of them. On this CPU, host and device memory are one: rank 0's whole build counts "
             "here, where on a GPU it would be in host memory.\n",
             "| way | rank | whole model | its pieces | peak over before: median (min-max) | held after over before: "
             "median (min-max) |", "|---|---|---|---|---|---|"]
    for way, words in WAYS.items():
        for rank in (0, 1):
            runs = [entry for entry in raw["runs"] if entry["way"] == way and entry["rank"] == rank]
            lines.append(f"| {way}: {words} | {rank} | {runs[0]['whole_MB']:.1f} | {runs[0]['own_pieces_MB']:.1f} | "
                         f"{spread(runs, 'peak_over_before_MB')} | {spread(runs, 'held_after_over_before_MB')} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="wide")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import time

    import torch

    raw = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "cpus": os.cpu_count(), "model": args.model,
           "repeats": args.repeats, "runs": []}
    for repeat in range(args.repeats):
        for way in WAYS if repeat % 2 == 0 else reversed(WAYS):  # interleaved, the order alternating
            raw["runs"] += run_once(args.model, way)
    (HERE / "fsdp_build_memory.json").write_text(json.dumps(raw, indent=1) + "\n")
    (HERE / "fsdp_build_memory.md").write_text(table(raw))
    print(table(raw))


if __name__ == "__main__":
    main()
