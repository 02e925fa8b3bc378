"""DistributedSampler, configured as the scripts configure it: every rank gets its own part of the data,
the parts never overlap, and set_epoch is what makes each epoch's order new."""
import re

import pytest
import torch
from helpers import REPO, SCRIPTS
from torch.utils.data.distributed import DistributedSampler

SAMPLER_SCRIPTS = [name for name in SCRIPTS if "DistributedSampler(" in (REPO / name).read_text()]


def shards(size, world_size, epoch=None, drop_last=True):
    samplers = [DistributedSampler(range(size), num_replicas=world_size, rank=rank, seed=0, drop_last=drop_last)
                for rank in range(world_size)]
    if epoch is not None:
        for sampler in samplers:
            sampler.set_epoch(epoch)
    return [list(sampler) for sampler in samplers]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_shards_are_disjoint_and_cover_the_dataset(world_size):
    parts = shards(120, world_size)
    assert all(len(part) == 120 // world_size for part in parts), "equal shards: every rank takes as many steps"
    assert sorted(sum(parts, [])) == list(range(120))


def test_uneven_dataset_drops_a_different_remainder_each_epoch():
    """With drop_last=True (the scripts' setting), 103 samples on 2 ranks: 102 per epoch, disjoint, and the
    sample left out changes with the epoch, so nothing is left out for good."""
    left_out = set()
    for epoch in range(4):
        parts = shards(103, 2, epoch)
        seen = sum(parts, [])
        assert len(seen) == len(set(seen)) == 102
        left_out |= set(range(103)) - set(seen)
    assert len(left_out) > 1


def test_set_epoch_changes_the_order_and_without_it_every_epoch_repeats():
    assert shards(100, 2, epoch=0) != shards(100, 2, epoch=1)
    assert shards(100, 2) == shards(100, 2), "no set_epoch: the same order every epoch"


def test_every_rank_shuffles_the_same_permutation():
    """Same seed and epoch on every rank: together the shards are one permutation, which is why they are disjoint."""
    parts = shards(100, 2, epoch=3)
    permutation = torch.randperm(100, generator=torch.Generator().manual_seed(0 + 3)).tolist()  # seed + epoch
    assert parts == [permutation[0::2], permutation[1::2]], "rank r takes every world_size-th of one permutation"
    assert parts[0] != sorted(parts[0])


@pytest.mark.parametrize("script", SAMPLER_SCRIPTS)
def test_every_script_with_a_distributed_sampler_calls_set_epoch_in_its_epoch_loop(script):
    source = (REPO / script).read_text()
    loop = re.search(r"for epoch in range\(.*?\n(.*?)\n", source, re.S)
    assert "train_sampler.set_epoch(epoch)" in loop.group(1)


def test_scripts_01_to_03_use_the_distributed_sampler():
    assert SAMPLER_SCRIPTS == ["01_mp_spawn.py", "02_torchrun.py", "03_multinode.py"]
