"""What the scripts' divergence check costs, measured in pairs: 02_torchrun.py's model under DDP on 2 ranks, trained
step by step with and without the check in the same processes (who goes first alternates), so that this shared
machine's drifts in speed hit both alike.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/divergence_check_cost.py --blocks 10

The check is the scripts' (train_one_epoch): before the optimizer step, this epoch's running loss sum is copied,
summed over the ranks with one all_reduce of one number, and tested with isfinite, which waits for it. Its cost
is bounded by that sequence alone, timed here too: the ratio with / without cannot honestly exceed
(step + check) / step by more than the noise. Rank 0 prints one JSON line: the ratio with / without (above 1.0:
the check costs time) per block of paired steps, its median, smallest and largest, the bound as a ratio, and the
verdict the spread allows.
"""
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
model = DDP(step02.build_model("cnn", 10), gradient_as_bucket_view=True)  # as in the scripts
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
totals = torch.zeros(2, dtype=torch.float64)  # loss sum, samples: as in the scripts


def check():
    loss_so_far = totals[0].clone()
    dist.all_reduce(loss_so_far)
    if not loss_so_far.isfinite():
        raise SystemExit("diverged")


def train_step(checked, images, labels):
    global totals
    began = time.perf_counter()
    loss = F.cross_entropy(model(images), labels)
    loss.backward()
    totals += torch.stack([loss.detach().double() * len(labels), torch.tensor(len(labels))])
    if checked:
        check()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - began


for step in range(10):  # warm-up: allocators, and DDP's buckets (rebuilt after the first step)
    train_step(step % 2 == 0, *batches[step % len(batches)])
ratios, medians = [], {True: [], False: []}
for _ in range(args.blocks):
    times = {True: [], False: []}
    for pair in range(args.pairs):
        images, labels = batches[pair % len(batches)]
        for checked in ((True, False) if pair % 2 == 0 else (False, True)):
            times[checked].append(train_step(checked, images, labels))
    for checked in times:
        medians[checked].append(statistics.median(times[checked]))
    ratios.append(medians[True][-1] / medians[False][-1])
checks = []  # the bound: the check alone, on this machine, between the same two processes
for _ in range(200):
    began = time.perf_counter()
    check()
    checks.append(time.perf_counter() - began)
check_s, step_s = statistics.median(checks), statistics.median(medians[False])
bound = (step_s + check_s) / step_s  # the ratio with / without that the check's own time gives
low, middle, high = min(ratios), statistics.median(ratios), max(ratios)
slower = _verdict.verdict(low, high, bound, above="biased: the whole spread lies past the bound (the check alone)",
                          below="slower with the check", neither="slower with the check")
verdict = _verdict.verdict(  # benchmarks/_verdict.py: the spread decides
    low, high, 1.0, above=slower, below="faster with the check: noise or bias, the check only adds work",
    neither=f"no difference resolved: the spread includes 1.0; the check alone is {100 * (bound - 1):.2f} % of a step")
if dist.get_rank() == 0:
    print(json.dumps({"torch": torch.__version__.split("+")[0], "world_size": dist.get_world_size(),
                      "step_ms_without": 1000 * step_s, "step_ms_with": 1000 * statistics.median(medians[True]),
                      "check_ms": 1000 * check_s, "ratio_bound": bound, "ratios": ratios, "ratio_median": middle,
                      "ratio_min": low, "ratio_max": high, "verdict": verdict}), flush=True)
finish()  # leaves without Python's shutdown (benchmarks/_shared.py says why)
