"""Exercise 01_ddp: a single-device trainer, to be made distributed with mp.spawn (TASK.md says what to write).

  python train.py                         # --nproc 2 by default: once written, two processes train together
  python train.py --nproc 1 --batch-size 32 --out run1

A tiny classifier on synthetic data, so that a run takes a second. The parts marked "given" record what the check
needs (which samples each process read, its final weights, the losses it reported) in --out; leave them as they are.
"""
import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

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
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=args.timeout))
    dataset = make_dataset(args.seed)
    sampler = DistributedSampler(dataset, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model = build_model()
    model = DDP(model)
    plain_model = model.module
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    record = {"pid": os.getpid(), "rank": rank, "group_size": dist.get_world_size()
              if dist.is_initialized() else 1, "seen": [], "local_totals": [], "reported_loss": []}  # given
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
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
        dist.all_reduce(totals)
        mean_loss = (totals[0] / totals[1]).item()
        record["reported_loss"].append(mean_loss)  # given
        print(f"rank {rank}: epoch {epoch} mean loss {mean_loss:.6f}", flush=True)
    checkpoint = os.path.join(args.out, "checkpoint.pt")
    if rank == 0:
        save_checkpoint(checkpoint, plain_model)
    dist.barrier()
    record["checkpoint_there_after_save"] = os.path.exists(checkpoint)  # given
    record["weights"] = {name: value.detach().clone() for name, value in plain_model.state_dict().items()}  # given
    torch.save(record, os.path.join(args.out, f"rank{rank}.pt"))  # given
    dist.destroy_process_group()


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
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    mp.spawn(process_main, args=(args.nproc, args), nprocs=args.nproc)
