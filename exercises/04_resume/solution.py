"""Exercise 04_resume: a DDP trainer that survives kill -9. Write its snapshot and its exact mid-epoch resume.

  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 --max-restarts=1 \
      exercises/04_resume/train.py --snapshot /tmp/resume/snapshot.pt --out /tmp/resume --kill-after 10

With --kill-after 10, rank 1 kills itself with SIGKILL after step 10 of the first attempt; torchrun stops rank 0
and starts both again (--max-restarts=1), and the new processes should continue from the last snapshot.
"""
import argparse
import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

SAMPLES, BATCH, EPOCHS = 96, 8, 2  # 96 samples / (8 per rank x 2 ranks) = 6 steps per epoch, 12 in all


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--snapshot", required=True, help="the snapshot file: written every --save-every steps")
    parser.add_argument("--save-every", type=int, default=4, help="optimizer steps between snapshots")
    parser.add_argument("--out", required=True, help="given: a folder for the check (the steps trained, the weights)")
    parser.add_argument("--kill-after", type=int, default=0, help="given: rank 1 dies (SIGKILL) after this step, "
                        "in the first attempt only; 0: never")
    return parser.parse_args()


def save_snapshot(path, state):
    """Writes `state` to `path` so that a process killed at any moment leaves a complete snapshot there: the
    previous one or this one, never part of one."""
    temporary = path + ".tmp"
    with open(temporary, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())  # on the disk before it replaces the old snapshot
    os.replace(temporary, path)  # atomic: anyone opening `path` sees the old file or the new one


def load_snapshot(path):
    """The snapshot at `path` (tensors, numbers, containers only: never code from the file)."""
    return torch.load(path, weights_only=True)


def main():
    args = parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    torch.manual_seed(0)  # every rank: the same initial weights, and the same dropout draws from then on
    model = DDP(nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    inputs = torch.randn(SAMPLES, 8, generator=torch.Generator().manual_seed(1))
    targets = inputs.sum(1, keepdim=True)
    steps_per_epoch = SAMPLES // (BATCH * world_size)

    start_epoch, start_batch = 0, 0
    if os.path.exists(args.snapshot):
        snapshot = load_snapshot(args.snapshot)
        model.module.load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])  # the momentum
        torch.set_rng_state(snapshot["rng"])  # dropout's next masks
        start_epoch, start_batch = snapshot["epoch"], snapshot["batches_done"]

    for epoch in range(start_epoch, EPOCHS):
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(100 + epoch))  # the epoch's shuffle
        for batch in range(start_batch if epoch == start_epoch else 0, steps_per_epoch):
            mine = order[(batch * world_size + rank) * BATCH:(batch * world_size + rank + 1) * BATCH]
            loss = (model(inputs[mine]) - targets[mine]).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            done = epoch * steps_per_epoch + batch + 1  # optimizer steps done by the whole run
            if rank == 0:  # given: which step each attempt trained, for the check
                with open(os.path.join(args.out, "steps.txt"), "a") as f:
                    f.write(f"attempt {attempt} epoch {epoch} batch {batch}\n")
            if done % args.save_every == 0:
                if rank == 0:
                    save_snapshot(args.snapshot, {"model": model.module.state_dict(),
                                                  "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
                                                  "epoch": epoch, "batches_done": batch + 1})
                dist.barrier()
            if done == args.kill_after and attempt == 0 and rank == 1:  # given: a worker lost mid-epoch
                os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:  # given: the final weights, for the check
        torch.save(model.module.state_dict(), os.path.join(args.out, "final.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    os._exit(0)  # given: skip Python's shutdown, during which gloo's threads can abort a finished process
