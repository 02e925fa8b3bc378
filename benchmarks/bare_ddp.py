"""The least a DDP training loop can be: the same model, data, batch and optimizer as 02_torchrun.py, and
nothing else (no validation, no metrics, no accumulation, no AMP, no progress). benchmarks/run.py compares
02's throughput with this one's. Run with torchrun; prints one JSON line per epoch from rank 0.

    torchrun --standalone --nproc_per_node=2 benchmarks/bare_ddp.py --train-samples 4096 --epochs 3

--communication takes DDP's gradient all-reduce apart, to find where scaling is lost (benchmarks/run.py):
`none` runs every step inside no_sync() (the ranks train independently: no communication, no waiting), `barrier`
adds only a barrier per step (the ranks wait for each other, but exchange no gradients).
"""
import argparse
import contextlib
import json
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _shared import finish, start, step02  # 02_torchrun.py's model and data
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser()
parser.add_argument("--train-samples", type=int, default=4096)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--communication", choices=["all-reduce", "barrier", "none"], default="all-reduce")
parser.add_argument("--no-bucket-view", action="store_true", help="DDP(gradient_as_bucket_view=False)")
args = parser.parse_args()

start()
data = step02.SyntheticImages(args.train_samples, seed=0)
sampler = DistributedSampler(data, seed=0, drop_last=True)
loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
model = DDP(step02.build_model("cnn", 10), gradient_as_bucket_view=not args.no_bucket_view)  # as in the scripts
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
for epoch in range(1, args.epochs + 1):
    sampler.set_epoch(epoch)
    began, samples = time.perf_counter(), 0
    for images, labels in loader:
        with model.no_sync() if args.communication != "all-reduce" else contextlib.nullcontext():
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
        if args.communication == "barrier":
            dist.barrier()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        samples += len(labels)
    if dist.get_rank() == 0:
        elapsed = time.perf_counter() - began
        print(json.dumps({"epoch": epoch, "samples_per_s": samples * dist.get_world_size() / elapsed}), flush=True)
finish()  # leaves without Python's shutdown (benchmarks/_shared.py says why)
