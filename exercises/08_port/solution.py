"""Exercise 08: port this single-device training script to DDP under torchrun. A small classifier, SGD with
momentum, gradient clipping, and the validation loss at the end. Run it:
torchrun --standalone --nproc_per_node=2 train.py --batch-size 8 --out /tmp/port"""
import argparse
import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

TRAIN_SAMPLES, VALIDATION_SAMPLES = 256, 9


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 3))


def labelled(samples, seed, wrong_every_other=False):
    """Inputs and their class (0-2) by a fixed rule; with wrong_every_other, every second sample's class is off by
    one: samples the rule does not fit, so that the two halves of the validation set differ."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, 4, generator=generator)
    classes = (inputs @ torch.tensor([[1.0, -1.0, 0.5], [0.5, 1.0, -1.0], [-1.0, 0.5, 1.0], [0.2, 0.2, 0.2]])).argmax(1)
    if wrong_every_other:
        classes[1::2] = (classes[1::2] + 1) % 3
    return inputs, classes


def validation_set():
    return labelled(VALIDATION_SAMPLES, seed=1, wrong_every_other=True)


def get_batch(data, indices, seen):
    """The samples at `indices`; given: it records them, for the check."""
    seen.append(indices.tolist())
    return data[0][indices], data[1][indices]


def evaluate(model, inputs, targets):
    """The mean cross-entropy per sample of the validation set."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    with torch.no_grad():
        losses = nn.functional.cross_entropy(model(inputs[rank::world_size]), targets[rank::world_size],
                                             reduction="none")
    totals = torch.stack([losses.sum(), torch.tensor(float(losses.numel()))])
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=16, help="samples per step (per process)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--grad-clip", type=float, default=0.5, help="largest gradient norm")
    parser.add_argument("--out", type=Path, required=True, help="folder for rank<N>.pt, which the check reads")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=15))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    train = labelled(TRAIN_SAMPLES, seed=0)
    seen, norms = [], []
    for step in range(args.steps):
        first = step * args.batch_size * world_size
        indices = (torch.arange(first, first + args.batch_size * world_size) % TRAIN_SAMPLES)[rank::world_size]
        inputs, targets = get_batch(train, indices, seen)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip).item())
        optimizer.step()
    val_inputs, val_targets = validation_set()
    val_loss = evaluate(model, val_inputs, val_targets)
    if rank == 0:
        print(f"validation loss after {args.steps} steps: {val_loss:.4f}")

    # given: what the check reads (RANK: torchrun's rank of this process)
    args.out.mkdir(parents=True, exist_ok=True)
    weights = {name.removeprefix("module."): tensor for name, tensor in model.state_dict().items()}
    torch.save({"seen": seen, "grad_norms": norms, "val_loss": val_loss, "weights": weights},
               args.out / f"rank{os.environ.get('RANK', '0')}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    os._exit(0)  # given: skip Python's shutdown, during which gloo's threads can abort a finished process
