"""The long-job lecture's experiments: port/gpt_stream.py's stream of shards read by two ranks' loaders, beside two
first attempts (every rank reading the whole stream; every loader worker reading its rank's whole stream); whole
shard files split between ranks, whose uneven end leaves a rank in a collective the other never joins; and a
snapshot written in the background, read before and after its write has ended."""
import contextlib
import io
import logging
import os
import time
from collections import Counter
from itertools import islice
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

from lessons.runs import REPO, load_script

STREAM = "port/gpt_stream.py"
# torch.multiprocessing's note that it ended a group's other process after one died (a pid and a time on each run)
logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)


TINY_TEXT = 4200  # bytes of the built-in text the lecture cuts into shards


def tiny_shards(folder, size=TINY_TEXT, shards=4):
    """The first `size` bytes of the built-in text cut into `shards` shard files by port/make_shards.py: the folder,
    and what make_shards.py said (its folder's path left out)."""
    text, out, said = Path(folder) / "text.txt", Path(folder) / "shards", io.StringIO()
    text.write_bytes((REPO / "port" / "data" / "ddp_steps_prose.txt").read_bytes()[:size])
    with contextlib.redirect_stdout(said):
        load_script("port/make_shards.py").main([str(text), "--out", str(out), "--shards", str(shards)])
    return out, said.getvalue().strip().replace(str(out), "shards")


def stream_of(folder, batch_size, block_size):
    """gpt_stream.py, its flags for these shards, the shards' paths and sizes."""
    ported = load_script(STREAM)
    args = ported.parse_args(["--data", str(folder), "--batch-size", str(batch_size), "--block-size",
                              str(block_size)])
    shards, sizes, _, _ = ported.open_shards(args, processes=2)
    return ported, args, shards, sizes


def every_window(shards, block_size):
    """Every window of the shards (block_size + 1 bytes from each start a shard allows), as bytes: a Counter, since
    one text can hold the same bytes at two places."""
    windows = Counter()
    for path in shards:
        data = Path(path).read_bytes()
        windows.update(data[start:start + block_size + 1] for start in range(len(data) - block_size))
    return windows


class WorkersIgnored(IterableDataset):
    """A first attempt's stream: gpt_stream.py's ShardStream whose loader workers never ask which worker they are
    (get_worker_info() taken to say "no worker"): each makes every micro-batch of its rank."""

    def __init__(self, ported, *args):
        self.stream, self.ported = ported.ShardStream(*args), ported

    def __iter__(self):
        self.ported.get_worker_info = lambda: None  # in this worker process only (forked from the notebook's)
        return iter(self.stream)


def micro_batches(dataset, count, workers=2):
    """The first `count` micro-batches a DataLoader with `workers` loader workers hands the training loop, each a
    list of windows (bytes)."""
    loader = DataLoader(dataset, batch_size=None, num_workers=workers, multiprocessing_context="fork")
    return [[bytes(row.tolist()) for row in batch] for batch in islice(loader, count)]


def in_stream_order(per_rank):
    """The ranks' micro-batches put back in the stream's order: rank r's row j of micro-batch m is window
    m x batch x ranks + j x ranks + r."""
    ranks = len(per_rank)
    return [window for batches in zip(*per_rank, strict=True) for rows in zip(*batches, strict=True)
            for window in rows[:ranks]]


def stream_reads(folder, batch_size=4, block_size=16):
    """What two ranks' loaders (2 workers each) read of one epoch and a bit, three ways: gpt_stream.py's split; every
    rank reading the whole stream (each told it is rank 0 of 1); every worker reading its rank's whole stream."""
    ported, args, shards, sizes = stream_of(folder, batch_size, block_size)
    windows = every_window(shards, block_size)
    epoch = sum(windows.values())
    count = epoch // (batch_size * 2) + 1  # one micro-batch past the epoch's end
    result = {"windows in an epoch": epoch, "micro-batches read per rank": count, "windows": windows}
    ways = {"gpt_stream.py": lambda rank: ported.ShardStream(shards, sizes, args, 0, rank, 2),
            "every rank the whole stream": lambda rank: ported.ShardStream(shards, sizes, args, 0, 0, 1),
            "every worker its rank's whole stream": lambda rank: WorkersIgnored(ported, shards, sizes, args, 0, rank,
                                                                               2)}
    for way, make in ways.items():
        result[way] = [micro_batches(make(rank), count) for rank in (0, 1)]
    return result


def shard_counts(folder, batch_size, block_size):
    """Micro-batches per rank in one epoch when each rank reads whole shard files (rank r: shards r, r + 2, ...),
    and with gpt_stream.py's split of one stream (every rank alike)."""
    _, _, shards, sizes = stream_of(folder, batch_size, block_size)
    windows = [max(0, size - block_size) for size in sizes]
    per_rank = [sum(windows[rank::2]) // batch_size for rank in (0, 1)]
    return {"shards' windows": windows, "whole shards per rank": per_rank,
            "gpt_stream.py": [sum(windows) // (batch_size * 2)] * 2}


def uneven_end(rank, world_size, counts, then, log):
    """In a gloo group (its collective timeout short): each rank all-reduces a gradient-sized tensor once per
    micro-batch, as DDP does, for its own count of micro-batches; then `then`: "barrier" (the end of the epoch),
    or "validation" (an all-reduce of 2 sums). Returns what happened to this rank, and how long it waited; what the
    process writes to its stderr (gloo's own messages too) goes to the file `log`_RANK."""
    os.dup2(os.open(f"{log}_{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    done, last = 0, time.monotonic()  # last: when this rank's last collective ended
    try:
        for _ in range(counts[rank]):
            where = f"all-reduce {done + 1}"
            dist.all_reduce(torch.ones(1000))  # stands for DDP's all-reduce of the gradient
            done, last = done + 1, time.monotonic()
        where = then
        if then == "barrier":
            dist.barrier()
        else:
            dist.all_reduce(torch.ones(2))
        outcome = "went through"
    except RuntimeError as error:
        outcome = f"RuntimeError: {str(error).split('] ')[-1].strip()}"
    return {"micro-batches done": done, "then in": where, "waited s": round(time.monotonic() - last, 1),
            "outcome": outcome}


class SlowDisk:
    """DCP's FileSystemWriter whose writes begin `delay` seconds late: a file system under load (a network file
    system, a busy disk), to give a background write a while to be caught in."""

    def __new__(cls, path, delay):
        from torch.distributed.checkpoint import FileSystemWriter

        class Writer(FileSystemWriter):
            def write_data(self, plan, planner):
                time.sleep(delay)
                return super().write_data(plan, planner)

        return Writer(path)


def trusted_too_early(rank, world_size, folder):
    """A snapshot written in the background (dcp.async_save on a group of its own, a slow disk): read back as a
    "latest" marker written as soon as async_save returned would have it read, then after its write has ended. DCP's
    own log of the failed read (a traceback per rank, on stderr) is left out: the exception says it."""
    import torch.distributed.checkpoint as dcp

    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)

    group = dist.new_group(backend="gloo")
    weights = {f"rank {rank}": torch.full((1000,), float(rank))}  # each rank's own part, as FSDP2's pieces
    path = os.path.join(folder, "step_10")
    began = time.monotonic()
    future = dcp.async_save(weights, storage_writer=SlowDisk(path, 2.0), process_group=group)
    result = {"async_save returned after s": round(time.monotonic() - began, 1),
              "index (.metadata) there then": os.path.exists(os.path.join(path, ".metadata"))}
    try:
        dcp.load({f"rank {rank}": torch.zeros(1000)}, checkpoint_id=path)  # the default group: the write's is busy
        result["read then"] = "read"
    except BaseException as error:  # noqa: BLE001 (DCP's CheckpointException is a BaseException)
        said = [line.strip() for line in str(error).splitlines() if "metadata" in line] or [str(error)]
        result["read then"] = f"{type(error).__name__}: {said[0].replace(folder + os.sep, '')}"
    future.result()
    result["write ended after s"] = round(time.monotonic() - began, 1)
    result["files in the folder after"] = sorted(os.listdir(path))
    result["index (.metadata) there after"] = os.path.exists(os.path.join(path, ".metadata"))
    loaded = {f"rank {rank}": torch.zeros(1000)}
    dcp.load(loaded, checkpoint_id=path)
    result["read after"] = torch.equal(loaded[f"rank {rank}"], weights[f"rank {rank}"])
    dist.barrier()
    return result


def timed(rank, world_size, argv, delay):
    """port/gpt_timed.py's main in a process of runs.Processes, with STEP_DELAY=delay ("RANK:SECONDS", or "")."""
    from lessons import port

    os.environ["STEP_DELAY"] = delay or "-1:0"
    port.train(rank, world_size, argv, "port/gpt_timed.py")


def draw_split(axis, batch_size=2, ranks=2, workers=2, micro_batches=4):
    """The first windows of the stream, each box one window, coloured by the rank that reads it, labelled with the
    loader worker that makes its micro-batch (gpt_stream.py's split)."""
    from matplotlib.patches import Rectangle

    per_micro = batch_size * ranks
    for index in range(per_micro * micro_batches):
        micro, rank = index // per_micro, index % ranks
        worker = micro % workers
        axis.add_patch(Rectangle((index, 0), 0.9, 1, color=f"C{rank}", alpha=0.35 + 0.4 * worker))
        axis.text(index + 0.45, 0.5, f"{index}\nw{worker}", ha="center", va="center", fontsize=8)
    for micro in range(1, micro_batches):
        axis.axvline(micro * per_micro - 0.05, color="black", lw=1.5)
    axis.set_xlim(0, per_micro * micro_batches)
    axis.set_ylim(0, 1)
    axis.set_yticks([])
    axis.set_xticks([micro * per_micro + per_micro / 2 for micro in range(micro_batches)],
                    [f"micro-batch {micro}" for micro in range(micro_batches)])
