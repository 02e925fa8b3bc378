"""Where each rank's DDP step goes, and which rank is the slow one: every step of every rank split into computing,
waiting for the other ranks, and communicating, from wall clocks around the gradient all-reduce (CPU and gloo only:
with NCCL an all-reduce's future completes once the work is queued on the GPU, not done (torch's Work.get_future
documentation), so these clocks would count a fast rank's wait as computing; a GPU needs CUDA events, not done
here). Then the same with one rank made slow on purpose (a sleep before its forward, as a slower device or a busier
node would be): the table names it, and the time the others lose shows up as waiting, not as communication.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/step_split.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/step_split.py --slow-rank 1 --slow-ms 100

How a step is split, per rank (02's data, an MLP, DDP as the scripts build it, a comm hook that notes when each
gradient bucket is handed to the all-reduce):
- waiting: from the moment this rank handed over its last bucket to the moment the last rank handed over its own
  (no all-reduce can end before every rank has joined it);
- communicating: from there until this rank's backward() returned (DDP returns once every bucket is reduced);
- computing: the rest of the step (forward, backward up to its last bucket, the optimizer step).
Communication that overlapped the backward pass counts as computing: this is the time the step lost to it. The
MLP's 3.4 MB of gradients are one DDP bucket, so here nothing overlaps; with several buckets, waiting also holds the
transfer of the earlier buckets that the last one queues behind. The clocks are CLOCK_MONOTONIC, one clock for the
processes of one machine; ranks on several machines would need their clocks compared first (not done here). The
model has no BatchNorm: DDP would broadcast its statistics from rank 0 before every forward (forward_sync_buffers,
formerly broadcast_buffers), a collective these clocks do not see, where a fast rank waits for a slow
one inside its "computing" (measured with 02's CNN: the slow rank's delay appeared there, not as waiting).
"""
import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _shared import finish, rank_batches, start  # 02_torchrun.py's data
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per phase (after 5 warm-up steps)")
    parser.add_argument("--batch-size", type=int, default=64, help="per rank")
    parser.add_argument("--slow-rank", type=int, default=None, help="the rank made slow in the second phase")
    parser.add_argument("--slow-ms", type=float, default=100, help="how much slower, per step")
    return parser.parse_args(argv)


def split(records, world_size):
    """Per rank, the medians over steps of (step, computing, waiting, communicating), in seconds. records[rank][step]:
    (began, last bucket handed over, backward returned, ended), on the one clock of this machine."""
    table = {}
    for rank in range(world_size):
        parts = []
        for step, (began, handed, returned, ended) in enumerate(records[rank]):
            everyone = max(records[other][step][1] for other in range(world_size))  # the last rank's hand-over
            waiting = max(0.0, min(everyone, returned) - handed)
            communicating = max(0.0, returned - max(everyone, handed))
            parts.append((ended - began, ended - began - waiting - communicating, waiting, communicating))
        table[rank] = tuple(statistics.median(part[k] for part in parts) for k in range(4))
    return table


def slowest(table, margin=0.25):
    """The rank that computes longest, if it computes longer than every other by more than `margin` of the median
    step (else None: no rank stands out)."""
    computing = {rank: parts[1] for rank, parts in table.items()}
    rank = max(computing, key=computing.get)
    others = [value for other, value in computing.items() if other != rank]
    step = statistics.median(parts[0] for parts in table.values())
    return rank if others and computing[rank] - max(others) > margin * step else None


def report(title, table):
    lines = [title, f"{'rank':>4} {'step ms':>8} {'computing':>10} {'waiting':>8} {'communicating':>14}"]
    for rank, (step, computing, waiting, communicating) in sorted(table.items()):
        lines.append(f"{rank:>4} {1000 * step:8.1f} {1000 * computing:10.1f} {1000 * waiting:8.1f} "
                     f"{1000 * communicating:14.1f}")
    slow = slowest(table)
    lines.append(f"slow rank: {slow} (it computes longest; the others wait for it)" if slow is not None else
                 "slow rank: none stands out")
    return "\n".join(lines)


def measure(model, optimizer, batches, steps, delay):
    handed = []  # when each bucket of this step was handed to the all-reduce

    def timed_allreduce(state, bucket):  # DDP's default all-reduce (a mean), with the moment of the hand-over noted
        tensor = bucket.buffer().div_(dist.get_world_size())
        handed.append(time.monotonic())
        return dist.all_reduce(tensor, async_op=True).get_future().then(lambda future: future.value()[0])

    model.register_comm_hook(None, timed_allreduce)
    records = []
    for step in range(5 + steps):
        images, labels = batches[step % len(batches)]
        handed.clear()
        began = time.monotonic()
        time.sleep(delay)  # the slow rank's extra work
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        returned = time.monotonic()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= 5:
            records.append((began, max(handed), returned, time.monotonic()))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    return gathered


def main(args):
    start()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if args.slow_rank is not None and not 0 <= args.slow_rank < world_size:
        sys.exit(f"error: --slow-rank {args.slow_rank}: not a rank of this world of {world_size}")
    batches = rank_batches(args.batch_size)
    phases = [("every rank alike", None)] + ([] if args.slow_rank is None else [
        (f"rank {args.slow_rank} slowed by {args.slow_ms:g} ms a step", args.slow_rank)])
    for title, slow in phases:
        torch.manual_seed(0)
        mlp = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                            nn.Linear(256, 10))
        model = DDP(mlp, gradient_as_bucket_view=True)  # new each phase: one comm hook each
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        records = measure(model, optimizer, batches, args.steps, args.slow_ms / 1000 if rank == slow else 0.0)
        if rank == 0:
            print(report(f"{title} ({world_size} ranks, medians of {args.steps} steps):", split(records, world_size)),
                  flush=True)
    finish()


if __name__ == "__main__":
    main(parse_args())
