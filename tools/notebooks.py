"""Builds notebooks/*.ipynb from the cells below and executes them, so that every committed output was
produced by the committed code.

    python tools/notebooks.py              # rebuild and execute every notebook (a few minutes on 2 cores)
    python tools/notebooks.py 04           # only those whose name starts with 04
    python tools/notebooks.py --check      # fail if a notebook is stale

Edit the cells here, not in Jupyter: a notebook is an output of this file. Each executed notebook records a
hash of its cells, the numbered scripts and notebooks/_support.py in its metadata; tests/test_notebooks.py
checks cells and hash (stale outputs fail), and runs each notebook.
"""
import hashlib
import sys
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parents[1]
FOLDER = REPO / "notebooks"

SETUP = """\
%matplotlib inline
import _support as nb  # notebooks/_support.py: run the scripts, read their metrics, show diffs
import matplotlib.pyplot as plt"""

NOTEBOOKS = {
    "00_single_gpu": [
        ("md", """\
# Step 00 — one device

[`00_single_gpu.py`](../00_single_gpu.py) is a complete trainer: built-in data, a small CNN, validation
every epoch, checkpoints, metrics. Every later step is this file plus one lesson. Here we look at the data,
run the script for real (on the CPU, in a minute or so), and plot what its `--metrics` file recorded."""),
        ("code", SETUP),
        ("md", """\
## The built-in data

Ten classes, each a smooth colour pattern; every sample is its pattern, shifted and buried in noise. Sample
*i* is computed from `(seed, i)` alone, so every process, and every restart, sees the same data with no file
on disk. The notebook imports the script's own class to draw a few samples per class."""),
        ("code", """\
import importlib.util

spec = importlib.util.spec_from_file_location("step00", "../00_single_gpu.py")
step00 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(step00)
data = step00.SyntheticImages(400, seed=0)
fig, axes = plt.subplots(4, 10, figsize=(12, 5))
for label in range(10):
    samples = [image for image, y in (data[i] for i in range(400)) if y == label][:3]
    axes[0, label].imshow((data.patterns[label].permute(1, 2, 0) * 0.25 + 0.5).clamp(0, 1))
    axes[0, label].set_title(f"class {label}", fontsize=8)
    for row, image in enumerate(samples, start=1):
        axes[row, label].imshow((image.permute(1, 2, 0) * 0.1 + 0.5).clamp(0, 1))
for axis in axes.flat:
    axis.axis("off")
fig.suptitle("top: each class's pattern; below: training samples (pattern + shift + noise)")
plt.show()"""),
        ("md", "## Training for real\n\nShorter than the default run; `--metrics` writes one JSON line per epoch."),
        ("code", """\
folder = nb.workdir()
output = nb.run(["python", "00_single_gpu.py", "--train-samples", "2048", "--epochs", "3",
              "--metrics", folder / "metrics.jsonl"])
print(nb.scrub(output))
metrics = nb.read_metrics(folder / "metrics.jsonl")"""),
        ("code", """\
epochs = [m["epoch"] for m in metrics]
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
left.plot(epochs, [m["train_loss"] for m in metrics], "o-", label="train")
left.plot(epochs, [m["val_loss"] for m in metrics], "o-", label="validation")
left.set(xlabel="epoch", ylabel="loss", title="the loss really falls")
left.legend()
right.plot(epochs, [100 * m["val_accuracy"] for m in metrics], "o-", color="C2")
right.axhline(10, color="grey", linestyle=":", label="chance")
right.set(xlabel="epoch", ylabel="validation accuracy (%)", ylim=(0, 100), title="and accuracy climbs")
right.legend()
plt.show()"""),
    ],
    "01_mp_spawn": [
        ("md", """\
# Step 01 — DistributedDataParallel with `mp.spawn`

The first distributed step. Read the diff: it is the whole lesson."""),
        ("code", SETUP),
        ("code", 'nb.show_diff("00_single_gpu.py", "01_mp_spawn.py")'),
        ("md", """\
## Who gets which samples: `DistributedSampler` and `set_epoch`

Each rank takes every `world_size`-th index of one shuffled order, so the shards are disjoint and together
cover the data. The shuffle is seeded by `seed + epoch`: without `set_epoch`, every epoch repeats the same
order. Below, 24 samples on 2 ranks over 3 epochs; colour = sample index."""),
        ("code", """\
import numpy as np
from torch.utils.data.distributed import DistributedSampler


def orders(call_set_epoch):
    rows = []
    for epoch in range(3):
        for rank in range(2):
            sampler = DistributedSampler(range(24), num_replicas=2, rank=rank, seed=0)
            if call_set_epoch:
                sampler.set_epoch(epoch)
            rows.append(list(sampler))
    return np.array(rows)

fig, axes = plt.subplots(1, 2, figsize=(12, 3.2))
for axis, call in zip(axes, [False, True], strict=True):
    grid = orders(call)
    axis.imshow(grid, cmap="viridis")
    for (row, col), value in np.ndenumerate(grid):
        axis.text(col, row, value, ha="center", va="center", fontsize=7, color="white")
    axis.set_yticks(range(6), [f"epoch {e} rank {r}" for e in range(3) for r in range(2)])
    axis.set_xlabel("position in the rank's shard")
    axis.set_title("with set_epoch(epoch)" if call else "without set_epoch: every epoch the same")
plt.tight_layout()
plt.show()
shards = orders(True)
print("epoch 0: shards disjoint:", set(shards[0]).isdisjoint(shards[1]),
      "| together complete:", sorted(np.concatenate([shards[0], shards[1]])) == list(range(24)))"""),
        ("md", """\
## One process or two: the same training

The same tiny run, as `00` with one process and as `01` with two (each with half the data per step, so the
global batch doubles). The curves are close, not identical: a different global batch is a different
optimisation."""),
        ("code", """\
folder = nb.workdir()
common = ["--train-samples", "2048", "--epochs", "3"]
nb.run(["python", "00_single_gpu.py", *common, "--metrics", folder / "one.jsonl"])
print(nb.scrub(nb.run(["python", "01_mp_spawn.py", "--nproc", "2", *common, "--metrics", folder / "two.jsonl"])))
one, two = nb.read_metrics(folder / "one.jsonl"), nb.read_metrics(folder / "two.jsonl")
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
for runs, label in [(one, "00: 1 process"), (two, "01: 2 processes")]:
    left.plot([m["epoch"] for m in runs], [m["train_loss"] for m in runs], "o-", label=label)
    right.plot([m["epoch"] for m in runs], [100 * m["val_accuracy"] for m in runs], "o-", label=label)
left.set(xlabel="epoch", ylabel="train loss")
right.set(xlabel="epoch", ylabel="validation accuracy (%)", ylim=(0, 100))
left.legend()
plt.show()"""),
    ],
    "02_torchrun": [
        ("md", """\
# Step 02 — torchrun

`torchrun` starts the processes and hands each its rank, local rank and world size in environment variables;
the script stops spawning and picking ports. Nothing about the training changes."""),
        ("code", SETUP),
        ("code", 'nb.show_diff("01_mp_spawn.py", "02_torchrun.py")'),
        ("md", """\
## Same training, different launcher

`01` under `mp.spawn` and `02` under `torchrun`, same seed, same 2 processes: the metrics match, epoch for
epoch — the launcher decides who starts the processes, not what they compute."""),
        ("code", """\
folder = nb.workdir()
common = ["--train-samples", "2048", "--epochs", "3"]
nb.run(["python", "01_mp_spawn.py", "--nproc", "2", *common, "--metrics", folder / "spawn.jsonl"])
print(nb.scrub(nb.run(["torchrun", "--standalone", "--nproc_per_node=2", "02_torchrun.py", *common,
                 "--metrics", folder / "torchrun.jsonl"])))
spawn, torchrun = nb.read_metrics(folder / "spawn.jsonl"), nb.read_metrics(folder / "torchrun.jsonl")
for a, b in zip(spawn, torchrun, strict=True):
    print(f"epoch {a['epoch']}: val acc {a['val_accuracy']:.2%} (mp.spawn) vs {b['val_accuracy']:.2%} (torchrun)")
plt.figure(figsize=(5, 3.5))
plt.plot([m["epoch"] for m in spawn], [m["train_loss"] for m in spawn], "o-", lw=4, alpha=0.4, label="01 mp.spawn")
plt.plot([m["epoch"] for m in torchrun], [m["train_loss"] for m in torchrun], "x--", label="02 torchrun")
plt.xlabel("epoch")
plt.ylabel("train loss")
plt.legend()
plt.show()"""),
    ],
    "03_multinode": [
        ("md", """\
# Step 03 — several nodes

`RANK` is unique in the whole job (who prints, who saves); `LOCAL_RANK` only on one machine (which GPU, who
does the machine's chores). Here two torchrun agents play two nodes on this machine, with two processes each,
meeting through c10d rendezvous."""),
        ("code", SETUP),
        ("code", 'nb.show_diff("02_torchrun.py", "03_multinode.py")'),
        ("code", """\
import re
import socket

with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
folder = nb.workdir()
node = ["torchrun", "--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}",
        "--rdzv_id=notebook", "--rdzv_conf=join_timeout=60", "03_multinode.py", "--train-samples", "1024",
        "--val-samples", "101", "--epochs", "1"]
agents = [nb.start(node, folder / f"node{n}.log") for n in range(2)]
for agent in agents:
    agent.wait(300)
logs = "".join((folder / f"node{n}.log").read_text() for n in range(2))
layout = sorted((int(node), int(local), int(rank)) for node, local, rank in
                re.findall(r"node (\\d+), local rank (\\d+): rank (\\d+) of 4", logs))
for node_rank, local, rank in layout:
    print(f"node {node_rank}  local rank {local}  ->  global rank {rank}")
print("parameter checksums at the end:", set(re.findall(r"parameter checksum ([-+.\\deE]+)", logs)))"""),
        ("code", """\
fig, axis = plt.subplots(figsize=(8, 3))
for node_rank in range(2):
    axis.add_patch(plt.Rectangle((node_rank * 4.2, 0), 4, 2.2, fill=False, lw=2))
    axis.text(node_rank * 4.2 + 2, 2.4, f"node {node_rank} (GROUP_RANK)", ha="center", fontsize=11)
for node_rank, local, rank in layout:
    x = node_rank * 4.2 + 0.3 + local * 1.9
    colour = "C3" if rank == 0 else "C0"
    axis.add_patch(plt.Rectangle((x, 0.3), 1.6, 1.6, color=colour, alpha=0.3))
    axis.text(x + 0.8, 1.35, f"RANK {rank}", ha="center", fontsize=11, weight="bold")
    axis.text(x + 0.8, 0.75, f"LOCAL_RANK {local}", ha="center", fontsize=9)
axis.set_xlim(-0.2, 8.6)
axis.set_ylim(-0.2, 3)
axis.axis("off")
axis.set_title("red: global rank 0 — the one process that prints and writes checkpoints")
plt.show()"""),
    ],
    "04_fault_tolerant": [
        ("md", """\
# Step 04 — losing nothing

A run whose worker is killed mid-training, restarted by `torchrun --max-restarts`, resumes from its last
snapshot at the very next batch. Below: an uninterrupted run, and a run in which one worker is killed with
`SIGKILL` during epoch 3. Their curves coincide, and so do their final parameters."""),
        ("code", SETUP),
        ("code", 'nb.show_diff("03_multinode.py", "04_fault_tolerant.py")'),
        ("code", """\
import random
import re
import time

import psutil

folder = nb.workdir()
def command(name):
    return ["torchrun", "--standalone", "--nproc_per_node=2", "--max-restarts=2", "04_fault_tolerant.py",
            "--train-samples", "1536", "--epochs", "4", "--batch-size", "32", "--save-every-steps", "4",
            "--checkpoint", folder / f"{name}.pt", "--metrics", folder / f"{name}.jsonl"]

quiet = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
uninterrupted = nb.scrub(nb.run(command("uninterrupted"), **quiet))
agent = nb.start(command("killed"), folder / "killed.log", **quiet)
nb.wait_for(lambda: (folder / "killed.jsonl").exists() and len(nb.read_metrics(folder / "killed.jsonl")) == 2)
time.sleep(0.5)  # into epoch 3
victim = random.Random(0).choice(psutil.Process(agent.pid).children())
victim.kill()
agent.wait(300)
killed = nb.scrub((folder / "killed.log").read_text())
print("\\n".join(line for line in killed.splitlines() if line.startswith(("epoch", "resumed", "rank"))))"""),
        ("code", """\
before, after = nb.read_metrics(folder / "uninterrupted.jsonl"), nb.read_metrics(folder / "killed.jsonl")
fig, axis = plt.subplots(figsize=(6, 3.5))
axis.plot([m["epoch"] for m in before], [m["val_loss"] for m in before], "o-", lw=5, alpha=0.35,
          label="uninterrupted")
axis.plot([m["epoch"] for m in after], [m["val_loss"] for m in after], "x--", label="killed in epoch 3, resumed")
axis.axvspan(2.5, 3.5, color="red", alpha=0.08, label="the epoch with the kill")
axis.set(xlabel="epoch", ylabel="validation loss")
axis.legend()
plt.show()
def final_checksum(log):
    return re.findall(r"checksum ([-+.\\deE]+)", log)[-1]

same = final_checksum(uninterrupted) == final_checksum(killed)
print("final parameters identical to the uninterrupted run:", same)"""),
    ],
    "05_ddp_under_the_hood": [
        ("md", """\
# What DDP does under the hood

Two experiments in real 2-process gloo groups started from this notebook (the functions are in
[`_support.py`](_support.py)):

1. **Gradients are averaged.** Each rank computes a gradient on its own batch; after `backward()` through
   DDP, every rank holds their mean — and so every rank takes the same optimizer step.
2. **Buckets overlap with backward.** DDP does not wait for `backward()` to finish: gradients are grouped
   into buckets (`bucket_cap_mb`, 25 MB by default), and each bucket's all-reduce starts as soon as its last
   gradient is ready, while autograd is still computing the earlier layers."""),
        ("code", SETUP),
        ("code", """\
import numpy as np

results = nb.run_group(nb.gradients_before_and_after_all_reduce, 2)
local = np.stack([r["local"].numpy() for r in results])
x = np.arange(local.shape[1])
fig, axis = plt.subplots(figsize=(8, 3.5))
axis.bar(x - 0.3, local[0], 0.2, label="rank 0, own batch")
axis.bar(x - 0.1, local[1], 0.2, label="rank 1, own batch")
axis.bar(x + 0.1, results[0]["after"].numpy(), 0.2, label="rank 0 after DDP backward")
axis.bar(x + 0.3, results[1]["after"].numpy(), 0.2, label="rank 1 after DDP backward")
axis.set(xlabel="weight index", ylabel="gradient", title="after backward, both ranks hold the mean")
axis.legend(fontsize=8)
plt.show()
print("after == mean of the local gradients:", np.allclose(results[0]["after"], local.mean(0), atol=1e-6))
identical = bool((results[0]["weights"] == results[1]["weights"]).all())
print("weights after the step identical on both ranks:", identical)"""),
        ("code", """\
timeline = nb.run_group(nb.bucket_timeline, 2)[0]
backward_ms = 1000 * timeline["backward_s"]
fig, axis = plt.subplots(figsize=(8, 3))
axis.barh(-1, backward_ms, color="lightgrey")
axis.text(backward_ms / 2, -1, "backward()", ha="center", va="center")
for index, at, size in timeline["buckets"]:
    axis.plot(1000 * at, index, "o", color="C0")
    axis.text(1000 * at, index + 0.25, f"bucket {index}: {size * 4 / 2**20:.1f} MB", fontsize=8)
axis.set(xlabel="milliseconds since backward() began", yticks=[], xlim=(0, backward_ms * 1.3),
         title="each bucket's all-reduce is launched during backward, not after it")
plt.show()
inside = sum(at < timeline["backward_s"] for _, at, _ in timeline["buckets"])
print(f"{len(timeline['buckets'])} buckets; {inside} launched before backward() returned")"""),
    ],
}


def source_hash(cells):
    """What a notebook's outputs depend on: its cells, the numbered scripts it runs and shows, and the
    notebooks' support module. Any of them changing makes the committed outputs stale."""
    digest = hashlib.sha256(repr(cells).encode())
    for path in sorted(REPO.glob("[0-9][0-9]_*.py")) + [FOLDER / "_support.py"]:
        digest.update(path.read_bytes())
    return digest.hexdigest()


def build(name):
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_markdown_cell(text) if kind == "md" else nbformat.v4.new_code_cell(text)
                      for kind, text in NOTEBOOKS[name]]
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    notebook.metadata["ddp_steps"] = {"source_sha256": source_hash(NOTEBOOKS[name]),
                                      "generated_by": "python tools/notebooks.py"}
    return notebook


def execute(notebook, timeout=600):
    from nbclient import NotebookClient

    NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(FOLDER)}}).execute()
    return notebook


def cells(notebook):
    return [("md" if cell.cell_type == "markdown" else "code", cell.source) for cell in notebook.cells]


def check():
    problems = []
    for name in NOTEBOOKS:
        path = FOLDER / f"{name}.ipynb"
        if not path.exists():
            problems.append(f"{path.name} is missing")
            continue
        committed = nbformat.read(path, as_version=4)
        if cells(committed) != NOTEBOOKS[name] or \
                committed.metadata.get("ddp_steps", {}).get("source_sha256") != source_hash(NOTEBOOKS[name]):
            problems.append(f"{path.name} is stale (its cells, the scripts or _support.py changed since it was "
                            f"executed): run python tools/notebooks.py {name}")
    for problem in problems:
        print("error:", problem, file=sys.stderr)
    return 1 if problems else 0


def main(prefixes):
    for name in NOTEBOOKS:
        if not prefixes or name.startswith(tuple(prefixes)):
            print(f"executing {name}.ipynb ...", flush=True)
            nbformat.write(execute(build(name)), FOLDER / f"{name}.ipynb")
    return 0


if __name__ == "__main__":
    sys.exit(check() if "--check" in sys.argv[1:] else main(sys.argv[1:]))
