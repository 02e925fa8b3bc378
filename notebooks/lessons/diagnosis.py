"""when_it_breaks.ipynb: finding the stuck rank (py-spy, the Flight Recorder's dumps), reading torchrun's
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
    (on Linux it pauses the process with ptrace and reads its memory with process_vm_readv: it needs the
    permission to attach to that process)."""
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
    is already in the next training step's all-reduce of 4 values. torch reads TORCH_DISTRIBUTED_DEBUG when
    torch.distributed is imported, long before this runs: setting the variable here changes nothing until
    dist.set_debug_level_from_env() reads it again. The group is formed after that, because a group checks the
    level when it is created (DETAIL: it wraps the backend in a ProcessGroupWrapper)."""
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


def debug_level_read_at_import():
    """TORCH_DISTRIBUTED_DEBUG=DETAIL set in two fresh Pythons: one sets it in its code after `import
    torch.distributed`, one gets it in its environment at start. Returns {how: the debug levels it printed}."""
    after = ("import os, torch.distributed as dist; os.environ['TORCH_DISTRIBUTED_DEBUG'] = 'DETAIL'; "
             "print(dist.get_debug_level()); dist.set_debug_level_from_env(); print(dist.get_debug_level())")
    before = "import torch.distributed as dist; print(dist.get_debug_level())"
    env = {key: value for key, value in os.environ.items() if key != "TORCH_DISTRIBUTED_DEBUG"}
    started = {"set after the import": subprocess.Popen([sys.executable, "-c", after], env=env, text=True,
                                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT),
               "set before the import": subprocess.Popen([sys.executable, "-c", before], text=True,
                                                         env={**env, "TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
                                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)}
    return {how: process.communicate(timeout=60)[0].split() for how, process in started.items()}


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
    """What each rank draws with the same seed everywhere, as steps 01-03 seed: a dropout mask, and the first
    two batches of a DataLoader with 2 worker processes and no generator; then the loader without a generator
    after torch.manual_seed(seed + rank), and the loader with a generator seeded with seed + rank. Also how many
    processes and threads this rank runs while the loader's workers are alive."""
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
    batches, counts = {}, {}
    for name, seed, generator in [("same seed, no generator", 0, None),
                                  ("torch.manual_seed(seed + rank), no generator", 0 + rank, None),
                                  ("same seed, generator seeded with seed + rank", 0,
                                   torch.Generator().manual_seed(0 + rank))]:
        torch.manual_seed(seed)  # without a generator, the loader draws its workers' base seed from this one
        # fork, as in a torchrun worker, whatever start method started this process (run_group: a fork server)
        loader = iter(DataLoader(Augmented(), batch_size=2, num_workers=2, generator=generator,
                                 multiprocessing_context="fork"))
        batches[name] = torch.stack([next(loader), next(loader)])  # batch 0 from worker 0, batch 1 from worker 1
        if not counts:
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


def nan_loss_check(rank, world_size, agree):
    """A few training steps of a tiny DDP model; at step 3 rank 1's input holds a NaN, so its loss is NaN.
    agree=False, the mistake: each rank checks its own loss and leaves the loop alone; the rank that left does
    nothing more, and its process stays in the group until the other is done too (runs.Processes: the ranks leave
    together), as a process busy with other work would (other_work in section 1). agree=True, the fix: every rank
    checks the loss summed over the ranks by one all_reduce. Returns (the step at which this rank stopped, the
    lines it printed, each with the seconds since its first step)."""
    import time

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    said, began = [], time.monotonic()

    def say(text):
        said.append(f"{time.monotonic() - began:4.1f} s  {text}")

    for step in range(1, 6):
        inputs = torch.ones(8, 4)
        if rank == 1 and step == 3:
            inputs[0, 0] = float("nan")  # one bad sample: this rank's loss is NaN
        loss = model(inputs).pow(2).mean()
        if agree:
            summed = loss.detach().clone()
            dist.all_reduce(summed)  # the loss summed over the ranks: NaN on every rank if NaN on one
            if not torch.isfinite(summed):
                if rank == 0:
                    say(f"error: the loss is {summed.item()} at step {step}; the run stopped before that step "
                        "changed any weight")
                return step, said
        elif not torch.isfinite(loss):
            say(f"step {step}: my loss is {loss.item()}: I leave the loop")
            return step, said
        try:
            loss.backward()  # DDP all-reduces the gradients inside backward()
        except RuntimeError as error:
            gist = re.search(r"Timed out.*?complete", str(error))  # gloo's message, without its source path
            say(f"step {step}: backward() failed: {type(error).__name__}: "
                f"{gist.group(0) if gist else tidy(str(error))[:100]}")
            return step, said
        optimizer.step()
        optimizer.zero_grad()
        say(f"step {step}: loss {loss.item():.4f}")
    return step, said
