"""01's experiments, each run in every rank of a real 2-process gloo group (runs.Processes): a barrier,
what each rank's loader samples with and without a DistributedSampler, the weights DDP broadcasts at wrap time,
the state dict of a wrapped model, and a collective only rank 0 calls."""
import time


def barrier_wait(rank, world_size):
    """Rank 1 arrives 1 s late at the barrier; every rank measures how long it waited there."""
    import torch.distributed as dist

    time.sleep(1.0 * rank)
    began = time.monotonic()
    dist.barrier()
    return round(time.monotonic() - began, 1)


def samples_seen(rank, world_size):
    """The sample indices a rank trains on in one epoch, with the seed every rank sets at start-up: with the
    single-process loader unchanged, and with a DistributedSampler."""
    import torch
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    data = list(range(16))
    torch.manual_seed(0)  # like the scripts: the same seed in every process
    plain = DataLoader(data, batch_size=4, shuffle=True)
    torch.manual_seed(0)
    sharded = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, seed=0))
    return {name: [int(i) for batch in loader for i in batch]
            for name, loader in [("without DistributedSampler", plain), ("with DistributedSampler", sharded)]}


def weights_before_and_after_wrapping(rank, world_size):
    """Each rank builds its model with a different seed; DDP(model) then makes them equal."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(rank)  # a mistake on purpose: every rank starts from different weights
    layer = nn.Linear(3, 1)
    before = layer.weight.detach().clone()
    model = DDP(layer)
    return {"before": before, "after": model.module.weight.detach().clone()}


def weights_loaded_after_wrapping(rank, world_size):
    """Rank 0 loads other weights into model.module after DDP(model) (a mistake on purpose), then each rank
    takes one SGD step on data of its own: each rank's weights before and after that step."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Linear(3, 1))
    if rank == 0:  # say, a checkpoint that only rank 0 reads, after the wrap
        model.module.load_state_dict({"weight": torch.ones(1, 3), "bias": torch.zeros(1)})
    before = model.module.weight.detach().clone()
    batch = torch.randn(8, 3, generator=torch.Generator().manual_seed(rank))
    model(batch).pow(2).mean().backward()  # DDP averages the two ranks' gradients here
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return {"before": before, "after": model.module.weight.detach().clone()}


def training_without_a_sampler(rank, world_size):
    """Mistake 1, trained: a small classifier under DDP, each process with the single-process loader and the
    same seed. The mean loss of each of 3 epochs, and whether the two ranks trained on the same batches."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset

    inputs = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(inputs, (inputs.sum(1) > 0).long())  # the same data in every process
    torch.manual_seed(0)  # like the scripts: the same seed in every process
    model = DDP(nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, same_batches = [], True
    for _ in range(3):
        total, steps = 0.0, 0
        for batch, labels in DataLoader(data, batch_size=32, shuffle=True):
            everyone = [torch.empty_like(batch) for _ in range(world_size)]
            dist.all_gather(everyone, batch)
            same_batches &= all(torch.equal(other, batch) for other in everyone)
            loss = F.cross_entropy(model(batch), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total, steps = total + loss.item(), steps + 1
        losses.append(round(total / steps, 3))
    return {"losses": losses, "same_batches": same_batches}


def state_dicts_of_a_wrapped_model(rank, world_size):
    """What model.state_dict() and model.module.state_dict() hold once the model is wrapped in DDP."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    return {"wrapped": model.state_dict(), "module": model.module.state_dict()}


def collective_on_rank_0_only(rank, world_size):
    """The classic hang: rank 0 evaluates under `if rank == 0:`, and evaluation all-reduces its totals.
    Rank 1 never calls that all_reduce: it goes on without it."""
    import torch
    import torch.distributed as dist

    began = time.monotonic()
    if rank == 0:
        try:
            dist.all_reduce(torch.zeros(3))  # what evaluate() does with its totals
        except RuntimeError as error:
            return f"rank 0 after {time.monotonic() - began:.0f} s: {type(error).__name__}: {error}"
        return "rank 0: no error"
    # rank 1 went on without it (a next collective of its own would be paired with rank 0's all_reduce: collectives
    # match by their order; when_it_breaks shows what follows). Its process stays in the group until rank 0 is
    # done too (runs.Processes: the ranks leave together), so rank 0's wait ends in its timeout
    return "rank 1: never called that all_reduce"


