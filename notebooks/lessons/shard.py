"""The sharded port's lesson (notebook shard_your_model): port/gpt_fsdp.py's classic mistakes, each run for real in a
gloo group of CPU processes beside its correct version. Each worker(rank, world_size) returns a small dict of what
happened; the model is gpt_fsdp.py's own GPT class, made small (2 blocks, width 32, 16 bytes of context)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from lessons.fsdp_mistakes import outcome
from lessons.runs import load_script

SHARDED = "port/gpt_fsdp.py"
FULL = StateDictOptions(full_state_dict=True)  # whole tensors, on every rank
SIZE = {"block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32, "dropout": 0.0}


def gpt(seed=0, **extra):
    """gpt_fsdp.py's GPT, small, with the weights the seed gives (gpt_fsdp.py's own init)."""
    torch.manual_seed(seed)
    return load_script(SHARDED).GPT(**SIZE, **extra)


def shard(model, mesh, policy=None):
    """As gpt_fsdp.py: one unit per block, then the root (the embeddings, the final norm, the tied head)."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy or MixedPrecisionPolicy())
    return fully_shard(model, mesh=mesh, mp_policy=policy or MixedPrecisionPolicy())


def batch(rank, rows=4):
    """This rank's inputs and targets: random bytes, different on each rank."""
    generator = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, 256, (rows, SIZE["block_size"] + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model, inputs, targets, reduction="mean"):
    return F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten(), ignore_index=-100,
                           reduction=reduction)


def whole_gradient(model):
    """Every parameter's gradient, whole, in one flat vector (every rank must call it: it gathers)."""
    return torch.cat([p.grad.full_tensor().flatten() if hasattr(p.grad, "full_tensor") else p.grad.flatten()
                      for p in model.parameters()])


def relative(a, b):
    return ((a - b).norm() / b.norm()).item()


def meta_before_to_empty(rank, world_size):
    """A model built on the meta device and sharded, called before to_empty gave it memory."""
    mesh = init_device_mesh("cpu", (world_size,))
    with torch.device("meta"):
        model = shard(gpt(), mesh)
    try:
        model(batch(rank)[0])
        return "no error"
    except Exception as error:
        return outcome(error, 220)


def tie(rank, world_size, steps=4):
    """Is the head's matrix still the token embedding's? Built on the meta device and given memory by to_empty:
    plain, and sharded first (as gpt_fsdp.py). Then the plain one, loaded with a whole model's weights and trained
    (AdamW, as the port), and how far its two matrices drift apart step by step."""
    mesh = init_device_mesh("cpu", (world_size,))
    result = {}
    with torch.device("meta"):
        plain = gpt()
    result["on the meta device"] = plain.head.weight is plain.token.weight
    plain.to_empty(device="cpu")
    result["plain model, after to_empty"] = plain.head.weight is plain.token.weight
    with torch.device("meta"):
        sharded = shard(gpt(), mesh)
    sharded.to_empty(device="cpu")
    result["sharded first (gpt_fsdp.py), after to_empty"] = sharded.head.weight is sharded.token.weight
    plain.load_state_dict(gpt().state_dict())  # the whole model's weights: both names hold the same values
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    inputs, targets = batch(rank)
    drift = [(plain.head.weight - plain.token.weight).abs().max().item()]
    for _ in range(steps):
        loss_of(plain, inputs, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        drift.append((plain.head.weight - plain.token.weight).abs().max().item())
    result["plain: largest |head - token| after each step"] = drift
    result["plain: parameters"] = sum(p.numel() for p in plain.parameters())
    result["whole model: parameters"] = sum(p.numel() for p in gpt().parameters())
    return result


def head_as_its_own_unit(rank, world_size):
    """The head given a fully_shard of its own, before the root: what happens, and when."""
    mesh = init_device_mesh("cpu", (world_size,))
    model = gpt()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    try:
        fully_shard(model.head, mesh=mesh)
        fully_shard(model, mesh=mesh)
    except Exception as error:
        return {"when": "fully_shard", "error": outcome(error, 220)}
    still_tied = model.head.weight is model.token.weight
    try:
        model(batch(rank)[0])
    except Exception as error:
        return {"when": "the first forward", "still one parameter after fully_shard": still_tied,
                "error": outcome(error, 220)}
    return {"when": "never", "still one parameter after fully_shard": still_tied}


def norms(rank, world_size):
    """The gradient norm: of this rank's pieces alone, as clip_grad_norm_ returns it, and of one process's whole
    gradient on the same data (every rank's batch, one mean)."""
    mesh = init_device_mesh("cpu", (world_size,))
    model = shard(gpt(), mesh)
    inputs, targets = batch(rank)
    loss_of(model, inputs, targets).backward()
    pieces = torch.stack([p.grad.to_local().norm() for p in model.parameters()]).norm().item()
    returned = nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    one = gpt()  # one process, every rank's batch: the same gradient, whole
    everything = [batch(r) for r in range(world_size)]
    loss_of(one, torch.cat([i for i, _ in everything]), torch.cat([t for _, t in everything])).backward()
    whole = torch.stack([p.grad.norm() for p in one.parameters()]).norm().item()
    return {"this rank's pieces": pieces, "clip_grad_norm_ returns": type(returned).__name__,
            "its placements": str(returned.placements), ".full_tensor()": returned.full_tensor().item(),
            "one process, whole gradient": whole}


def reduce_dtypes(rank, world_size):
    """The same step's gradient under three MixedPrecisionPolicy settings, against fp32 throughout: the relative
    error of the whole gradient, and the dtype the gradient pieces are kept in; and what the bf16 reduction alone
    changes: bf16 reduce against fp32 reduce, both computing in bf16 (relative to the fp32 gradient's norm)."""
    mesh = init_device_mesh("cpu", (world_size,))
    policies = {"fp32 (no policy)": MixedPrecisionPolicy(),
                "bf16 compute, fp32 reduce (--param-dtype bf16)": MixedPrecisionPolicy(
                    param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                "bf16 compute, bf16 reduce": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                  reduce_dtype=torch.bfloat16)}
    gradients, dtypes = {}, {}
    inputs, targets = batch(rank)
    for name, policy in policies.items():
        model = shard(gpt(), mesh, policy)
        loss_of(model, inputs, targets).backward()
        gradients[name] = whole_gradient(model)
        dtypes[name] = str(next(model.parameters()).grad.dtype)
    reference = gradients["fp32 (no policy)"]
    result = {name: (relative(gradient, reference), dtypes[name]) for name, gradient in gradients.items()}
    compute_only = gradients["bf16 compute, fp32 reduce (--param-dtype bf16)"]
    result["bf16 reduce against fp32 reduce, both bf16 compute"] = (
        (gradients["bf16 compute, bf16 reduce"] - compute_only).norm().item() / reference.norm().item(), None)
    return result


def compiled_blocks(rank, world_size):
    """Each block compiled (aot_eager: captured, run by eager kernels) three ways: in place before fully_shard (as
    gpt_fsdp.py), in place after it, and replaced by torch.compile's wrapper before it. For each: the loss and
    whole gradient against the eager model's, the number of graphs compiled for the 2 blocks; and for the whole
    weights as model.state_dict() names them and as DCP's get_model_state_dict does (gpt_fsdp.py's snapshots and
    export), the first block's first name and whether a whole GPT (as gpt_single.py builds it) loads them."""
    mesh = init_device_mesh("cpu", (world_size,))
    result, eager = {}, None
    ways = ("eager", "block.compile(), then fully_shard (gpt_fsdp.py)", "fully_shard, then block.compile()",
            "blocks[i] = torch.compile(block), then fully_shard")
    for way in ways:
        torch._dynamo.reset()  # compile afresh, and count the graphs this way makes (2 blocks)
        torch._dynamo.utils.counters.clear()
        model = gpt()
        for i, block in enumerate(model.blocks):
            if way.startswith("block.compile"):
                block.compile(backend="aot_eager", fullgraph=True)
            elif way.startswith("blocks[i]"):
                model.blocks[i] = torch.compile(block, backend="aot_eager", fullgraph=True)
            fully_shard(model.blocks[i], mesh=mesh)
            if way.startswith("fully_shard"):
                block.compile(backend="aot_eager", fullgraph=True)
        fully_shard(model, mesh=mesh)
        loss = loss_of(model, *batch(rank))
        loss.backward()
        gradient = whole_gradient(model)
        eager = eager or (loss.item(), gradient)
        result[way] = {"loss equal to eager's": loss.item() == eager[0],
                       "gradient equal to eager's": torch.equal(gradient, eager[1]),
                       "graphs compiled": torch._dynamo.utils.counters["stats"]["unique_graphs"]}
        states = {"model.state_dict()": {name: value.full_tensor() for name, value in model.state_dict().items()},
                  "get_model_state_dict (gpt_fsdp.py's files)": get_model_state_dict(model, options=FULL)}
        for source, state in states.items():
            try:
                gpt().load_state_dict(state)
                loaded = "loads"
            except RuntimeError as error:
                loaded = str(error).splitlines()[1].strip()[:110]
            result[way][source] = ([n for n in state if n.startswith("blocks.0.")][0], loaded)
    return result


def mean_of_means(rank, world_size):
    """Ranks holding different numbers of targets (rank r ignores the last 6r of each window's 16, as padding):
    the gradient of each rank's mean, averaged by FSDP2, and of each rank's sum over the count of all targets (times
    the ranks, as gpt_fsdp.py), against one process's mean over every target."""
    mesh = init_device_mesh("cpu", (world_size,))

    def padded(r):
        inputs, targets = batch(r)
        targets = targets.clone()
        targets[:, SIZE["block_size"] - 6 * r:] = -100
        return inputs, targets

    everything = [padded(r) for r in range(world_size)]
    count = sum((t != -100).sum().item() for _, t in everything)
    one = gpt()
    loss_of(one, torch.cat([i for i, _ in everything]), torch.cat([t for _, t in everything])).backward()
    truth = torch.cat([p.grad.flatten() for p in one.parameters()])
    inputs, targets = everything[rank]
    result = {"targets on this rank": (targets != -100).sum().item(), "targets in all": count}
    for name in ("mean of each rank's mean", "sum / all targets x ranks (gpt_fsdp.py)"):
        model = shard(gpt(), mesh)
        if name.startswith("mean"):
            loss = loss_of(model, inputs, targets)
        else:
            loss = loss_of(model, inputs, targets, reduction="sum") * world_size / count
        loss.backward()
        result[name] = relative(whole_gradient(model), truth)
    return result


class Recomputed(nn.Module):
    """A GPT whose blocks are recomputed in backward by checkpoint(), reentrant or not."""

    def __init__(self, reentrant):
        super().__init__()
        self.gpt, self.reentrant = gpt(), reentrant

    def forward(self, tokens):
        model = self.gpt
        x = model.token(tokens) + model.position(torch.arange(tokens.shape[1]))
        for block in model.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        return model.head(model.ln(x))


def checkpointing_under_ddp(rank, world_size):
    """Activation checkpointing under DDP, two steps each: the reentrant kind with find_unused_parameters=True (the
    classic error), and the ways out."""
    ways = {"use_reentrant=True, find_unused_parameters=True": (True, {"find_unused_parameters": True}),
            "use_reentrant=True": (True, {}),
            "use_reentrant=True, static_graph=True": (True, {"static_graph": True}),
            "use_reentrant=False, find_unused_parameters=True": (False, {"find_unused_parameters": True})}
    result = {}
    inputs, targets = batch(rank)
    for name, (reentrant, options) in ways.items():
        model = DDP(Recomputed(reentrant), **options)
        try:
            for _ in range(2):
                loss_of(model, inputs, targets).backward()
            result[name] = "trains"
        except RuntimeError as error:
            result[name] = outcome(error, 220)
        dist.barrier()
    return result


def lesson(rank, world_size):
    """Every experiment above, in one group."""
    return {"meta": meta_before_to_empty(rank, world_size), "tie": tie(rank, world_size),
            "head unit": head_as_its_own_unit(rank, world_size), "norms": norms(rank, world_size),
            "reduce": reduce_dtypes(rank, world_size), "compile": compiled_blocks(rank, world_size),
            "mean of means": mean_of_means(rank, world_size), "ddp": checkpointing_under_ddp(rank, world_size)}


def frozen(rank, world_size, steps=2):
    """The exercise: the position table frozen (requires_grad False) inside the root unit, beside trainable
    parameters; AdamW given every parameter, as gpt_fsdp.py gives it. What trains, what is gathered, what moves."""
    mesh = init_device_mesh("cpu", (world_size,))
    model = gpt()
    model.position.weight.requires_grad_(False)
    try:
        shard(model, mesh)
    except Exception as error:
        return {"fully_shard": outcome(error, 220)}
    before = {name: p.full_tensor().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss_of(model, *batch(rank)).backward()
        grads = {name: p.grad is not None for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    moved = {name: not torch.equal(p.full_tensor(), before[name]) for name, p in model.named_parameters()}
    return {"position.weight": {"a DTensor": type(model.position.weight).__name__,
                                "this rank's rows": tuple(model.position.weight.to_local().shape),
                                "gradient": grads["position.weight"], "moved": moved["position.weight"]},
            "token.weight": {"gradient": grads["token.weight"], "moved": moved["token.weight"]},
            "parameters with a gradient": sum(grads.values()), "parameters": len(grads)}
