"""A minimal reproduction, with torch alone, of the abort at exit that ended some runs of the port here after they
had gone well (1 of 30 runs, 1 of its 15 stops: tools/stress_exits_before.md; issue 34): `terminate called
without an active exception`, SIGABRT, exit code -6, after a clean run.

    for i in $(seq 24); do torchrun --standalone --nproc_per_node=2 tools/repro_gloo_exit_abort.py; done 2>&1 |
        grep -c "terminate called"                       # some aborts (3 in 24 runs here, torch 2.15.0)
    ... tools/repro_gloo_exit_abort.py --leave-at-once   # what the scripts now do

What happens (a native stack taken with gdb at the abort, torch 2.15.0, Python 3.11):
- Once DDP (or FSDP2) has used the gloo process group, destroy_process_group() no longer frees it: its worker
  threads (`pt_gloo_runloop`) run until the process ends, even after the DDP object is gone and gc has run
  (which object keeps the group was not found). After plain collectives only, destroy_process_group frees the
  group and joins its threads (all measured).
- A worker thread releases a finished all_reduce (`~AsyncAllreduceWork`) a moment after the main thread has seen it
  complete. Its tensors have Python objects, so the release takes the GIL (`TensorImpl::decref_pyobject`).
- If the main thread has meanwhile reached the end of the program, Python is shutting down (`Py_FinalizeEx`), and a
  thread asking for the GIL then is ended by `pthread_exit`; its forced unwinding through a C++ destructor, which
  may not throw, calls std::terminate: SIGABRT. The slower the worker thread (two busy cores), the likelier.
pytorch/pytorch#179291 (an atexit handler proposed, abandoned) describes the same kind of abort.
The scripts leave with os._exit(0) after destroy_process_group, once every file is written and closed and stdout
flushed: Python's shutdown, where the abort happens, never runs.
"""
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
optimizer = torch.optim.AdamW(model.parameters())
for _ in range(5):
    model(torch.randn(8, 32)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    check = torch.ones(2)
    dist.all_reduce(check)  # a tensor with a Python object: its release by gloo's thread takes the GIL
if dist.get_rank() == 0:
    time.sleep(0.5)  # rank 1 reaches the end first
dist.destroy_process_group()
if "--leave-at-once" in sys.argv:
    sys.stdout.flush()
    os._exit(0)
