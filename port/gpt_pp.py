"""The GPT of gpt_ddp.py cut into pipeline stages: each process holds a run of blocks, not the whole model.

`diff port/gpt_ddp.py port/gpt_pp.py` is the whole change; each statement or block it adds says "pp:" and why.
Process s of N holds blocks s*L/N .. (s+1)*L/N - 1 (the first also the embeddings, the last also the final norm and
the head); every process reads the same windows, and torch.distributed.pipelining's schedule (--schedule gpipe or
1f1b) passes --grad-accum micro-batches of --batch-size windows through the stages, each stage's activations sent to
the next and their gradients sent back. The tied embedding and head live on the first and the last stage: two copies,
kept equal by summing their gradients. Snapshots are gpt_ddp.py's whole files: any number of stages, gpt_ddp.py on
one process, or gpt_single.py resumes them.

  torchrun --standalone --nproc_per_node=2 port/gpt_pp.py                          # 2 stages, 1F1B, 4 micro-batches
  torchrun --standalone --nproc_per_node=2 port/gpt_pp.py --schedule gpipe --grad-accum 8
  torchrun --standalone --nproc_per_node=2 port/gpt_pp.py --checkpoint gpt.pt     # SIGTERM it, run it again
"""
import argparse
import hashlib
import json
import math
import os
import signal  # step 04
import sys
import threading  # step 04
import time
import warnings
from contextlib import nullcontext
from datetime import timedelta  # step 01
from functools import lru_cache

import torch
import torch.distributed as dist  # step 01
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record  # step 02
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe  # pp

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "ddp_steps_prose.txt")
# what a snapshot must agree on with the command that resumes it: any of these changes what the run computes
SAME_ON_RESUME = ("data", "seed", "steps", "batch_size", "block_size", "grad_accum", "lr", "warmup_steps",
                  "weight_decay", "grad_clip", "n_layer", "n_head", "n_embd", "dropout", "amp")


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
    parser.add_argument("--grad-accum", type=int, default=4, help="micro-batches per optimizer step (pp: the "
                        "pipeline's: while one stage works on a micro-batch the others work on others)")
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
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b", help="pp: gpipe: every "
                        "micro-batch's forward, then every backward; 1f1b: a backward as soon as it can (the same "
                        "idle time, fewer micro-batches' activations held at once)")
    parser.add_argument("--checkpoint", default=None, help="snapshot here; a run finding one resumes from it")
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
                 "eval_windows", "log_every", "save_every_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if min(args.warmup_steps, args.sample_bytes) < 0 or not 0 <= args.grad_clip < float("inf"):
        parser.error("--warmup-steps, --sample-bytes and --grad-clip must be 0 or more")
    if not (0 < args.lr < float("inf") and 0 < args.timeout < float("inf")):  # step 01
        parser.error(f"--lr and --timeout must be positive numbers, got {args.lr} and {args.timeout}")
    if not (0 <= args.weight_decay < float("inf") and 0 <= args.dropout < 1):
        parser.error(f"--weight-decay must be 0 or more, --dropout in [0, 1); got {args.weight_decay}, "
                     f"{args.dropout}")
    stages = int(os.environ.get("WORLD_SIZE", 1))  # pp: torchrun's number of processes, one stage each
    if stages > args.n_layer:  # pp: every stage holds one block or more
        parser.error(f"--n-layer {args.n_layer} blocks cannot make {stages} stages")
    if args.schedule == "1f1b" and stages > args.grad_accum:  # pp: torch's Schedule1F1B raises a ValueError
        parser.error(f"--schedule 1f1b needs --grad-accum {args.grad_accum} to be at least the {stages} stages; "
                     "gpipe runs fewer")
    if args.amp == "fp16":  # pp: the schedule calls backward itself, on the loss its loss_fn returns: not built here
        parser.error("--amp fp16: not built here (the schedule calls backward itself, on a loss no GradScaler has "
                     "scaled); use --amp (bf16)")
    if args.n_embd % args.n_head:
        parser.error(f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}")
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
        self.qkv, self.proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd),
                                 nn.Dropout(dropout))

    def forward(self, x):
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(batch, length, 3, self.n_head, width // self.n_head).permute(
            2, 0, 3, 1, 4)  # three of (batch, head, position, head width)
        # is_causal: position t attends to 0..t only; PyTorch picks a fused (flash / memory-efficient) kernel
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        x = x + F.dropout(self.proj(y.transpose(1, 2).reshape(batch, length, width)), self.dropout, self.training)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, block_size, n_layer, n_head, n_embd, dropout):
        super().__init__()
        self.token, self.position = nn.Embedding(256, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*(Block(n_embd, n_head, dropout) for _ in range(n_layer)))
        self.ln, self.head, self.dropout = nn.LayerNorm(n_embd), nn.Linear(n_embd, 256, bias=False), dropout
        self.head.weight = self.token.weight  # tied: one matrix reads bytes in and writes them out
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)  # GPT-2's; PyTorch's defaults are too large here
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, x):  # pp: bytes on the first stage; on the others, the activations the stage before sent
        if self.position is not None:  # pp: the first stage embeds
            x = F.dropout(self.token(x) + self.position(torch.arange(x.shape[1], device=x.device)), self.dropout,
                          self.training)  # pp
        x = self.blocks(x)  # pp: this stage's blocks (the others' are nn.Identity here)
        return self.head(self.ln(x)) if self.head is not None else x  # pp: the last stage: the logits


def cut(model, stage, stages):
    """pp: the parts of the model that stage (of stages) runs: its blocks, the embeddings on the first stage, the final
    norm and the head on the last. The other blocks become nn.Identity, so a block keeps its name (blocks.2 on any
    stage, in any snapshot); the last stage keeps the token embedding, unused, for the tied matrix to keep its name
    (token.weight) there. The rest is freed: each process then holds its stage's weights only (main builds the whole
    model first, as gpt_ddp.py does: fine at this size; a large model would be built on the meta device)."""
    first, end = stage * len(model.blocks) // stages, (stage + 1) * len(model.blocks) // stages  # pp
    for index in range(len(model.blocks)):  # pp
        if not first <= index < end:  # pp
            model.blocks[index] = nn.Identity()  # pp
    if stage > 0:  # pp
        model.position = None  # pp
    if 0 < stage < stages - 1:  # pp
        model.token = None  # pp
    if stage < stages - 1:  # pp
        model.ln, model.head = None, None  # pp
    return model  # pp


def grouped_names(model):
    """pp: the parameters' names as AdamW's two groups hold them (main): the matrices, then the rest. Over the whole
    model, a plain AdamW's numbering, which gpt_ddp.py's snapshots use; over a stage, this stage's AdamW's."""
    matrices = [name for name, p in model.named_parameters() if p.dim() == 2 and "position" not in name]  # pp
    return matrices, [name for name, _ in model.named_parameters() if name not in matrices]  # pp


def stage_part(saved, whole_groups, stage_groups):
    """pp: this stage's part of a whole AdamW's state (numbered over whole_groups), numbered over its own groups."""
    number, names = {name: i for i, name in enumerate(sum(whole_groups, []))}, sum(stage_groups, [])  # pp
    return {"state": {i: saved["state"][number[n]] for i, n in enumerate(names) if number[n] in saved["state"]},
            "param_groups": [{**saved["param_groups"][0], "params": list(range(len(stage_groups[0])))},
                             {**saved["param_groups"][1], "params": list(range(len(stage_groups[0]), len(names)))}]}


def whole_state(model, optimizer, whole_groups):
    """pp: on rank 0, the whole model's weights and a whole AdamW's state numbered over whole_groups, gpt_ddp.py's
    snapshot's layout, gathered from every stage by name; (None, None) on the others. The whole model passes through
    rank 0's host memory: fine at this size; a large model's stages would each write their own (DCP, gpt_fsdp.py)."""
    state, names = optimizer.state_dict(), sum(grouped_names(model), [])  # pp
    mine = ({name: value.cpu() for name, value in model.state_dict().items()},  # pp: host memory, to pickle
            {name: {key: value.cpu() for key, value in state["state"][i].items()}
             for i, name in enumerate(names) if i in state["state"]})  # pp
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None  # pp
    dist.gather_object(mine, parts, dst=0)  # pp
    if dist.get_rank() != 0:  # pp
        return None, None  # pp
    number = {name: i for i, name in enumerate(sum(whole_groups, []))}  # pp
    groups = [{**group, "params": [number[name] for name in names]}
              for group, names in zip(state["param_groups"], whole_groups, strict=True)]  # pp
    # pp: stage 0's entries last, so that they win: its token.weight (and moments), the last stage's head.weight
    moments = {number[name]: value for _, part in reversed(parts) for name, value in part.items()}  # pp
    return {name: value for part, _ in reversed(parts) for name, value in part.items()}, {
        "state": dict(sorted(moments.items())), "param_groups": groups}  # pp


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


def forward_stages(model, x, args):
    """pp: one forward through all the stages, the activations passed on by plain sends and receives (training's
    schedule does this for micro-batches; validation and sampling pass one batch). Returns the logits on the last
    stage, None on the others; every stage is given the batch's bytes (the first reads them, the others their shape)."""
    rank, last = dist.get_rank(), dist.get_world_size() - 1  # pp
    if rank > 0:  # pp: the stage before sends one vector of --n-embd per byte
        x = torch.empty(*x.shape, args.n_embd, device=x.device)  # pp
        dist.recv(x, src=rank - 1)  # pp
    x = model(x)  # pp
    if rank == last:  # pp
        return x  # pp
    dist.send(x.float().contiguous(), dst=rank + 1)  # pp
    return None  # pp


@torch.no_grad()
def evaluate(model, tokens, args, device):
    """(Mean loss per byte, median of the windows' mean losses) over the first --eval-windows non-overlapping
    windows of the held-out text."""
    model.eval()
    starts = list(range(0, len(tokens) - args.block_size, args.block_size))[:args.eval_windows]
    last = dist.get_world_size() - 1  # pp: every window through every stage; the last one's losses
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, bytes
    window_losses = [torch.zeros(0, device=device)]
    for first in range(0, len(starts), args.batch_size):
        inputs, targets = get_batch(tokens, starts[first:first + args.batch_size], args.block_size, device)
        with autocast(device, args.amp):
            logits = forward_stages(model, inputs, args)  # pp
        if logits is None:  # pp: not the last stage
            continue  # pp
        losses = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
        totals += torch.stack([losses.sum().double(), torch.tensor(losses.numel(), device=device).double()])
        window_losses.append(losses.view(targets.shape).mean(1))
    window_losses = torch.cat(window_losses)
    result = torch.zeros(2, dtype=torch.float64, device=device)  # pp
    if dist.get_rank() == last:  # pp
        result[:] = torch.stack([totals[0] / totals[1], window_losses.median().double()])  # pp
    dist.broadcast(result, src=last)  # pp: the last stage's two numbers, to every stage
    model.train()
    return result[0].item(), result[1].item()  # pp


@torch.no_grad()
def sample(model, args, device, prompt=b"\n"):
    """--sample-bytes bytes drawn from the model, one at a time (temperature 0.8), decoded as UTF-8."""
    model.eval()
    tokens, generator = torch.tensor([list(prompt)], device=device), torch.Generator(device).manual_seed(args.seed)
    for _ in range(args.sample_bytes):
        logits = forward_stages(model, tokens[:, -args.block_size:], args)  # pp
        byte = torch.zeros((1, 1), dtype=torch.long, device=device)  # pp
        if logits is not None:  # pp: the last stage draws the next byte
            byte = torch.multinomial((logits[:, -1].float() / 0.8).softmax(-1), 1, generator=generator)  # pp
        dist.broadcast(byte, src=dist.get_world_size() - 1)  # pp: every stage's next input holds it
        tokens = torch.cat([tokens, byte], dim=1)  # pp
    return bytes(tokens[0, len(prompt):].tolist()).decode("utf-8", errors="replace")


def save_checkpoint(path, snapshot):
    """A crash at any moment leaves the old snapshot or the new one, never half of one."""
    if dist.get_rank() != 0:  # step 03: global rank 0 writes; the others wait until the file exists
        dist.barrier()  # step 01
        return  # step 01
    with open(path + ".tmp", "wb") as f:
        torch.save(snapshot, f)
        f.flush()
        os.fsync(f.fileno())  # on the disk, not only in the page cache, before it replaces the old one
    os.replace(path + ".tmp", path)  # atomic
    log(f"saved snapshot {path} (step {snapshot['step']})")
    dist.barrier()  # step 01


def load_checkpoint(args, device, digest):
    """The snapshot at --checkpoint, or None if there is none yet. Every rank reads it, onto its own device."""
    if not os.path.exists(args.checkpoint):
        return None
    try:  # weights_only: a snapshot is a pickle, and unpickling an untrusted one could run arbitrary code
        with warnings.catch_warnings():  # quietly: a plain pickle warns of its protocol before it is refused below
            warnings.simplefilter("ignore")
            snapshot = torch.load(args.checkpoint, map_location=device, weights_only=True)
        saved, _ = snapshot["args"], snapshot["data_sha256"]  # (another script's checkpoint lacks one or both)
    except Exception as error:  # truncated, corrupted, not a torch file at all, or not this script's
        fail(f"--checkpoint {args.checkpoint}: unreadable, or not a snapshot of this script ({type(error).__name__}); "
             "move it away to start over", everyone=False)  # port lesson: this rank's copy alone may be unreadable
    changed = [f"--{name.replace('_', '-')} {getattr(args, name)} (snapshot: {saved.get(name)})"
               for name in SAME_ON_RESUME if saved.get(name) != getattr(args, name) and name != "data"]
    if snapshot["data_sha256"] != digest:
        changed.append(f"--data {args.data} holds other bytes than the snapshot's text")
    if changed:
        fail(f"--checkpoint {args.checkpoint}: a resume cannot change {', '.join(changed)}; repeat the snapshot's "
             "values, or give another --checkpoint path to start afresh", everyone=False)  # port lesson
    return snapshot


@record  # step 02: under torchrun, a worker's traceback goes into torchrun's failure summary
def main(args):
    # step 02: torchrun says who this process is: its rank among all, its index on this machine, how many in all
    rank, local_rank, world_size = (int(os.environ[name]) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    train_tokens, val_tokens, digest = load_text(args, processes=1)  # pp: every stage reads the same windows
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
    model = GPT(args.block_size, args.n_layer, args.n_head, args.n_embd, args.dropout).to(device)
    snapshot = load_checkpoint(args, device, digest) if args.checkpoint else None
    # port lesson: one place to resume from (a rank finding no snapshot would start afresh while the others resume).
    # pp: on any number of stages: the global batch is --batch-size x --grad-accum on any number
    found = [None] * world_size  # port lesson
    where = snapshot and (snapshot["step"], snapshot["position"], snapshot["world_size"])  # port lesson
    dist.all_gather_object(found, where)  # port lesson
    if len(set(found)) > 1 or (snapshot and snapshot["world_size"] != 1):  # pp: a snapshot of one process's batch
        fail(f"--checkpoint {args.checkpoint}: (step, position, world size) of the snapshot by rank: {found}; "
             "every rank must read the same snapshot, of one process's batch")  # pp
    if snapshot:
        model.load_state_dict(snapshot["model"])
    whole_groups = grouped_names(model)  # pp: the whole model's parameter names, which snapshots number
    parameters, model_flops_per_token = sum(p.numel() for p in model.parameters()), flops_per_token(model, args)  # pp
    raw_model = model = cut(model, rank, world_size)  # pp: no wrapper: this stage's part of the model, the rest freed
    # pp: this process is stage `rank` of world_size; the schedule splits each batch into --grad-accum micro-batches
    # and runs each stage's forwards and backwards in its order, sending activations to rank + 1 and their
    # gradients back to rank - 1 (point-to-point sends, not collectives). It averages the micro-batches' gradients
    stage = PipelineStage(model, rank, world_size, device)  # pp
    schedule = (Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe)(stage, args.grad_accum, loss_fn=lambda
                logits, targets: F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()))  # pp
    # pp: the tied matrix has a copy on stage 0 (the embedding) and on the last stage (the head), each of which gets
    # its part of the gradient; summing the two parts on both gives each the one-process gradient, so both copies
    # take the same step and stay equal. A group of the two (every process must create it), with --timeout: a new
    # group's default is torch's (30 minutes for gloo, 10 for NCCL), not the one init_process_group was given
    ends = dist.new_group([0, world_size - 1], timeout=timedelta(seconds=args.timeout)) if world_size > 1 else None
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
    if snapshot:  # pp: AdamW's moments of this stage's parameters, by name, out of the whole AdamW's state
        optimizer.load_state_dict(stage_part(snapshot["optimizer"], whole_groups, grouped_names(model)))  # pp
        scheduler.load_state_dict(snapshot["scheduler"])  # where in warm-up and decay the run is
        if scaler.is_enabled():
            scaler.load_state_dict(snapshot["scaler"])  # its scale and the count of good steps since it last grew
        start_step, position = snapshot["step"], snapshot["position"]  # where in the data
        log(f"resumed from {args.checkpoint}: step {start_step} of {args.steps}")
    snapshot = None  # pp: the whole snapshot freed: each stage keeps its own part
    # no RNG state to save: dropout draws from a seed made of --seed and the position in the data (and the rank)
    stop_requested = threading.Event()  # step 04: Slurm sends SIGTERM (or USR1) before it kills a job
    for signum in (signal.SIGTERM, signal.SIGUSR1):  # step 04
        signal.signal(signum, lambda *_: stop_requested.set())  # step 04

    def make_snapshot(step):  # everything the next step depends on, not only the weights
        model_state, optimizer_state = whole_state(model, optimizer, whole_groups)  # pp: on rank 0; None elsewhere
        return {"model": model_state, "optimizer": optimizer_state,  # pp
                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "step": step, "position": position,
                "data_sha256": digest, "args": vars(args), "world_size": 1}  # pp: one process's batch

    global_batch = args.batch_size * args.grad_accum  # pp: the stages share one batch: it does not grow with them
    blocks = "/".join(str((s + 1) * args.n_layer // world_size - s * args.n_layer // world_size)
                      for s in range(world_size))  # pp: each stage's, as cut() splits them
    log(f"GPT of {parameters / 1e6:.2f}M parameters on {device}: "  # pp
        f"{len(train_tokens)} training / {len(val_tokens)} validation bytes, {global_batch} windows of "
        f"{args.block_size} bytes per optimizer step, warm-up {args.warmup_steps} steps; {world_size} stages of "
        f"{blocks} blocks, {args.schedule}, {args.grad_accum} micro-batches")  # pp
    timer, norms = time.perf_counter(), []  # norms: this run's pre-clip gradient norms, step by step
    for step in range(start_step, args.steps):
        # pp: every stage reads the step's windows, one process's batch (the first stage needs the bytes, the last
        # the targets); step 04's stream, one shuffled order of windows, so that a resume continues it
        starts = window_starts(position, args.batch_size * args.grad_accum, num_windows, args.seed)  # pp
        inputs, targets = get_batch(train_tokens, starts, args.block_size, device)  # pp
        torch.manual_seed(args.seed * 1_000_003 + position + rank)  # pp: dropout: + rank: each stage's own masks
        position += args.batch_size * args.grad_accum  # pp
        losses = []  # pp: the last stage's loss of each micro-batch
        with autocast(device, args.amp):  # pp: around forwards and backwards (the schedule runs both)
            schedule.step(*([inputs] if rank == 0 else []), target=targets if rank == world_size - 1 else None,
                          losses=losses, return_outputs=False)  # pp: else the last stage keeps all the logits
        step_loss = torch.stack(losses).mean().detach() if losses else torch.zeros((), device=device)  # pp
        if os.environ.get("NAN_LOSS_AT") == f"{rank}:{step + 1}":  # port lesson: the tests make one rank's loss NaN
            step_loss += float("nan")
        # stop at the first non-finite loss, before it reaches the weights or a snapshot
        # step 01 + step 04: one all_reduce: step 01's loss summed over ranks (NaN on one rank is NaN on all: all stop
        # here; a rank-local check would leave the others waiting in the next all-reduce), and step 04's stop flag
        check = torch.stack([step_loss, torch.tensor(float(stop_requested.is_set()), device=device)])
        dist.all_reduce(check)  # step 01 + step 04
        loss_value, stop = check[0].item(), check[1].item() > 0  # pp: the last stage's loss, 0 from the others
        if not math.isfinite(loss_value):
            fail(f"the loss is {loss_value} at step {step + 1}; the last snapshot, if any, holds finite weights (the "
                 "steps since it are lost); try a lower --lr")
        scaler.unscale_(optimizer)  # the true gradients (divided by the scale) before their norm meets --grad-clip
        # the gradient's norm over all parameters, then every gradient scaled down if it is above --grad-clip
        if ends and rank in (0, world_size - 1):  # pp: each copy of the tied matrix: its part of the gradient
            dist.all_reduce(model.token.weight.grad, group=ends)  # pp: plus the other copy's: the whole gradient
        # pp: each stage holds its parameters' gradients: the squares of their norms summed over the stages (the tied
        # matrix counted once, on stage 0) give the model's norm, by which every stage scales its own
        own = [p.grad for name, p in model.named_parameters() if rank == 0 or name != "token.weight"]  # pp
        squares = torch.nn.utils.get_total_norm(own) ** 2  # pp
        dist.all_reduce(squares)  # pp
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), args.grad_clip or float("inf"), squares.sqrt())  # pp
        grad_norm = squares.sqrt().item()  # pp
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
            finite = torch.tensor(float(all(p.isfinite().all() for p in model.parameters())), device=device)  # pp
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)  # pp: each stage checks its own; all agree on the verdict
            if not finite:  # pp
                fail(f"the weights are not finite after step {done}: not saved; try a lower --lr")
            save_checkpoint(args.checkpoint, make_snapshot(done))
        if stopping:  # step 04
            log(f"stopped after step {done}" + ("; the same command resumes from there" if args.checkpoint else ""))
            dist.barrier()  # port lesson: leave together, as at the end of the run (below)
            dist.destroy_process_group()  # step 01
            sys.exit(0)  # step 04: not a failure: torchrun must not spend a restart on it
    text = sample(model, args, device)  # pp: every stage takes part in each byte's forward
    log("sample:\n" + text)  # pp
    checksum = torch.tensor(sum(p.double().sum().item() for name, p in model.named_parameters()
                                if rank == 0 or name != "token.weight"), dtype=torch.float64, device=device)  # pp
    dist.all_reduce(checksum)  # pp: the whole model's, summed over the stages (the tied matrix once)
    checksum = checksum.item()  # pp
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
