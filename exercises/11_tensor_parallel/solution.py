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
    """Where the split MLP begins: every process takes the whole input. Forward: nothing to send. Backward: each
    process's input gradient covers only its own hidden units; the layer before needs their sum."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)  # the sum over every process's hidden units
        return grad


class SumOverRanks(torch.autograd.Function):
    """Where the split MLP ends: each process holds a partial output (its hidden units' share); their sum is the
    output. Backward: the gradient of a sum is the same for every part, and every process already holds it whole."""

    @staticmethod
    def forward(ctx, partial):
        whole = partial.clone()
        dist.all_reduce(whole)
        return whole

    @staticmethod
    def backward(ctx, grad):
        return grad


class SplitMLP(nn.Module):
    """This process's share of `mlp` (Linear(WIDTH, HIDDEN), GELU, Linear(HIDDEN, WIDTH)): hidden units
    rank x HIDDEN / world_size up to the next rank's. The first layer split by its outputs (the rows of its weight and
    its bias: ColwiseParallel), the second by its inputs (the columns of its weight: RowwiseParallel); the second's
    bias whole on every process, added once, after the sum."""

    def __init__(self, mlp, rank, world_size):
        super().__init__()
        share = mlp[0].out_features // world_size
        mine = slice(rank * share, (rank + 1) * share)
        self.up_weight = nn.Parameter(mlp[0].weight[mine].detach().clone())
        self.up_bias = nn.Parameter(mlp[0].bias[mine].detach().clone())
        self.down_weight = nn.Parameter(mlp[2].weight[:, mine].detach().clone())
        self.down_bias = nn.Parameter(mlp[2].bias.detach().clone())

    def forward(self, x):
        x = CopyToRanks.apply(x)
        partial = F.linear(F.gelu(F.linear(x, self.up_weight, self.up_bias)), self.down_weight)
        return SumOverRanks.apply(partial) + self.down_bias


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
