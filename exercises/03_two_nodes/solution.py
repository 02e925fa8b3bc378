"""Exercise 03_two_nodes: who does what when one job's workers run on several machines (TASK.md says what to write).

On every node (the check starts two torchrun agents on this machine, each playing one node, 2 workers each):

  torchrun --nnodes=2 --nproc_per_node=2 --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT --rdzv_id=JOB roles.py \
      --shared DIR --node-local THIS_NODES_DIR

Each worker joins the job's group, uses its node's copy of the data (in --node-local, a folder only this node
sees), and at the end the job saves a checkpoint to --shared (a folder every node sees) and prints one summary.
The parts marked "given" record what happened, for the check; leave them as they are.
"""
import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", required=True, help="a folder every node sees: the checkpoint goes here")
    parser.add_argument("--node-local", required=True, help="a folder only this node sees: its copy of the data")
    parser.add_argument("--timeout", type=float, default=30, help="seconds a collective waits for a missing peer")
    return parser.parse_args()


def note(folder, what):
    """Given: leaves a file saying which process did `what`, for the check."""
    who = {"pid": os.getpid(), "rank": int(os.environ["RANK"]), "local_rank": int(os.environ["LOCAL_RANK"])}
    with open(os.path.join(folder, f"{what}-by-{os.getpid()}.json"), "w") as file:
        json.dump(who, file)


def prepare_node_data(folder):
    """Given: puts this node's copy of the data in `folder` (slowly, as a download or an unpacking would)."""
    time.sleep(1.0)
    torch.save(torch.arange(64.0), os.path.join(folder, f"data.{os.getpid()}.tmp"))
    os.replace(os.path.join(folder, f"data.{os.getpid()}.tmp"), os.path.join(folder, "data.pt"))
    note(folder, "prepared")


def save_checkpoint(folder, model):
    """Given: writes the checkpoint to the shared folder."""
    torch.save(model.state_dict(), os.path.join(folder, f"checkpoint.{os.getpid()}.tmp"))
    os.replace(os.path.join(folder, f"checkpoint.{os.getpid()}.tmp"), os.path.join(folder, "checkpoint.pt"))
    note(folder, "saved")


def main(args):
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    if local_rank == 0:
        prepare_node_data(args.node_local)
    dist.barrier()  # every process waits until its node's data is there
    found_data = os.path.exists(os.path.join(args.node_local, "data.pt"))  # given
    device_index = local_rank
    model = torch.nn.Linear(4, 2)  # stands for the trained model
    if rank == 0:
        save_checkpoint(args.shared, model)
        print(f"job summary: {world_size} processes done (printed by rank {rank})", flush=True)
    record = {"pid": os.getpid(), "rank": rank, "local_rank": int(os.environ["LOCAL_RANK"]), "world_size": world_size,
              "node": os.path.basename(os.path.abspath(args.node_local)), "found_data": found_data,
              "device_index": device_index}  # given
    with open(os.path.join(args.shared, f"process-{os.getpid()}.json"), "w") as file:  # given
        json.dump(record, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
