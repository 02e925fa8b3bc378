"""Step 05's classic FSDP2 mistakes (fully_shard, torch.distributed.checkpoint), each run for real in a gloo group
of CPU processes beside its correct version: the optimizer built before fully_shard; a state dict or a collective
called on rank 0 only; torch.save of a sharded model from one rank; a sharded model read or loaded as if it held
full tensors. Each experiment is a worker(rank, world_size, ...) that returns a small dict of what happened."""
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.functional import cross_entropy
from torch.nn.parallel import DistributedDataParallel as DDP

TIMEOUT = 3  # seconds: a collective that one rank never joins ends here, with gloo's error, not never
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # full tensors, on CPU, on rank 0 only


def small_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def shard(model, mesh):
    """Like step 05: each child with parameters its own FSDP unit, then the root. (05 asks for any parameter, nested
    ones included, layer.parameters(); this asks for the child's own, recurse=False: the same units for this model,
    whose children are single layers, not for a model whose children hold only nested layers.)"""
    for child in model:
        if any(True for _ in child.parameters(recurse=False)):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(rank, size=8):
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(size, 16, generator=generator), torch.randint(0, 4, (size,), generator=generator)


def outcome(error, length=150):
    """The error's type and first line (its first `length` characters), without gloo's source path (its build
    machine's, not this one's)."""
    message = re.sub(r"^\[\S+\] ", "", str(error).splitlines()[0])
    return f"{type(error).__name__}: {message[:length]}"


def detail(error):
    """load_state_dict's first line names only the model; the second says what went wrong (the first tensor)."""
    lines = str(error).splitlines()
    if len(lines) < 2:
        return None
    copying = re.match(r"While copying the parameter named (\S+),.*an exception occurred : \('(.*)',\)",
                       lines[1].strip())
    return f"{copying[1]}: {copying[2]}" if copying else lines[1].strip()[:200]


def full(model):
    """Every parameter in full, one vector (an all-gather per parameter: every rank must call it)."""
    return torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])


# --- a. The optimizer built before fully_shard ----------------------------------------------------------------

def optimizer_order(rank, world_size, steps=3):
    """fully_shard swaps each parameter for a new DTensor Parameter: an optimizer built before it holds the old
    tensors, which no longer belong to the model, get no gradient, and so are skipped by step(): nothing moves,
    and no error says so. Built after: the loss falls."""
    mesh, inputs, labels, results = init_device_mesh("cpu", (world_size,)), *batch(rank), {}
    for order in ("before", "after"):
        model = small_model()
        if order == "before":
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        held = list(model.parameters())
        shard(model, mesh)
        if order == "after":
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        start = full(model)
        losses, optimized = [], optimizer.param_groups[0]["params"]
        for _ in range(steps):
            loss = cross_entropy(model(inputs), labels)
            loss.backward()
            got = {"optimizer's tensors": any(p.grad is not None for p in optimized),
                   "model's parameters": all(p.grad is not None for p in model.parameters())}
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        results[order] = {
            "losses": losses,
            "optimizer holds the model's parameters": all(a is b for a, b in zip(optimized, model.parameters(),
                                                                                 strict=True)),
            "optimizer's tensors": sorted({type(p).__name__ for p in optimized}),
            "model's parameters": sorted({type(p).__name__ for p in model.parameters()}),
            "parameters replaced by fully_shard": not any(a is b for a, b in zip(held, model.parameters(),
                                                                                 strict=True)),
            "got a gradient": got,
            "weights changed": not torch.equal(full(model), start)}
    return results


# --- b. A state dict or a collective on rank 0 only -------------------------------------------------------------

RANK0_CALLS = ("get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))",
               "p.full_tensor()", "dcp.save")


def rank0_only(rank, world_size, folder, call=RANK0_CALLS[0]):
    """First the correct ways: get_model_state_dict on every rank; and plain model.state_dict(), which is safe on
    rank 0 alone: its only hook reshards, locally (FSDPParamGroup._register_state_dict_hooks), and its values are
    this rank's DTensors. Then `call` made inside `if rank == 0:` while the other ranks go on to a barrier, as in
    `if rank == 0: save(...)` then `dist.barrier()`: it gathers over the mesh's group, the others never join,
    both sides wait, and the group's timeout ends both waits with gloo's error. That breaks this process's gloo
    state (even a new group's timeout leaves the default group's next barrier hanging): one call per group,
    run last, in processes of their own (helpers.run_group, not runs.Processes, which reuses its processes)."""
    mesh = init_device_mesh("cpu", (world_size,))
    model = shard(small_model(), mesh)
    began = time.perf_counter()
    gathered = get_model_state_dict(model, options=FULL)
    results = {"every rank: get_model_state_dict": {
        "seconds": time.perf_counter() - began,
        "holds": {key: (type(value).__name__, tuple(value.shape)) for key, value in gathered.items()}}}
    if rank == 0:
        began = time.perf_counter()
        local = model.state_dict()
        results["rank 0 alone: model.state_dict()"] = {
            "seconds": time.perf_counter() - began,
            "holds": {key: (type(value).__name__, tuple(value.shape), tuple(value.to_local().shape))
                      for key, value in local.items()}}
    check = torch.tensor([float(rank + 1)])
    dist.all_reduce(check)  # had state_dict() sent anything, rank 0's next collective would be out of step
    results["group in step after it"] = check.item() == world_size * (world_size + 1) / 2
    began, where = time.perf_counter(), "dist.barrier()" if rank else call
    try:
        if rank == 0:
            if call == RANK0_CALLS[0]:
                get_model_state_dict(model, options=FULL)
            elif call == RANK0_CALLS[1]:
                model[0].weight.full_tensor()
            else:
                dcp.save(model.state_dict(), checkpoint_id=Path(folder) / "rank0-only")
        dist.barrier()
        result = "returned"
    except RuntimeError as error:
        result = outcome(error)
    results[f"rank 0 alone: {call}"] = {"call": call, "waiting in": where, "outcome": result,
                                        "seconds": time.perf_counter() - began}
    return results


# --- c. torch.save of a sharded model from one rank -------------------------------------------------------------

def checkpoints(rank, world_size, folder):
    """Rank 0 torch.saves model.state_dict() (wrong: DTensors holding rank 0's shards only), and the two correct
    checkpoints: the full state dict (gathered by every rank, saved by rank 0), and DCP (every rank writes its
    shards), read back into a differently initialised sharded model. Returns the files' paths on rank 0;
    open_checkpoint reads them in any process, with or without a group."""
    folder = Path(folder)
    model = shard(small_model(), init_device_mesh("cpu", (world_size,)))
    reference = full(model)
    paths = {"sharded": folder / "sharded.pt", "full": folder / "full.pt", "dcp": folder / "dcp"}
    if rank == 0:
        torch.save(model.state_dict(), paths["sharded"])
    gathered = get_model_state_dict(model, options=FULL)  # every rank: an all-gather per tensor
    if rank == 0:
        torch.save(gathered, paths["full"])
    dcp.save(model.state_dict(), checkpoint_id=paths["dcp"])  # every rank: its own shards, plus rank 0's metadata
    fresh = shard(small_model(seed=1), init_device_mesh("cpu", (world_size,)))
    different = not torch.equal(full(fresh), reference)
    state = get_model_state_dict(fresh)
    dcp.load(state, checkpoint_id=paths["dcp"])
    set_model_state_dict(fresh, state)
    results = {"dcp: reloaded sharded model equal": different and torch.equal(full(fresh), reference)}
    if rank == 0:
        weight = torch.load(paths["sharded"])["0.weight"]
        rows = weight.to_local().shape[0]
        results.update({
            "paths": {name: str(path) for name, path in paths.items()},
            "dcp files": sorted(path.name for path in paths["dcp"].iterdir()),
            "sharded file's 0.weight": (type(weight).__name__, tuple(weight.shape), tuple(weight.to_local().shape)),
            "its local tensor is rank 0's rows": weight.to_local().equal(
                model[0].weight.full_tensor()[:rows]) and rows < weight.shape[0]})
    else:
        model[0].weight.full_tensor()  # rank 0's full_tensor above is a collective: join it
    return results


def open_checkpoint(path):
    """What another program (an evaluation script, no process group) finds in a checkpoint: a torch.save file,
    or a DCP folder (converted offline by dcp_to_torch_save), and what loading it into a plain model does."""
    path = Path(path)
    if path.is_dir():
        converted = path.with_suffix(".pt")
        dcp_to_torch_save(path, converted)
        path = converted
    state = torch.load(path)  # weights_only=True (the default) accepts DTensors
    holds = {key: (type(value).__name__, tuple(value.shape), *((tuple(value.to_local().shape),)
                                                                if isinstance(value, DTensor) else ()))
             for key, value in state.items()}
    model = small_model(seed=1)
    try:
        model.load_state_dict(state)
        loaded = "loaded"
    except RuntimeError as error:
        loaded = f"{outcome(error)} {detail(error)}"
    reference = small_model(seed=0).state_dict()
    return {"holds": holds, "load_state_dict": loaded,
            "equal to the trained model": all(torch.equal(model.state_dict()[key], reference[key])
                                              for key in reference)}


# --- d. Full (DDP or plain) views and sharded ones mixed --------------------------------------------------------

def mixed_views(rank, world_size):
    """A sharded model loaded, wrapped or read as if it held full tensors, each beside the correct way."""
    mesh = init_device_mesh("cpu", (world_size,))
    plain = small_model()
    saved = plain.state_dict()  # a plain/DDP-era checkpoint: full tensors
    ddp_saved = {f"module.{key}": value for key, value in saved.items()}  # as DDP's state_dict() names them
    results = {}
    for name, state in (("full tensors", saved), ("DDP's module. keys", ddp_saved)):
        model = shard(small_model(seed=1), mesh)
        try:
            model.load_state_dict(state)
            results[f"load_state_dict({name})"] = "loaded"
        except RuntimeError as error:
            results[f"load_state_dict({name})"] = f"{outcome(error)} {detail(error)}"
    # Correct: set_model_state_dict, the full state dict on rank 0 only, broadcast and sharded to every rank
    model = shard(small_model(seed=1), mesh)
    state = {key.removeprefix("module."): value for key, value in ddp_saved.items()} if rank == 0 else {}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    reference = torch.cat([p.detach().reshape(-1) for p in plain.parameters()])
    results["set_model_state_dict(broadcast_from_rank0): equal to the checkpoint"] = torch.equal(full(model),
                                                                                                 reference)
    # Correct too: load into the plain model, then shard it
    model = small_model(seed=1)
    model.load_state_dict(saved)
    results["load plain, then shard: equal to the checkpoint"] = torch.equal(full(shard(model, mesh)), reference)
    # DDP around a sharded model: its first act, broadcasting rank 0's parameters, meets DTensors
    try:
        DDP(shard(small_model(), mesh))
        results["DDP(sharded model)"] = "wrapped"
    except (RuntimeError, NotImplementedError) as error:
        results["DDP(sharded model)"] = outcome(error)
    # A sharded weight read as a full one: the shape is the global one, the data this rank's rows; a reduction
    # gives a Partial DTensor whose .item() is this rank's part, no collective, no warning
    weight = shard(small_model(), mesh)[0].weight
    results["weight.shape"], results["weight.to_local().shape"] = tuple(weight.shape), tuple(weight.to_local().shape)
    results["weight.sum(): placements"] = str(weight.sum().placements)
    results["weight.sum().item()"] = weight.sum().item()
    results["weight.full_tensor().sum().item()"] = weight.full_tensor().sum().item()
    results["plain model's weight.sum().item()"] = plain[0].weight.sum().item()
    return results


def meta_init(rank, world_size):
    """The model built on the meta device and sharded, then given values three ways: used before to_empty; each
    layer's own reset_parameters after to_empty (every rank seeded alike); rank 0's whole build sent out with
    set_model_state_dict (step 05's way). Returns each rank's rows of the first weight and whether the gathered
    tensors equal a whole build of the same seed."""
    import warnings

    mesh = init_device_mesh("cpu", (world_size,))
    eager = small_model(0).state_dict()  # the whole model of seed 0, as step 04 builds it on every rank

    def on_meta():
        with torch.device("meta"):
            return shard(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), mesh)

    def gathered(model):
        return all(torch.equal(value.full_tensor(), eager[key]) for key, value in model.state_dict().items())

    results = {}
    model = on_meta()
    try:
        model(torch.randn(2, 16))
        results["used before to_empty"] = "no error"
    except Exception as error:
        results["used before to_empty"] = outcome(error)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for layer in model.modules():
            if isinstance(layer, nn.Linear):
                layer.reset_parameters()
    results["reset_parameters"] = {"rows": model[0].weight.to_local().detach().clone(),
                                   "equal to the whole build": gathered(model),
                                   "warnings": sorted({str(warning.message) for warning in caught})}
    model = on_meta()
    model.to_empty(device="cpu")
    set_model_state_dict(model, small_model(0).state_dict() if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    results["from rank 0"] = {"rows": model[0].weight.to_local().detach().clone(),
                              "equal to the whole build": gathered(model)}
    return results


def lesson(rank, world_size, folder, call=RANK0_CALLS[0]):
    """Everything in one group, the group-breaking rank-0-only `call` last."""
    return {"optimizer": optimizer_order(rank, world_size), "mixed views": mixed_views(rank, world_size),
            "meta": meta_init(rank, world_size),
            "checkpoints": checkpoints(rank, world_size, folder),
            "rank 0 only": rank0_only(rank, world_size, folder, call)}
