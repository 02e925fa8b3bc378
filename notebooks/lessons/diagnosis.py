"""07_when_it_breaks.ipynb: finding the stuck rank (py-spy, the Flight Recorder's dumps), reading torchrun's
failure report, and the 2-process experiments of its silent mistakes. The generic helpers (starting commands,
following logs, scrubbing paths, process pools) are in lessons.runs."""
import os
import pickle
import re
import socket
import subprocess
import sys
from pathlib import Path

from lessons.runs import REPO, scrub

PY_SPY = str(Path(sys.executable).with_name("py-spy"))
SITE = str(Path(os.__file__).parent)  # the standard library's folder, e.g. .../lib/python3.11


def tidy(text):
    """Output as it may be shown: no temporary folders, no venv or Python install prefixes, no host name."""
    import torch

    text = scrub(text).replace(str(Path(torch.__file__).parents[1]) + "/", "").replace(f"{REPO}/", "")
    text = text.replace(SITE + "/", "").replace(sys.base_prefix + "/", "")
    return re.sub(rf"\b{re.escape(socket.gethostname())}\b", "HOST", text)


def workers(agent, script):
    """The worker processes a torchrun started for `script`, by rank (each has RANK in its environment)."""
    import psutil

    found = [p for p in psutil.Process(agent.pid).children(recursive=True) if script in " ".join(p.cmdline())]
    return sorted(found, key=lambda p: int(p.environ()["RANK"]))


def py_spy_dump(pid):
    """`py-spy dump --pid PID`: the Python stack of every thread of a running process, read from outside it
    (through ptrace: it needs the permission to attach to that process)."""
    done = subprocess.run([PY_SPY, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
    return tidy(re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr))  # without its colours


def flight_records(folder):
    """{rank: the entries of that rank's Flight Recorder dump} from the files rank_0, rank_1, ... in `folder`:
    each dump is a pickle of a dict (its "entries": one per collective, oldest first)."""
    return {int(path.name.split("_")[-1]): pickle.loads(path.read_bytes())["entries"]
            for path in sorted(Path(folder).glob("rank_*"))}


def describe(entry):
    """One Flight Recorder entry as a line: sequence number, operation, tensor shapes."""
    return f"#{entry['collective_seq_id']} {entry['profiling_name']:16s} input shapes {entry['input_sizes']}"


def exit_codes(summary):
    """(rank, exit code, signal name or '') for every failure in torchrun's ChildFailedError summary."""
    return [(int(rank), int(code), name) for rank, code, name in
            re.findall(r"rank\s+: (\d+) .*\n\s+exitcode\s+: (-?\d+) \(pid: \d+\)\s*(?:\((\w+)\))?", summary)]


# --- 2-process experiments (run with runs.Processes or runs.run_group) --------------------------------------------
def mismatched_collectives_detail(rank, world_size):
    """The classic hang with TORCH_DISTRIBUTED_DEBUG=DETAIL: rank 0 all-reduces 3 evaluation totals while rank 1
    is already in the next training step's all-reduce of 4 values. The group is formed here, after the variable
    is set: DETAIL takes effect when a group is created."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=10))
        try:
            dist.all_reduce(torch.zeros(3) if rank == 0 else torch.ones(4))
            return "no error"
        except RuntimeError as error:
            return str(error)
    finally:
        os.environ.pop("TORCH_DISTRIBUTED_DEBUG")
        dist.set_debug_level_from_env()


def models_that_differ(rank, world_size):
    """Rank 1 builds its model with one layer more (say, an option read from a file only it sees changed)."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    try:
        DDP(nn.Sequential(*[nn.Linear(4, 4) for _ in range(1 + rank)]))
        return "no error"
    except RuntimeError as error:
        return str(error)


class Augmented:
    """A dataset whose every sample is a random 'augmentation' (a random crop offset, say): 3 numbers from the
    random generator of whichever process loads it."""

    def __len__(self):
        return 8

    def __getitem__(self, index):
        import torch

        return torch.rand(3)


def randomness_across_ranks(rank, world_size):
    """What each rank draws with the same seed everywhere, as the scripts seed: a dropout mask, and the first
    batch of a DataLoader with 2 worker processes; then the loader again with a generator seeded with
    seed + rank. Also how many processes and threads this rank runs while the loader's workers are alive."""
    import psutil
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    def everyone(tensor):
        gathered = [torch.empty_like(tensor) for _ in range(world_size)]
        dist.all_gather(gathered, tensor)
        return gathered

    torch.manual_seed(0)  # the same seed on every rank
    mask = torch.nn.functional.dropout(torch.ones(8), 0.5)
    batches = {}
    for name, generator in [("same seed", None), ("generator seeded with seed + rank",
                                                  torch.Generator().manual_seed(0 + rank))]:
        torch.manual_seed(0)
        # fork, as in a torchrun worker: this process was spawned, and its children would be spawned too
        loader = iter(DataLoader(Augmented(), batch_size=2, num_workers=2, generator=generator,
                                 multiprocessing_context="fork"))
        batches[name] = torch.stack([next(loader), next(loader)])  # batch 0 from worker 0, batch 1 from worker 1
        if generator is None:
            me = psutil.Process()
            counts = {"processes": 1 + len(me.children()), "threads": me.num_threads(),
                      "torch threads": torch.get_num_threads()}
        del loader
    return {"mask": everyone(mask), "batches": {name: everyone(b) for name, b in batches.items()}, "counts": counts}


def seeded_by_rank(rank, world_size):
    """Each rank seeds with seed + rank before building its model (exercise 2): its weights before and after
    the wrap, and the dropout mask of its first forward."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0 + rank)
    layer = nn.Linear(8, 8)
    before = layer.weight.detach().clone()
    model = DDP(nn.Sequential(layer, nn.Dropout(0.5)))
    output = model(torch.ones(1, 8))
    mask = (output != 0).flatten().float()
    gathered = {name: [torch.empty_like(t) for _ in range(world_size)]
                for name, t in [("before", before), ("after", layer.weight.detach()), ("mask", mask)]}
    for name, tensor in [("before", before), ("after", layer.weight.detach().clone()), ("mask", mask)]:
        dist.all_gather(gathered[name], tensor)
    return gathered
