"""What gradient_as_bucket_view=True saves, measured in pairs: two DDP copies of 02_torchrun.py's model on 2 ranks,
one with the option and one without, trained alternately step by step in the same processes (who goes first
alternates too), so that this shared machine's drifts in speed hit both alike.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/bucket_view_cost.py --blocks 10

The loop is the scripts' (zero_grad(set_to_none=True)): .grad is None before every backward, so with the option
the Reducer still copies each new gradient into its bucket and only the copy back out into .grad is saved (the
batched_grad_copy paragraph of DistributedDataParallel's docstring, torch/nn/parallel/distributed.py). That
copy is the bound: the option cannot save more per step than copying the gradients once, which is timed here
too. Rank 0 prints one JSON line: the ratio without / with (above 1.0: the option is faster) per block of
paired steps, its median, smallest and largest, the bound as a ratio, and the verdict the spread allows.
"""
import copy
import json
import statistics
import time

import _verdict
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _shared import finish, paired_steps_arguments, rank_batches, start, step02  # 02_torchrun.py's model and data
from torch.nn.parallel import DistributedDataParallel as DDP

args = paired_steps_arguments()
start()
batches = rank_batches(args.batch_size)
base = step02.build_model("cnn", 10)
models = {"with": DDP(copy.deepcopy(base), gradient_as_bucket_view=True),
          "without": DDP(copy.deepcopy(base), gradient_as_bucket_view=False)}
optimizers = {name: torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) for name, model in models.items()}


def train_step(name, images, labels):
    began = time.perf_counter()
    F.cross_entropy(models[name](images), labels).backward()
    optimizers[name].step()
    optimizers[name].zero_grad(set_to_none=True)  # as in the scripts
    return time.perf_counter() - began


for step in range(10):  # warm-up: allocators, and DDP's buckets (rebuilt after the first step)
    for name in models:
        train_step(name, *batches[step % len(batches)])
ratios, medians = [], {"with": [], "without": []}
for _ in range(args.blocks):
    times = {"with": [], "without": []}
    for pair in range(args.pairs):
        images, labels = batches[pair % len(batches)]
        for name in (("with", "without") if pair % 2 == 0 else ("without", "with")):
            times[name].append(train_step(name, images, labels))
    for name in times:
        medians[name].append(statistics.median(times[name]))
    ratios.append(medians["without"][-1] / medians["with"][-1])
# the bound: copying the gradients once (what the option saves per step at most), timed on this machine
gradients = torch.cat([p.detach().reshape(-1) for p in base.parameters()])
target = torch.empty_like(gradients)
copies = []
for _ in range(200):
    began = time.perf_counter()
    target.copy_(gradients)
    copies.append(time.perf_counter() - began)
copy_s = statistics.median(copies)
step_s = statistics.median(medians["with"])
bound = (step_s + copy_s) / step_s  # the largest ratio without / with that saving one copy can give
low, middle, high = min(ratios), statistics.median(ratios), max(ratios)
faster = _verdict.verdict(low, high, bound, above="biased: the whole spread lies past the bound (one copy of the "
                          "gradients)", below="faster with the option", neither="faster with the option")
verdict = _verdict.verdict(low, high, 1.0, above=faster, below="slower with the option",
                           neither="not resolved on this machine")  # benchmarks/_verdict.py: the spread decides
if dist.get_rank() == 0:
    print(json.dumps({"torch": torch.__version__.split("+")[0], "world_size": dist.get_world_size(),
                      "gradient_bytes": gradients.numel() * 4, "step_ms_with": 1000 * step_s,
                      "step_ms_without": 1000 * statistics.median(medians["without"]),
                      "copy_ms": 1000 * copy_s, "ratio_bound": bound, "ratios": ratios,
                      "ratio_median": middle, "ratio_min": low, "ratio_max": high, "verdict": verdict}), flush=True)
finish()  # leaves without Python's shutdown (benchmarks/_shared.py says why)
