"""Exercise 02_torchrun_env: a program that mp.spawn starts, to be started by torchrun instead (TASK.md says how).

  python hello.py                                           # today: mp.spawn starts 2 processes
  torchrun --standalone --nproc_per_node=2 hello.py         # once written: torchrun starts them

Each process joins the process group, all-reduces rank + 1 over it and says who it is. The part marked "given"
records that in --out for the check, next to what the launcher's environment says; leave it as it is.
"""
import argparse
import json
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="processes mp.spawn starts")
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


def main(rank, world_size, args):  # mp.spawn calls it in each new process, its index as `rank`
    # TODO(exercise): under torchrun, this process's rank, local rank and world size are in the environment that
    # torchrun set, and so is where the group meets: read them there (and pass no rank or size by hand)
    local_rank = rank  # all on this machine
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=args.timeout))
    work(rank, local_rank, world_size, args)
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    # TODO(exercise): let torchrun start the processes: each is then one of its workers, told who it is and where
    # the group meets by its environment, so nothing below is needed. Started without torchrun, say so in one line
    # and exit with an error.
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # under torchrun: host a store of our own, not torchrun's
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    mp.spawn(main, args=(args.nproc, args), nprocs=args.nproc)
