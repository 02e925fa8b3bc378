"""What the tutorial says DDP does, checked in real 2-process gloo groups running the scripts' own code."""
import argparse
import os

import pytest
import torch
import torch.distributed as dist
from helpers import load_script, run_group
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

pytestmark = pytest.mark.multiproc

SINGLE, DISTRIBUTED = "00_single_gpu.py", "01_mp_spawn.py"
CPU = torch.device("cpu")


def flat_parameters(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def gather(tensor):
    """Every rank's copy of `tensor`, in rank order."""
    copies = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(copies, tensor)
    return copies


def bn_free_model():
    """For exact gradient comparisons: BatchNorm normalizes a batch of B differently from a batch of 2B, which
    would compare BatchNorm, not DDP."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                         nn.Linear(32, 10))


def options(**overrides):
    return argparse.Namespace(**{"grad_accum": 1, "amp": False, **overrides})


def wrap_broadcasts_rank0_weights(rank, world_size):
    torch.manual_seed(rank)  # a different initialisation on every rank
    model = load_script(DISTRIBUTED).build_model("cnn", 10)
    before = gather(flat_parameters(model))
    model = DDP(model)
    after = gather(flat_parameters(model))
    return before, after


def test_ddp_wrap_gives_every_rank_rank0_weights():
    before, after = run_group(wrap_broadcasts_rank0_weights, 2)[0]
    assert not torch.equal(before[0], before[1]), "the test needs ranks that start different"
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[0])


def train_real_model(rank, world_size):
    script = load_script(DISTRIBUTED)
    torch.manual_seed(rank)
    model = DDP(script.build_model("cnn", 10))
    data = script.SyntheticImages(256, seed=0)
    sampler = DistributedSampler(data, seed=0, drop_last=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        script.train_one_epoch(model, DataLoader(data, batch_size=32, sampler=sampler), optimizer,
                               torch.amp.GradScaler("cpu", enabled=False), options(), CPU, epoch)
    return gather(flat_parameters(model))


def test_ranks_hold_bitwise_identical_parameters_after_training():
    """The script's own CNN (with BatchNorm), its own training loop, different data on each rank, 2 epochs."""
    copies = run_group(train_real_model, 2)[0]
    assert torch.equal(copies[0], copies[1])


def ddp_step_vs_single_step(rank, world_size, batches, grad_accum):
    """Each rank trains on its own `grad_accum` micro-batches with 01's loop; rank 0 also runs 00's loop,
    without DDP, on all ranks' micro-batches at once. Counts gradient all-reduces with a comm hook."""
    all_reduces = []

    def counting_hook(state, bucket):
        all_reduces.append(bucket.index())
        return allreduce_hook(None, bucket)

    model = DDP(bn_free_model())
    model.register_comm_hook(None, counting_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    my_batches = batches[rank * grad_accum:(rank + 1) * grad_accum]
    load_script(DISTRIBUTED).train_one_epoch(model, my_batches, optimizer, torch.amp.GradScaler("cpu", enabled=False),
                                             options(grad_accum=grad_accum), CPU, 1)
    reference = bn_free_model()
    big_batch = [(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))]
    load_script(SINGLE).train_one_epoch(reference, big_batch, torch.optim.SGD(reference.parameters(), lr=0.1),
                                        torch.amp.GradScaler("cpu", enabled=False), options(), CPU, 1)
    return flat_parameters(model), flat_parameters(reference), len(all_reduces)


def make_batches(count, batch_size=8):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(batch_size, 3, 16, 16, generator=generator),
             torch.randint(10, (batch_size,), generator=generator)) for _ in range(count)]


@pytest.fixture(scope="module")
def one_step():
    """One DDP step on 2 ranks, batch B each, no accumulation: rank 0's (DDP, single-process, all-reduces)."""
    return run_group(ddp_step_vs_single_step, 2, make_batches(2), 1)[0]


def test_gradients_are_averaged(one_step):
    """One DDP step on 2 ranks with batch B each = one single-process step on the 2B batch."""
    ddp, single, _ = one_step
    assert torch.allclose(ddp, single, atol=1e-6)
    assert not torch.allclose(ddp, flat_parameters(bn_free_model()), atol=1e-4), "the step must change the weights"


def test_no_sync_accumulation_equals_one_big_step_and_communicates_once(one_step):
    """4 micro-batches per rank with no_sync on the first 3 = one step on the 8x batch, with a single
    round of gradient all-reduces (the same count as a step without accumulation: one_step's)."""
    (accumulated, single, accumulated_all_reduces), _ = run_group(ddp_step_vs_single_step, 2, make_batches(8), 4)
    assert torch.allclose(accumulated, single, atol=1e-6)
    _, _, plain_all_reduces = one_step
    assert accumulated_all_reduces == plain_all_reduces >= 1


def save_from_every_rank(rank, world_size, folder):
    script = load_script(DISTRIBUTED)
    model = script.build_model("cnn", 10)
    args = argparse.Namespace(model="cnn")
    script.save_checkpoint(f"{folder}/rank{rank}.pt", model, args, epoch=1, num_classes=10)
    return sorted(os.listdir(folder))  # what exists when save_checkpoint returns on this rank


def test_only_rank0_writes_the_checkpoint_and_the_others_wait_for_it(tmp_path):
    """Every rank asks to save to its own path; only rank 0's file appears, and it already exists when
    save_checkpoint returns on rank 1 (the barrier)."""
    seen_by_rank = run_group(save_from_every_rank, 2, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.pt"]
    assert seen_by_rank == [["rank0.pt"], ["rank0.pt"]]
