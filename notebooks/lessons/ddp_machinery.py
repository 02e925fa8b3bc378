"""ddp_under_the_hood's experiments on DDP's machinery, each in a real 2-process gloo group: gradients before and after
the all-reduce, communication timed against backward (overlap), unused parameters, BatchNorm buffers, uneven inputs
and Join."""
import time

from lessons.runs import free_port


def gradients_before_and_after_all_reduce(rank, world_size):
    """Each rank's own gradient (no DDP) and the gradient DDP leaves after backward, for one small layer."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    layer = nn.Linear(6, 1)
    batch = torch.randn(8, 6, generator=torch.Generator().manual_seed(100 + rank))  # each rank its own data
    layer(batch).pow(2).mean().backward()
    local = layer.weight.grad.flatten().clone()
    layer.zero_grad()
    model = DDP(layer)
    model(batch).pow(2).mean().backward()
    averaged = model.module.weight.grad.flatten().clone()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return {"local": local, "after": averaged, "weights": model.module.weight.detach().flatten().clone()}




def wide_model(layers=6, width=1024):
    """Linear layers big enough that communicating their gradients takes measurable time."""
    from torch import nn

    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])


def communication_timings(rank, world_size, repeats=15):
    """Milliseconds per round, for `repeats` rounds in which every measurement runs once, interleaved (so that
    drifts of this shared machine's speed hit all alike), on 2 ranks with the same model and weights:
    backward() through DDP with no communication (a hook that hands each bucket back: DDP's machinery alone;
    timed twice, the two differ by the machine's noise); backward() through DDP's own asynchronous all-reduce
    (overlap), also with bucket_cap_mb=5 and with the bf16 compression hook; and, without any backward, the
    all-reduces of the same buckets alone, all of them and all but the last one handed over (the only ones
    that have computation left to hide behind: the bound on what overlap can hide). Also the buckets DDP used,
    and how the bf16 hook's averaged gradients compare with the exact ones."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    def nothing(state, bucket):  # hands the bucket back unchanged: DDP's machinery without communication
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    torch.manual_seed(0)
    batch = torch.randn(64, 1024, generator=torch.Generator().manual_seed(rank))  # each rank its own data
    weights = wide_model().state_dict()
    setups = {"no communication": ({}, nothing), "DDP (overlapped)": ({}, None),
              "DDP, bucket_cap_mb=5": ({"bucket_cap_mb": 5}, None),
              "DDP + bf16 compression hook": ({}, bf16_compress_hook)}
    models = {}
    for mode, (options, hook) in setups.items():
        model = wide_model()
        model.load_state_dict(weights)  # the same weights everywhere: only the communication differs
        models[mode] = DDP(model, **options)
        if hook:
            models[mode].register_comm_hook(dist.group.WORLD, hook)
    models["no communication (again)"] = models["no communication"]

    def backward(mode):
        model = models[mode]
        model.zero_grad(set_to_none=True)
        loss = model(batch).pow(2).mean()
        dist.barrier()  # both ranks start together
        began = time.perf_counter()
        loss.backward()
        return 1000 * (time.perf_counter() - began)

    for _ in range(2):  # warm-up: DDP rebuilds its buckets after the first iteration
        for mode in models:
            backward(mode)
    ddp_modes = ("DDP (overlapped)", "DDP, bucket_cap_mb=5")
    sizes = {}  # bytes per bucket, in the order the buckets are handed over: read by a recording hook
    for mode in ddp_modes:
        probe, seen = DDP(wide_model(), **setups[mode][0]), []

        def record(state, bucket, seen=seen):
            seen.append(bucket.buffer().numel() * bucket.buffer().element_size())
            return nothing(state, bucket)

        probe.register_comm_hook(None, record)
        for _ in range(2):  # the second iteration uses the rebuilt buckets, as the timed models do
            seen.clear()
            probe(batch).pow(2).mean().backward()
        sizes[mode] = list(seen)
    buffers = {mode: [torch.ones(size // 4) for size in sizes[mode]] for mode in ddp_modes}

    def all_reduce_alone(mode, but_last=False):  # the buckets' all-reduces, launched as DDP launches them
        chosen = buffers[mode][:-1] if but_last else buffers[mode]
        dist.barrier()
        began = time.perf_counter()
        for work in [dist.all_reduce(buffer, async_op=True) for buffer in chosen]:
            work.wait()
        return 1000 * (time.perf_counter() - began)

    measurements = {**{mode: (lambda mode=mode: backward(mode)) for mode in models},
                    **{f"all-reduce alone, {mode}'s buckets": (lambda mode=mode: all_reduce_alone(mode))
                       for mode in ddp_modes},
                    **{f"all-reduce alone, {mode}'s buckets but the last": (
                        lambda mode=mode: all_reduce_alone(mode, but_last=True)) for mode in ddp_modes}}
    for measure in measurements.values():  # warm-up of the all-reduces too
        measure()
    rounds = {name: [] for name in measurements}
    for _ in range(repeats):
        for name, measure in measurements.items():  # interleaved: one of each per round
            rounds[name].append(measure())
    exact = [p.grad.clone() for p in models["DDP (overlapped)"].parameters()]
    compressed = list(models["DDP + bf16 compression hook"].parameters())
    relative = max(((c.grad - e).abs().max() / e.abs().max()).item() for c, e in zip(compressed, exact, strict=True))
    return {"rounds": rounds, "buckets_mb": {mode: [size / 2**20 for size in sizes[mode]] for mode in ddp_modes},
            "parameters": sum(p.numel() for p in exact), "bf16_relative_error": relative,
            "bf16_identical": all(torch.equal(c.grad, e) for c, e in zip(compressed, exact, strict=True)),
            "bf16_gradients": [c.grad.clone() for c in compressed]}  # every parameter's, to compare across ranks


def two_heads():
    """A model whose forward uses only one of its two heads."""
    from torch import nn

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)

        def forward(self, x):
            return self.used(self.body(x))  # self.unused takes no part in the loss

    return Model()


def unused_parameters(rank, world_size):
    """Two training steps of two_heads() under DDP with each option: 'ok', or the error DDP raises."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    outcomes = {}
    for name, options in {"DDP(model)": {}, "find_unused_parameters=True": {"find_unused_parameters": True},
                          "static_graph=True": {"static_graph": True}}.items():
        torch.manual_seed(0)
        model, step = DDP(two_heads(), **options), 0
        try:
            while step < 2:
                step += 1
                model(torch.randn(3, 4)).sum().backward()
            outcomes[name] = "2 steps, ok"
        except RuntimeError as error:  # raised by each rank itself, before any collective: the group stays usable
            outcomes[name] = f"step {step}: RuntimeError: {str(error).splitlines()[0][:150]}..."
    return outcomes


def batchnorm_buffers(rank, world_size):
    """BatchNorm under DDP, each rank with data of its own: the running mean after each of two forwards, the
    batch statistics each rank used, and BatchNorm's output against one process normalising both ranks'
    samples together; then the same with the mean and variance all-reduced over the ranks (what SyncBatchNorm
    does on GPUs), and what SyncBatchNorm says on a CPU."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))
    data = [torch.randn(4, 3, generator=torch.Generator().manual_seed(10 * rank + step)) + 3 * rank
            for step in range(2)]
    running, batch_means = [], []
    for batch in data:
        model(batch)  # in training mode DDP first copies rank 0's buffers to every rank, then BatchNorm runs
        running.append(model.module[1].running_mean.clone())
        batch_means.append(model.module[0](batch).detach().mean(0))  # what this rank's BatchNorm averaged
    features = torch.randn(4, 3, generator=torch.Generator().manual_seed(100 + rank)) + 3 * rank
    everyone = [torch.zeros(4, 3) for _ in range(world_size)]
    dist.all_gather(everyone, features)
    reference = nn.BatchNorm1d(3)(torch.cat(everyone))[4 * rank:4 * rank + 4]  # one process, all 8 samples
    local = nn.BatchNorm1d(3)(features)  # this rank's 4 samples only, as BatchNorm does under DDP
    sums = torch.stack([features.sum(0), features.pow(2).sum(0), torch.full((3,), 4.0)])
    dist.all_reduce(sums)  # SyncBatchNorm's idea: statistics of every rank's samples
    mean = sums[0] / sums[2]
    synced = (features - mean) / (sums[1] / sums[2] - mean**2 + 1e-5).sqrt()
    try:
        nn.SyncBatchNorm(3)(features)
        sync_on_cpu = "ran"
    except ValueError as error:
        sync_on_cpu = f"ValueError: {error}"
    return {"running": running, "batch_means": batch_means, "local_vs_one_process": (local - reference).abs().max(),
            "synced_vs_one_process": (synced - reference).abs().max(), "sync_batchnorm_on_cpu": sync_on_cpu}


def uneven_inputs(rank, world_size, use_join):
    """Rank 0 has 3 batches, rank 1 has 2 (an uneven split). Without Join, rank 0's third backward waits for
    an all-reduce rank 1 never joins; with Join, rank 1 shadows it. Returns what happened and, with Join, the
    final weights."""
    import contextlib

    import torch
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    began, step = time.monotonic(), 0
    try:
        with Join([model]) if use_join else contextlib.nullcontext():
            while step < 3 - rank:
                step += 1
                optimizer.zero_grad()
                model(torch.randn(8, 4)).pow(2).mean().backward()
                optimizer.step()
    except RuntimeError as error:
        return {"outcome": f"rank {rank}, step {step}, after {time.monotonic() - began:.0f} s: "
                           f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"}
    outcome = f"rank {rank}: finished its {3 - rank} steps after {time.monotonic() - began:.1f} s"
    if not use_join:  # rank 1 goes on with its next work (validation, say) while rank 0 still waits; its process
        # stays in the group until rank 0 is done too (run_group: the ranks leave together)
        outcome += ", then left the loop (its process stays in the group, as one busy with other work would)"
    return {"outcome": outcome, "weights": model.module.weight.detach().clone()}


def under_the_hood(rank, world_size):
    """Every 2-process experiment of ddp_under_the_hood.ipynb, one after the other in one group (starting
    processes costs seconds). The uneven inputs without Join come last: they break the group on purpose."""
    return {"averaging": gradients_before_and_after_all_reduce(rank, world_size),
            "timings": communication_timings(rank, world_size),
            "unused": unused_parameters(rank, world_size),
            "batchnorm": batchnorm_buffers(rank, world_size),
            "join": uneven_inputs(rank, world_size, use_join=True),
            "no_join": uneven_inputs(rank, world_size, use_join=False)}


def single_process_group():
    """A gloo group of one process, in this notebook's own process: enough for DDP to build its buckets and call
    its hooks, in milliseconds instead of the seconds it takes to start processes."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
