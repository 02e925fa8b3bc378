"""port/gpt_pp.py, the DDP port cut into pipeline stages, computes what one process computes: one run on 4 stages
with the GPipe schedule (steps 1-3, and a validation through the middle stages' sends), resumed on 2 stages with 1F1B
(steps 4-6), equals gpt_single.py with the same batch and micro-batches, step by step, and ends with its weights and
AdamW's moments; the tied matrix's two copies (stage 0's embedding, the last stage's head) stay
equal; the snapshots are gpt_single.py's layout, which it resumes, sampling the pipeline's text from the same weights.
Four launches, made once (`runs`): one process; the two layouts; gpt_single.py on the last snapshot."""
import math
import re

import pytest
import torch
from helpers import PYTHON, load_script, read_metrics, run_ok, torchrun
from test_port import make_text

PP, SINGLE = "port/gpt_pp.py", "port/gpt_single.py"
# 4 blocks: 4 stages of one, or 2 of two (the middle stages of 4 hold neither embedding nor head); 4 micro-batches of
# 2 windows; --grad-clip 0.5 is under every step's norm, so the clipping over the stages acts
FLAGS = ["--steps", "6", "--n-layer", "4", "--n-embd", "32", "--n-head", "4", "--block-size", "16", "--lr", "1e-2",
         "--warmup-steps", "2", "--eval-windows", "9", "--eval-every", "3", "--log-every", "1", "--sample-bytes", "20",
         "--grad-clip", "0.5", "--batch-size", "2", "--grad-accum", "4"]
# fp32 on the CPU. The stages compute one process's operations on the same micro-batches; only the order of some
# additions differs: the schedule divides the summed gradients by the micro-batches where one process divides each
# micro-batch's loss, the step's loss is a mean of the micro-batches' losses, the gradient norm is summed over the
# stages (measured over the 6 steps: at most 2e-7 relative): 1e-5 leaves a margin and catches a term counted twice
RTOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pp")
    common = [*FLAGS, "--data", make_text(folder / "text.txt")]
    checkpoint = folder / "pp.pt"
    one = run_ok([PYTHON, SINGLE, *common, "--metrics", folder / "one.jsonl", "--checkpoint", folder / "one.pt"],
                 timeout=180).stdout
    output = run_ok(torchrun(4, PP, *common, "--schedule", "gpipe", "--metrics", folder / "pp.jsonl", "--checkpoint",
                             checkpoint, "--stop-after-steps", 3), timeout=240).stdout
    stopped = torch.load(checkpoint, weights_only=True)  # as the 4 stages left it
    output += run_ok(torchrun(2, PP, *common, "--schedule", "1f1b", "--metrics", folder / "pp.jsonl",
                              "--checkpoint", checkpoint), timeout=240).stdout
    single = run_ok([PYTHON, SINGLE, *common, "--checkpoint", checkpoint], timeout=180).stdout  # at step 6: samples
    return {"one": (one, read_metrics(folder / "one.jsonl"), torch.load(folder / "one.pt", weights_only=True)),
            "pp": (output, read_metrics(folder / "pp.jsonl"), [stopped, torch.load(checkpoint, weights_only=True)]),
            "single": single}


def close(a, b):
    return math.isclose(a, b, rel_tol=RTOL)


@pytest.mark.launch
@pytest.mark.past_fsdp
def test_gpipe_on_4_stages_then_1f1b_on_2_computes_what_one_process_computes_step_by_step(runs):
    (_, one, _), (output, pp, _) = runs["one"], runs["pp"]
    assert "4 stages of 1/1/1/1 blocks, gpipe, 4 micro-batches" in output, output[-3000:]
    assert "2 stages of 2/2 blocks, 1f1b, 4 micro-batches" in output and "step 3 of 6" in output, output[-3000:]
    assert [m["step"] for m in pp] == [m["step"] for m in one] == list(range(1, 7))
    for mine, reference in zip(pp, one, strict=True):
        for key in ("loss", "grad_norm", "lr"):
            assert close(mine[key], reference[key]), (mine["step"], key, mine[key], reference[key])
        assert mine["grad_norm"] > 0.5  # the clipping acted at every step
    for key in ("val_loss", "val_median_window_loss"):  # after step 3 on 4 stages, after step 6 on 2
        assert [close(m[key], r[key]) for m, r in zip(pp, one, strict=True) if key in r] == [True, True]


@pytest.mark.launch
@pytest.mark.past_fsdp
def test_the_tied_copies_stay_equal_and_the_snapshot_is_gpt_singles_layout_which_resumes_it(runs):
    (_, _, reference), (output, _, snapshots) = runs["one"], runs["pp"]
    for snapshot in snapshots:  # stage 0's embedding and the last stage's head, after 3 and after 6 steps
        assert torch.equal(snapshot["model"]["head.weight"], snapshot["model"]["token.weight"])
        assert {k: v.shape for k, v in snapshot["model"].items()} == {k: v.shape for k, v in reference["model"].items()}
        mine, theirs = snapshot["optimizer"], reference["optimizer"]
        assert [g["params"] for g in mine["param_groups"]] == [g["params"] for g in theirs["param_groups"]]
        assert {i: {k: v.shape for k, v in s.items()} for i, s in mine["state"].items()} == \
            {i: {k: v.shape for k, v in s.items()} for i, s in theirs["state"].items()}  # every moment, numbered alike
    final = snapshots[1]
    # The weights one process ends with, within 1e-4 (a hundredth of --lr; a wrong gradient moves a weight by about
    # --lr a step). Measured: at most 2.2e-6, on k's bias, whose gradient is 0 but for rounding, which AdamW's
    # division by its root turns into steps; 1.2e-7 elsewhere
    for name, tensor in reference["model"].items():
        assert torch.allclose(final["model"][name], tensor, rtol=0, atol=1e-4), name
    # AdamW's moments, parameter by parameter, numbered as one process numbers them: within 1 % of each tensor's
    # largest value (where a gradient is near 0 rounding decides a moment's sign); blocks swapped would be far apart
    for number, state in reference["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            tensor = state[key]
            assert torch.allclose(final["optimizer"]["state"][number][key], tensor, rtol=0,
                                  atol=0.01 * tensor.abs().max().item()), (number, key)
    lines = re.findall(r"rank \d done: parameter checksum ([-\d.e]+)", output)[-2:]
    checksums = set(lines)
    assert len(lines) == 2 and len(checksums) == 1, output[-3000:]  # the stages' sums, all-reduced: one on each
    single = float(re.search(r"done: parameter checksum ([-\d.e]+)", runs["single"]).group(1))
    assert math.isclose(float(checksums.pop()), single, rel_tol=1e-12)  # the same weights, the tie counted once
    sample = output.split("sample:\n")[-1].split("\nrank ")[0]
    assert sample and sample in runs["single"]  # sampled through 2 stages: one process's text from the same weights


@pytest.mark.parametrize("argv, world_size, said", [
    (["--n-layer", "2"], 4, "--n-layer 2 blocks cannot make 4 stages"),
    (["--grad-accum", "2"], 4, "--schedule 1f1b needs --grad-accum 2 to be at least the 4 stages"),
    (["--amp", "fp16"], 2, "--amp fp16: not built here"),
])
def test_a_pipeline_that_cannot_be_cut_or_scheduled_is_refused_in_one_line(argv, world_size, said, monkeypatch,
                                                                           capsys):
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    with pytest.raises(SystemExit) as refused:
        load_script(PP).parse_args(argv)
    assert refused.value.code == 2 and said in capsys.readouterr().err
