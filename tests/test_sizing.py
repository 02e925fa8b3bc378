"""tools/sizing.py's formulas, checked on this machine: a GPT block's activations counted (32 bytes per token per unit
of width in bf16, 2 with activation checkpointing), the logits' 4 bytes per vocabulary entry; the training state's
formula is the one benchmarks/gpt_fsdp_memory.py predicts its measured runs with; docs/sizing.md holds the tool's
table and counts as it prints them now."""
import argparse
import math

from helpers import REPO, load_script

SIZING = load_script("tools/sizing.py")


def test_a_blocks_activations_are_32_bytes_per_token_per_unit_of_width_in_bf16_and_2_checkpointed():
    for width, tokens, batch in ((64, 32, 2), (128, 16, 3)):  # two shapes: the counts scale as the formula says
        block, light, rest = SIZING.counted_constants(width, tokens, batch)
        assert math.isclose(block, SIZING.BLOCK_BYTES, rel_tol=0.02), block  # 32.2 and 32.2 measured
        assert light == SIZING.CHECKPOINTED_BYTES  # the block's input, bf16, nothing else
        formula = SIZING.LOGIT_BYTES * 256 + SIZING.EDGE_BYTES * width  # the port's vocabulary: 256 bytes
        assert math.isclose(rest, formula, rel_tol=0.05), (rest, formula)  # 1304 against 1280 measured


def test_the_state_formula_is_the_memory_benchmarks_prediction_and_shrinks_as_each_layout_says():
    benchmark = load_script("benchmarks/gpt_fsdp_memory.py")
    shape = argparse.Namespace(n_layer=6, n_embd=512)
    whole, largest = benchmark.parameters(shape)
    for name, kind in (("DDP", "ddp"), ("ZeRO-1", "zero"), ("FSDP2", "fsdp")):  # the benchmark's predictions: these
        assert benchmark.predicted_state(name, 4, shape) == SIZING.state_bytes(kind, whole, largest, 4)
    total, block = SIZING.parameters(80, 8192)
    assert round(total / 1e9, 2) == 64.86 and block == 12 * 8192**2 + 13 * 8192
    ddp, zero, fsdp = (SIZING.state_bytes(kind, total, block, 8)[1] for kind in ("ddp", "zero", "fsdp"))
    assert ddp == 20 * total and zero == 13 * total and fsdp == 2 * total + 12 * block
    state_64, *_ = SIZING.per_gpu(80, 8192, "fsdp", 64, 1, 1)
    state_tp, plain_tp, _ = SIZING.per_gpu(80, 8192, "fsdp", 8, 8, 1)
    _, plain, _ = SIZING.per_gpu(80, 8192, "fsdp", 64, 1, 1)
    assert state_tp < state_64 and math.isclose(plain_tp * 8, plain, rel_tol=0.01)  # TP: a gathered block is 1/8


def test_docs_sizing_holds_the_tools_table_and_its_counts_as_it_prints_them_now():
    page = (REPO / "docs/sizing.md").read_text()
    assert SIZING.table() in page, "paste `python tools/sizing.py` into docs/sizing.md"
    assert SIZING.count_line() in page, "paste `python tools/sizing.py --count` into docs/sizing.md"
