"""What the benchmark programs share: 02_torchrun.py loaded as a module, so that they train its model on its
data and only the loop differs from the tutorial's; and the start every one of them makes."""
import argparse
import importlib.util
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

_spec = importlib.util.spec_from_file_location("step02", Path(__file__).resolve().parents[1] / "02_torchrun.py")
step02 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(step02)


def start():
    """Threads as benchmarks/run.py sets them (OMP_NUM_THREADS), and a gloo group from torchrun's variables."""
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    torch.manual_seed(0)


def finish():
    """Leaves the group, then the process without Python's shutdown: once DDP has used gloo's group, its threads
    outlive destroy_process_group, and one still freeing a collective's tensors as Python shuts down aborts the
    process (-6), as the scripts explain (tools/repro_gloo_exit_abort.py)."""
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def paired_steps_arguments():
    """The flags of the benchmarks that time two variants in paired, alternating steps."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=10, help="blocks of paired steps: one ratio each")
    parser.add_argument("--pairs", type=int, default=20, help="paired steps per block")
    parser.add_argument("--batch-size", type=int, default=64)
    return parser.parse_args()


def rank_batches(batch_size, count=8):
    """`count` batches of 02's synthetic images, different on every rank (seeded by the rank)."""
    data = step02.SyntheticImages(batch_size * count, seed=dist.get_rank())
    return [(torch.stack([data[i][0] for i in range(b, b + batch_size)]),
             torch.tensor([data[i][1] for i in range(b, b + batch_size)])) for b in range(0, len(data), batch_size)]
