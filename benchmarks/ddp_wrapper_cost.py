"""What wrapping a model in DDP costs a single process, measured step by step in one process: the same model
trained with and without the DDP wrapper, alternating every step, so that this shared machine's slow drifts
in speed hit both alike. benchmarks/run.py reports the result next to its whole-script comparison of
02_torchrun.py (1 process) with 00_single_gpu.py, whose run-to-run noise is larger than the effect.

    OMP_NUM_THREADS=2 torchrun --standalone --nproc_per_node=1 benchmarks/ddp_wrapper_cost.py --steps 200

Prints one JSON line: median step times (ms) and their ratio, plain / DDP (1.0 = DDP costs nothing).
"""
import argparse
import copy
import json
import statistics
import time

import torch
import torch.nn.functional as F
from _shared import finish, start, step02  # 02_torchrun.py's model and data
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--bucket-view", action="store_true", help="DDP(gradient_as_bucket_view=True)")
args = parser.parse_args()

start()
data = step02.SyntheticImages(args.batch_size * 8, seed=0)
batches = [(torch.stack([data[i][0] for i in range(b, b + args.batch_size)]),
            torch.tensor([data[i][1] for i in range(b, b + args.batch_size)]))
           for b in range(0, len(data), args.batch_size)]
plain = step02.build_model("cnn", 10)
models = {"plain": plain, "ddp": DDP(copy.deepcopy(plain), gradient_as_bucket_view=args.bucket_view)}
optimizers = {name: torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) for name, model in models.items()}
times = {name: [] for name in models}
for step in range(args.steps + 10):
    images, labels = batches[step % len(batches)]
    for name in (("plain", "ddp") if step % 2 == 0 else ("ddp", "plain")):  # alternate who goes first
        began = time.perf_counter()
        F.cross_entropy(models[name](images), labels).backward()
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)
        if step >= 10:  # the first steps warm up allocators and DDP's buckets
            times[name].append(time.perf_counter() - began)
plain_ms, ddp_ms = (1000 * statistics.median(times[name]) for name in ("plain", "ddp"))
print(json.dumps({"plain_ms": plain_ms, "ddp_ms": ddp_ms, "plain_over_ddp": plain_ms / ddp_ms}), flush=True)
finish()  # leaves without Python's shutdown (benchmarks/_shared.py says why)
