"""Exercise 02_torchrun_env: a program that mp.spawn starts, to be started by torchrun instead (TASK.md says how).

  python hello.py                                           # today: mp.spawn starts 2 processes
  torchrun --standalone --nproc_per_node=2 hello.py         # once written: torchrun starts them

Each process joins the process group, all-reduces rank + 1 over it and says who it is. The part marked "given"
records that in --out for the check, next to what the launcher's environment says; leave it as it is.
"""
import argparse
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=30, help="seconds a collective waits for a missing peer")
    parser.add_argument("--out", default="run", help="folder for the check's records")
    return parser.parse_args()


def work(rank, local_rank, world_size, args):
    """Given: all-reduces rank + 1 over the group, says who this process is, and records it in --out next to the
    launcher's variables as this process found them."""
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    print(f"rank {rank}, local rank {local_rank}, world size {world_size}: all-reduced {total.item():g}", flush=True)
    record = {"pid": os.getpid(), "rank": rank, "local_rank": local_rank, "world_size": world_size,
              "group_size": dist.get_world_size(), "all_reduced": total.item(),
              "launcher": {name: os.environ.get(name) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}}
    with open(os.path.join(args.out, f"process-{os.getpid()}.json"), "w") as file:
        json.dump(record, file)


def main(args):
    rank, local_rank, world_size = (int(os.environ[name]) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=args.timeout))
    work(rank, local_rank, world_size, args)
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    missing = [name for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if name not in os.environ]
    if missing:  # a job script that forgot torchrun would otherwise fail later, or train alone
        sys.exit(f"error: start {sys.argv[0]} with torchrun, e.g. torchrun --standalone --nproc_per_node=2 "
                 f"{sys.argv[0]} (not set: {', '.join(missing)})")
    main(args)
