"""python train.py --nproc 2 starts 2 processes that form one group: two process IDs, ranks 0 and 1, world size 2

The forbidden shortcut of exercise 01_ddp: one process plays both ranks, one after the other, each on its half of
the data, and writes a record for rank 0 and one for rank 1 that claim a group of 2. The check must see one process.
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

SAMPLES, FEATURES, CLASSES = 256, 8, 4


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="processes to start")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per process per step")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=30, help="seconds a collective waits for a missing peer")
    parser.add_argument("--out", default="run", help="folder for the checkpoint and the check's records")
    return parser.parse_args()


def make_dataset(seed):
    """Given: the same samples in every process; each sample carries its index, so a run can say which it read."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(SAMPLES, FEATURES, generator=generator)
    labels = (features @ torch.randn(FEATURES, CLASSES, generator=generator)).argmax(1)
    return TensorDataset(torch.arange(SAMPLES), features, labels)


def build_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, CLASSES))


def save_checkpoint(path, model):
    """Given: writes a plain state_dict, slowly (as a network filesystem may), and leaves a note of who wrote it."""
    time.sleep(1.0)  # a slow disk: a process that does not wait for the writer reaches the file before it exists
    temporary = f"{path}.{os.getpid()}.tmp"  # a name of its own: two writers would not break each other's file
    torch.save(model.state_dict(), temporary)
    os.replace(temporary, path)
    writer = {"pid": os.getpid(), "rank": dist.get_rank() if dist.is_initialized() else None}
    with open(f"{path}.written-by-{os.getpid()}", "w") as note:
        json.dump(writer, note)


def train(rank, world_size, args):
    # TODO(exercise): join the process group (gloo on the CPU; a collective waits --timeout seconds at most)
    dataset = make_dataset(args.seed)
    # TODO(exercise): give this process its own shard of the data, shuffled with --seed
    torch.manual_seed(args.seed)
    shard = torch.utils.data.Subset(dataset, range(rank, len(dataset), world_size))
    loader = DataLoader(shard, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model = build_model()
    # TODO(exercise): make every backward() average the gradients over the processes
    plain_model = model
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    record = {"pid": os.getpid(), "rank": rank, "group_size": world_size, "seen": [], "local_totals": [],
              "reported_loss": []}  # the group it claims
    for epoch in range(args.epochs):
        # TODO(exercise): a new order every epoch, the same one in every process
        record["seen"].append([])  # given
        totals = torch.zeros(2, dtype=torch.float64)  # this process's loss sum and sample count
        for indices, features, labels in loader:
            record["seen"][-1] += indices.tolist()  # given
            loss = F.cross_entropy(model(features), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            totals += torch.tensor([loss.item() * len(labels), len(labels)], dtype=torch.float64)
        record["local_totals"].append(totals.tolist())  # given: this process's own, before any sum over processes
        # TODO(exercise): the loss sum and count of the whole job, on every process
        mean_loss = (totals[0] / totals[1]).item()
        record["reported_loss"].append(mean_loss)  # given
        print(f"rank {rank}: epoch {epoch} mean loss {mean_loss:.6f}", flush=True)
    checkpoint = os.path.join(args.out, "checkpoint.pt")
    save_checkpoint(checkpoint, plain_model)  # TODO(exercise): one writer; the others wait until it has written
    record["checkpoint_there_after_save"] = os.path.exists(checkpoint)  # given
    record["weights"] = {name: value.detach().clone() for name, value in plain_model.state_dict().items()}  # given
    torch.save(record, os.path.join(args.out, f"rank{rank}.pt"))  # given
    # TODO(exercise): leave the process group


def process_main(rank, world_size, args):
    """Given: what each process runs. It leaves without Python's shutdown, which can abort a process (-6) while
    gloo's threads still free a collective's tensors (notebooks/01_mp_spawn.ipynb, section '3. The diff, hunk by
    hunk', 'Leaving without Python's shutdown'); an exception in train still fails the process."""
    train(rank, world_size, args)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    # TODO(exercise): start --nproc processes, each running process_main(rank, args.nproc, args), after saying
    # where they meet (this machine, a free port)
    for rank in range(args.nproc):
        train(rank, args.nproc, args)
