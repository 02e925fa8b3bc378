"""The port lesson's workers: run in each process of a gloo group (runs.Processes or runs.run_group), they compute the
validation metrics of port/gpt_ddp.py's model three ways - rank-local, as DistributedSampler shards and gathers
them, and as gpt_ddp.py does - and compare the texts the ranks read."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from lessons.runs import load_script

PORTED = "port/gpt_ddp.py"


def _window_losses(ported, model, tokens, starts, args):
    """Each window's mean loss per byte."""
    inputs, targets = ported.get_batch(tokens, starts, args.block_size, torch.device("cpu"))
    with torch.no_grad():
        losses = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction="none")
    return losses.view(targets.shape).mean(1)


def metrics_three_ways(rank, world_size, checkpoint, argv):
    """Validation loss and median window loss of the snapshot at `checkpoint` (made with flags `argv`):
    - "this rank alone": what a rank-local computation reports (each rank a different answer),
    - "mean of the ranks' means": the shard means all-reduced and divided by the world size,
    - "DistributedSampler + all_gather": shards padded by repeating windows, gathered, used as they come,
    - "gpt_ddp.py": sums all-reduced, windows gathered with the padding cut off (exact)."""
    ported = load_script(PORTED)
    args = ported.parse_args([str(part) for part in argv])
    model = ported.GPT(args.block_size, args.n_layer, args.n_head, args.n_embd, 0.0)
    model.load_state_dict(torch.load(checkpoint, weights_only=True)["model"])
    model.eval()
    _, val_tokens, _ = ported.load_text(args, world_size)
    starts = list(range(0, len(val_tokens) - args.block_size, args.block_size))[:args.eval_windows]
    mine = _window_losses(ported, model, val_tokens, starts[rank::world_size], args)
    result = {"windows": len(starts), "windows on this rank": len(mine),
              "this rank alone": (mine.mean().item(), mine.median().item())}
    means = torch.tensor([mine.mean().item(), mine.median().item()])
    dist.all_reduce(means)
    result["mean of the ranks' means (medians)"] = tuple((means / world_size).tolist())
    sampler = list(DistributedSampler(range(len(starts)), num_replicas=world_size, rank=rank, shuffle=False))
    padded = _window_losses(ported, model, val_tokens, [starts[i] for i in sampler], args)
    gathered = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(gathered, padded)
    everything = torch.cat(gathered)
    result["DistributedSampler + all_gather"] = (everything.mean().item(), everything.median().item())
    result["windows gathered by DistributedSampler"] = len(everything)
    result["gpt_ddp.py (exact)"] = ported.evaluate(model, val_tokens, args, torch.device("cpu"))
    one = _window_losses(ported, model, val_tokens, starts, args)  # the whole set in one process: the truth
    result["one process, every window"] = (one.mean().item(), one.median().item())
    return result


def different_texts(rank, world_size):
    """gpt_ddp.py's text check when rank 1 read a different file: (exit status, what the rank printed)."""
    import contextlib
    import hashlib
    import io

    ported = load_script(PORTED)
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        try:
            text = b"the text" if rank == 0 else b"another copy of the text"
            ported.check_same_text(hashlib.sha256(text).hexdigest(), "text.txt")
            status = 0
        except SystemExit as stopped:
            status = stopped.code
    return status, said.getvalue().strip()


def train(rank, world_size, argv, script=PORTED):
    """gpt_ddp.py's main (or another port script's) in a process of runs.Processes, with the variables torchrun
    would set: a run without torchrun's start-up (seconds of imports per process), for the lessons' repeated runs."""
    import os

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
                      LOCAL_WORLD_SIZE=str(world_size))
    ported = load_script(script)
    ported.main(ported.parse_args([str(part) for part in argv]))
