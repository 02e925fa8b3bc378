"""Exercise 10_stream: a tiny model learns y = 3x + 1 from windows stored in shard files of different sizes, read as
one stream by loader worker processes while it trains, on every rank. Run it:
mkdir -p /tmp/stream && torchrun --standalone --nproc_per_node=2 exercises/10_stream/train.py --out /tmp/stream"""
import argparse
import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset, get_worker_info  # noqa: F401 (get_worker_info: for you)

SHARDS = (37, 50, 21, 44)  # windows per shard file: shards differ in size, as real ones do; 152 in an epoch
RECORD = 8  # bytes per window: its number (int32, each window's own) and its input x (float32)


def make_shards(folder):
    """Given: writes the shard files (every rank writes the same bytes, each file replaced whole) and returns their
    paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths, first = [], 0
    for shard, count in enumerate(SHARDS):
        numbers = torch.arange(first, first + count, dtype=torch.int32)
        inputs = numbers.float() / sum(SHARDS) * 2 - 1  # x in [-1, 1)
        records = torch.stack([numbers, inputs.view(torch.int32)], 1)
        path, part = folder / f"shard_{shard}.bin", folder / f"shard_{shard}.bin.{os.getpid()}"
        part.write_bytes(records.numpy().tobytes())
        os.replace(part, path)
        paths.append(path)
        first += count
    return paths


def window_at(index, seed=0):
    """Given: (shard, window within the shard) of window `index` of the endless stream. Each epoch takes the shards in
    an order drawn from (seed, epoch), and each shard's windows in an order drawn from (seed, epoch, shard): every
    window once per epoch, and any index found without reading a byte."""
    epoch, index = divmod(index, sum(SHARDS))
    draw = seed * 1_000_003 + epoch
    for shard in torch.randperm(len(SHARDS), generator=torch.Generator().manual_seed(draw)).tolist():
        if index < SHARDS[shard]:
            order = torch.randperm(SHARDS[shard], generator=torch.Generator().manual_seed(draw * 1_000_003 + shard))
            return shard, order[index].item()
        index -= SHARDS[shard]
    raise AssertionError("unreachable")


class ShardStream(IterableDataset):
    """This rank's micro-batches of the stream, from `position` on: the windows all ranks consumed before (a resumed
    run's snapshot holds it). Each loader worker process runs __iter__ on its own copy of this object."""

    def __init__(self, paths, position, rank, world_size, batch_size):
        self.paths, self.position, self.rank, self.world_size = paths, position, rank, world_size
        self.batch_size = batch_size  # windows per rank and micro-batch

    def read(self, indices):
        """Given: the windows of the stream at `indices` (a range or list of ints), as one micro-batch: (numbers, x)."""
        records = []
        for index in indices:
            shard, window = window_at(index)
            with open(self.paths[shard], "rb") as f:
                f.seek(window * RECORD)
                records.append(f.read(RECORD))
        data = torch.frombuffer(bytearray(b"".join(records)), dtype=torch.int32).view(-1, 2)
        return data[:, 0].long(), data[:, 1].contiguous().view(torch.float32)

    def __iter__(self):
        worker = get_worker_info()  # None in the training process itself (--num-workers 0)
        micro, every = (worker.id, worker.num_workers) if worker else (0, 1)  # worker w makes w, w + W, ...
        while True:
            first = self.position + micro * self.batch_size * self.world_size  # the whole micro-batch, all ranks'
            # this rank's share: every world_size-th window, from its rank on
            yield self.read(range(first + self.rank, first + self.batch_size * self.world_size, self.world_size))
            micro += every

def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps, one micro-batch each")
    parser.add_argument("--batch-size", type=int, default=4, help="windows per rank and step")
    parser.add_argument("--position", type=int, default=0, help="windows of all ranks consumed before (a resume)")
    parser.add_argument("--num-workers", type=int, default=2, help="loader worker processes per rank")
    parser.add_argument("--out", type=Path, required=True, help="folder for the shards and rank<N>.json")
    args = parser.parse_args()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])  # torchrun's
    paths = make_shards(args.out / "shards")
    stream = ShardStream(paths, args.position, rank, world_size, args.batch_size)
    # the workers start here, forked before the process group exists: no lock of a gloo thread is copied into them
    batches = iter(DataLoader(stream, batch_size=None, num_workers=args.num_workers))
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    torch.manual_seed(0)
    model = DDP(nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen, losses = [], []
    for _ in range(args.steps):
        numbers, inputs = next(batches)
        seen.append(numbers.tolist())
        loss = ((model(inputs[:, None]).squeeze(1) - (3 * inputs + 1)) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()  # DDP averages the gradients over the ranks: every rank must take a step
        optimizer.step()
        losses.append(loss.item())
    if rank == 0:
        print(f"loss after {args.steps} steps: {losses[-1]:.4f}")
    # given: what the check reads
    (args.out / f"rank{rank}.json").write_text(json.dumps({"seen": seen, "losses": losses}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    os._exit(0)  # given: skip Python's shutdown, during which gloo's threads can abort a finished process
