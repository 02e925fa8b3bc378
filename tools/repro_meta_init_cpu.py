"""Groundwork for issue 37 (step 05 built on the meta device): what a sharded initialisation gives on the CPU.

A layer built on the meta device, sharded by fully_shard over 2 gloo ranks, materialised with to_empty and
initialised with its own reset_parameters, every rank seeded alike, as the FSDP2 tutorial does on GPUs. On CUDA,
DTensor's random ops draw each shard from its place in one stream (OffsetBasedRNGTracker). On the CPU, DTensor's
dispatch finds the mesh unsupported (is_rng_supported_mesh in torch/distributed/tensor/_random.py, which warns) and
starts no tracker (torch/distributed/tensor/_dispatch.py), so each rank fills its own shard from its own
generator: with the same seed, every shard is the same numbers (shown here on an even split, 6 rows on 2 ranks).

It then asks what an initialisation that draws each layer whole from the shared seed gives (each rank would keep
its own rows of it, so no rank ever holds more than one layer whole): the model built on the meta device,
materialised with to_empty, and every layer's own reset_parameters called in the order of model.modules(), against
the same model built eagerly after the same torch.manual_seed, for step 05's three kinds of model.

Last, the other way: every rank builds the model on the meta device and shards it as step 05 does (each top-level
layer with weights, then the root), rank 0 also builds it eagerly on the CPU after the seed, as step 04 does, and
set_model_state_dict(..., StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)) sends every rank its
pieces; each rank then gathers the whole model and compares it with an eager build of its own.

    .venv/bin/python tools/repro_meta_init_cpu.py      # about a minute; prints what it found
"""
import os
import socket
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def worker(rank, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    with torch.device("meta"):
        layer = torch.nn.Linear(4, 6)
    fully_shard(layer, mesh=init_device_mesh("cpu", (2,)))
    layer.to_empty(device="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        layer.reset_parameters()
    gathered = layer.weight.full_tensor().detach()
    torch.manual_seed(0)
    unsharded = torch.nn.Linear(4, 6).weight.detach()
    if rank == 0:
        print(f"torch {torch.__version__}, 2 gloo ranks, Linear(4, 6) on the meta device, fully_shard, to_empty, "
              "reset_parameters after torch.manual_seed(0) on every rank")
        print("rank 0's rows equal rank 1's:", torch.equal(gathered[:3], gathered[3:]))
        print("the gathered weight equals the unsharded init of the same seed:", torch.equal(gathered, unsharded))
        print("rank 0's rows equal the unsharded init's first rows:", torch.equal(gathered[:3], unsharded[:3]))
        print("warnings:", sorted({str(warning.message) for warning in caught}))
    dist.destroy_process_group()


def layer_by_layer(name):
    """Step 05's model `name` built on the meta device, then every layer's reset_parameters in module order, from
    torch.manual_seed(0): how many of its tensors equal the eager build's after the same seed."""
    step05 = load_step05()
    torch.manual_seed(0)
    eager = step05.build_model(name, 10).state_dict()
    with torch.device("meta"):
        model = step05.build_model(name, 10)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for layer in model.modules():
        if hasattr(layer, "reset_parameters") and [*layer.parameters(recurse=False), *layer.buffers(recurse=False)]:
            layer.reset_parameters()
    drawn = model.state_dict()
    differ = [key for key in eager if not torch.equal(eager[key], drawn[key])]
    print(f"--model {name}: {len(eager) - len(differ)} of {len(eager)} tensors equal to the eager build"
          + (f"; the first that differs: {differ[0]}" if differ else ""))


def from_rank_0(rank, port, names):
    """Step 05's sharding of each model built on the meta device, its weights sent from rank 0's eager build."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    for name in names:
        step05 = load_step05()
        with torch.device("meta"):
            model = step05.build_model(name, 10)
        for layer in model.children():
            if list(layer.parameters()):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        whole = {}
        if rank == 0:
            torch.manual_seed(0)
            whole = step05.build_model(name, 10).state_dict()
        set_model_state_dict(model, whole, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        gathered = {key: value.full_tensor() if hasattr(value, "full_tensor") else value  # a buffer is whole
                    for key, value in model.state_dict().items()}
        torch.manual_seed(0)
        eager = step05.build_model(name, 10).state_dict()
        held = sum(parameter.to_local().numel() for parameter in model.parameters())
        print(f"rank {rank}, --model {name}: {sum(torch.equal(eager[key], gathered[key]) for key in eager)} of "
              f"{len(eager)} tensors equal to its own eager build; it holds {held:,} of "
              f"{sum(parameter.numel() for parameter in model.parameters()):,} parameter values", flush=True)
    dist.destroy_process_group()


def load_step05():
    import importlib.util

    spec = importlib.util.spec_from_file_location("step05", Path(__file__).resolve().parents[1] / "05_fsdp.py")
    step05 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step05)
    return step05


if __name__ == "__main__":
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    mp.spawn(worker, args=(free,), nprocs=2)
    print("each layer drawn whole, in module order, after torch.manual_seed(0):")
    for name in ("cnn", "wide-256", "resnet18"):
        layer_by_layer(name)
    print("on the meta device on every rank, the weights sent from rank 0's eager build (broadcast_from_rank0):")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    mp.spawn(from_rank_0, args=(free, ["cnn", "wide-256", "resnet18"]), nprocs=2)
