"""What the benchmark programs share: 02_torchrun.py loaded as a module, so that they train its model on its
data and only the loop differs from the tutorial's; and the start every one of them makes."""
import importlib.util
import os
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
