"""Exercise 05_fsdp: train a small model on 2 processes with FSDP2, each rank holding only its pieces of it.

  .venv/bin/torchrun --standalone --nproc_per_node=2 exercises/05_fsdp/train.py --out /tmp/fsdp

Every rank builds the same model from the same seed and trains it on its half of each step's global batch.
"""
import argparse
import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

STEPS, GLOBAL_BATCH = 5, 16


def build_model():
    """Given: three layers; every rank builds the same weights from the seed."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def make_optimizer(parameters):
    return torch.optim.SGD(parameters, lr=0.05, momentum=0.9)  # given


def global_batch(step):
    """Given: the whole step's batch (inputs, targets), the same on every rank; each rank trains on its rows."""
    inputs = torch.randn(GLOBAL_BATCH, 16, generator=torch.Generator().manual_seed(step))
    return inputs, inputs[:, :4] * 2 - inputs[:, 4:8]


def whole_state(model):
    """Every parameter whole (plain tensors, the plain model's names), on every rank."""
    return model.state_dict()  # TODO(exercise): a sharded model's state_dict() holds this rank's pieces only


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="given: a folder for the check (losses, pieces, weights)")
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    model = build_model()
    # TODO(exercise): shard the model with FSDP2: each layer that has parameters, then the whole model
    optimizer = make_optimizer(model.parameters())
    losses = []
    for step in range(STEPS):
        inputs, targets = global_batch(step)
        mine = slice(rank, None, world_size)  # every world_size-th row: together, the global batch
        loss = (model(inputs[mine]) - targets[mine]).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        logged = loss.detach().clone()  # given: the global batch's loss, for the check (equal counts per rank)
        dist.all_reduce(logged)
        losses.append(logged.item() / world_size)
    # given: what the check reads: how many elements of the parameters this rank holds, the losses, the weights
    held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
    state = whole_state(model)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"losses": losses, "elements_held": held}, f)
    torch.save(state, os.path.join(args.out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    os._exit(0)  # given: skip Python's shutdown, during which gloo's threads can abort a finished process
