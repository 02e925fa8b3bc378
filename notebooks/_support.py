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
    return _code("".join(_diff(previous, script)))


def _diff(previous, script):
    old, new = ((REPO / name).read_text().splitlines(keepends=True) for name in (previous, script))
    return list(difflib.unified_diff(old, new, previous, script))  # 3 lines of context, as diffs/ and diff -u


def _code(text):
    from IPython.display import Code

    return Code(text, language="diff")


def hunks(previous, script):
    """The diff's hunks, each a list of lines starting with its @@ header."""
    found = []
    for line in _diff(previous, script)[2:]:
        if line.startswith("@@"):
            found.append([])
        found[-1].append(line)
    return found


_shown = {}  # (previous, script) -> {hunk index: indexes of its lines shown so far}
_last = {}  # the part hunk() or more() showed last: previous, script, hunk index, its last line


def hunk(previous, script, containing, through=None):
    """Shows the one hunk of the diff that adds or removes a line containing `containing`, read from the
    repository now; with `through`, only its lines up to the next line containing `through` (more() shows
    the rest). A hunk that is not there, or is not the only one, is an error: the lesson never shows the
    wrong code."""
    every = hunks(previous, script)
    matches = [index for index, lines in enumerate(every)
               if any(line[0] in "+-" and containing in line for line in lines[1:])]
    if len(matches) != 1:
        raise LookupError(f"{len(matches)} hunks of {previous} -> {script} change a line containing {containing!r} "
                          "(expected exactly 1): the scripts changed, update the lesson")
    return _part(previous, script, matches[0], 1, through)


def more(through=None):
    """Shows the next part of the hunk shown last: up to the next line containing `through`, or to its end."""
    previous, script, index, last = _last["part"]
    return _part(previous, script, index, last + 1, through)


def _part(previous, script, index, first, through):
    lines = hunks(previous, script)[index]
    last = len(lines) - 1
    if through is not None:
        last = next((i for i in range(first, len(lines)) if through in lines[i]), None)
        if last is None:
            raise LookupError(f"no line containing {through!r} in the rest of hunk {lines[0].strip()}: update the "
                              "lesson")
    _shown.setdefault((previous, script), {}).setdefault(index, set()).update(range(first, last + 1))
    _last["part"] = previous, script, index, last
    part = "" if (first, last) == (1, len(lines) - 1) else f"   (lines {first}-{last} of this hunk's {len(lines) - 1})"
    return _code(lines[0].rstrip("\n") + part + "\n" + "".join(lines[first:last + 1]))


def every_hunk_shown(previous, script):
    """Fails unless every changed line of the diff was shown by hunk() in this notebook: a new hunk in the
    scripts must be explained before the lesson builds again."""
    shown = _shown.get((previous, script), {})
    missing = [lines[0].strip() for index, lines in enumerate(hunks(previous, script))
               if any(line[0] in "+-" and i not in shown.get(index, ()) for i, line in enumerate(lines) if i)]
    if missing:
        raise AssertionError(f"hunks of {previous} -> {script} not explained in this notebook: {missing}")
    print(f"all {len(hunks(previous, script))} hunks of the diff {previous} -> {script} are explained above")


def show(function):
    """A function's source, to read before it runs."""
    import inspect

    from IPython.display import Code

    return Code(inspect.getsource(function), language="python")


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
from helpers import load_script, run_group  # noqa: E402, F401


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


# --- 01_mp_spawn.ipynb: the concepts and the classic mistakes, each in a real 2-process gloo group ----------
def barrier_wait(rank, world_size):
    """Rank 1 arrives 1 s late at the barrier; every rank measures how long it waited there."""
    import torch.distributed as dist

    time.sleep(1.0 * rank)
    began = time.monotonic()
    dist.barrier()
    return round(time.monotonic() - began, 1)


def samples_seen(rank, world_size):
    """The sample indices a rank trains on in one epoch, with the seed every rank sets at start-up: with the
    single-process loader unchanged, and with a DistributedSampler."""
    import torch
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    data = list(range(16))
    torch.manual_seed(0)  # like the scripts: the same seed in every process
    plain = DataLoader(data, batch_size=4, shuffle=True)
    torch.manual_seed(0)
    sharded = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, seed=0))
    return {name: [int(i) for batch in loader for i in batch]
            for name, loader in [("without DistributedSampler", plain), ("with DistributedSampler", sharded)]}


def weights_before_and_after_wrapping(rank, world_size):
    """Each rank builds its model with a different seed; DDP(model) then makes them equal."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(rank)  # a mistake on purpose: every rank starts from different weights
    layer = nn.Linear(3, 1)
    before = layer.weight.detach().clone()
    model = DDP(layer)
    return {"before": before, "after": model.module.weight.detach().clone()}


def state_dicts_of_a_wrapped_model(rank, world_size):
    """What model.state_dict() and model.module.state_dict() hold once the model is wrapped in DDP."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    return {"wrapped": model.state_dict(), "module": model.module.state_dict()}


def collective_on_rank_0_only(rank, world_size):
    """The classic hang: rank 0 evaluates under `if rank == 0:`, and evaluation all-reduces its totals.
    Rank 1 never calls that all_reduce; it goes on to its next step and waits there."""
    import torch
    import torch.distributed as dist

    began = time.monotonic()
    if rank == 0:
        try:
            dist.all_reduce(torch.zeros(3))  # what evaluate() does with its totals
        except RuntimeError as error:
            return f"rank 0 after {time.monotonic() - began:.0f} s: {type(error).__name__}: {error}"
        return "rank 0: no error"
    time.sleep(5)  # rank 1 went on without it (its own next collective would wait the same way)
    return "rank 1: never called that all_reduce"
