"""What the notebooks share: running the repository's scripts for real, reading their metrics, showing the
diff between two steps, and the small process-group experiments of 05_ddp_under_the_hood.ipynb.

Everything runs from the repository root with relative paths, and prints no absolute path or host name, so
the committed outputs say nothing about the machine that made them."""
import difflib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def show_diff(previous, script):
    """The diff between two numbered scripts, read from the repository now: it cannot go stale."""
    from IPython.display import Code

    old, new = ((REPO / name).read_text().splitlines(keepends=True) for name in (previous, script))
    return Code("".join(difflib.unified_diff(old, new, previous, script)), language="diff")


def workdir():
    """A scratch folder for metrics and snapshots (its path is never printed)."""
    return Path(tempfile.mkdtemp(prefix="ddp-steps-notebook-"))


def environment(**extra):
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    return {**env, **{key: str(value) for key, value in extra.items()}}


def start(command, log, **env):
    """Starts a command from the repository root, its output going to the file `log`."""
    with open(log, "w") as out:
        return subprocess.Popen([TORCHRUN if part == "torchrun" else sys.executable if part == "python" else
                                 str(part) for part in command], cwd=REPO, env=environment(**env),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def run(command, timeout=600, **env):
    """Runs a command to its end and returns its output (torchrun's own warnings left out)."""
    log = workdir() / "output.log"
    process = start(command, log, **env)
    try:
        process.wait(timeout)
    finally:
        process.kill()
    output = "\n".join(line for line in log.read_text().splitlines() if not line.startswith(("W1", "I1")))
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, command))} exited {process.returncode}:\n{output[-2000:]}")
    return output


def scrub(text):
    """Output as it may be shown: no temporary paths, no host names."""
    text = re.sub(r"/\S*ddp-steps-notebook-\w+/", "", text)
    return re.sub(r"\[[\w.-]+\] ", "", text)


def read_metrics(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def wait_for(condition, timeout=120):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("gave up waiting")
        time.sleep(0.05)


# --- in-notebook process groups (05_ddp_under_the_hood.ipynb) ------------------------------------------------
# run_group(worker, world_size) starts real gloo groups; it is the tests' own (tests/helpers.py), written once.
sys.path.insert(0, str(REPO / "tests"))
from helpers import run_group  # noqa: E402, F401


def gradients_before_and_after_all_reduce(rank, world_size):
    """Each rank's own gradient (no DDP) and the gradient DDP leaves after backward, for one small layer."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    layer = nn.Linear(6, 1)
    batch = torch.randn(8, 6, generator=torch.Generator().manual_seed(100 + rank))  # each rank its own data
    layer(batch).pow(2).mean().backward()
    local = layer.weight.grad.flatten().clone()
    layer.zero_grad()
    model = DDP(layer)
    model(batch).pow(2).mean().backward()
    averaged = model.module.weight.grad.flatten().clone()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return {"local": local, "after": averaged, "weights": model.module.weight.detach().flatten().clone()}


def bucket_timeline(rank, world_size):
    """When, during backward(), each gradient bucket is handed to the all-reduce (a comm hook records it)."""
    import torch
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    layers = [nn.Linear(512, 512) for _ in range(8)]
    model = DDP(nn.Sequential(*[m for layer in layers for m in (layer, nn.ReLU())]), bucket_cap_mb=1)
    events = []

    def hook(state, bucket):
        events.append((bucket.index(), time.perf_counter(), sum(t.numel() for t in bucket.gradients())))
        return allreduce_hook(None, bucket)

    model.register_comm_hook(None, hook)
    batch = torch.randn(256, 512)
    timings = []
    for _ in range(4):  # the first iterations build the buckets; measure the last
        events.clear()
        loss = model(batch).pow(2).mean()
        began = time.perf_counter()
        loss.backward()
        timings.append((began, time.perf_counter(), list(events)))
    began, ended, last = timings[-1]
    return {"backward_s": ended - began, "buckets": [(index, at - began, size) for index, at, size in last]}
