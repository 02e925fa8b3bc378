"""Exercise 11_tensor_parallel: a transformer block's MLP split across the processes by hand, as gpt_tp.py's
ColwiseParallel and RowwiseParallel split it: each process holds its share of the hidden units, computes its part of
the output, and the parts are summed across the processes, in forward and, for the layer before, in backward.

  .venv/bin/torchrun --standalone --nproc_per_node=2 exercises/11_tensor_parallel/train.py --out /tmp/tp
"""
import argparse
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

FEATURES, WIDTH, HIDDEN = 8, 16, 64  # the input's features, the model's width, the MLP's hidden units (4 x WIDTH)
STEPS, BATCH, LR = 5, 8, 0.1  # plain SGD: a gradient twice too large is a step twice too long


class Model(nn.Module):
    """Given: an input layer, a residual MLP (a transformer block's: WIDTH -> HIDDEN -> WIDTH), an output layer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(FEATURES, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, WIDTH))
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x):
        h = self.embed(x)
        h = h + self.mlp(h)
        return self.out(h)


def build():
    """Given: the whole model, the same weights in every process (and in the check's one process)."""
    torch.manual_seed(0)
    return Model()


def batch(step):
    """Given: the step's inputs and targets. Every process reads the same ones: the processes that split a layer
    compute one forward together."""
    generator = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, FEATURES, generator=generator), torch.randn(BATCH, 1, generator=generator)


class CopyToRanks(torch.autograd.Function):
    """Where the split MLP begins: every process takes the whole input."""

    @staticmethod
    def forward(ctx, x):
        # TODO(exercise): what does each process need of x, and does anything have to be sent?
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # TODO(exercise): this process's gradient of x covers only its own hidden units
        return grad


class SumOverRanks(torch.autograd.Function):
    """Where the split MLP ends: each process holds a partial output, its hidden units' share."""

    @staticmethod
    def forward(ctx, partial):
        # TODO(exercise): the output is the sum of every process's partial output
        return partial.clone()

    @staticmethod
    def backward(ctx, grad):
        # TODO(exercise): what is the gradient of each part of a sum, and where is it already?
        return grad


class SplitMLP(nn.Module):
    """This process's share of `mlp` (Linear(WIDTH, HIDDEN), GELU, Linear(HIDDEN, WIDTH)): hidden units
    rank x HIDDEN / world_size up to the next rank's."""

    def __init__(self, mlp, rank, world_size):
        super().__init__()
        # TODO(exercise): keep only this process's share of the hidden units (as written, every process keeps the
        # whole MLP and computes all of it)
        self.mlp = mlp

    def forward(self, x):
        # TODO(exercise): this process's hidden units only, the parts summed across the processes (CopyToRanks,
        # SumOverRanks above)
        return self.mlp(x)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="given: a folder for the check")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("start it with torchrun: .venv/bin/torchrun --standalone --nproc_per_node=2 " + __file__)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    model = build()
    model.mlp = SplitMLP(model.mlp, rank, world_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        inputs, targets = batch(step)
        loss = F.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    # given: what the check reads: the losses, the MLP's numbers this process holds, the layers every process holds
    record = {"losses": losses, "mlp_elements": sum(p.numel() for p in model.mlp.parameters()),
              "whole_layers": {name: p.tolist() for name, p in model.named_parameters()
                               if name.startswith(("embed.", "out."))}}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    os._exit(0)  # given: skip Python's shutdown, during which gloo's threads can abort a finished process
