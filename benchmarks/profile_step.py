"""Where a 2-process training step's time goes on CPU: torch.profiler on every rank, over steps of the
same model, data and batch as 02_torchrun.py. Prints, for rank 0, the operators that take the most time,
and for each rank, how much of the step was spent in DDP's gradient all-reduce (including waiting for the
other rank). The benchmark's scaling figure (benchmarks/run.py) comes with this explanation.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/profile_step.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=1 benchmarks/profile_step.py   # to compare
"""
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _shared import finish, start, step02  # 02_torchrun.py's model and data
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

start()
rank = dist.get_rank()
data = step02.SyntheticImages(64 * 2 * 60, seed=0)
sampler = DistributedSampler(data, seed=0, drop_last=True)
loader = iter(DataLoader(data, batch_size=64, sampler=sampler, drop_last=True))
model = DDP(step02.build_model("cnn", 10), gradient_as_bucket_view=True)  # as in the scripts
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def step():
    images, labels = next(loader)
    F.cross_entropy(model(images), labels).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


for _ in range(20):  # warm-up
    step()
with profile(activities=[ProfilerActivity.CPU]) as prof:
    began = time.perf_counter()
    for _ in range(30):
        step()
    elapsed = time.perf_counter() - began
events = prof.key_averages()
total_us = elapsed * 1e6
comm_us = sum(e.self_cpu_time_total for e in events if any(k in e.key for k in ("gloo", "all_reduce", "allreduce")))
data_us = sum(e.cpu_time_total for e in events if e.key.startswith("enumerate(DataLoader)"))
lines = [f"rank {rank} of {dist.get_world_size()}: {1000 * elapsed / 30:.1f} ms/step; all-reduce (incl. waiting) "
         f"{100 * comm_us / total_us:.1f} %; data loading {100 * data_us / total_us:.1f} %"]
if rank == 0:
    lines.append(events.table(sort_by="self_cpu_time_total", row_limit=12))
for r in range(dist.get_world_size()):
    dist.barrier()
    if r == rank:
        print("\n".join(lines), flush=True)
finish()  # leaves without Python's shutdown (benchmarks/_shared.py says why)
