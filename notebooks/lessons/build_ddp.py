"""build_ddp_yourself's experiments: DDP built in steps (naive; a hook per parameter; buckets: lessons.my_ddp.MyDDP),
each run in real gloo groups and compared with torch's DistributedDataParallel; the classic mistakes; no_sync; the
unused-parameter hang; and the step times of each version beside their bounds."""
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.functional import cross_entropy
from torch.nn.parallel import DistributedDataParallel as DDP

from lessons.my_ddp import MyDDP

sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _verdict  # noqa: E402  benchmarks/_verdict.py: the one rule for a verdict word (the spread decides)

CAP_MB = 10_000 / 2**20  # 10,000 bytes: the small model below falls into two buckets
STEPS = 4


def small_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def batch(step, rank, size=8, features=32):
    """Each rank its own batch at each step, the same on every run."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(size, features, generator=generator), torch.randint(0, 10, (size,), generator=generator)


class NaiveDDP(nn.Module):
    """Step 1. At wrap, rank 0's parameters and buffers to every rank; after backward(), sync_gradients():
    every gradient summed across ranks, one blocking all-reduce per parameter, then divided by the world size."""

    def __init__(self, module, broadcast=True, divide=True):
        super().__init__()
        self.module, self.divide = module, divide
        if broadcast:
            for tensor in [*module.parameters(), *module.buffers()]:
                dist.broadcast(tensor.detach(), src=0)

    def forward(self, *inputs):
        return self.module(*inputs)

    def sync_gradients(self):
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)  # blocking: the sum over ranks, in place
                if self.divide:
                    p.grad.div_(dist.get_world_size())


class HookDDP(NaiveDDP):
    """Step 2. The same broadcast; during backward, a hook per parameter starts an asynchronous all-reduce of
    its gradient (times 1/world size) the moment it is ready; sync_gradients() waits for all of them and
    copies the averages into .grad."""

    def __init__(self, module):
        super().__init__(module)
        self.pending = []
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._gradient_ready)

    def _gradient_ready(self, p):
        averaged = p.grad.mul(1 / dist.get_world_size())  # a copy: .grad stays this rank's until the wait
        self.pending.append((dist.all_reduce(averaged, async_op=True), averaged, p))

    def sync_gradients(self):
        for work, averaged, p in self.pending:
            work.wait()
            p.grad.copy_(averaged)
        self.pending = []


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def gather(tensor):
    copies = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, tensor)
    return copies


def train(model, rank, steps=STEPS, warm_up=False, step_before_sync=False):
    """SGD with momentum on each rank's own batches; returns the parameters. warm_up: one throwaway
    forward/backward first (gradients discarded, no step), after which torch's DDP has rebuilt its buckets."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if warm_up:
        inputs, labels = batch(99, rank)
        cross_entropy(model(inputs), labels).backward()
        getattr(model, "sync_gradients", lambda: None)()
        optimizer.zero_grad()
    for step in range(steps):
        inputs, labels = batch(step, rank)
        cross_entropy(model(inputs), labels).backward()
        if step_before_sync:  # the classic mistake: the step reads .grad before the all-reduce is in
            optimizer.step()
        getattr(model, "sync_gradients", lambda: None)()
        if not step_before_sync:
            optimizer.step()
        optimizer.zero_grad()
    return flat(model)


def compare(mine, theirs):
    """What the lesson reports of two parameter vectors: bitwise equal? how many elements differ, by how much?"""
    return {"bitwise": torch.equal(mine, theirs), "differ": int((mine != theirs).sum()), "of": mine.numel(),
            "max_abs": float((mine - theirs).abs().max())}


def torch_buckets(ddp):
    """torch's bucket layout, from the DDP logger (after its rebuild): sizes in bytes, parameter indices."""
    data = ddp._get_ddp_logging_data()
    return {key: data.get(key) for key in ("bucket_sizes", "rebuilt_bucket_sizes", "rebuilt_per_bucket_param_indices")}


def my_buckets(model):
    index = {p: i for i, p in enumerate(model.module.parameters())}
    return {"sizes": [sum(p.numel() * p.element_size() for p in b) for b in model.buckets],
            "indices": [[index[p] for p in b] for b in model.buckets]}


def equality(rank, world_size):
    """The from-scratch versions and torch's DDP, trained on the same batches, compared tensor by tensor."""
    ddp = DDP(small_model(), bucket_cap_mb=CAP_MB)
    reference = train(ddp, rank, warm_up=True)  # torch's rebuilt buckets from the first compared step on
    mine = MyDDP(small_model(), bucket_cap_mb=CAP_MB)
    results = {"torch buckets": torch_buckets(ddp), "my buckets": my_buckets(mine),
               "buckets (MyDDP)": compare(train(mine, rank, warm_up=True), reference),
               "buckets, torch without warm-up": compare(
                   train(MyDDP(small_model(), bucket_cap_mb=CAP_MB), rank, warm_up=True),
                   train(DDP(small_model(), bucket_cap_mb=CAP_MB), rank)),
               "buckets, torch's default cap": compare(
                   train(MyDDP(small_model(), bucket_cap_mb=CAP_MB), rank, warm_up=True),
                   train(DDP(small_model()), rank, warm_up=True)),
               "naive": compare(train(NaiveDDP(small_model()), rank, warm_up=True), reference),
               "hook per parameter": compare(train(HookDDP(small_model()), rank, warm_up=True), reference)}
    return results


def division_orders(rank, world_size):
    """One backward's gradients averaged three ways, each over torch's own bucket layout, against DDP's (default
    options); and DDP's other paths (a reference comm hook, batched_grad_copy, a kept bucket view) against it."""
    ddp = DDP(small_model(), bucket_cap_mb=CAP_MB)
    train(ddp, rank, steps=0, warm_up=True)
    inputs, labels = batch(0, rank)
    cross_entropy(ddp(inputs), labels).backward()
    local = small_model()
    cross_entropy(local(inputs), labels).backward()
    buckets = MyDDP(local, bucket_cap_mb=CAP_MB).buckets  # the same layout as torch's (shown by equality())
    orders = {"x 1/world size, then sum": lambda t: t.mul_(1 / world_size),
              "/ world size, then sum": lambda t: t.div_(world_size), "sum, then / world size": None}
    results = {}
    for name, before in orders.items():
        averaged = {}
        for bucket in buckets:
            tensor = torch.cat([p.grad.reshape(-1) for p in bucket])
            if before:
                before(tensor)
            dist.all_reduce(tensor)
            if not before:
                tensor.div_(world_size)
            averaged.update(zip(bucket, tensor.split([p.numel() for p in bucket]), strict=True))
        results[name] = compare(torch.cat([averaged[p] for p in local.parameters()]),
                                torch.cat([p.grad.reshape(-1) for p in ddp.module.parameters()]))
    # DDP's other paths against its default one: each divides (div_) instead of multiplying by 1/world size
    reference = torch.cat([p.grad.reshape(-1) for p in ddp.module.parameters()])
    hooked = DDP(small_model(), bucket_cap_mb=CAP_MB)
    hooked.register_comm_hook(None, default_hooks.allreduce_hook)
    variants = {"DDP, allreduce_hook": hooked,
                "DDP, batched_grad_copy": DDP(small_model(), bucket_cap_mb=CAP_MB, batched_grad_copy=True),
                "DDP, gradient_as_bucket_view, .grad kept": DDP(small_model(), bucket_cap_mb=CAP_MB,
                                                                 gradient_as_bucket_view=True)}
    for name, variant in variants.items():
        train(variant, rank, steps=0, warm_up=True)
        if name.endswith(".grad kept"):  # .grad becomes the bucket's view; zeroed in place, it stays one
            previous_inputs, previous_labels = batch(98, rank)
            cross_entropy(variant(previous_inputs), previous_labels).backward()
            variant.zero_grad(set_to_none=False)
        cross_entropy(variant(inputs), labels).backward()
        results[name] = compare(torch.cat([p.grad.reshape(-1) for p in variant.module.parameters()]), reference)
    scale = torch.randn(100_000, generator=torch.Generator().manual_seed(0))
    results["x * (1/3) == x / 3 on 100,000 random floats"] = float((scale * (1 / 3) == scale / 3).float().mean())
    return results


def mistakes(rank, world_size):
    """The classic mistakes, each run for real: what they do to the gradients and to the ranks' agreement."""
    results = {}
    # Forgetting to divide: the gradient is the sum over ranks, world_size times DDP's mean.
    ddp, summed = DDP(small_model()), NaiveDDP(small_model(), divide=False)
    for model in (ddp, summed):
        inputs, labels = batch(0, rank)
        cross_entropy(model(inputs), labels).backward()
        getattr(model, "sync_gradients", lambda: None)()
    ratio = torch.cat([(a.grad / b.grad).reshape(-1) for a, b in zip(summed.module.parameters(),
                                                                   ddp.module.parameters(), strict=True)])
    ratio = ratio[ratio.isfinite()]
    results["no division: gradient / DDP's"] = (float(ratio.min()), float(ratio.max()))
    results["no division: gradient == world size x DDP's, bitwise"] = torch.equal(
        torch.cat([p.grad.reshape(-1) for p in summed.module.parameters()]),
        world_size * torch.cat([p.grad.reshape(-1) for p in ddp.module.parameters()]))
    # Forgetting the broadcast at wrap: each rank initialised with its own seed keeps its own weights.
    for broadcast in (True, False):
        copies = gather(train(NaiveDDP(small_model(seed=rank), broadcast=broadcast), rank))
        results[f"broadcast={broadcast}: ranks agree after training"] = all(torch.equal(c, copies[0]) for c in copies)
    # Stepping before waiting for the all-reduces: the step uses this rank's own gradient.
    for early in (False, True):
        copies = gather(train(HookDDP(small_model()), rank, step_before_sync=early))
        results[f"step before the wait={early}: ranks agree"] = all(torch.equal(c, copies[0]) for c in copies)
    return results


def accumulation(rank, world_size, micro_batches=3, steps=2):
    """Gradient accumulation: micro_batches - 1 forward-backward passes in no_sync, one outside, then a step."""
    results = {}
    for name, model in (("torch", DDP(small_model(), bucket_cap_mb=CAP_MB)),
                        ("mine", MyDDP(small_model(), bucket_cap_mb=CAP_MB))):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        train(model, rank, steps=0, warm_up=True)
        for step in range(steps):
            for micro in range(micro_batches):
                inputs, labels = batch(10 * step + micro, rank)
                if micro < micro_batches - 1:
                    with model.no_sync():
                        cross_entropy(model(inputs), labels).backward()
                    if micro == 0 and step == 0:
                        copies = gather(model.module[0].weight.grad)
                        results[f"{name}: ranks' gradients differ inside no_sync"] = not all(
                            torch.equal(c, copies[0]) for c in copies)
                else:
                    cross_entropy(model(inputs), labels).backward()
            optimizer.step()
            optimizer.zero_grad()
        results[name] = flat(model)
    results["mine vs torch"] = compare(results.pop("mine"), results.pop("torch"))
    return results


NO_SYNC_PATTERNS = ("forward and backward inside", "forward inside, backward outside",
                    "forward outside, backward inside", "nested: forward after the inner one exits")


def no_sync_patterns(rank, world_size):
    """One backward per pattern, each from zeroed gradients, in torch's DDP and in MyDDP (both after a warm-up:
    the same buckets): did the backward sync the ranks' gradients? and are the two's gradients bitwise equal?"""
    grads, results = {}, {}
    for name, model in (("torch", DDP(small_model(), bucket_cap_mb=CAP_MB)),
                        ("mine", MyDDP(small_model(), bucket_cap_mb=CAP_MB))):
        train(model, rank, steps=0, warm_up=True)
        for pattern in NO_SYNC_PATTERNS:
            model.zero_grad()
            inputs, labels = batch(50, rank)
            if pattern == "forward and backward inside":
                with model.no_sync():
                    cross_entropy(model(inputs), labels).backward()
            elif pattern == "forward inside, backward outside":
                with model.no_sync():
                    loss = cross_entropy(model(inputs), labels)
                loss.backward()
            elif pattern == "forward outside, backward inside":
                loss = cross_entropy(model(inputs), labels)
                with model.no_sync():
                    loss.backward()
            else:
                with model.no_sync():
                    with model.no_sync():
                        pass
                    loss = cross_entropy(model(inputs), labels)  # still inside the outer no_sync
                loss.backward()
            copies = gather(model.module[0].weight.grad)
            results[f"{name}: {pattern}: synced"] = all(torch.equal(c, copies[0]) for c in copies)
            grads[name, pattern] = torch.cat([p.grad.reshape(-1) for p in model.module.parameters()])
    for pattern in NO_SYNC_PATTERNS:
        results[f"{pattern}: mine == torch's, bitwise"] = torch.equal(grads["mine", pattern], grads["torch", pattern])
    return results


def subgroup_broadcast(rank, world_size):
    """MyDDP over a group without global rank 0 (the ranks 1 and 2 of 3): each member starts from its own seed;
    after the wrap, both hold the weights of the group's first member, global rank 1."""
    members = [1, 2]
    if world_size != 3:
        return None
    group = dist.new_group(members)  # every rank of the world takes part in creating it
    if rank not in members:
        return None
    model = MyDDP(small_model(seed=rank), group=group)
    return torch.equal(flat(model), flat(small_model(seed=members[0])))


class WithExtra(nn.Module):
    """A model whose `extra` layer is used only when asked: on some ranks, some steps, it gets no gradient."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head, self.extra = nn.Linear(32, 64), nn.Linear(64, 10), nn.Linear(64, 64)

    def forward(self, inputs, use_extra=True):
        hidden = torch.relu(self.body(inputs))
        return self.head(self.extra(hidden) if use_extra else hidden)


def unused_parameter(rank, world_size):
    """The last rank skips `extra` for one step. Its bucket (the first: `extra` was registered last) never
    completes there, so that rank never launches its all-reduce; the others launch it and wait, until the
    group's collective timeout. The last rank stays in the group until they are done (run_group: the ranks
    leave together), as a rank busy with anything else would: its exit would end the others' wait early. Breaks
    the group: run it last. First, the same case in torch's DDP with find_unused_parameters=True, 3 steps: does it
    complete, does it rebuild its buckets?"""
    ddp = DDP(WithExtra(), bucket_cap_mb=CAP_MB, find_unused_parameters=True)
    began = time.perf_counter()
    for step in range(3):
        inputs, labels = batch(step, rank)
        cross_entropy(ddp(inputs, use_extra=rank != world_size - 1), labels).backward()
    torch_run = {"seconds": time.perf_counter() - began, **torch_buckets(ddp)}
    model = MyDDP(WithExtra(), bucket_cap_mb=CAP_MB)
    inputs, labels = batch(0, rank)
    began = time.perf_counter()
    try:
        cross_entropy(model(inputs, use_extra=rank != world_size - 1), labels).backward()
        outcome = "backward() returned"
    except RuntimeError as error:
        message = re.sub(r"^\[\S+\] ", "", str(error).splitlines()[0])  # gloo's source path: not this machine's
        outcome = f"{type(error).__name__}: {message[:150]}"
    seconds = time.perf_counter() - began
    return {"buckets": [[name for name, p in model.module.named_parameters() if p in set(b)] for b in model.buckets],
            "outcome": outcome, "seconds": seconds, "torch, find_unused_parameters=True": torch_run}


def lesson(rank, world_size):
    """Everything build_ddp_yourself runs in one group, the group-breaking experiment last."""
    return {"equality": equality(rank, world_size), "division": division_orders(rank, world_size),
            "mistakes": mistakes(rank, world_size), "accumulation": accumulation(rank, world_size),
            "no_sync patterns": no_sync_patterns(rank, world_size),
            "subgroup broadcast": subgroup_broadcast(rank, world_size),
            "unused": unused_parameter(rank, world_size)}


# --- Overlap, measured ---------------------------------------------------------------------------------------

TIMING_CAP_MB = 1  # a 512 x 512 weight is 1 MB: with its bias, one layer per bucket


def wide_model(layers=4, width=512):
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])


class TimelineDDP(MyDDP):
    """MyDDP that notes when each gradient arrives, when each bucket's all-reduce is launched (the arrival of
    its last gradient: flattening and launching it are part of the communication), and when it is done (a
    callback on the all-reduce's future, run by gloo's thread)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events = []

    def _gradient_ready(self, p):
        arrived, launched = time.perf_counter(), len(self.launched)
        self.events.append(("gradient", None, arrived))
        super()._gradient_ready(p)
        for index in range(launched, len(self.launched)):  # the buckets this gradient completed
            self.events.append(("launch", index, arrived))
            self.launched[index][0].get_future().then(
                lambda _, index=index: self.events.append(("done", index, time.perf_counter())))


def timings(rank, world_size, blocks=10, steps=3):
    """Milliseconds per training step (forward, backward, gradient sync, SGD step) of each version on the same
    model and batch, in `blocks` blocks of `steps` rounds; in each round every version runs one step, in an
    order rotated from round to round, so that this shared machine's drifts hit all alike. Per block, each
    version's median step. Also per block: the all-reduces of the same buckets alone (no computation), the
    communication term of the bounds. And one step's timeline of the bucketed version."""
    inputs = torch.randn(64, 512, generator=torch.Generator().manual_seed(rank))
    models = {"no communication": wide_model(), "naive": NaiveDDP(wide_model()),
              "hook per parameter": HookDDP(wide_model()),
              "buckets (MyDDP)": MyDDP(wide_model(), bucket_cap_mb=TIMING_CAP_MB),
              "torch DDP": DDP(wide_model(), bucket_cap_mb=TIMING_CAP_MB),
              "torch DDP, gradient_as_bucket_view": DDP(wide_model(), bucket_cap_mb=TIMING_CAP_MB,
                                                        gradient_as_bucket_view=True)}
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=1e-6) for name, model in models.items()}
    buffers = [torch.randn(sum(p.numel() for p in bucket)) for bucket in models["buckets (MyDDP)"].buckets]

    def step(name):
        model, optimizer = models[name], optimizers[name]
        dist.barrier()  # every rank starts the step together
        began = time.perf_counter()
        model(inputs).pow(2).mean().backward()
        getattr(model, "sync_gradients", lambda: None)()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # .grad kept: gradient_as_bucket_view's alias survives
        return 1000 * (time.perf_counter() - began)

    def communication():
        dist.barrier()
        began = time.perf_counter()
        for work in [dist.all_reduce(buffer, async_op=True) for buffer in buffers]:
            work.wait()
        return 1000 * (time.perf_counter() - began)

    measures = {**{name: (lambda name=name: step(name)) for name in models}, "communication alone": communication}
    for measure in measures.values():  # warm-up: torch's DDP rebuilds its buckets after its first iteration
        measure(), measure()
    per_block = {name: [] for name in measures}
    names = list(measures)
    for block in range(blocks):
        times = {name: [] for name in names}
        for repeat in range(steps):  # one step of each version in turn, the order rotated every time
            turn = block * steps + repeat
            for name in names[turn % len(names):] + names[:turn % len(names)]:
                times[name].append(measures[name]())
        for name in names:
            per_block[name].append(sorted(times[name])[steps // 2])
    timeline = TimelineDDP(wide_model(), bucket_cap_mb=TIMING_CAP_MB)
    for _ in range(3):  # the last step's events
        timeline.events.clear()
        dist.barrier()
        began = time.perf_counter()
        timeline(inputs).pow(2).mean().backward()
        ended = time.perf_counter()
    events = [(kind, index, 1000 * (at - began)) for kind, index, at in timeline.events]
    return {"per_block": per_block, "timeline": events, "backward_returned": 1000 * (ended - began),
            "bucket_mb": [b.numel() * 4 / 2**20 for b in buffers]}


def summary(per_block):
    """Each measure's blocks, with the bounds computed block by block: compute + communication (no overlap at
    all) and max(compute, communication) (perfect overlap)."""
    compute, comm = per_block["no communication"], per_block["communication alone"]
    return {**per_block, "bound: compute + communication": [a + b for a, b in zip(compute, comm, strict=True)],
            "bound: max(compute, communication)": [max(a, b) for a, b in zip(compute, comm, strict=True)]}


def spread(values):
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def paired(a, b):
    """a - b block by block (both measured in the same blocks, interleaved), its (median, min, max), and a word
    only where the whole interval clears zero: "below" (a faster in every block), "above", else "overlaps"."""
    median, low, high = spread([x - y for x, y in zip(a, b, strict=True)])
    return median, low, high, _verdict.verdict(low, high, 0, above="above", below="below", neither="overlaps")


WORDS = {"below": "faster in every block", "above": "slower in every block",
         "overlaps": "cannot tell"}


def pairing_helped(a, b):
    """Widths (max - min over blocks) of a - b and of a and b alone: pairing cancels a slow moment only if it
    hit both alike, and then the paired width is narrower than both raw widths."""
    def width(values):
        return max(values) - min(values)

    paired_width = width([x - y for x, y in zip(a, b, strict=True)])
    return paired_width, width(a), width(b), paired_width < min(width(a), width(b))


def timeline_verdict(events, backward_returned):
    """Which buckets' all-reduces were done before the last gradient arrived (hidden behind backward's
    computation), and how long backward() went on after the last gradient (communication waited for)."""
    last = max(at for kind, _, at in events if kind == "gradient")
    done = {index: at for kind, index, at in events if kind == "done"}
    return {"last gradient": last, "hidden": sorted(i for i, at in done.items() if at <= last),
            "not hidden": sorted(i for i, at in done.items() if at > last), "tail": backward_returned - last}


def torch_source(relative, text, occurrence=1, lines=1):
    """Where `text` is in the installed torch's `relative` file: 'torch/relative:line: the line', read now;
    with lines=n, that line and the n - 1 after it."""
    source = (Path(torch.__file__).parent / relative).read_text().splitlines()
    found = [number for number, line in enumerate(source, start=1) if text in line]
    number = found[occurrence - 1]
    text = "\n    ".join(line.strip() for line in source[number - 1:number - 1 + lines])
    return f"torch/{relative}:{number}: {text}"
