"""The DDP knobs benchmarks/shaped_link.py measures all train correctly on 2 ranks (real gloo groups running the
benchmark's own code): the ones that only change how gradients travel leave the parameters bitwise identical;
compression and PowerSGD still learn; accumulation is the scripts' accumulation (tests/test_ddp_claims.py shows
that one equals one step on the large batch). And the published table is what the raw figures give."""
import argparse
import json
import sys

import pytest
import torch
from helpers import REPO, load_script, run_group

sys.path.insert(0, str(REPO / "benchmarks"))
import shaped_link  # noqa: E402
import shaped_link_worker as bench  # noqa: E402

SAME_ARITHMETIC = ["bucket_cap_mb=0.1", "bucket_cap_mb=100", "gradient_as_bucket_view=False", "static_graph"]


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train_each_knob(knobs, steps, rank, world_size):
    """The cnn (with BatchNorm) from the same weights, `steps` optimizer steps per knob on each rank's own
    batches; the final parameters, per knob."""
    pool = bench.batches(2 * steps, 16, first=0)[rank::world_size]
    finals = {}
    for knob in knobs:
        ddp, accumulate = bench.wrap(initial_cnn(), bench.KNOBS[knob])
        optimizer = bench.sgd(ddp)
        for step in range(steps):
            bench.train_step(ddp, optimizer, pool[step:step + accumulate])
        finals[knob] = flat(ddp.module)
    return finals


def initial_cnn():
    torch.manual_seed(0)
    return bench.build_model("cnn")


def accumulate_both_ways(rank):
    """4 micro-batches per rank, one optimizer step: the benchmark's train_step and 02_torchrun.py's
    train_one_epoch with --grad-accum 4, from the same weights."""
    micro = bench.batches(8, 16, first=0)[rank * 4:(rank + 1) * 4]
    results = []
    for loop in ("benchmark", "script"):
        ddp, accumulate = bench.wrap(initial_cnn(), bench.KNOBS["grad-accum 4"])
        optimizer = bench.sgd(ddp)
        if loop == "benchmark":
            bench.train_step(ddp, optimizer, micro)
        else:
            load_script("02_torchrun.py").train_one_epoch(
                ddp, micro, optimizer, torch.amp.GradScaler("cpu", enabled=False),
                argparse.Namespace(grad_accum=accumulate, amp=False, lr=0.05), torch.device("cpu"), 1)
        results.append(flat(ddp.module))
    return results


def every_knob(rank, world_size):
    """Everything these tests check, in one 2-rank group (starting one costs seconds)."""
    train, val = bench.batches(2048 // 32, 32, first=0), bench.batches(512 // 32, 32, first=10_000_000)
    return {"identical": train_each_knob(["default", *SAME_ARITHMETIC], 6, rank, world_size),
            # the benchmark's own accuracy run, on the wide MLP: 2 epochs of 2048 samples, 64 steps
            "learned": {knob: bench.train_and_evaluate("mlp", bench.KNOBS[knob], 2, train, val)
                        for knob in ["default", *bench.CHANGE_THE_RESULT]},
            "accumulated": accumulate_both_ways(rank),
            "static_graph_error": bench.static_graph_inside_no_sync(rank, world_size)}  # last: a broken model


@pytest.fixture(scope="module")
def ranks():
    return run_group(every_knob, 2, timeout=240)


@pytest.mark.multiproc
def test_knobs_that_only_change_how_gradients_travel_leave_the_parameters_bitwise_identical(ranks):
    """Bucket sizes, gradient_as_bucket_view and static_graph: the same sums, so the same parameters."""
    default = ranks[0]["identical"]["default"]
    assert not torch.equal(default, flat(initial_cnn())), "the steps must change the weights"
    for knob in ["default", *SAME_ARITHMETIC]:
        for rank in (0, 1):
            assert torch.equal(ranks[rank]["identical"][knob], default), f"{knob}, rank {rank}"


@pytest.mark.multiproc
def test_compressed_and_powersgd_runs_still_learn(ranks):
    """fp16/bf16 compression, PowerSGD rank 1 and 4 (compressing after its first steps, with error feedback),
    accumulation and the combinations: validation accuracy far above chance (10 %), and, but for accumulation
    (4x fewer optimizer steps), near the uncompressed run's."""
    results = ranks[0]["learned"]
    steps = 2 * (2048 // 32 // 2)  # 2 epochs, each rank 32 batches per epoch
    assert steps >= bench.POWERSGD_START + 40, "PowerSGD must run compressed for most steps"
    default_accuracy, _ = results["default"]
    assert default_accuracy > 0.6, results
    for knob, (accuracy, _) in results.items():
        assert accuracy > 0.4, f"{knob} did not learn: {results}"
        if "accumulate" not in bench.KNOBS[knob]:
            assert accuracy > default_accuracy - 0.1, f"{knob} learns much worse than the default: {results}"


@pytest.mark.multiproc
def test_the_benchmarks_accumulation_is_the_scripts(ranks):
    """The same parameters as 02_torchrun.py's --grad-accum 4 (which tests/test_ddp_claims.py shows equals one
    step on the 4x batch)."""
    for rank in (0, 1):
        benchmark, script = ranks[rank]["accumulated"]
        assert torch.equal(benchmark, script)


@pytest.mark.multiproc
def test_static_graph_cannot_accumulate_with_no_sync_in_this_torch(ranks):
    """Why no combination joins static_graph and accumulation (pytorch/pytorch#143580): the first backward inside
    no_sync() fails. If this starts failing, torch fixed it: combine them in KNOBS."""
    errors = [rank["static_graph_error"] for rank in ranks]
    assert all(error and "expect_autograd_hooks_" in error for error in errors), errors


def test_the_published_table_is_what_the_raw_figures_give_and_the_readme_shows_it():
    """benchmarks/shaped_link.md is summarize(benchmarks/shaped_link.json), and docs/scaling.md holds it."""
    table = shaped_link.summarize(json.loads(shaped_link.RAW.read_text()))
    assert shaped_link.TABLE.read_text() == table, "run: .venv/bin/python benchmarks/shaped_link.py --table-only"
    assert table.strip() in (REPO / "docs/scaling.md").read_text(), \
        "paste benchmarks/shaped_link.md into docs/scaling.md"
    assert shaped_link.PLOT.exists()
