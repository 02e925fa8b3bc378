"""Exercise 06: write DDP yourself. MyDDP wraps a model as torch's DistributedDataParallel does: every rank starts
from rank 0's parameters, each gradient is averaged over the ranks during backward(), and no_sync() lets gradients
accumulate locally. Run it: torchrun --standalone --nproc_per_node=2 my_ddp.py --out /tmp/my_ddp"""
import argparse
import contextlib
import datetime
import gc
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class MyDDP(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module, self.world_size, self.sync = module, dist.get_world_size(), True
        # TODO(exercise): make every rank start from rank 0's parameters
        # TODO(exercise): give each parameter a hook, called once backward() has accumulated its .grad, that
        #                 averages .grad over the ranks (and does nothing while self.sync is False)

    def forward(self, *inputs):
        return self.module(*inputs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate .grad on this rank; the first one after it averages the sum."""
        # TODO(exercise): turn self.sync off while inside, and back to what it was on the way out
        yield


# --- given: the experiment the check reads; you need not change anything below --------------------------------
STEPS = 4


def make_model(rank):
    torch.manual_seed(rank)  # each rank its own initial weights: only the wrapper can make them agree
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def batch(rank, step):
    generator = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own data, the same in both runs
    return torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)


def backward(model, rank, step):
    inputs, targets = batch(rank, step)
    nn.functional.mse_loss(model(inputs), targets).backward()


def copies(tensors):
    return [tensor.detach().clone() for tensor in tensors]


def train(model, rank, calls):
    """STEPS steps of SGD with momentum, then one accumulated gradient: 2 micro-batches under no_sync, 1 outside."""
    optimizer, result = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), {}
    for step in range(STEPS):
        optimizer.zero_grad()
        before = calls[0]
        backward(model, rank, step)
        result.setdefault("all_reduce calls in one backward", calls[0] - before)
        result.setdefault("gradients of the first step", copies(p.grad for p in model.parameters()))
        optimizer.step()
    result["parameters after training"] = copies(model.parameters())
    optimizer.zero_grad()
    before = calls[0]
    with model.no_sync():
        for micro_batch in range(2):
            backward(model, rank, 100 + micro_batch)
    result["all_reduce calls inside no_sync"] = calls[0] - before
    result["gradients inside no_sync"] = copies(p.grad for p in model.parameters())
    before = calls[0]
    backward(model, rank, 102)
    result["all_reduce calls in the backward after no_sync"] = calls[0] - before
    result["gradients after no_sync"] = copies(p.grad for p in model.parameters())
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True, help="folder for rank<N>.pt, which the check reads")
    out = parser.parse_args().out
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=15))  # a rank left waiting fails in 15 s
    rank, calls, all_reduce = dist.get_rank(), [0], dist.all_reduce

    def counted_all_reduce(*args, **kwargs):  # the check counts your all-reduces
        calls[0] += 1
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counted_all_reduce
    model = make_model(rank)
    result = {"parameters before wrapping": copies(model.parameters())}
    mine = MyDDP(model)
    result["parameters after wrapping"] = copies(model.parameters())
    result["mine"] = train(mine, rank, calls)
    result["torch DDP objects while MyDDP trained"] = sum(
        DistributedDataParallel in type(thing).__mro__ for thing in gc.get_objects())
    dist.all_reduce = all_reduce
    result["torch"] = train(DistributedDataParallel(make_model(rank)), rank, [0])
    out.mkdir(parents=True, exist_ok=True)
    torch.save(result, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: done, wrote {out / f'rank{rank}.pt'}")


if __name__ == "__main__":
    main()
