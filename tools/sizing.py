"""Which parallelism a GPT needs, from arithmetic: each GPU's memory for training it with DDP, ZeRO-1, FSDP2, FSDP2
with tensor parallelism, and with pipeline stages, for three sizes on 80 GB GPUs; and the formulas' constants,
counted on this machine.

    .venv/bin/python tools/sizing.py            # the table (docs/sizing.md holds it)
    .venv/bin/python tools/sizing.py --count    # count the activations of small GPTs here, against the formula

The formulas (Ψ parameters; L blocks of width h; b sequences of s tokens per micro-batch; V the vocabulary; one
micro-batch a step, or with p stages p of them, the fewest 1F1B takes):
- The training state, fp32 as every port keeps it (weights, gradients, AdamW's two moments: 16 bytes a parameter),
  at its peak, after backward: DDP 16 Ψ + 4 Ψ (its gradient buckets); ZeRO-1 on N: 12 Ψ + 8 Ψ / N; FSDP2 on N:
  16 Ψ / N + three whole blocks (12 h² each: in the table the one computing and the next one prefetched in bf16, and
  a block's gradient in fp32, FSDP2's reduce_dtype; in the benchmark all three fp32). With tensor parallelism t the
  blocks and the embedding are split t ways too; with p pipeline stages each holds L / p blocks.
  benchmarks/gpt_fsdp_memory.py predicts its runs with state_bytes, and measures them.
- The activations a micro-batch leaves for backward, with bf16 compute (FSDP2's param_dtype bf16): each block 32
  bytes per token per unit of width (the 16 numbers its matmuls, norms, attention and GELU keep; counted here:
  --count), 2 with activation checkpointing (its input, and one block's 32 while backward recomputes it); the
  logits, fp32 for the loss, 4 V bytes per token, and 4 h per token for the embedding and the final norm. Tensor
  parallelism with sequence parallelism divides the blocks' and the logits' by t (the port gpt_tp.py has no sequence
  parallelism: its norms' and residuals' share is not divided). With 1F1B, the first of p stages holds p micro-batches
  of its L / p blocks: as many activations as without stages.
- The bytes sent: sent_bytes; and those leaving each node, with 8 GPUs a node, a tensor group filling a node and a
  data-parallel ring through consecutive GPUs (so FSDP2 on 64 crosses each node boundary once, and beside a tensor
  group of 8 every hop of the data-parallel ring crosses one).
Left out: the CUDA context and the communication buffers (each often 1 GB or more), the allocator's fragmentation,
temporary buffers (a gathered unit's bf16 copy, attention's workspace): a total near 80 GB does not fit in practice.
"""
import argparse
import importlib.util
import sys
from pathlib import Path

REPO, GB = Path(__file__).resolve().parents[1], 1e9
BLOCK_BYTES, CHECKPOINTED_BYTES, LOGIT_BYTES, EDGE_BYTES = 32, 2, 4, 4  # per token (x h, x h, x V, x h): --count
GPU_GB, PER_NODE, SEQUENCE, VOCAB = 80, 8, 2048, 50257
MODELS = {"1.3B (24 blocks x 2048)": (24, 2048), "6.7B (32 x 4096)": (32, 4096), "65B (80 x 8192)": (80, 8192)}
# (name, data-parallel kind, N, tensor t, pipeline p): GPUs = N x t x p, t within a node, N and p across nodes
LAYOUTS = [("DDP, 8 GPUs", "ddp", 8, 1, 1), ("ZeRO-1, 8 GPUs", "zero", 8, 1, 1), ("FSDP2, 8 GPUs", "fsdp", 8, 1, 1),
           ("FSDP2, 64 GPUs", "fsdp", 64, 1, 1), ("FSDP2 8 x TP 8, 64 GPUs", "fsdp", 8, 8, 1),
           ("FSDP2 8 x TP 8 x PP 4, 256 GPUs", "fsdp", 8, 8, 4)]


def parameters(layers, width, vocab=VOCAB, context=SEQUENCE):
    """The GPT's parameters (the tied matrix once) and one block's: 12 h^2 + 13 h (q, k, v and the output projection
    4 h^2 + 4 h, the MLP 8 h^2 + 5 h, two LayerNorms 4 h), the token and position tables, the final LayerNorm."""
    block = 12 * width * width + 13 * width
    return layers * block + vocab * width + context * width + 2 * width, block


def state_bytes(kind, total, unit, processes, gathered=12):
    """(Bytes of training state a process holds between steps; at its peak, with every gradient and, under FSDP2,
    three whole units of `unit` parameters, `gathered` bytes a parameter for the three together: 12 in fp32, 8 for
    two in bf16 and a gradient in fp32.) kind: ddp, zero or fsdp; total: the parameters it holds a share of (FSDP2,
    ZeRO-1) or whole (DDP)."""
    if kind == "ddp":  # fp32 weights, AdamW's two moments, DDP's buckets (kept); + the gradients
        return 16 * total, 20 * total
    if kind == "zero":  # DDP's, but only 1/N of the moments
        return 8 * total + 8 * total / processes, 12 * total + 8 * total / processes
    return 12 * total / processes, 16 * total / processes + gathered * unit  # pieces of each; + gradients


def activation_bytes(layers, width, tokens, vocab, checkpointed=False):
    """Bytes one micro-batch of `tokens` tokens leaves for backward (bf16 compute, fp32 logits)."""
    blocks = layers * width * tokens * (CHECKPOINTED_BYTES if checkpointed else BLOCK_BYTES)
    return blocks + (BLOCK_BYTES * width * tokens if checkpointed else 0) + tokens * (LOGIT_BYTES * vocab +
                                                                                       EDGE_BYTES * width)


def sent_bytes(layers, width, kind, data, tensor, stages, tokens=SEQUENCE, vocab=VOCAB):
    """Bytes one GPU sends per step (one micro-batch), by a ring's count ((n - 1)/n of the whole for an all-gather or a
    reduce-scatter, twice that for an all-reduce, n the group's size), as (data-parallel group, tensor group, to the
    next or previous stage). Data-parallel: DDP and ZeRO-1 all-reduce the fp32 gradients (ZeRO-1 then broadcasts
    each process's updated share: about the same again as an all-gather); FSDP2 gathers the bf16 weights in forward
    and again in backward and reduce-scatters the fp32 gradients. Tensor: with sequence parallelism each block's
    forward gathers its bf16 input twice and reduce-scatters its two outputs, and backward the same: 8 x (t - 1)/t x
    the whole activation between blocks (s b h numbers, 2 bytes each; without sequence parallelism, 4 all-reduces of
    twice that: the same); the loss's few numbers left out. Stages: one micro-batch's activations forward and their
    gradients back, bf16, split by sequence across the tensor group."""
    _, block = parameters(layers, width, vocab)
    share = (layers // stages * block + vocab * width) / tensor  # what this GPU's data-parallel group shares
    ring, micro = (data - 1) / data, stages  # micro-batches a step: 1, or as many as stages
    dp = {"ddp": 2 * ring * 4 * share, "zero": 2 * ring * 4 * share + ring * 4 * share,
          "fsdp": 2 * ring * 2 * share + ring * 4 * share}[kind]
    tp = micro * 8 * (tensor - 1) / tensor * 2 * tokens * width * (layers // stages)  # whole: s b h
    pp = micro * 2 * 2 * tokens * width / tensor if stages > 1 else 0  # split by sequence (sequence parallelism)
    return dp, tp, pp


def leaving_node(data, tensor, stages, sent):
    """Bytes leaving each node per step (PER_NODE GPUs a node; see the module's docstring for the placement)."""
    dp, _, pp = sent
    if data * tensor <= PER_NODE and stages == 1:
        return 0  # the whole job on one node
    crossing = PER_NODE if tensor == PER_NODE else 1  # data-parallel rings: every GPU's hop, or one a node
    return crossing * dp + (PER_NODE * pp if tensor == PER_NODE else 0)


def per_gpu(layers, width, kind, data, tensor, stages, tokens=SEQUENCE, vocab=VOCAB):
    """(State at its peak, activations, activations with checkpointing), bytes, on the most loaded GPU."""
    total, block = parameters(layers, width, vocab)
    split = (layers // stages * block + vocab * width) / tensor  # stage 0's blocks and the embedding, split by TP
    _, state = state_bytes(kind, split, block / tensor, data, gathered=8)
    # 1F1B: the first stage holds `stages` micro-batches of its layers/stages blocks (layers in all); the last, one
    # micro-batch of its blocks, and the logits
    first, last = ([activation_bytes(blocks, width / tensor, tokens, vocab / tensor if logits else 0, checkpointed=c)
                    for c in (False, True)] for blocks, logits in ((layers, stages == 1), (layers // stages, True)))
    return state, max(first[0], last[0]), max(first[1], last[1])


def table():
    lines = [f"| model | layout | state per GPU (GB) | activations, 1 sequence of {SEQUENCE} tokens (GB) | the same "
             f"with activation checkpointing | fits in {GPU_GB} GB | sent per GPU per step (GB): data-parallel group; "
             "tensor group; to neighbouring stages | leaving each node per step (GB) |", "|---" * 8 + "|"]
    for name, (layers, width) in MODELS.items():
        total, _ = parameters(layers, width)
        for layout, kind, data, tensor, stages in LAYOUTS:
            state, plain, light = per_gpu(layers, width, kind, data, tensor, stages)
            fits = "yes" if state + plain <= GPU_GB * GB else "with checkpointing" if state + light <= GPU_GB * GB \
                else "no"
            sent = sent_bytes(layers, width, kind, data, tensor, stages)
            node = leaving_node(data, tensor, stages, sent)
            lines.append(f"| {name}: {total / 1e9:.2f} B parameters | {layout} | {state / GB:.1f} | {plain / GB:.1f} "
                         f"| {light / GB:.1f} | {fits} | " + "; ".join(f"{v / GB:.3g}" if v else "-" for v in sent)
                         + (f" | {node / GB:.3g} |" if node else " | - |"))
    return "\n".join(lines) + "\n"


def count(layers, width, tokens, batch, checkpointed, dtype="bf16"):
    """Bytes autograd saves for backward in one forward and loss of port/gpt_fsdp.py's GPT, in this process (each
    storage once; the weights left out)."""
    import torch
    import torch.nn.functional as F

    spec = importlib.util.spec_from_file_location("gpt_fsdp", REPO / "port" / "gpt_fsdp.py")
    port = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(port)
    torch.manual_seed(0)
    model = port.GPT(tokens, layers, max(1, width // 32), width, 0.0, recompute=checkpointed)
    model = model.to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    weights, saved = {p.untyped_storage().data_ptr() for p in model.parameters()}, {}

    def pack(tensor):  # views share a storage: one count each
        if tensor.untyped_storage().data_ptr() not in weights:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    data = torch.randint(0, 256, (batch, tokens + 1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = model(data[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), data[:, 1:].flatten())
    return sum(saved.values())


def counted_constants(width=64, tokens=32, batch=2):
    """(Per block, per block checkpointed, the rest), bytes per token (x h, x h, none): a GPT of 1 and of 2 blocks
    counted; the difference is one block's."""
    found = []
    for checkpointed in (False, True):
        one, two = (count(layers, width, tokens, batch, checkpointed) for layers in (1, 2))
        found.append(((two - one) / (tokens * batch * width), (one - (two - one)) / (tokens * batch)))
    return found[0][0], found[1][0], found[0][1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", action="store_true", help="count small GPTs' activations here, against the formula")
    args = parser.parse_args(argv)
    if not args.count:
        print(table(), end="")
        return
    print(count_line())


def count_line():
    """What --count prints (docs/sizing.md quotes it; the counts are exact, the same on every run)."""
    block, light, rest = counted_constants()
    width, vocab = 64, 256  # the port's vocabulary: its bytes
    return (f"one block: {block:.2f} bytes per token per unit of width (formula {BLOCK_BYTES}); with activation "
            f"checkpointing {light:.2f} (formula {CHECKPOINTED_BYTES}); the rest: {rest:.1f} bytes per token "
            f"(formula {LOGIT_BYTES} x {vocab} + {EDGE_BYTES} x {width} = {LOGIT_BYTES * vocab + EDGE_BYTES * width})")


if __name__ == "__main__":
    sys.exit(main())
