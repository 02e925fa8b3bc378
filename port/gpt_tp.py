"""gpt_fsdp.py with tensor parallelism: each block's matrices split across the processes of a group, on a 2-D mesh.

`diff port/gpt_fsdp.py port/gpt_tp.py` is the change; each statement it adds says "tp:" and why. --tp N arranges
the processes in a grid of world_size/N rows (data: each row its own windows, FSDP2 shards across the rows) and N
columns (tensor: the N processes of a row split every matrix of a block and compute one forward together). Attention
is split by heads (q, k and v by rows, the output projection by columns), the MLP likewise, the tied byte embedding
and output layer by vocabulary: the logits stay split by vocabulary, and the loss is computed on the pieces
(loss_parallel). Activations between blocks are whole on every process of a row (no sequence parallelism). The
gradient norm is combined over the two meshes the parameters live on. Snapshots are DCP folders by parameter name,
which another (data, tensor) layout resumes; the end exports one plain file that gpt_single.py loads.

  torchrun --standalone --nproc_per_node=2 port/gpt_tp.py                 # one row of 2: tensor parallelism only
  torchrun --standalone --nproc_per_node=4 port/gpt_tp.py --tp 2          # 2 x 2: FSDP2 across rows, TP within
  torchrun --standalone --nproc_per_node=2 port/gpt_tp.py --checkpoint gpt   # SIGTERM it, run it again
"""
import argparse
import hashlib
import json
import math
import os
import shutil  # fsdp: snapshot folders
import signal  # step 04
import sys
import threading  # step 04
import time
import warnings
from collections import defaultdict  # tp:
from contextlib import nullcontext
from datetime import timedelta  # step 01
from functools import lru_cache

import torch
import torch.distributed as dist  # step 01
import torch.distributed.checkpoint as dcp  # fsdp: snapshots in pieces, as step 05's
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (  # fsdp
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh  # fsdp
from torch.distributed.elastic.multiprocessing.errors import record  # step 02
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # fsdp: on a CPU, torch 2.9.1 or later
from torch.distributed.tensor import DTensor, Replicate, Shard  # tp:
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module  # tp
from torch.utils.checkpoint import checkpoint  # fsdp: activation checkpointing

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "ddp_steps_prose.txt")
# what a snapshot must agree on with the command that resumes it: any of these changes what the run computes
# fsdp: not batch_size: another number of processes may resume, if the global batch stays (load_checkpoint)
SAME_ON_RESUME = ("data", "seed", "steps", "block_size", "grad_accum", "lr", "warmup_steps", "weight_decay",
                  "grad_clip", "n_layer", "n_head", "n_embd", "dropout", "amp", "param_dtype", "pad_up_to")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], usage=argparse.SUPPRESS,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps in all")
    parser.add_argument("--batch-size", type=int, default=32, help="windows per process per micro-batch")
    parser.add_argument("--block-size", type=int, default=64, help="bytes of context the model sees")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (AdamW)")
    parser.add_argument("--warmup-steps", type=int, default=50, help="optimizer steps of linear warm-up; then the "
                        "learning rate decays (cosine) to a tenth of --lr at --steps")
    parser.add_argument("--weight-decay", type=float, default=0.1, help="AdamW's, on the weight matrices only")
    parser.add_argument("--grad-clip", type=float, default=1.0, help="largest gradient norm; 0: no clipping")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--n-layer", type=int, default=4, help="transformer blocks")
    parser.add_argument("--n-head", type=int, default=4, help="attention heads per block")
    parser.add_argument("--n-embd", type=int, default=128, help="width of the model")
    parser.add_argument("--dropout", type=float, default=0.0, help="dropout probability while training")
    parser.add_argument("--seed", type=int, default=0, help="seeds the model, the data order and dropout")
    parser.add_argument("--data", default=DATA, help="a text file (any bytes); its last 10%% is held out")
    parser.add_argument("--eval-every", type=int, default=200, help="optimizer steps between validations")
    parser.add_argument("--eval-windows", type=int, default=256, help="held-out windows each validation reads")
    parser.add_argument("--log-every", type=int, default=50, help="optimizer steps between progress lines")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--amp", nargs="?", const="bf16", choices=["bf16", "fp16"],
                        help="mixed precision: --amp is bf16 autocast (CPU, and GPUs that have bf16); --amp fp16 adds "
                             "a GradScaler (GPUs without bf16; on a CPU too, slowly)")
    parser.add_argument("--param-dtype", choices=["bf16"], default=None, help="fsdp: MixedPrecisionPolicy: compute "
                        "with bf16 copies of the weights, keep the pieces and the optimizer in fp32, reduce gradients "
                        "in fp32")
    parser.add_argument("--activation-checkpointing", action="store_true", help="fsdp: keep each block's input only, "
                        "and recompute its activations in backward: less memory, one more forward")
    parser.add_argument("--compile", nargs="?", const="inductor", choices=["inductor", "aot_eager"], help="fsdp: "
                        "torch.compile each block before it is sharded: inductor (generates kernels; on a CPU with a "
                        "C++ compiler) or aot_eager (captures forward and backward, runs them eagerly: a quick check)")
    parser.add_argument("--pad-up-to", type=int, default=0, help="fsdp: the last 0 to N targets of each window are "
                        "padding, ignored by the loss (as documents shorter than the window, padded): the ranks then "
                        "hold different numbers of targets")
    parser.add_argument("--replicas", type=int, default=1, help="fsdp: HSDP: this many groups of processes, each "
                        "holding one whole copy in pieces; gradients averaged across the groups")
    parser.add_argument("--tp", type=int, default=2, help="tp: processes that split each block's matrices between "
                        "them (a row of the mesh); must divide the number of processes, --n-head and 256")
    parser.add_argument("--checkpoint", default=None, help="snapshot folder; a run finding one resumes from it")  # fsdp
    parser.add_argument("--save-every-steps", type=int, default=200, help="optimizer steps between snapshots")
    parser.add_argument("--metrics", default=None, metavar="PATH", help="append one JSON line per step here")
    parser.add_argument("--sample-bytes", type=int, default=300, help="bytes of text to sample at the end")
    parser.add_argument("--peak-tflops", type=float, default=None, help="one device's dense peak, TFLOP/s (a GPU's "
                        "datasheet figure; a CPU's: benchmarks/cpu_matmul_peak.py): the log adds the model FLOPs "
                        "utilisation")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a collective waits for a missing "
                        "process before it fails")  # step 01
    parser.add_argument("--stop-after-steps", type=int, default=None, help="stop after this step as if "
                        "SIGTERM had come (the tests' and the lesson's deterministic interruption)")  # step 04
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "block_size", "grad_accum", "n_layer", "n_head", "n_embd", "eval_every",
                 "eval_windows", "log_every", "save_every_steps", "replicas", "tp"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if min(args.warmup_steps, args.sample_bytes) < 0 or not 0 <= args.grad_clip < float("inf"):
        parser.error("--warmup-steps, --sample-bytes and --grad-clip must be 0 or more")
    if not (0 < args.lr < float("inf") and 0 < args.timeout < float("inf")):  # step 01
        parser.error(f"--lr and --timeout must be positive numbers, got {args.lr} and {args.timeout}")
    if not (0 <= args.weight_decay < float("inf") and 0 <= args.dropout < 1):
        parser.error(f"--weight-decay must be 0 or more, --dropout in [0, 1); got {args.weight_decay}, "
                     f"{args.dropout}")
    if not 0 <= args.pad_up_to < args.block_size:  # fsdp: every window keeps at least one target
        parser.error(f"--pad-up-to must be 0 or more and less than --block-size {args.block_size}")
    if int(os.environ.get("WORLD_SIZE", 1)) % args.replicas:  # fsdp: torchrun's number of processes
        parser.error(f"--replicas {args.replicas} must divide the {os.environ.get('WORLD_SIZE', 1)} processes")
    if args.n_embd % args.n_head:
        parser.error(f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}")
    processes = int(os.environ.get("WORLD_SIZE", args.tp))  # tp: without torchrun, main's message says what to do
    if processes % args.tp or args.n_head % args.tp or 256 % args.tp:  # tp: whole heads, whole vocabulary rows
        parser.error(f"--tp {args.tp} must divide the {processes} processes, --n-head {args.n_head} and the 256 bytes "
                     "of the vocabulary")  # tp
    if args.tp > 1 and args.replicas > 1:  # tp:
        parser.error("--replicas with --tp: HSDP across tensor-parallel rows is not built here")  # tp:
    if args.peak_tflops is not None and not 0 < args.peak_tflops < float("inf"):
        parser.error(f"--peak-tflops must be a positive number, got {args.peak_tflops}")
    if not os.path.isfile(args.data):
        parser.error(f"--data {args.data}: " + ("a folder, not a text file" if os.path.isdir(args.data) else
                                                "no such file"))
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but PyTorch sees no GPU")
    # native bf16 only: the default, including_emulation=True, also accepts GPUs older than Ampere, which emulate
    # it slowly (torch.cuda.is_bf16_supported)
    if args.amp == "bf16" and choose_device(args.device).type == "cuda" and \
            not torch.cuda.is_bf16_supported(including_emulation=False):
        parser.error("--amp: this GPU has no native bf16; use --amp fp16 (with its GradScaler)")
    return args


def load_text(args, processes):
    """The text as bytes (the model's tokens: 256 of them, no tokenizer to ship), split 90/10 into training
    and validation, and its SHA-256. Refuses, in one line, a text too short to train or validate on."""
    try:
        with open(args.data, "rb") as f:
            text = f.read()
    except OSError as error:  # missing, a folder, unreadable: one line, not a traceback
        sys.exit(f"error: --data {args.data}: {error.strerror or error}")
    split = len(text) * 9 // 10  # an empty or short file is refused below, before any tensor is made of it
    global_batch = args.batch_size * args.grad_accum * processes
    if split - args.block_size < global_batch or len(text) - split <= args.block_size:
        sys.exit(f"error: --data {args.data}: {len(text)} bytes are too few for --block-size {args.block_size} and "
                 f"a global batch of {global_batch} windows; give a longer text or smaller sizes")
    folder = os.path.dirname(os.path.abspath(args.checkpoint or args.metrics or "."))
    if not os.access(folder, os.W_OK):
        sys.exit(f"error: {folder} is not a writable folder (--checkpoint, --metrics)")
    tokens = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    train, val = tokens[:split], tokens[split:]
    return train, val, hashlib.sha256(text).hexdigest()


@lru_cache(maxsize=2)
def epoch_order(num_windows, seed, epoch):
    return torch.randperm(num_windows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def window_starts(position, count, num_windows, seed):
    """Windows position .. position+count-1 of the endless training stream: every start offset once per epoch,
    in an order drawn from (seed, epoch) alone, so that any stretch of it can be computed again on a resume."""
    starts = []
    while len(starts) < count:
        epoch, index = divmod(position + len(starts), num_windows)
        starts += epoch_order(num_windows, seed, epoch)[index:index + count - len(starts)].tolist()
    return starts


def padding(position, count, args):
    """fsdp: how many last targets of stream windows position.. are padding: from (seed, position), known to all."""
    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + position + 1)
    return torch.randint(0, args.pad_up_to + 1, (count,), generator=generator)


def get_batch(tokens, starts, block_size, device):
    """Inputs and targets: each window's bytes, and the same bytes one further on (the next byte to predict)."""
    windows = torch.stack([tokens[start:start + block_size + 1] for start in starts]).long().to(device)
    return windows[:, :-1], windows[:, 1:]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP, each added to the residual stream."""

    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        # tp: q, k and v as three matrices (gpt_fsdp.py's one qkv holds all heads' q, then k, then v: split by rows,
        # its first piece would hold every q and part of k); split by rows, each holds its process's heads
        self.q, self.k, self.v = (nn.Linear(n_embd, n_embd) for _ in range(3))  # tp:
        self.proj = nn.Linear(n_embd, n_embd)  # tp:
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))

    def forward(self, x):
        batch, length, width = x.shape
        h = self.ln1(x)  # tp:
        # tp: -1 heads: all of them, or under --tp this process's (width stays the whole model's: x is whole here)
        q, k, v = (linear(h).view(batch, length, -1, width // self.n_head).transpose(1, 2)  # tp:
                   for linear in (self.q, self.k, self.v))  # (batch, head, position, head width) each
        # is_causal: position t attends to 0..t only; PyTorch picks a fused (flash / memory-efficient) kernel
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        x = x + F.dropout(self.proj(y.transpose(1, 2).reshape(batch, length, -1)), self.dropout, self.training)  # tp
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, block_size, n_layer, n_head, n_embd, dropout, recompute=False):
        super().__init__()
        self.recompute = recompute  # fsdp: --activation-checkpointing
        self.token, self.position = nn.Embedding(256, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*(Block(n_embd, n_head, dropout) for _ in range(n_layer)))
        self.ln, self.head, self.dropout = nn.LayerNorm(n_embd), nn.Linear(n_embd, 256, bias=False), dropout
        self.head.weight = self.token.weight  # tied: one matrix reads bytes in and writes them out
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)  # GPT-2's; PyTorch's defaults are too large here
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens):
        x = self.token(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        x = F.dropout(x, self.dropout, self.training)
        for block in self.blocks:  # fsdp: recompute: only each block's input is kept for backward, which runs the
            # block's forward again (the same dropout masks: checkpoint restores the random state)
            x = checkpoint(block, x, use_reentrant=False) if self.recompute else block(x)
        return self.head(self.ln(x))


def flops_per_token(model, args):
    """The model FLOPs of one training step per token: 6 per weight (a multiply and an add each, once forward and
    twice backward: the gradients of the inputs and of the weights; biases and LayerNorm parameters counted alike, as
    the usual 6N does), the position table left out (looked up, not
    multiplied) and the tied token matrix counted once (as the output layer), plus attention's two matmuls over
    every earlier and later position, 12 x layers x context x width (the common count, which includes the half the
    causal mask skips). Recomputed activations are not counted: model FLOPs, not the hardware's."""
    weights = sum(p.numel() for name, p in model.named_parameters() if "position" not in name)
    return 6 * weights + 12 * args.n_layer * args.block_size * args.n_embd


def lr_factor(step, args):
    """Linear warm-up over --warmup-steps optimizer steps, then cosine decay to a tenth of --lr at --steps."""
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps))
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))


def choose_device(name):
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def autocast(device, amp):
    # bf16 keeps fp32's range: no loss scaling needed; fp16's is narrow, so its small gradients need a GradScaler
    # (main). Either way the weights and the optimizer stay in fp32
    if amp is None:
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


def log(message):
    if dist.get_rank() == 0:  # step 03: global rank 0, one voice for the whole job
        print(message, flush=True)


def fail(message, everyone=True):
    # port lesson: everyone: every rank calls it at once (on an all-reduced value, or one DDP keeps equal on all), none
    # waits in a collective for a rank that has gone (when_it_breaks); else one rank fails alone, torchrun ends the rest
    if dist.get_rank() == 0 or not everyone:  # port lesson
        print(f"error: {message}", file=sys.stderr, flush=True)  # port lesson
    if everyone:  # port lesson
        dist.barrier()  # step 01: rank 0 has said why before any rank exits
        dist.destroy_process_group()  # port lesson
    sys.exit(1)  # port lesson


def check_same_text(digest, path):
    """One text for all: a node holding another copy of --data would otherwise train on it without a word."""
    digests = [None] * dist.get_world_size()  # port lesson
    dist.all_gather_object(digests, digest)  # port lesson
    if len(set(digests)) > 1:  # port lesson
        fail(f"--data {path}: the ranks read different bytes (SHA-256 {', '.join(d[:12] for d in digests)} by "
             "rank); give every node the same file")  # port lesson


def gather_uneven(values, total, rows):
    """tp: every row's values when row r holds items r, r + rows, ... of `total`: gloo's all_gather refuses
    uneven sizes (torch's docstring says they are supported, naming no backend), so each shard
    is padded to the largest and the padding cut off again by the shard sizes every rank can compute.
    (DistributedSampler pads by repeating samples instead: gathered, those would count twice.)"""
    world_size = dist.get_world_size()  # port lesson
    padded = torch.zeros(-(-total // rows), device=values.device)  # tp: row r holds items r, r + rows, ...
    padded[:len(values)] = values  # port lesson
    gathered = [torch.empty_like(padded) for _ in range(world_size)]  # port lesson
    dist.all_gather(gathered, padded)  # port lesson
    return torch.cat([shard[:len(range(r, total, rows))]  # tp: the first process of each row: one copy of its items
                      for r, shard in enumerate(gathered[::world_size // rows])])


def whole(tensor):
    """tp: a tensor split across a row (logits split by vocabulary, a loss computed on them) gathered whole."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def evaluate(model, tokens, args, device):
    """(Mean loss per byte, median of the windows' mean losses) over the first --eval-windows non-overlapping
    windows of the held-out text."""
    model.eval()
    starts = list(range(0, len(tokens) - args.block_size, args.block_size))[:args.eval_windows]
    rows = dist.get_world_size() // args.tp  # tp: the processes of a row read the same windows
    total, starts = len(starts), starts[dist.get_rank() // args.tp::rows]  # tp
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, bytes
    window_losses = [torch.zeros(0, device=device)]
    for first in range(0, -(-total // rows), args.batch_size):  # fsdp: as many forwards on every
        # rank (each gathers the weights from all): a rank out of windows runs window 0 and counts none of it
        windows = starts[first:first + args.batch_size]  # fsdp
        inputs, targets = get_batch(tokens, windows or [0], args.block_size, device)  # fsdp
        with autocast(device, args.amp):
            logits = whole(model(inputs))  # tp
        losses = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
        losses = losses[:len(windows) * args.block_size]  # fsdp
        totals += torch.stack([losses.sum().double(), torch.tensor(losses.numel(), device=device).double()])
        window_losses.append(losses.view(-1, args.block_size).mean(1))  # fsdp
    window_losses = torch.cat(window_losses)
    dist.all_reduce(totals)  # step 01: exact: sums of losses and of bytes, one division, not a mean of means
    window_losses = gather_uneven(window_losses, total, rows)  # port lesson: a median is no sum: all values, once each
    model.reshard()  # fsdp: the root unit keeps its weights whole after a forward, for the backward; none follows here
    model.train()
    return (totals[0] / totals[1]).item(), window_losses.median().item()


@torch.no_grad()
def sample(model, args, device, prompt=b"\n"):
    """--sample-bytes bytes drawn from the model, one at a time (temperature 0.8), decoded as UTF-8."""
    model.eval()
    tokens, generator = torch.tensor([list(prompt)], device=device), torch.Generator(device).manual_seed(args.seed)
    for _ in range(args.sample_bytes):
        logits = whole(model(tokens[:, -args.block_size:]))[:, -1].float() / 0.8  # tp
        tokens = torch.cat([tokens, torch.multinomial(logits.softmax(-1), 1, generator=generator)], dim=1)
    model.reshard()  # fsdp
    return bytes(tokens[0, len(prompt):].tolist()).decode("utf-8", errors="replace")


def save_checkpoint(path, snapshot):
    """A crash at any moment leaves the old snapshot or the new one, never half of one: the new one is written into
    PATH.tmp, forced to disk, and only then takes the place of the old one, which is kept as PATH.prev."""
    if dist.get_rank() == 0 and os.path.exists(path + ".tmp"):  # fsdp: what a crash left of a snapshot being written
        shutil.rmtree(path + ".tmp")  # fsdp
    dist.barrier()  # fsdp
    # fsdp: every rank writes (and fsyncs) its own pieces, then rank 0 the index (.metadata)
    dcp.save(snapshot.pop("sharded"), checkpoint_id=path + ".tmp")  # fsdp
    if dist.get_rank() != 0:  # step 03: global rank 0 writes; the others wait until the file exists
        dist.barrier()  # step 01
        return  # step 01
    with open(os.path.join(path + ".tmp", "train_state.pt"), "wb") as f:  # fsdp: the rest, in the same folder
        torch.save(snapshot, f)
        f.flush()
        os.fsync(f.fileno())  # on the disk, not only in the page cache, before it replaces the old one
    if os.path.exists(path):  # fsdp: a folder cannot replace another in one rename: the old one becomes PATH.prev
        shutil.rmtree(path + ".prev", ignore_errors=True)  # fsdp
        os.replace(path, path + ".prev")  # fsdp: a crash before the next line leaves it, and load_checkpoint uses it
    os.replace(path + ".tmp", path)  # atomic
    log(f"saved snapshot {path} (step {snapshot['step']})")
    dist.barrier()  # step 01


def export_whole(path, model, optimizer, snapshot):
    """fsdp: PATH: the run as one file in gpt_single.py's format (whole tensors, the optimizer's state keyed by number
    as a plain optimizer's is), which it resumes and samples from on one device. Each tensor is gathered whole on
    every rank in turn; rank 0 alone keeps a copy, in host memory (cpu_offload), and writes them."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # fsdp
    model_state = get_model_state_dict(model, options=options)  # fsdp: the tied matrix under both names
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=options)  # fsdp: keyed by parameter name
    if dist.get_rank() == 0:  # fsdp
        qkv_as_one(model_state)  # tp: gpt_single.py's names
        qkv_as_one(optimizer_state["state"])  # tp: AdamW's moments likewise
        for group in optimizer_state["param_groups"]:  # tp: qkv where q was; k and v gone
            group["params"] = [n.replace(".q.", ".qkv.") for n in group["params"] if ".k." not in n and ".v." not in n]
        groups = optimizer_state["param_groups"]  # fsdp: names -> 0, 1, ... in the groups' order, as AdamW numbers them
        number = {name: i for i, name in enumerate(name for group in groups for name in group["params"])}  # fsdp
        optimizer_state = {"state": {number[name]: value for name, value in optimizer_state["state"].items()},
                           "param_groups": [{**group, "params": [number[name] for name in group["params"]]}
                                            for group in groups]}  # fsdp
        with open(path + ".tmp", "wb") as f:  # fsdp
            torch.save({**snapshot, "model": model_state, "optimizer": optimizer_state}, f)  # fsdp
            f.flush()  # fsdp
            os.fsync(f.fileno())  # fsdp
        os.replace(path + ".tmp", path)  # fsdp: atomic
        log(f"saved the whole run in {path}: python port/gpt_single.py --checkpoint {path} with this run's model, "
            "data and schedule flags")
    dist.barrier()  # fsdp: the others wait until it is written


def qkv_as_one(named):
    """tp: each block's q, k and v (tensors, or AdamW's states of them) joined by rows into gpt_single.py's qkv."""
    for name in [name for name in named if ".q." in name]:  # tp
        parts = [named.pop(name.replace(".q.", f".{part}.")) for part in "qkv"]  # tp
        named[name.replace(".q.", ".qkv.")] = torch.cat(parts) if torch.is_tensor(parts[0]) else {  # tp: a state:
            key: torch.cat([part[key] for part in parts]) if parts[0][key].dim() else parts[0][key]  # tp: step alike
            for key in parts[0]}


def load_checkpoint(args, device, digest, world_size):
    """The snapshot at --checkpoint, or None if there is none yet. Every rank reads its small part (train_state.pt)
    here, and its pieces of the weights once the model is sharded (DCP reads its index, .metadata, with plain
    pickle: resume only snapshots your own jobs wrote)."""
    path = next((p for p in (args.checkpoint, args.checkpoint + ".prev") if os.path.exists(p)), None)  # fsdp
    if path is None:  # fsdp
        return None
    try:  # weights_only: a snapshot is a pickle, and unpickling an untrusted one could run arbitrary code
        with warnings.catch_warnings():  # quietly: a plain pickle warns of its protocol before it is refused below
            warnings.simplefilter("ignore")
            snapshot = torch.load(os.path.join(path, "train_state.pt"), map_location=device, weights_only=True)
        saved, _ = snapshot["args"], snapshot["data_sha256"]  # (another script's checkpoint lacks one or both)
    except Exception as error:  # truncated, corrupted, not a torch file at all, or not this script's
        fail(f"--checkpoint {path}: unreadable, or not a snapshot of this script ({type(error).__name__}); "
             "move it away to start over" + (f" (then {path}.prev, the one before it, is resumed)" if os.path.exists(
                 path + ".prev") else ""), everyone=False)  # port lesson: this rank's copy alone may be unreadable
    changed = [f"--{name.replace('_', '-')} {getattr(args, name)} (snapshot: {saved.get(name)})"
               for name in SAME_ON_RESUME if saved.get(name) != getattr(args, name) and name != "data"]
    if snapshot["data_sha256"] != digest:
        changed.append(f"--data {args.data} holds other bytes than the snapshot's text")
    # fsdp: any number of processes resumes it, if the global batch stays (the same windows, split otherwise)
    if "tp" not in saved:  # tp: gpt_fsdp.py's snapshot: one qkv matrix per block, where this script names q, k, v
        fail(f"--checkpoint {path}: a snapshot of gpt_fsdp.py (one qkv matrix per block); resume it with gpt_fsdp.py, "
             "or give another --checkpoint path to start afresh", everyone=False)  # tp
    rows, saved_rows = world_size // args.tp, snapshot["world_size"] // saved["tp"]  # tp: rows read windows
    if args.batch_size * rows != saved["batch_size"] * saved_rows:  # tp
        changed.append(f"the global batch --batch-size {args.batch_size} x {rows} rows of --tp {args.tp} (snapshot: "
                       f"{saved['batch_size']} x {saved_rows})")  # tp
    if changed:
        fail(f"--checkpoint {path}: a resume cannot change {', '.join(changed)}; repeat the snapshot's "
             "values, or give another --checkpoint path to start afresh", everyone=False)  # port lesson
    return {**snapshot, "path": path}  # fsdp


@record  # step 02: under torchrun, a worker's traceback goes into torchrun's failure summary
def main(args):
    # step 02: torchrun says who this process is: its rank among all, its index on this machine, how many in all
    rank, local_rank, world_size = (int(os.environ[name]) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    train_tokens, val_tokens, digest = load_text(args, processes=world_size)  # refused before the group forms
    device = choose_device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)  # step 02: one GPU per process
        torch.cuda.set_device(device)  # step 01: before init_process_group, so NCCL uses this GPU
    else:  # step 03: the processes on this machine share its cores (torchrun sets OMP_NUM_THREADS=1 when unset)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 0)) or
                              max(1, cores // int(os.environ["LOCAL_WORLD_SIZE"])))
    # step 01: gloo on CPU, NCCL on GPU; a peer that never answers fails the collective after --timeout
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=args.timeout))
    torch.set_float32_matmul_precision("high")  # for TF32 on Ampere+ GPUs (also sets oneDNN's CPU matmuls to tf32)
    check_same_text(digest, args.data)  # port lesson
    num_windows = len(train_tokens) - args.block_size
    torch.manual_seed(args.seed)  # the initial weights
    with torch.device("meta"):  # fsdp: shapes and dtypes only, no memory: rank 0 builds the values once, below
        model = GPT(args.block_size, args.n_layer, args.n_head, args.n_embd, args.dropout,
                    recompute=args.activation_checkpointing)  # fsdp
    snapshot = load_checkpoint(args, device, digest, world_size) if args.checkpoint else None
    # port lesson: one place to resume from (a rank finding no snapshot would start afresh while the others resume)
    found = [None] * world_size  # port lesson
    where = snapshot and (snapshot["step"], snapshot["position"])  # port lesson
    dist.all_gather_object(found, where)  # port lesson
    if len(set(found)) > 1:  # port lesson
        fail(f"--checkpoint {args.checkpoint}: (step, position) of the snapshot by rank: {found}; "
             "every rank must read the same snapshot")  # port lesson
    # fsdp: the processes that share the pieces: all of them; with --replicas R, HSDP: a 2-D mesh of R groups
    # (replicate) of world_size/R processes (shard). Each group holds one whole copy in pieces, as 1-D FSDP2 over
    # fewer processes; gradients are reduce-scattered within a group, then each piece all-reduced across the groups.
    # Put a group's processes on one node: gathers within it on fast links, and only pieces cross between nodes
    # tp: a grid of world_size/tp rows and tp columns: processes r*tp .. r*tp+tp-1 form row r, which splits each
    # matrix and reads the same windows; FSDP2 shards across the rows ("data"), as across processes in gpt_fsdp.py
    grid = init_device_mesh(device.type, (world_size // args.tp, args.tp), mesh_dim_names=("data", "tensor"))  # tp
    for dimension in ("data", "tensor"):  # tp: init_device_mesh gives its groups torch's default (30 minutes for
        dist.set_timeout(timedelta(seconds=args.timeout), grid.get_group(dimension))  # tp: gloo), not --timeout
    row, rows = grid["data"].get_local_rank(), world_size // args.tp  # tp: which row, how many
    mesh = init_device_mesh(device.type, (args.replicas, world_size // args.replicas),
                            mesh_dim_names=("replicate", "shard")) if args.replicas > 1 else grid["data"]  # tp
    # fsdp: FSDP2 asks the reduce-scatter for a mean; older torch's gloo gave the sum (pytorch/pytorch#162338)
    mean = torch.empty(1, device=device)  # fsdp
    dist.reduce_scatter_tensor(mean, torch.ones(world_size, device=device), op=dist.ReduceOp.AVG)  # fsdp
    dist.all_reduce(mean, op=dist.ReduceOp.AVG)  # fsdp: HSDP's all-reduce across the copies asks for a mean too
    if world_size > 1 and mean.item() != 1:  # fsdp: at 1, FSDP2 sends nothing (torch: NCCL's AVG may be wrong there)
        fail(f"torch {torch.__version__}'s reduce-scatter sums where FSDP2 asks for a mean: see docs/versions.md")
    # fsdp: --param-dtype bf16: each piece is cast to bf16 before it is gathered (half the bytes), and a unit's forward
    # and backward compute in bf16; the pieces (and AdamW's state) stay fp32, the gradients are reduced in fp32
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if args.param_dtype else \
        MixedPrecisionPolicy()  # fsdp
    if args.tp > 1:  # tp: first split across the row (on the meta device: shapes only), then sharded across rows
        for block in model.blocks:  # tp: by rows, each process computes its heads and its part of the MLP's hidden
            # layer; by columns, the output projections take those parts and sum them across the row (an all-reduce)
            parallelize_module(block, grid["tensor"], {"q": ColwiseParallel(), "k": ColwiseParallel(),  # tp
                                                       "v": ColwiseParallel(), "proj": RowwiseParallel(),  # tp
                                                       "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()})  # tp
        # tp: the tied matrix split by vocabulary rows: the embedding looks up the rows it holds (and sums across the
        # row), the head computes the logits of its bytes only, left split (Shard(-1)) for the loss, below
        parallelize_module(model, grid["tensor"], {"token": RowwiseParallel(input_layouts=Replicate()),  # tp
                                                   "head": ColwiseParallel(output_layouts=Shard(-1),  # tp
                                                                           use_local_output=False)})  # tp
        model.head.weight = model.token.weight  # tp: each style made a parameter of its own: one again, as built
    for block in model.blocks:  # fsdp: one unit per transformer block, gathered just before it runs, freed after
        if args.compile:  # fsdp: in place (torch.compile(block) returns a wrapper: "_orig_mod." in the names);
            block.compile(backend=args.compile, fullgraph=True)  # fsdp: before fully_shard; FSDP2's hooks stay eager
        fully_shard(block, mesh=mesh, mp_policy=policy)  # fsdp
    # fsdp: the root last: the embeddings, the final norm and the head. The tied matrix is in this one unit, so it
    # stays one parameter (sharding the head as a unit of its own would make it a second one: torch refuses that)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # fsdp
    model.to_empty(device=device)  # fsdp: memory for this rank's pieces; their values are not set yet
    if not snapshot:  # fsdp: gpt_ddp.py's starting weights (the same seed), built whole once by rank 0 in host
        # memory; every rank receives them one tensor at a time and keeps its pieces (a resume reads its pieces)
        set_model_state_dict(model, GPT(args.block_size, args.n_layer, args.n_head, args.n_embd, args.dropout)
                             .state_dict() if rank == 0 else {},
                             options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))  # fsdp
    raw_model = model  # fsdp: fully_shard wraps nothing: the parameter names stay the plain model's
    # weight decay on the weight matrices only, not on biases, LayerNorm gains and the position table's rows
    matrices = [p for name, p in raw_model.named_parameters() if p.dim() == 2 and "position" not in name]
    others = [p for name, p in raw_model.named_parameters() if not (p.dim() == 2 and "position" not in name)]
    optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": args.weight_decay},
                                   {"params": others, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, args))
    # --amp fp16: the loss multiplied by a scale before backward, so that small gradients survive fp16; the scale
    # halves after a step whose gradients overflowed (that step skipped) and grows after 2000 good ones. Otherwise
    # every call below passes through unchanged
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    start_step, position = 0, 0  # position: training windows used so far, by all ranks together
    if snapshot:  # fsdp: each rank reads the parts of the saved tensors its pieces need, whatever world size wrote them
        model_state, optimizer_state = get_state_dict(model, optimizer)  # fsdp: views of this rank's pieces, to fill
        try:  # fsdp: DCP gathers every rank's read errors: all ranks stop here together
            dcp.load({"model": model_state, "optimizer": optimizer_state["state"]}, checkpoint_id=snapshot["path"])
        except (Exception, dcp.CheckpointException) as error:  # fsdp: (the latter a BaseException)
            fail(f"--checkpoint {snapshot['path']}: a piece is unreadable ({type(error).__name__}); move it away")
        set_state_dict(model, optimizer, model_state_dict=model_state,  # fsdp: AdamW's moments, and its lr
                       optim_state_dict={"state": optimizer_state["state"], "param_groups": snapshot["param_groups"]})
        scheduler.load_state_dict(snapshot["scheduler"])  # where in warm-up and decay the run is
        if scaler.is_enabled():
            scaler.load_state_dict(snapshot["scaler"])  # its scale and the count of good steps since it last grew
        start_step, position = snapshot["step"], snapshot["position"]  # where in the data
        log(f"resumed from {snapshot['path']}: step {start_step} of {args.steps}")  # fsdp: PATH or PATH.prev
    # no RNG state to save: dropout draws from a seed made of --seed and the position in the data (and the rank)
    stop_requested = threading.Event()  # step 04: Slurm sends SIGTERM (or USR1) before it kills a job
    for signum in (signal.SIGTERM, signal.SIGUSR1):  # step 04
        signal.signal(signum, lambda *_: stop_requested.set())  # step 04

    def make_snapshot(step):  # everything the next step depends on, not only the weights
        model_state, optimizer_state = get_state_dict(model, optimizer)  # fsdp: this rank's pieces, by name
        return {"sharded": {"model": model_state, "optimizer": optimizer_state["state"]},  # fsdp
                "param_groups": optimizer_state["param_groups"],  # fsdp
                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "step": step, "position": position,
                "data_sha256": digest, "args": vars(args), "world_size": world_size}  # port lesson

    # port lesson: the global batch grew with the world size; warm-up and decay count optimizer steps, so the same
    # --warmup-steps now spans world_size times the windows (and --lr is applied to a world_size times larger batch)
    global_batch = args.batch_size * args.grad_accum * rows  # tp: each row's windows
    log(f"GPT of {sum(p.numel() for p in raw_model.parameters()) / 1e6:.2f}M parameters on {device}: "
        f"{len(train_tokens)} training / {len(val_tokens)} validation bytes, {global_batch} windows of "
        f"{args.block_size} bytes per optimizer step, warm-up {args.warmup_steps} steps; {world_size} processes, "
        f"{args.replicas} whole copies in {world_size // args.replicas} pieces each"
        + (f"; {rows} rows of --tp {args.tp}" if args.tp > 1 else "")  # tp
        + (f"; each block compiled ({args.compile})" if args.compile else ""))  # fsdp
    model_flops_per_token = flops_per_token(raw_model, args)  # the whole model's, not this rank's pieces
    timer, norms = time.perf_counter(), []  # norms: this run's pre-clip gradient norms, step by step
    for step in range(start_step, args.steps):
        step_loss = torch.zeros((), device=device)
        # fsdp: the step's loss is one mean over all its targets, on every rank and micro-batch (with --pad-up-to, the
        # ranks hold different numbers of them): every rank counts them all from the stream, with no message
        pads = [padding(position + k * args.batch_size * rows, args.batch_size * rows, args)
                for k in range(args.grad_accum)]  # tp: rows
        targets_in_step = sum(args.block_size * len(pad) - pad.sum().item() for pad in pads)  # fsdp
        for micro_step in range(args.grad_accum):  # step 01: no_sync needs to know the last one
            # step 04's data order: one shuffled stream, counted in windows of all ranks (so a resume continues it);
            # each rank takes every world_size-th of the next batch_size * world_size: together, the single batch
            starts = window_starts(position, args.batch_size * rows, num_windows, args.seed)[row::rows]  # tp: by row
            inputs, targets = get_batch(train_tokens, starts, args.block_size, device)
            pad = pads[micro_step][row::rows].to(device)  # tp: this row's windows' padding, ignored (-100)
            kept = torch.arange(args.block_size, device=device) < args.block_size - pad[:, None]  # fsdp
            targets = targets.masked_fill(~kept, -100)  # fsdp
            torch.manual_seed(args.seed * 1_000_003 + position + row)  # tp: + row: a row's processes drop alike
            position += args.batch_size * rows  # tp
            # fsdp: as DDP's no_sync: micro-batches before the last keep whole gradients (the memory DDP needs for
            # them, until the last one), reduced once, on the sum
            model.set_requires_gradient_sync(micro_step == args.grad_accum - 1)  # fsdp
            with autocast(device, args.amp):
                logits = model(inputs)
            # fsdp: this rank's sum over its targets, over the step's count of all targets, times world_size (FSDP2
            # averages the gradients over the ranks): the step's gradient is that of the one mean. A mean of each
            # rank's mean would weigh a target more on a rank that holds fewer
            # tp: times rows (FSDP2 averages over the rows). Under --tp the logits are split by vocabulary:
            # loss_parallel computes the cross-entropy on the pieces (a softmax over a row's pieces), forward and
            # backward, without gathering the whole logits
            with loss_parallel() if args.tp > 1 else nullcontext():  # tp
                loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100,
                                       reduction="sum") * rows / targets_in_step  # tp: rows
                scaler.scale(loss).backward()  # each micro-batch adds its share of the gradient
            step_loss += whole(loss.detach())  # tp
        if os.environ.get("NAN_LOSS_AT") == f"{rank}:{step + 1}":  # port lesson: the tests make one rank's loss NaN
            step_loss += float("nan")
        # stop at the first non-finite loss, before it reaches the weights or a snapshot
        # step 01 + step 04: one all_reduce: step 01's loss summed over ranks (NaN on one rank is NaN on all: all stop
        # here; a rank-local check would leave the others waiting in the next all-reduce), and step 04's stop flag
        check = torch.stack([step_loss, torch.tensor(float(stop_requested.is_set()), device=device)])
        dist.all_reduce(check)  # step 01 + step 04
        loss_value, stop = check[0].item() / world_size, check[1].item() > 0  # step 01 + step 04
        if not math.isfinite(loss_value):
            fail(f"the loss is {loss_value} at step {step + 1}; the last snapshot, if any, holds finite weights (the "
                 "steps since it are lost); try a lower --lr")
        scaler.unscale_(optimizer)  # the true gradients (divided by the scale) before their norm meets --grad-clip
        # the gradient's norm over all parameters, then every gradient scaled down if it is above --grad-clip
        # tp: each rank holds pieces of the averaged gradient. clip_grad_norm_ stacks every parameter's norm, and under
        # --tp the parameters live on two meshes (the blocks' linear layers, embedding and head on (data, tensor); the
        # LayerNorms and the position table on data alone): each mesh's total, made whole, then the model's (the root
        # of their sum of squares), logged, and every piece scaled by it on every rank alike
        by_mesh = defaultdict(list)  # tp
        for parameter in model.parameters():  # tp
            by_mesh[parameter.device_mesh].append(parameter)  # tp
        grad_norm = torch.linalg.vector_norm(torch.stack([whole(torch.nn.utils.get_total_norm(  # tp
            [p.grad for p in parameters])) for parameters in by_mesh.values()]))  # tp
        for parameters in by_mesh.values():  # tp
            torch.nn.utils.clip_grads_with_norm_(parameters, args.grad_clip or float("inf"), grad_norm)  # tp
        grad_norm = grad_norm.item()  # tp
        if not math.isfinite(grad_norm) and not scaler.is_enabled():  # fp16: an overflow; the scaler skips the step
            fail(f"the gradient norm is {grad_norm} at step {step + 1}; try a lower --lr")
        norms.append(grad_norm)
        scaler.step(optimizer)  # optimizer.step(), unless the gradients hold an inf or a NaN (fp16 only)
        scaler.update()
        lr = optimizer.param_groups[0]["lr"]  # the rate this step used; scheduler.step() sets the next
        with warnings.catch_warnings():  # a step the fp16 scaler skipped still counts in the schedule: no warning
            warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`")
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)  # frees the gradients instead of writing zeros into them
        done, seconds = step + 1, time.perf_counter() - timer
        metrics = {"step": done, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
                   "tokens_per_s": global_batch * args.block_size / seconds}
        if args.peak_tflops:  # the model FLOPs done per second, over what the devices could do at their peak
            metrics["mfu"] = (metrics["tokens_per_s"] * model_flops_per_token  # step 01: every device's peak
                              / (args.peak_tflops * 1e12 * world_size))
        timer = time.perf_counter()
        if done % args.eval_every == 0 or done == args.steps:
            metrics["val_loss"], metrics["val_median_window_loss"] = evaluate(model, val_tokens, args, device)
            log(f"step {done}/{args.steps}  val loss {metrics['val_loss']:.4f}  perplexity "
                f"{math.exp(metrics['val_loss']):.2f}  median window loss {metrics['val_median_window_loss']:.4f}")
        if done % args.log_every == 0 or done == args.steps:
            log(f"step {done}/{args.steps}  loss {loss_value:.4f}  lr {metrics['lr']:.2e}  grad norm "
                f"{grad_norm:.3f}  {metrics['tokens_per_s']:.0f} tokens/s"
                + (f"  MFU {metrics['mfu']:.1%}" if args.peak_tflops else ""))
        if args.metrics and rank == 0:  # step 01
            with open(args.metrics, "a") as f:
                f.write(json.dumps(metrics) + "\n")
        stopping = stop or done == args.stop_after_steps  # step 04: every rank decides alike
        if args.checkpoint and (done % args.save_every_steps == 0 or done == args.steps or stopping):
            finite = torch.tensor(float(all(p.to_local().isfinite().all() for p in model.parameters())), device=device)
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)  # fsdp: each rank checks its pieces; all agree on the verdict
            if not finite:  # fsdp
                fail(f"the weights are not finite after step {done}: not saved; try a lower --lr")
            save_checkpoint(args.checkpoint, make_snapshot(done))
        if stopping:  # step 04
            log(f"stopped after step {done}" + ("; the same command resumes from there" if args.checkpoint else ""))
            dist.barrier()  # port lesson: leave together, as at the end of the run (below)
            dist.destroy_process_group()  # step 01
            sys.exit(0)  # step 04: not a failure: torchrun must not spend a restart on it
    if args.checkpoint:  # fsdp: the end as one plain file, for one device
        export_whole(args.checkpoint + ".single.pt", model, optimizer,
                     {key: value for key, value in make_snapshot(args.steps).items() if key != "sharded"})  # fsdp
    text = sample(model, args, device)  # fsdp: every rank (each forward gathers from all); the same text on each
    log("sample:\n" + text)  # fsdp
    # fsdp: full_tensor: each whole parameter gathered from its pieces (every rank takes part)
    checksum = sum(p.full_tensor().double().sum().item() for p in raw_model.parameters())
    norms_digest = f"{len(norms)}, sum {sum(norms)!r}, sha256 {hashlib.sha256(repr(norms).encode()).hexdigest()[:16]}"
    # every rank: equal on all of them (the weights, and the gradient norms, port lesson)
    print(f"rank {rank} done: parameter checksum {checksum!r}; gradient norms: {norms_digest}\n", end="",
          flush=True)  # one write per line: lines of different ranks never run into each other
    dist.barrier()  # port lesson: leave together
    dist.destroy_process_group()  # step 01


if __name__ == "__main__":
    args = parse_args()
    if "LOCAL_RANK" not in os.environ:  # step 02: stop rather than train as a world of one
        sys.exit(f"{sys.argv[0]} must be started by torchrun: torchrun --standalone --nproc_per_node=2 {sys.argv[0]}")
    main(args)
    # step 01: leave without Python's shutdown: once DDP has used gloo's group, destroy_process_group leaves its
    # threads running, and one still freeing a collective's tensors as Python shuts down aborts the process (-6)
    sys.stdout.flush()  # step 01
    os._exit(0)  # step 01
