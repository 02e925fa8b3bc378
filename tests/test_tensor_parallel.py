"""port/gpt_tp.py, the sharded port with tensor parallelism on a 2-D mesh (data x tensor), computes what one process
computes, on three layouts of one run, each resuming the last one's snapshot: a grid of 2 x 2 processes (FSDP2 across
the 2 rows, each block's matrices split across a row's 2), one row of 2 (tensor parallelism alone), two rows of 1
(FSDP2 alone); the run computes what 1-D FSDP2 (gpt_fsdp.py) on 4 processes computes, and exports the same weights
and AdamW moments (q, k and v joined again); the tied matrix stays one; gpt_single.py resumes the exported file and
samples the run's text; wrong layouts are refused in one line. Six launches, made once (`runs`): one process; the
three layouts; gpt_fsdp.py on 4 processes; gpt_single.py resuming the exported file."""
import math
import re

import pytest
import torch
from helpers import PYTHON, load_script, read_metrics, run_ok, torchrun
from test_port import make_text

TP, SHARDED, SINGLE = "port/gpt_tp.py", "port/gpt_fsdp.py", "port/gpt_single.py"
# 4 heads (2 per process at --tp 2); --grad-clip 0.5 is under every step's norm, so the clipping over two meshes acts
FLAGS = ["--steps", "6", "--n-layer", "2", "--n-embd", "32", "--n-head", "4", "--block-size", "16", "--lr", "1e-2",
         "--warmup-steps", "2", "--eval-windows", "9", "--eval-every", "3", "--log-every", "1", "--sample-bytes", "20",
         "--grad-clip", "0.5"]
# fp32 on the CPU. The layouts differ only in the order of additions: the output projections' and the MLP's second
# matrix's partial products summed across a row (all-reduce), the softmax over logits split by vocabulary
# (loss_parallel: a maximum and a sum of exponentials across the row), the gradients averaged across the rows
# (reduce-scatter), the gradient norm summed per mesh. Each is ~1e-7 relative (measured over the 6 steps: at most
# 1.2e-7 on the losses, 2.7e-7 on the norms): 1e-5 leaves a margin of 35 and catches a term counted twice.
RTOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp")
    common = [*FLAGS, "--data", make_text(folder / "text.txt")]
    checkpoint = folder / "tp"
    one = run_ok(torchrun(1, TP, *common, "--tp", 1, "--batch-size", 8, "--metrics", folder / "one.jsonl"),
                 timeout=180).stdout
    output = ""  # one run on three layouts of the same global batch (8 windows), each resuming the last's snapshot
    for nproc, tp, batch, stop in ((4, 2, 4, 2), (2, 2, 8, 4), (2, 1, 4, None)):  # 2 x 2, 1 x 2, 2 x 1
        output += run_ok(torchrun(nproc, TP, *common, "--tp", tp, "--batch-size", batch, "--metrics",
                                  folder / "tp.jsonl", "--checkpoint", checkpoint,
                                  *(["--stop-after-steps", stop] if stop else [])), timeout=240).stdout
    fsdp = run_ok(torchrun(4, SHARDED, *common, "--batch-size", 2, "--metrics", folder / "fsdp.jsonl",
                           "--checkpoint", folder / "fsdp"), timeout=240).stdout
    # the export holds the last layout's flags (4 windows per process), which gpt_single.py checks like any resume's
    single = run_ok([PYTHON, SINGLE, *common, "--batch-size", 4, "--checkpoint", f"{checkpoint}.single.pt"],
                    timeout=180).stdout
    return {"one": (one, read_metrics(folder / "one.jsonl")), "tp": (output, read_metrics(folder / "tp.jsonl")),
            "fsdp": (fsdp, read_metrics(folder / "fsdp.jsonl")), "single": single,
            "exports": [torch.load(f"{path}.single.pt", weights_only=True) for path in (checkpoint, folder / "fsdp")]}


def close(a, b):
    return math.isclose(a, b, rel_tol=RTOL)


@pytest.mark.launch
@pytest.mark.past_fsdp
def test_one_run_on_a_2x2_grid_one_row_of_2_and_two_rows_of_1_computes_what_one_process_computes(runs):
    (_, one), (output, tp) = runs["one"], runs["tp"]
    assert "2 rows of --tp 2" in output and "1 rows of --tp 2" in output, output[-3000:]
    assert "resumed from" in output and "step 2 of 6" in output and "step 4 of 6" in output, output[-3000:]
    assert [m["step"] for m in tp] == [m["step"] for m in one] == list(range(1, 7))
    for mine, reference in zip(tp, one, strict=True):  # steps 1-2 on the grid, 3-4 on one row, 5-6 on two rows
        for key in ("loss", "grad_norm", "lr"):
            assert close(mine[key], reference[key]), (mine["step"], key, mine[key], reference[key])
        assert mine["grad_norm"] > 0.5  # the clipping acted at every step
    for key in ("val_loss", "val_median_window_loss"):  # after steps 3 (one row) and 6 (two rows)
        assert [close(m[key], r[key]) for m, r in zip(tp, one, strict=True) if key in r] == [True, True]


@pytest.mark.launch
@pytest.mark.past_fsdp
def test_the_layouts_compute_what_1d_fsdp2_on_4_processes_computes_and_export_the_same_weights_and_moments(runs):
    (_, tp), (_, fsdp) = runs["tp"], runs["fsdp"]
    for mine, reference in zip(tp, fsdp, strict=True):
        for key in ("loss", "grad_norm"):
            assert close(mine[key], reference[key]), (mine["step"], key, mine[key], reference[key])
    mine, reference = runs["exports"]  # q, k and v joined in the right order, AdamW's moments too
    # Within 1 % of each tensor's largest value. AdamW divides each moment by the root of the second: where a gradient
    # is near 0 its rounding decides the update, up to about --lr (measured: at most 5.7e-6 on weights of up to 0.04;
    # moments 2e-10 apart, of up to 7e-4). Rows of q, k or v joined in another order would be apart by the weights
    # themselves.
    assert mine["model"].keys() == reference["model"].keys()
    for name, tensor in reference["model"].items():
        assert torch.allclose(mine["model"][name], tensor, rtol=0, atol=0.01 * tensor.abs().max().item()), name
    assert mine["optimizer"]["param_groups"] == reference["optimizer"]["param_groups"]
    for number, state in reference["optimizer"]["state"].items():
        for key, tensor in state.items():  # step, exp_avg, exp_avg_sq
            assert torch.allclose(mine["optimizer"]["state"][number][key], tensor, rtol=0,
                                  atol=0.01 * tensor.abs().max().item()), (number, key)


@pytest.mark.launch
@pytest.mark.past_fsdp
def test_the_tied_matrix_stays_one_and_gpt_single_resumes_the_exported_file_with_the_runs_weights_and_text(runs):
    (one_output, _), (output, _) = runs["one"], runs["tp"]
    sizes = re.findall(r"GPT of ([\d.]+)M parameters", one_output + output)
    assert len(sizes) == 4 and len(set(sizes)) == 1, sizes  # no second copy of the tied matrix on any layout
    exported = runs["exports"][0]
    assert torch.equal(exported["model"]["head.weight"], exported["model"]["token.weight"])
    assert exported["model"]["blocks.0.qkv.weight"].shape == (3 * 32, 32)  # gpt_single.py's names
    checksum = re.findall(r"rank 0 done: parameter checksum ([-\d.e]+)", output)[-1]
    assert float(re.search(r"done: parameter checksum ([-\d.e]+)", runs["single"]).group(1)) == float(checksum)
    sample = output.split("sample:\n")[-1].split("\nrank ")[0]
    assert sample and sample in runs["single"]  # whole logits on every layout: the same text


@pytest.mark.parametrize("argv, world_size, said", [
    (["--tp", "3"], 4, "--tp 3 must divide the 4 processes"),
    (["--tp", "2", "--n-head", "3", "--n-embd", "96"], 4, "--n-head 3"),
    (["--tp", "2", "--replicas", "2"], 4, "--replicas with --tp"),
    (["--tp", "3", "--n-head", "3", "--n-embd", "96"], 3, "the 256 bytes of the vocabulary"),
])
def test_a_layout_that_cannot_split_is_refused_in_one_line(argv, world_size, said, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    with pytest.raises(SystemExit) as refused:
        load_script(TP).parse_args(argv)
    assert refused.value.code == 2 and said in capsys.readouterr().err
