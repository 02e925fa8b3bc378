"""Exercise 07: a short trainer that hangs at its end. Two ranks train a small classifier with DDP, then measure
the validation loss. Run it: torchrun --standalone --nproc_per_node=2 train.py --out /tmp/hang"""
import argparse
import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

STEPS, VALIDATION_SAMPLES = 20, 9


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))


def labelled(samples, seed, wrong_every_other=False):
    """Inputs and their class (0-2) by a fixed rule; with wrong_every_other, every second sample's class is off by
    one, samples the rule does not fit (so that the two ranks' shards differ: rank 1 gets those)."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, 4, generator=generator)
    classes = (inputs @ torch.tensor([[1.0, -1.0, 0.5], [0.5, 1.0, -1.0], [-1.0, 0.5, 1.0], [0.2, 0.2, 0.2]])).argmax(1)
    if wrong_every_other:
        classes[1::2] = (classes[1::2] + 1) % 3
    return inputs, classes


def validation_set():
    return labelled(VALIDATION_SAMPLES, seed=1, wrong_every_other=True)


def evaluate(model, inputs, targets):
    """The mean cross-entropy over the whole validation set: each rank sums its shard's losses, then the sums and
    counts of all ranks are added (exact, however uneven the shards)."""
    with torch.no_grad():
        losses = nn.functional.cross_entropy(model(inputs), targets, reduction="none")
    totals = torch.stack([losses.sum(), torch.tensor(float(len(targets)))])
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


# TODO(exercise): this run hangs after training: find which rank waits, where, and for what; then fix it so that
#                 every rank ends with the validation loss of the whole validation set
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True, help="folder for rank<N>.pt, which the check reads")
    out = parser.parse_args().out
    # a rank left waiting in a collective fails after 5 s (the default: 30 minutes) with a traceback of where
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    inputs, targets = labelled(64, seed=0)
    for _step in range(STEPS):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(inputs[rank::world_size]), targets[rank::world_size]).backward()
        optimizer.step()

    val_inputs, val_targets = validation_set()
    val_loss = None
    if rank == 0:  # one rank reports the validation loss
        val_loss = evaluate(model, val_inputs[rank::world_size], val_targets[rank::world_size])
        print(f"validation loss after {STEPS} steps: {val_loss:.4f}")

    # given: what the check reads, then every rank waits for the others before leaving
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"val_loss": val_loss, "weights": model.module.state_dict()}, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    os._exit(0)  # given: skip Python's shutdown, during which gloo's threads can abort a finished process
