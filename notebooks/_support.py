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


# --- 01_mp_spawn.ipynb: the concepts and the classic mistakes, each in a real 2-process gloo group ----------
class Processes:
    """`size` processes started once, that wait for work: run(worker, *args) makes them a gloo process group,
    calls worker(rank, size, *args) in each, as mp.spawn calls main, and returns what each rank returned, in
    rank order. Starting a process costs seconds (each imports torch); forming a group in running ones, a
    fraction of one. A worker must live in an importable module (this one): a fresh process imports it."""

    def __init__(self, size=2):
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")  # fresh interpreters, started the way mp.spawn starts them
        self.size, self.results, self.jobs = size, context.Queue(), [context.Queue() for _ in range(size)]
        self.processes = [context.Process(target=serve, args=(rank, size, jobs, self.results), daemon=True)
                          for rank, jobs in enumerate(self.jobs)]
        for process in self.processes:
            process.start()

    def run(self, worker, *args, collective_timeout=60, form_group=True, timeout=300):
        """form_group=False: the worker forms the group itself (01's main does) from MASTER_ADDR:MASTER_PORT."""
        import queue

        from helpers import free_port

        port, results, deadline = free_port(), {}, time.monotonic() + timeout
        for jobs in self.jobs:
            jobs.put((worker, args, port, collective_timeout, form_group))
        while len(results) < self.size:
            dead = [rank for rank, process in enumerate(self.processes) if not process.is_alive()]
            if dead or time.monotonic() > deadline:  # an error, never a hang
                self.close()
                raise RuntimeError(f"ranks {dead} died" if dead else f"{worker.__name__} ran past {timeout} s")
            try:
                rank, failed, result = self.results.get(timeout=0.5)
            except queue.Empty:
                continue
            results[rank] = (failed, result)
        for rank, (failed, result) in results.items():  # every rank has answered: the next job starts clean
            if failed:
                raise RuntimeError(f"{worker.__name__} failed on rank {rank}:\n{result}")
        return [results[rank][1] for rank in range(self.size)]

    def close(self):
        for jobs in self.jobs:
            jobs.put(None)
        for process in self.processes:
            process.join(1)
            process.kill()  # a process still tearing PyTorch down after a second: nothing of it is needed


def serve(rank, size, jobs, results):
    """What each process of Processes does until it is told to stop: wait for a job; join a process group with
    the others, as 01's main does (gloo, MASTER_ADDR:MASTER_PORT, its rank, the world size); run the job; leave
    the group; send back what the job returned."""
    import queue
    import traceback
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # two processes share this machine's cores
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the scripts' logs: the notebook reads their metrics files
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    parent = os.getppid()
    while True:
        try:
            job = jobs.get(timeout=1)
        except queue.Empty:
            if os.getppid() != parent:  # the notebook's kernel is gone: no orphan stays behind
                return
            continue
        if job is None:
            return
        worker, args, port, collective_timeout, form_group = job
        os.environ["MASTER_PORT"] = str(port)
        try:
            if form_group:
                dist.init_process_group("gloo", rank=rank, world_size=size,
                                        timeout=timedelta(seconds=collective_timeout))
            results.put((rank, False, worker(rank, size, *args)))
        except (Exception, SystemExit):  # SystemExit: argparse refusing a script's flags
            results.put((rank, True, traceback.format_exc()))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def script_main(rank, world_size, script, *argv):
    """What 01's mp.spawn runs in each process: the script's own main(rank, world_size, args), which forms the
    process group itself. For 00, its main(args), in rank 0 alone: one process."""
    module = load_script(script)
    args = module.parse_args([str(part) for part in argv])
    if script == "00_single_gpu.py":
        if rank == 0:
            module.main(args)
    else:
        module.main(rank, world_size, args)


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


def weights_loaded_after_wrapping(rank, world_size):
    """Rank 0 loads other weights into model.module after DDP(model) (a mistake on purpose), then each rank
    takes one SGD step on data of its own: each rank's weights before and after that step."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Linear(3, 1))
    if rank == 0:  # say, a checkpoint that only rank 0 reads, after the wrap
        model.module.load_state_dict({"weight": torch.ones(1, 3), "bias": torch.zeros(1)})
    before = model.module.weight.detach().clone()
    batch = torch.randn(8, 3, generator=torch.Generator().manual_seed(rank))
    model(batch).pow(2).mean().backward()  # DDP averages the two ranks' gradients here
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return {"before": before, "after": model.module.weight.detach().clone()}


def training_without_a_sampler(rank, world_size):
    """Mistake 1, trained: a small classifier under DDP, each process with the single-process loader and the
    same seed. The mean loss of each of 3 epochs, and whether the two ranks trained on the same batches."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset

    inputs = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(inputs, (inputs.sum(1) > 0).long())  # the same data in every process
    torch.manual_seed(0)  # like the scripts: the same seed in every process
    model = DDP(nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, same_batches = [], True
    for _ in range(3):
        total, steps = 0.0, 0
        for batch, labels in DataLoader(data, batch_size=32, shuffle=True):
            everyone = [torch.empty_like(batch) for _ in range(world_size)]
            dist.all_gather(everyone, batch)
            same_batches &= all(torch.equal(other, batch) for other in everyone)
            loss = F.cross_entropy(model(batch), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total, steps = total + loss.item(), steps + 1
        losses.append(round(total / steps, 3))
    return {"losses": losses, "same_batches": same_batches}


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


# --- 03-05: runs that may fail or hang, and logs read as they are written ---------------------------------------
from helpers import free_port, kill_tree  # noqa: E402, F401  (the tests' own, written once)


def wait_all(processes, began, timeout):
    """Waits for processes started at `began` (time.monotonic()); returns {process: (exit status, seconds after
    `began` when it ended)}. One still running `timeout` seconds after `began` is killed with all it started,
    and its status is None."""
    ended = {}
    while len(ended) < len(processes) and time.monotonic() - began < timeout:
        ended.update({process: (process.returncode, time.monotonic() - began) for process in processes
                      if process not in ended and process.poll() is not None})
        time.sleep(0.1)
    for process in set(processes) - set(ended):
        kill_tree(process.pid)
        process.wait()
        ended[process] = None, time.monotonic() - began
    return ended


def lines_with(output, *words):
    """The lines of `output` that contain any of `words`, scrubbed, each once: what to read in a long log."""
    found = [re.sub(r"^[IWE]\d{4} [\d:.]+ \d+ \S+\] ", "torchrun: ", line.strip())  # its log prefix
             for line in scrub(output).replace(f"{REPO}/", "").splitlines() if any(word in line for word in words)]
    return "\n".join(dict.fromkeys(found))


class Follow:
    """Reads a log as it is written, and notes when each line arrived (seconds since the Follow began), so
    that a run can be drawn against the wall clock (`began`: the clock of an earlier Follow, to draw one run
    after another). `marks` holds moments the notebook adds (a kill, say)."""

    def __init__(self, log, began=None):
        import threading

        self.log, self.began, self.lines, self.marks = Path(log), began or time.monotonic(), [], {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def now(self):
        return time.monotonic() - self.began

    def _read(self):
        position, partial = 0, ""
        while True:
            stopping = self._stop.is_set()  # one last read after the stop, so no line is missed
            if self.log.exists():
                with open(self.log) as f:
                    f.seek(position)
                    chunk = f.read()
                    position = f.tell()
                *complete, partial = (partial + chunk).split("\n")
                self.lines += [(self.now(), line) for line in complete]
            if stopping:
                return
            time.sleep(0.02)

    def matches(self, pattern):
        """(arrival, match) of every line so far that matches `pattern`."""
        return [(at, found) for at, line in list(self.lines) if (found := re.search(pattern, line))]

    def wait_for(self, pattern, count=1, timeout=120):
        """Waits until `count` lines match `pattern`; returns the last of them (a re.Match)."""
        deadline = time.monotonic() + timeout
        while len(found := self.matches(pattern)) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {count} lines matching {pattern!r} within {timeout} s")
            time.sleep(0.02)
        return found[count - 1][1]

    def stop(self):
        self._stop.set()
        self._thread.join()
        return self


# --- diagrams: boxes and arrows (flows), and lifelines with messages (sequences) -------------------------------
def flow(boxes, arrows, title, size=(10, 4)):
    """Draws boxes {name: (x, y, text)} joined by arrows [(from, to, label)], in data coordinates."""
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=size)
    texts = {name: axis.text(x, y, text, ha="center", va="center", fontsize=9, zorder=2,
                             bbox=dict(boxstyle="round,pad=0.5", facecolor="#eef3fb", edgecolor="#4a6fa5"))
             for name, (x, y, text) in boxes.items()}
    fig.canvas.draw()  # lay the boxes out, so that each arrow can start and end at a box's edge
    for source, target, label in arrows:
        (x0, y0, _), (x1, y1, _) = boxes[source], boxes[target]
        axis.annotate("", xy=(x1, y1), xytext=(x0, y0), zorder=3,
                      arrowprops=dict(arrowstyle="-|>", color="#555", shrinkA=2, shrinkB=2, mutation_scale=14,
                                      patchA=texts[source].get_bbox_patch(), patchB=texts[target].get_bbox_patch(),
                                      connectionstyle="arc3,rad=0.15"))
        if label:
            axis.text((x0 + x1) / 2, (y0 + y1) / 2, label, fontsize=8, ha="center", va="center", color="#a33",
                      bbox=dict(facecolor="white", edgecolor="none", pad=1), zorder=4)
    xs, ys = [x for x, _, _ in boxes.values()], [y for _, y, _ in boxes.values()]
    axis.set(xlim=(min(xs) - 1.3, max(xs) + 1.3), ylim=(min(ys) - 0.8, max(ys) + 0.8))
    axis.set_title(title, pad=12)
    axis.axis("off")
    plt.show()


def sequence(actors, messages, title, size=(10, 5)):
    """A sequence diagram: one lifeline per actor, messages [(from, to, text)] top to bottom (from == to: a
    note on that lifeline)."""
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=size)
    x = {actor: i for i, actor in enumerate(actors)}
    depth = len(messages) + 1
    for actor, i in x.items():
        axis.plot([i, i], [0, -depth], color="#999", lw=1, zorder=0)
        axis.text(i, 0.4, actor, ha="center", fontsize=9, weight="bold",
                  bbox=dict(boxstyle="round", facecolor="#eef3fb", edgecolor="#4a6fa5"))
    for row, (source, target, text) in enumerate(messages, start=1):
        if source == target:
            axis.text(x[source], -row, text, ha="center", va="center", fontsize=8,
                      bbox=dict(facecolor="#fff8e0", edgecolor="#c9a100"))
            continue
        axis.annotate("", xy=(x[target], -row), xytext=(x[source], -row),
                      arrowprops=dict(arrowstyle="-|>", color="#4a6fa5"))
        axis.text((x[source] + x[target]) / 2, -row + 0.15, text, ha="center", fontsize=8)
    axis.set(xlim=(-0.7, len(actors) - 0.3), ylim=(-depth, 1))
    axis.set_title(title, pad=24)
    axis.axis("off")
    plt.show()


# --- 05_ddp_under_the_hood.ipynb: DDP's machinery, each piece in a real 2-process gloo group -----------------
def wide_model(layers=6, width=1024):
    """Linear layers big enough that communicating their gradients takes measurable time."""
    from torch import nn

    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])


def communication_timings(rank, world_size, repeats=15):
    """Milliseconds of one backward() through DDP on 2 ranks, the fastest of `repeats` (the run least disturbed by
    whatever else runs on the machine), with the same model, weights and buckets, and only the communication
    changed by a communication hook: none at all; each bucket's all-reduce done before backward may go on (no
    overlap); DDP's own asynchronous all-reduce (overlap), also with bucket_cap_mb=5; and the bf16 compression
    hook. "no communication" is timed twice: the two differ by the machine's noise. Also the buckets DDP used,
    and how the hook's averaged gradients compare with the exact ones."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    def nothing(state, bucket):  # hands the bucket back unchanged: DDP's machinery without communication
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    def blocking(state, bucket):  # all-reduces the bucket before backward may compute anything else
        dist.all_reduce(bucket.buffer())
        return nothing(state, bucket).then(lambda future: future.value().div_(world_size))

    torch.manual_seed(0)
    batch = torch.randn(64, 1024, generator=torch.Generator().manual_seed(rank))  # each rank its own data
    weights = wide_model().state_dict()
    setups = {"no communication": ({}, nothing), "all-reduce, not overlapped": ({}, blocking),
              "DDP (overlapped)": ({}, None), "DDP, bucket_cap_mb=5": ({"bucket_cap_mb": 5}, None),
              "DDP + bf16 compression hook": ({}, bf16_compress_hook)}
    models = {}
    for mode, (options, hook) in setups.items():
        model = wide_model()
        model.load_state_dict(weights)  # the same weights everywhere: only the communication differs
        models[mode] = DDP(model, **options)
        if hook:
            models[mode].register_comm_hook(dist.group.WORLD, hook)
    models["no communication (again)"] = models["no communication"]

    def backward(mode):
        model = models[mode]
        model.zero_grad(set_to_none=True)
        loss = model(batch).pow(2).mean()
        dist.barrier()  # both ranks start together
        began = time.perf_counter()
        loss.backward()
        return 1000 * (time.perf_counter() - began)

    results = {mode: [] for mode in models}
    for _ in range(2):  # warm-up: DDP rebuilds its buckets after the first iteration
        for mode in models:
            backward(mode)
    for _ in range(repeats):
        for mode in models:  # interleaved, so that drifts of the machine's speed hit every mode alike
            results[mode].append(backward(mode))
    exact = [p.grad.clone() for p in models["DDP (overlapped)"].parameters()]
    compressed = list(models["DDP + bf16 compression hook"].parameters())
    relative = max(((c.grad - e).abs().max() / e.abs().max()).item() for c, e in zip(compressed, exact, strict=True))
    return {"ms": {mode: min(runs) for mode, runs in results.items()},
            "buckets_mb": {mode: [int(size) / 2**20 for size in
                                  models[mode]._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(", ")]
                           for mode in ("DDP (overlapped)", "DDP, bucket_cap_mb=5")},
            "parameters": sum(p.numel() for p in exact), "bf16_relative_error": relative,
            "bf16_identical": all(torch.equal(c.grad, e) for c, e in zip(compressed, exact, strict=True)),
            "bf16_gradients": [c.grad.clone() for c in compressed]}  # every parameter's, to compare across ranks


def two_heads():
    """A model whose forward uses only one of its two heads."""
    from torch import nn

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)

        def forward(self, x):
            return self.used(self.body(x))  # self.unused takes no part in the loss

    return Model()


def unused_parameters(rank, world_size):
    """Two training steps of two_heads() under DDP with each option: 'ok', or the error DDP raises."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    outcomes = {}
    for name, options in {"DDP(model)": {}, "find_unused_parameters=True": {"find_unused_parameters": True},
                          "static_graph=True": {"static_graph": True}}.items():
        torch.manual_seed(0)
        model, step = DDP(two_heads(), **options), 0
        try:
            while step < 2:
                step += 1
                model(torch.randn(3, 4)).sum().backward()
            outcomes[name] = "2 steps, ok"
        except RuntimeError as error:  # raised by each rank itself, before any collective: the group stays usable
            outcomes[name] = f"step {step}: RuntimeError: {str(error).splitlines()[0][:150]}..."
    return outcomes


def batchnorm_buffers(rank, world_size):
    """BatchNorm under DDP, each rank with data of its own: the running mean after each of two forwards, the
    batch statistics each rank used, and BatchNorm's output against one process normalising both ranks'
    samples together; then the same with the mean and variance all-reduced over the ranks (what SyncBatchNorm
    does on GPUs), and what SyncBatchNorm says on a CPU."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))
    data = [torch.randn(4, 3, generator=torch.Generator().manual_seed(10 * rank + step)) + 3 * rank
            for step in range(2)]
    running, batch_means = [], []
    for batch in data:
        model(batch)  # in training mode DDP first copies rank 0's buffers to every rank, then BatchNorm runs
        running.append(model.module[1].running_mean.clone())
        batch_means.append(model.module[0](batch).detach().mean(0))  # what this rank's BatchNorm averaged
    features = torch.randn(4, 3, generator=torch.Generator().manual_seed(100 + rank)) + 3 * rank
    everyone = [torch.zeros(4, 3) for _ in range(world_size)]
    dist.all_gather(everyone, features)
    reference = nn.BatchNorm1d(3)(torch.cat(everyone))[4 * rank:4 * rank + 4]  # one process, all 8 samples
    local = nn.BatchNorm1d(3)(features)  # this rank's 4 samples only, as BatchNorm does under DDP
    sums = torch.stack([features.sum(0), features.pow(2).sum(0), torch.full((3,), 4.0)])
    dist.all_reduce(sums)  # SyncBatchNorm's idea: statistics of every rank's samples
    mean = sums[0] / sums[2]
    synced = (features - mean) / (sums[1] / sums[2] - mean**2 + 1e-5).sqrt()
    try:
        nn.SyncBatchNorm(3)(features)
        sync_on_cpu = "ran"
    except ValueError as error:
        sync_on_cpu = f"ValueError: {error}"
    return {"running": running, "batch_means": batch_means, "local_vs_one_process": (local - reference).abs().max(),
            "synced_vs_one_process": (synced - reference).abs().max(), "sync_batchnorm_on_cpu": sync_on_cpu}


def uneven_inputs(rank, world_size, use_join):
    """Rank 0 has 3 batches, rank 1 has 2 (an uneven split). Without Join, rank 0's third backward waits for
    an all-reduce rank 1 never joins; with Join, rank 1 shadows it. Returns what happened and, with Join, the
    final weights."""
    import contextlib

    import torch
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    began, step = time.monotonic(), 0
    try:
        with Join([model]) if use_join else contextlib.nullcontext():
            while step < 3 - rank:
                step += 1
                optimizer.zero_grad()
                model(torch.randn(8, 4)).pow(2).mean().backward()
                optimizer.step()
    except RuntimeError as error:
        return {"outcome": f"rank {rank}, step {step}, after {time.monotonic() - began:.0f} s: "
                           f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"}
    outcome = f"rank {rank}: finished its {3 - rank} steps after {time.monotonic() - began:.1f} s"
    if not use_join:
        time.sleep(5)  # rank 1 goes on with its next work (validation, say); rank 0 still waits
        outcome += ", then went on to other work"
    return {"outcome": outcome, "weights": model.module.weight.detach().clone()}


def under_the_hood(rank, world_size):
    """Every 2-process experiment of 05_ddp_under_the_hood.ipynb, one after the other in one group (starting
    processes costs seconds). The uneven inputs without Join come last: they break the group on purpose."""
    return {"averaging": gradients_before_and_after_all_reduce(rank, world_size),
            "timings": communication_timings(rank, world_size),
            "unused": unused_parameters(rank, world_size),
            "batchnorm": batchnorm_buffers(rank, world_size),
            "join": uneven_inputs(rank, world_size, use_join=True),
            "no_join": uneven_inputs(rank, world_size, use_join=False)}


def single_process_group():
    """A gloo group of one process, in this notebook's own process: enough for DDP to build its buckets and call
    its hooks, in milliseconds instead of the seconds it takes to start processes."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
