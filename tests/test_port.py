"""port/: the small GPT of gpt_single.py, ported to torchrun in gpt_ddp.py, keeps the port's promises. Two
processes with two micro-batches of a quarter of the batch each (no_sync on the first) compute what one process
computes with the whole batch (to float rounding);
every rank computes the same gradient norm, and clips alike; validation metrics are exact over uneven shards;
a stopped run resumes to exactly the parameters of an uninterrupted one; a NaN loss on one rank stops every rank
together, with one line and exit status 1; ranks that read different texts refuse to train.
gpt_fsdp.py, the port sharded with FSDP2, computes what gpt_ddp.py computes (to float rounding), keeps the tied
matrix one, resumes bitwise, HSDP computes what 1-D FSDP2 computes, and its exported file is gpt_single.py's.

Tiny settings: a text the tests make, a one-block model, a few steps. The 2-process runs are made once per session
(`runs`) and serve several claims."""
import contextlib
import functools
import inspect
import io
import json
import math
import random
import re
import warnings

import pytest
import torch
from helpers import PYTHON, REPO, clean_env, load_script, read_metrics, run, run_group, run_ok, torchrun
from test_refused_input import (
    PORT_SNAPSHOT,
    TRAIN_STATE,
    assert_said_once,
    checkpoint_of,
    cut,
    pickled,
    saved,
    snapshot_of,
)

SINGLE, PORTED, SHARDED = "port/gpt_single.py", "port/gpt_ddp.py", "port/gpt_fsdp.py"
TINY = ["--steps", "6", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "16", "--lr", "1e-2",
        "--warmup-steps", "2", "--eval-windows", "9", "--eval-every", "3", "--log-every", "1", "--sample-bytes",
        "20", "--save-every-steps", "2"]  # 9 validation windows: shards of 5 and 4 on 2 ranks
BATCH = 8  # the global batch: 8 windows in one process; in each of two, 2 micro-batches of 2 (--grad-accum 2)
PORTED_BATCH = ["--batch-size", BATCH // 4, "--grad-accum", 2]
# fp32 on CPU: the two runs differ only in the order of additions (see test_two_processes_...), ~1e-7 relative
RTOL = 1e-4
PEAK_TFLOPS = "0.5"  # any peak: the runs below that log the model FLOPs utilisation are checked against it


WORDS = ("the model learns every byte of this text while two processes share each batch and agree on every "
         "gradient before the step is taken so nothing drifts apart")


def make_text(path, size=12_000, block_size=16):
    """A small text of English words, made by the tests: not the built-in one, so they never depend on it. Its
    held-out part (the last 10%) starts with 9 validation windows that alternate between those words (windows 0, 2,
    .., 8: rank 0's shard on 2 ranks) and random capitals and digits the model never trained on (1, 3, .., 7: rank
    1's): a rank-local median, or a mean of the ranks' means, is then far from the whole set's."""
    words = WORDS.split()
    rng = random.Random(0)
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 12))).capitalize() + "." for _ in range(400)]
    prose, split = "\n".join(lines), size * 9 // 10
    odd = "".join(rng.choice("QXZJKVW0123456789") for _ in range(block_size * 9))
    held_out = "".join(prose[split + block_size * k:][:block_size] if k % 2 == 0 else odd[block_size * k:][:block_size]
                       for k in range(9))
    path.write_text((prose[:split] + held_out + prose[split + len(held_out):])[:size])
    return path


@pytest.fixture(scope="session")
def text(tmp_path_factory):
    return make_text(tmp_path_factory.mktemp("port") / "text.txt")


@pytest.fixture(scope="session")
def runs(text, tmp_path_factory):
    """runs(name) makes one of the session's runs once: (output, metrics or None, checkpoint path)."""
    made, folder = {}, tmp_path_factory.mktemp("port-runs")

    def commands(name):
        checkpoint, metrics = folder / (name if "sdp" in name else f"{name}.pt"), folder / f"{name}.jsonl"
        common = [*TINY, "--data", text, "--checkpoint", checkpoint, "--metrics", metrics]
        if name == "single":
            return [[PYTHON, SINGLE, *common, "--batch-size", BATCH, "--peak-tflops", PEAK_TFLOPS]], metrics, checkpoint
        if name == "ported":
            return [torchrun(2, PORTED, *common, *PORTED_BATCH)], metrics, checkpoint
        if name == "fsdp":  # gpt_fsdp.py (a snapshot folder, and at the end the exported checkpoint.single.pt)
            return [torchrun(2, SHARDED, *common, *PORTED_BATCH)], metrics, checkpoint
        if name.startswith("padded"):  # the last 0-8 targets of each window ignored: 2 processes, or 1 with the whole
            batch = PORTED_BATCH if name == "padded" else ["--batch-size", BATCH // 2, "--grad-accum", 2]  # batch
            return [torchrun(2 if name == "padded" else 1, SHARDED, *common, *batch, "--pad-up-to", 8,
                             "--peak-tflops", PEAK_TFLOPS)], metrics, checkpoint
        if name == "hsdp":  # 4 processes, 2 copies of 2 pieces, a quarter of the batch each; resumed by 1-D FSDP2 on 2
            stopped = torchrun(4, SHARDED, *common, "--replicas", 2, "--batch-size", 1, "--grad-accum", 2)
            return [[*stopped, "--stop-after-steps", "3"], torchrun(2, SHARDED, *common, *PORTED_BATCH)], metrics, \
                checkpoint
        interrupted = torchrun(2, PORTED, *common, *PORTED_BATCH)  # "resumed": stopped, then again
        if name == "fsdp-resumed":  # and each block's activations recomputed in backward, each block compiled
            interrupted = torchrun(2, SHARDED, *common, *PORTED_BATCH, "--activation-checkpointing", "--compile",
                                   "aot_eager")
        return [[*interrupted, "--stop-after-steps", "3"], interrupted], metrics, checkpoint

    def get(name):
        if name not in made:
            steps, metrics, checkpoint = commands(name)
            output = "".join(run_ok(command, timeout=120).stdout for command in steps)
            made[name] = output, read_metrics(metrics), checkpoint
        return made[name]

    return get


NORMS = r"gradient norms: (\d+), sum ([-+.\deE]+), sha256 (\w+)"  # every step's pre-clip norm: count, sum, hash


def rank_lines(output):
    """{rank: (parameter checksum, steps, sum of the gradient norms, hash of them all)} from every rank's last line."""
    return {int(found[0]): found[1:] for found in re.findall(
        rf"rank (\d) done: parameter checksum ([-+.\deE]+); {NORMS}", output)}


# --- the port computes what the single-device script computes --------------------------------------------------

@pytest.mark.launch
def test_two_processes_with_half_the_batch_each_match_one_process_with_the_whole(runs):
    """Same windows, same order: in each of its 2 micro-batches, rank r takes every 2nd window of the next 4 of
    the batch the single process takes whole; the first micro-batch's backward runs under no_sync (no all-reduce),
    the second's all-reduces the sum and DDP averages over the ranks. Not bitwise: float addition is not
    associative, and the sums run in another order (each rank's two quarter-batch means, halved and added, then the
    all-reduce's sum and division by 2, against one mean of the whole batch; a process with 2 threads splits its
    matmuls differently from two with 1) - about 1e-7 relative in fp32, and RTOL = 1e-4 allows for the few steps
    to amplify it."""
    single, ported = runs("single")[1], runs("ported")[1]
    assert [m["step"] for m in single] == [m["step"] for m in ported] == list(range(1, 7))
    for one, two in zip(single, ported, strict=True):
        assert one["lr"] == two["lr"], "warm-up and decay count optimizer steps, the same in both"
        for key in ("loss", "grad_norm", "val_loss", "val_median_window_loss"):
            if key in one:
                assert two[key] == pytest.approx(one[key], rel=RTOL), (one["step"], key)
    assert single[-1]["loss"] < single[0]["loss"] - 0.5, "the loss falls"


@pytest.mark.launch
def test_validation_metrics_are_exact_over_uneven_shards(runs, text):
    """9 validation windows on 2 ranks: 5 and 4. The loss is the all-reduced sums (of losses and of bytes) divided
    once, and the median is taken over every window's loss gathered once each: both equal the one-process run's
    value within RTOL (another run, whose weights differ by float rounding; notebook port_your_model compares the
    ways on the same weights).
    The test text makes rank 0's windows easy and rank 1's hard (make_text), so that rank 0's own median and the
    mean of the two ranks' means are far from the whole set's: this checks first that, with the final weights,
    they are (more than 100 x RTOL off), so that a port computing either would fail the comparison."""
    single, ported = runs("single")[1], runs("ported")[1]
    evaluated = [(one, two) for one, two in zip(single, ported, strict=True) if "val_loss" in one]
    assert [one["step"] for one, _ in evaluated] == [3, 6]
    script = load_script(SINGLE)
    args = script.parse_args([*map(str, TINY), "--data", str(text)])
    model = script.GPT(args.block_size, args.n_layer, args.n_head, args.n_embd, 0.0)
    model.load_state_dict(torch.load(runs("single")[2], weights_only=True)["model"])
    val = script.load_text(args, processes=1)[1]
    inputs, targets = script.get_batch(val, list(range(0, 9 * args.block_size, args.block_size)), args.block_size,
                                       torch.device("cpu"))
    with torch.no_grad():
        windows = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(),
                                                    reduction="none").view(targets.shape).mean(1)
    exact_mean, exact_median = single[-1]["val_loss"], single[-1]["val_median_window_loss"]
    assert windows.mean().item() == pytest.approx(exact_mean, rel=RTOL)
    assert windows.median().item() == pytest.approx(exact_median, rel=RTOL)
    rank_local_median = windows[0::2].median().item()
    mean_of_means = (windows[0::2].mean().item() + windows[1::2].mean().item()) / 2
    assert abs(rank_local_median - exact_median) > 100 * RTOL * exact_median, (rank_local_median, exact_median)
    assert abs(mean_of_means - exact_mean) > 100 * RTOL * exact_mean, (mean_of_means, exact_mean)
    for one, two in evaluated:
        assert two["val_loss"] == pytest.approx(one["val_loss"], rel=RTOL)
        assert two["val_median_window_loss"] == pytest.approx(one["val_median_window_loss"], rel=RTOL)


# --- every rank agrees ----------------------------------------------------------------------------------------

@pytest.mark.launch
def test_every_rank_computes_the_same_gradient_norm_and_ends_with_the_same_weights(runs):
    """clip_grad_norm_ runs after the last micro-batch's backward, when DDP has made the gradients identical:
    every rank's pre-clip norm is the same number at every step (the hash of each rank's list of them, and their
    sum, agree to the last bit), and so are the weights. And it is the whole batch's norm: the single process's."""
    output = runs("ported")[0]
    ranks = rank_lines(output)
    assert sorted(ranks) == [0, 1] and ranks[0] == ranks[1] and ranks[0][1] == "6"
    steps, total, _ = re.search(NORMS, runs("single")[0]).groups()
    assert steps == "6" and float(total) == pytest.approx(float(ranks[0][2]), rel=RTOL)
    assert output.count("sample:") == 1 and output.count("val loss") == 2, "rank 0 alone logs and samples"


def gathered_and_refused(rank, world_size, damaged):
    """In one 2-process group (one start-up for three claims): rank r's values of 9 items, shared as
    DistributedSampler and as gpt_ddp.py share them, then gathered; gpt_fsdp.py's load_checkpoint given each damaged
    snapshot; then the text check, each rank with another digest (which ends the group)."""
    from torch.utils.data import DistributedSampler

    ported = load_script(PORTED)
    values = torch.arange(9.0)
    sampler = list(DistributedSampler(range(9), num_replicas=world_size, rank=rank, shuffle=False))
    padded = [torch.zeros(len(sampler)) for _ in range(world_size)]
    torch.distributed.all_gather(padded, values[sampler])
    gathered = torch.cat(padded).tolist(), ported.gather_uneven(values[rank::world_size], 9).tolist()
    sharded, refusals = load_script(SHARDED), {}
    for case, path in damaged.items():
        said = io.StringIO()
        with contextlib.redirect_stderr(said), pytest.raises(SystemExit) as stopped:
            sharded.load_checkpoint(sharded.parse_args(["--checkpoint", path]), "cpu", "0" * 64, world_size)
        refusals[case] = stopped.value.code, said.getvalue()
    said = io.StringIO()
    with contextlib.redirect_stderr(said), pytest.raises(SystemExit) as stopped:
        ported.check_same_text(f"digest of the text rank {rank} read", "text.txt")
    return gathered, (stopped.value.code, said.getvalue()), refusals


# gpt_fsdp.py's snapshot is a folder: name: (make what --checkpoint names in a fresh folder, the error's type)
DAMAGED_FOLDERS = {
    "empty train_state.pt": (lambda root: saved("train_state.pt", b"")(root).parent, "EOFError"),
    "train_state.pt a text file": (lambda root: saved("train_state.pt", b"not a snapshot\n")(root).parent,
                                   "UnpicklingError"),
    "a folder without train_state.pt": (lambda root: root, "FileNotFoundError"),
    "05's train_state.pt": (lambda root: saved("train_state.pt", TRAIN_STATE)(root).parent, "KeyError"),
    "gpt_ddp.py's snapshot file": (saved("gpt.pt", lambda: PORT_SNAPSHOT), "NotADirectoryError"),
}


@pytest.fixture(scope="module")
def damaged_folders(tmp_path_factory):
    """{case: (path, its folder, every file there and its bytes before)}"""
    made = {}
    for case, (make, _) in DAMAGED_FOLDERS.items():
        root = tmp_path_factory.mktemp("damaged")
        made[case] = make(root), root, snapshot_of(root)
    return made


@pytest.fixture(scope="module")
def group_results(damaged_folders):
    return run_group(gathered_and_refused, 2, {case: str(path) for case, (path, _, _) in damaged_folders.items()})


@pytest.mark.multiproc
def test_a_gathered_metric_counts_each_item_once_where_distributed_sampler_counts_one_twice(group_results):
    sampler_gathered, exact = group_results[0][0]
    assert sorted(sampler_gathered) == [0, 0, 1, 2, 3, 4, 5, 6, 7, 8], "DistributedSampler pads with item 0 again"
    assert sorted(exact) == list(range(9))


@pytest.mark.multiproc
def test_ranks_that_read_different_texts_refuse_together_in_one_line(group_results):
    (code0, said0), (code1, said1) = (refused for _, refused, _ in group_results)
    assert code0 == code1 == 1
    assert said0.startswith("error: --data text.txt: the ranks read different bytes") and said1 == ""
    assert "check_same_text(digest, args.data)" in inspect.getsource(load_script(PORTED).main), "main checks"


@pytest.mark.multiproc
def test_the_sharded_port_refuses_a_damaged_or_foreign_snapshot_on_every_rank_in_one_line_and_leaves_it(
        group_results, damaged_folders):
    """gpt_fsdp.py's load_checkpoint, on each rank of a 2-process group: every rank that reads the damaged small part
    of a snapshot folder says so in one line and exits 1, and nothing there changes. (A piece or the index damaged is
    found by DCP once the model is sharded: the same line with "a piece is unreadable", as step 05's.)"""
    for case, (path, root, before) in damaged_folders.items():
        said = (f"error: --checkpoint {path}: unreadable, or not a snapshot of this script "
                f"({DAMAGED_FOLDERS[case][1]}); move it away to start over\n")
        assert [refusals[case] for _, _, refusals in group_results] == [(1, said), (1, said)], case
        assert snapshot_of(root) == before, case


@pytest.mark.launch
def test_a_nan_loss_on_one_rank_stops_every_rank_at_that_step_without_a_snapshot_of_it(text, tmp_path):
    """Rank 1's loss alone becomes NaN at step 3 (NAN_LOSS_AT): the all-reduced loss is NaN on both ranks, so
    both stop there - none waits for the other in the next all-reduce - and the snapshot of step 2 stays."""
    checkpoint = tmp_path / "gpt.pt"
    command = torchrun(2, PORTED, *TINY, "--data", text, "--batch-size", "4", "--checkpoint", checkpoint)
    result = run(command, timeout=120, env=clean_env(NAN_LOSS_AT="1:3"))
    assert result.returncode == 1, result.stdout[-3000:]  # torchrun's status: 1 for any failed worker
    errors = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert errors == ["error: the loss is nan at step 3; the last snapshot, if any, holds finite weights (the steps "
                      "since it are lost); try a lower --lr"], result.stdout[-3000:]
    assert "step 3/6" not in result.stdout and "rank 0 done" not in result.stdout
    snapshot = torch.load(checkpoint, weights_only=True)
    assert snapshot["step"] == 2 and all(value.isfinite().all() for value in snapshot["model"].values())


# --- a stopped run resumes exactly ---------------------------------------------------------------------------

@pytest.mark.launch
def test_a_run_stopped_mid_training_resumes_to_exactly_the_uninterrupted_parameters(runs):
    """--stop-after-steps 3 stops both ranks as SIGTERM would (a snapshot, exit 0); the same command resumes from
    the snapshot - weights, AdamW's moments, the schedule's place and the position in the data - and ends on the
    very same bits as the run that was never stopped."""
    output, metrics, checkpoint = runs("resumed")
    assert "stopped after step 3; the same command resumes from there" in output
    assert "resumed from" in output and "step 3 of 6" in output
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    resumed, uninterrupted = (torch.load(path, weights_only=True) for path in (checkpoint, runs("ported")[2]))
    assert resumed["step"] == uninterrupted["step"] == 6
    for name, value in uninterrupted["model"].items():
        assert torch.equal(resumed["model"][name], value), name
    assert metrics[3:] == [{**m, "tokens_per_s": n["tokens_per_s"]} for m, n in zip(runs("ported")[1][3:], metrics[3:],
                                                                                   strict=True)]


# --- gpt_fsdp.py: the port sharded per block, as step 05 shards (FSDP2) ----------------------------------------

def whole_snapshot(folder, like):
    """A gpt_fsdp.py snapshot folder's model as whole tensors (DCP's pieces read by this one process)."""
    import torch.distributed.checkpoint as dcp

    whole = {name: torch.empty_like(value) for name, value in like.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": whole}, checkpoint_id=folder, no_dist=True)
    return whole


@pytest.mark.launch
def test_the_sharded_port_computes_what_the_ddp_port_computes_and_logs_the_whole_models_norm(runs):
    """gpt_fsdp.py with gpt_ddp.py's flags (two micro-batches: the first keeps its gradients whole and unreduced,
    set_requires_gradient_sync(False), as DDP's no_sync): the same starting weights (rank 0's build, sent to all),
    the same loss, pre-clip gradient norm and validation at every step, to float rounding (a reduce-scatter adds in
    another order than an all-reduce: RTOL, as above). The logged norm is the whole model's, DDP's, not the
    norm of one rank's pieces."""
    ddp, sharded = runs("ported"), runs("fsdp")
    for one, two in zip(ddp[1], sharded[1], strict=True):
        assert one["lr"] == two["lr"]
        for key in ("loss", "grad_norm", "val_loss", "val_median_window_loss"):
            if key in one:
                assert two[key] == pytest.approx(one[key], rel=RTOL), (one["step"], key)
    ranks, reference = rank_lines(sharded[0]), rank_lines(ddp[0])[0]
    assert sorted(ranks) == [0, 1] and ranks[0] == ranks[1] and ranks[0][1] == "6"
    assert float(ranks[0][0]) == pytest.approx(float(reference[0]), rel=RTOL)
    assert sharded[0].count("sample:") == 1 and sharded[0].count("val loss") == 2, "rank 0 alone logs"


@pytest.mark.launch
def test_the_tied_matrix_stays_one_and_gpt_single_resumes_the_exported_file_and_samples_the_same_text(runs, text):
    """token.weight and head.weight: one parameter, sharded in the root unit: equal in the snapshot folder and in
    the exported file, which is gpt_single.py's own snapshot format: gpt_single.py, on one process, with the run's
    flags, resumes from it at the last step and samples the very text the sharded run sampled, from the very same
    weights (the checksum to the last digit)."""
    output, _, checkpoint = runs("fsdp")
    exported = torch.load(f"{checkpoint}.single.pt", weights_only=True)
    assert torch.equal(exported["model"]["token.weight"], exported["model"]["head.weight"])
    pieces = whole_snapshot(checkpoint, exported["model"])
    assert torch.equal(pieces["token.weight"], pieces["head.weight"])
    assert all(torch.equal(pieces[name], value) for name, value in exported["model"].items())
    single = run_ok([PYTHON, SINGLE, *TINY, "--data", text, "--checkpoint", f"{checkpoint}.single.pt", *PORTED_BATCH],
                    timeout=120).stdout
    assert "step 6 of 6" in single
    sample = re.compile(r"sample:\n(.*?)\n(?:rank \d )?done", re.S)
    text = sample.search(output).group(1)
    assert len(text) >= 10 and sample.search(single).group(1) == text
    assert re.search(r"checksum ([-+.\deE]+)", single).group(1) == rank_lines(output)[0][0]


@pytest.mark.launch
def test_a_stopped_sharded_run_resumes_bitwise_and_hsdp_equals_fsdp_and_resumes_on_another_mesh(runs):
    """Stopped after step 3 and resumed on the same 2 processes: the same bits as the run never stopped (each rank
    reads its own pieces back), with --activation-checkpointing on (recomputing a block's forward in backward gives
    the same numbers as keeping them) and --compile aot_eager (each block captured by torch.compile, forward and
    backward, before fully_shard, and run on the eager kernels: observed to give the same bits). HSDP on 4
    processes (2 copies x 2 pieces, a quarter of the batch each): the 1-D run's losses and norms to float rounding
    (RTOL: another order of additions); its snapshot, resumed by 1-D FSDP2 on 2 processes with the same global
    batch, ends where the 1-D run ends (RTOL)."""
    uninterrupted, resumed = runs("fsdp"), runs("fsdp-resumed")
    assert "stopped after step 3" in resumed[0] and "step 3 of 6" in resumed[0]
    assert resumed[0].count("each block compiled (aot_eager)") == 2
    one, two = (torch.load(f"{run[2]}.single.pt", weights_only=True) for run in (uninterrupted, resumed))
    for name, value in one["model"].items():
        assert torch.equal(two["model"][name], value), name
    assert [{**m, "tokens_per_s": 0} for m in resumed[1]] == [{**m, "tokens_per_s": 0} for m in uninterrupted[1]]
    output, hsdp, _ = runs("hsdp")
    assert "stopped after step 3" in output and "step 3 of 6" in output
    assert [m["step"] for m in hsdp] == list(range(1, 7))
    for a, b in zip(uninterrupted[1], hsdp, strict=True):
        for key in ("loss", "grad_norm", "val_loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=RTOL), (a["step"], key)
    assert float(rank_lines(output)[0][0]) == pytest.approx(float(rank_lines(uninterrupted[0])[0][0]), rel=RTOL)


@pytest.mark.launch
def test_a_loss_over_the_steps_count_of_targets_gives_two_ranks_with_different_counts_one_processs_gradient(runs):
    """--pad-up-to 8: each window's last 0-8 targets are padding, so the two ranks hold different numbers of targets.
    gpt_fsdp.py divides each rank's sum by the step's count of all targets (times the ranks, as FSDP2 averages): on 2
    processes it computes, step by step, what 1 process computes with the whole batch (to float rounding, RTOL)."""
    two, one = runs("padded"), runs("padded-one")
    for a, b in zip(one[1], two[1], strict=True):
        for key in ("loss", "grad_norm", "val_loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=RTOL), (a["step"], key)
    assert float(rank_lines(two[0])[0][0]) == pytest.approx(float(rank_lines(one[0])[0][0]), rel=RTOL)


# --- the model FLOPs utilisation -------------------------------------------------------------------------------

def test_the_model_flops_per_token_are_the_matmuls_of_one_training_step():
    """flops_per_token (the same function in the three port scripts) against torch's FlopCounterMode over one
    training step's forward and backward. The count differs from the formula by exactly two known terms: the formula
    counts 6 FLOPs for each bias and LayerNorm parameter too (an add or a multiply, not a matmul: the counter counts
    none), and the counter counts SDPA's backward as computing the attention scores QK^T again (2 x layers x context x
    width per token, which model FLOPs leave out). At the default size (4 layers, width 128, context 64) they partly
    cancel: the count is 0.4 % above the formula."""
    import torch.nn.functional as F
    from torch.utils.flop_counter import FlopCounterMode

    scripts = [load_script(name) for name in (SINGLE, PORTED, SHARDED)]
    sizes = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16"]
    for script in scripts:
        args = script.parse_args(sizes)
        torch.manual_seed(0)
        model, tokens = script.GPT(16, 2, 2, 32, 0.0), torch.randint(0, 256, (3, 17))
        with FlopCounterMode(display=False) as counter:
            F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        adds = sum(p.numel() for p in model.parameters() if p.dim() == 1)  # biases, LayerNorm gains
        recomputed_scores = 2 * args.n_layer * args.block_size * args.n_embd
        assert counter.get_total_flops() == 3 * 16 * (script.flops_per_token(model, args) - 6 * adds
                                                      + recomputed_scores), script.__name__
    default = scripts[0].parse_args([])
    model = scripts[0].GPT(default.block_size, default.n_layer, default.n_head, default.n_embd, 0.0)
    formula = scripts[0].flops_per_token(model, default)
    count_minus_formula = (2 * default.n_layer * default.block_size * default.n_embd
                           - 6 * sum(p.numel() for p in model.parameters() if p.dim() == 1))
    assert round(count_minus_formula / formula * 100, 1) == 0.4


@pytest.mark.launch
def test_the_logged_mfu_is_the_model_flops_per_second_over_every_devices_peak(runs, text):
    """--peak-tflops: each step's mfu = tokens/s x flops_per_token / (peak x processes), in one process (gpt_single.py)
    and in two (gpt_fsdp.py, its tokens/s the whole step's): the runs of the tests above, which pass --peak-tflops."""
    script = load_script(SINGLE)
    args = script.parse_args([*TINY, "--data", str(text)])
    per_token = script.flops_per_token(script.GPT(args.block_size, args.n_layer, args.n_head, args.n_embd, 0.0), args)
    for name, processes in (("single", 1), ("padded", 2), ("padded-one", 1)):
        output, metrics, _ = runs(name)
        assert [m["step"] for m in metrics] == list(range(1, 7)) and "MFU " in output
        for m in metrics:
            assert m["mfu"] == pytest.approx(m["tokens_per_s"] * per_token / (float(PEAK_TFLOPS) * 1e12 * processes),
                                             rel=1e-12), (name, m)


def test_a_mean_of_each_ranks_mean_is_not_the_one_process_gradient_when_the_counts_differ():
    """The same arithmetic in one process, the ranks' gradients averaged as DDP and FSDP2 average them: each rank's
    sum over the count of all targets gives the gradient of one mean over the whole batch; each rank's own mean
    (F.cross_entropy's default) gives another, weighing a target more on the rank that holds fewer."""
    import torch.nn.functional as F

    sharded = load_script(SHARDED)
    args = sharded.parse_args(["--block-size", "16", "--pad-up-to", "12", "--seed", "3"])
    torch.manual_seed(0)
    model, tokens = sharded.GPT(16, 1, 2, 32, 0.0), torch.randint(0, 256, (8, 17))
    inputs, kept = tokens[:, :-1], torch.arange(16) < 16 - sharded.padding(0, 8, args)[:, None]
    targets = tokens[:, 1:].masked_fill(~kept, -100)
    ranks = [slice(0, None, 2), slice(1, None, 2)]
    assert kept[ranks[0]].sum() != kept[ranks[1]].sum(), "the two ranks hold different numbers of targets"

    def gradient(rows, reduction, scale=1.0):
        model.zero_grad()
        loss = F.cross_entropy(model(inputs[rows]).flatten(0, 1), targets[rows].flatten(), ignore_index=-100,
                               reduction=reduction)
        (loss * scale).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    one_process = gradient(slice(None), "mean")
    by_count = sum(gradient(rows, "sum", 2 / kept.sum()) for rows in ranks) / 2
    by_means = sum(gradient(rows, "mean") for rows in ranks) / 2
    assert torch.allclose(by_count, one_process, rtol=1e-5, atol=1e-8)
    assert not torch.allclose(by_means, one_process, rtol=1e-2, atol=1e-4)


# --- what the single-device script promises ------------------------------------------------------------------

def test_refused_flags_say_why_in_one_line(capsys, text, monkeypatch):
    for script in (SINGLE, PORTED, SHARDED):
        for flags, said in ((["--n-embd", "30", "--n-head", "4"], "--n-embd 30 must be a multiple of --n-head 4"),
                            (["--lr", "nan"], "--lr"), (["--steps", "0"], "--steps must be at least 1"),
                            (["--peak-tflops", "0"], "--peak-tflops must be a positive number, got 0.0"),
                            (["--data", "missing.txt"], "--data missing.txt: no such file"),
                            (["--data", str(REPO / "port")], f"--data {REPO / 'port'}: a folder, not a text file")):
            with pytest.raises(SystemExit):
                load_script(script).parse_args(flags)
            assert said in capsys.readouterr().err.splitlines()[-1]
    monkeypatch.setenv("WORLD_SIZE", "4")  # as torchrun sets it: HSDP's groups must split the processes evenly
    with pytest.raises(SystemExit):
        load_script(SHARDED).parse_args(["--replicas", "3"])
    assert capsys.readouterr().err.splitlines()[-1].endswith("--replicas 3 must divide the 4 processes")


@pytest.mark.parametrize("script", [SINGLE, PORTED, SHARDED])
@pytest.mark.parametrize("size", [200, 3, 0])
def test_a_text_too_short_for_one_global_batch_or_empty_is_refused_in_one_line(text, tmp_path, script, size):
    """One line naming the file, before any tensor is made of it (an empty file once died in torch.frombuffer)."""
    short = tmp_path / "short.txt"
    short.write_bytes(text.read_bytes()[:size])
    module = load_script(script)
    with pytest.raises(SystemExit, match=f"^error: --data {short}: {size} bytes are too few[^\n]*$"):
        module.load_text(module.parse_args(["--data", str(short)]), processes=2)


# name: (make the file --checkpoint names, the error's type the one line gives)
DAMAGED_CHECKPOINTS = {
    "empty file": (saved("gpt.pt", b""), "EOFError"),
    "snapshot cut short": (cut("gpt.pt", lambda: PORT_SNAPSHOT), "RuntimeError"),
    "text file": (saved("gpt.pt", b"not a snapshot\n"), "UnpicklingError"),
    "plain pickle": (pickled("gpt.pt"), "UnpicklingError"),
    "plain state_dict": (saved("gpt.pt", {"token.weight": torch.zeros(256, 32)}), "KeyError"),
    "04's snapshot": (saved("gpt.pt", lambda: checkpoint_of(optimizer={})), "KeyError"),
    "a folder": (lambda root: (root / "gpt.pt").mkdir() or root / "gpt.pt", "IsADirectoryError"),
}


@pytest.mark.parametrize("case", DAMAGED_CHECKPOINTS)
def test_a_damaged_or_foreign_checkpoint_is_refused_in_one_line_and_left_as_it_was(text, tmp_path, case, capsys):
    """In-process, the single-device script's load_checkpoint (gpt_ddp.py's, on 2 ranks: the launch below)."""
    make, why = DAMAGED_CHECKPOINTS[case]
    path, single = make(tmp_path), load_script(SINGLE)
    before = snapshot_of(tmp_path)
    said = (f"error: --checkpoint {path}: unreadable, or not a snapshot of this script ({why}); move it away to start "
            "over")
    with pytest.raises(SystemExit, match=f"^{re.escape(said)}$"):
        single.load_checkpoint(single.parse_args(["--data", str(text), "--checkpoint", str(path)]), "cpu", "0" * 64)
    assert capsys.readouterr().err == "" and snapshot_of(tmp_path) == before


@pytest.mark.launch
def test_the_ported_script_refuses_another_scripts_snapshot_on_every_rank_and_leaves_it(text, tmp_path):
    """Step 04's snapshot given to the port: each rank reads it and says so in the same one line (it was a KeyError
    traceback on each), before any step, and the file is as it was."""
    path = saved("gpt.pt", lambda: checkpoint_of(optimizer={}))(tmp_path)
    before = snapshot_of(tmp_path)
    result = run(torchrun(2, PORTED, *TINY, "--data", text, *PORTED_BATCH, "--checkpoint", path), timeout=90)
    assert_said_once(result, f"error: --checkpoint {path}: unreadable, or not a snapshot of this script (KeyError)")
    assert "step 1/" not in result.stdout and snapshot_of(tmp_path) == before


def test_bf16_autocast_trains_on_the_cpu(text, tmp_path, capsys):
    single = load_script(SINGLE)
    metrics = tmp_path / "amp.jsonl"
    single.main(single.parse_args([*TINY, "--data", str(text), "--amp", "--batch-size", "4", "--metrics",
                                   str(metrics)]))
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert "sample:" in capsys.readouterr().out


def test_fp16_with_a_grad_scaler_clips_the_true_gradient_and_resumes_exactly(text, tmp_path, capsys):
    """--amp fp16: the scaler's factor is taken out (unscale_) before the norm meets --grad-clip, so the logged
    norms are the gradient's own, fp32's to fp16's rounding (without unscale_ they would be the scale, 2**16 at the
    start, times too large); and a run resumed from a snapshot ends with the weights and the scaler state of the
    run that was not interrupted (the scale is in the snapshot)."""
    single = load_script(SINGLE)
    flags = [*TINY, "--data", str(text), "--batch-size", "4", "--save-every-steps", "3"]

    def norms(amp, checkpoint):
        metrics = tmp_path / f"{checkpoint}.jsonl"
        single.main(single.parse_args([*flags, *amp, "--metrics", str(metrics), "--checkpoint",
                                       str(tmp_path / checkpoint)]))
        return [json.loads(line)["grad_norm"] for line in metrics.read_text().splitlines()]

    fp32, fp16 = norms([], "fp32.pt"), norms(["--amp", "fp16"], "fp16.pt")
    # the same data and start: where no step overflowed, fp16's norm is fp32's to its rounding (3e-4 relative
    # measured; 5% allowed); a norm of still-scaled gradients would be thousands of times larger
    same = [(a, b) for a, b in zip(fp32, fp16, strict=True) if math.isfinite(b)]
    assert len(same) >= 3 and all(abs(b - a) <= 0.05 * a for a, b in same), (fp32, fp16)

    saved = single.save_checkpoint
    try:  # keep the step-3 snapshot of a third run, then resume from it
        single.save_checkpoint = lambda path, snapshot: saved(path, snapshot) if snapshot["step"] == 3 else None
        norms(["--amp", "fp16"], "resumed.pt")
    finally:
        single.save_checkpoint = saved
    assert torch.load(tmp_path / "resumed.pt", weights_only=True)["step"] == 3
    norms(["--amp", "fp16"], "resumed.pt")
    whole, resumed = (torch.load(tmp_path / name, weights_only=True) for name in ("fp16.pt", "resumed.pt"))
    assert resumed["step"] == whole["step"] == 6 and resumed["scaler"] == whole["scaler"] != {}
    assert all(torch.equal(whole["model"][key], resumed["model"][key]) for key in whole["model"])
    assert "resumed from" in capsys.readouterr().out


def test_an_fp16_step_whose_gradients_overflow_is_skipped_and_the_run_goes_on(text, tmp_path, monkeypatch,
                                                                             recwarn):
    """--amp fp16 with a scale so large (2**40) that every scaled gradient overflows fp16 (its largest: 65504):
    the scaler skips each step instead of the run stopping on a non-finite norm, as an fp32 run would; the norm is
    logged as not finite (NaN here), the optimizer never steps, and the scale halves at each skipped step; the
    schedule's warning about a scheduler stepping before its optimizer is not shown (the skipped steps count)."""
    single = load_script(SINGLE)
    monkeypatch.setattr(torch.amp, "GradScaler", functools.partial(torch.amp.GradScaler, init_scale=2.0**40))
    metrics, checkpoint = tmp_path / "m.jsonl", tmp_path / "fp16.pt"
    single.main(single.parse_args([*TINY, "--data", str(text), "--batch-size", "4", "--amp", "fp16", "--metrics",
                                   str(metrics), "--checkpoint", str(checkpoint)]))
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]
    norms = [json.loads(line)["grad_norm"] for line in metrics.read_text().splitlines()]
    snapshot = torch.load(checkpoint, weights_only=True)
    assert len(norms) == 6 and not any(math.isfinite(norm) for norm in norms)
    assert snapshot["optimizer"]["state"] == {} and snapshot["scaler"]["scale"] == 2.0 ** (40 - 6)


@pytest.mark.launch
def test_the_ported_script_refuses_to_run_without_torchrun():
    result = run([PYTHON, PORTED, "--steps", "1"], timeout=60)
    assert result.returncode == 1 and "must be started by torchrun" in result.stdout


def test_the_scripts_are_standalone_and_the_built_in_text_ships_with_them():
    for script in (SINGLE, PORTED, SHARDED):
        source = (REPO / script).read_text()
        assert not re.search(r"^(from|import) (lessons|helpers|port)\b", source, re.M)
    data = REPO / "port/data/ddp_steps_prose.txt"
    assert 100_000 < data.stat().st_size <= 2_000_000 and (REPO / "port/data/README.md").exists()
