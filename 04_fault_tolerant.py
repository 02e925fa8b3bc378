"""Step 04: the same multi-node training, made to survive a dead worker or a preempted job without losing work.

Every --save-every-steps optimizer steps (and at every epoch end) global rank 0 writes a complete snapshot: model,
optimizer, LR schedule, GradScaler, RNG states and how far into the epoch's data the job is. A restarted job
loads it and continues exactly where it left off, mid-epoch included: no epoch is re-run, no sample skipped.
torchrun restarts the workers when one dies; SIGTERM or SIGUSR1 (what a scheduler sends before it kills a job)
makes every rank stop at the next step, after a snapshot. The tutorial this follows saved only model + epoch,
so every resume re-ran the epoch it died in.

  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 --max-restarts=3 \
      04_fault_tolerant.py --checkpoint snapshot.pt
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1:2 --nproc_per_node=2 --max-restarts=3 \
      --rdzv_backend=c10d --rdzv_endpoint=nodeA:29500 --rdzv_id=job1 --rdzv_conf=join_timeout=60 \
      04_fault_tolerant.py --checkpoint snapshot.pt       # elastic: 1 or 2 nodes, on every node
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives every restart a fresh workers' store (MASTER_ADDR:MASTER_PORT). Set it
on every node of every multi-node run: without it a run on more than one node is refused (pytorch/pytorch#135712).
"""
import argparse
import atexit
import json
import math
import multiprocessing.forkserver
import os
import random
import re
import signal
import socket
import sys
import threading
import time
import warnings
from contextlib import nullcontext
from datetime import timedelta

# torchvision (CIFAR-10, image folders, models by name) is imported where it is used, not here: its import takes
# about 1 to 2 s of CPU (it loads torch's compiler, as a first optimizer does), and the built-in data and models
# need none of it
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], usage=argparse.SUPPRESS,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64, help="samples per process per step")
    parser.add_argument("--lr", type=float, default=0.05, help="peak learning rate (SGD, cosine decay)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the model, the data order and the synthetic data")
    parser.add_argument("--data", default="synthetic", help="'synthetic' (built in), 'cifar10', or an ImageFolder "
                        "directory holding train/ and val/")
    parser.add_argument("--data-dir", default="data", help="where cifar10 is (or is downloaded to)")
    parser.add_argument("--download", action="store_true", help="download cifar10 if it is missing")
    parser.add_argument("--train-samples", type=int, default=None, help="use only this many training samples")
    parser.add_argument("--val-samples", type=int, default=None, help="use only this many validation samples")
    parser.add_argument("--model", default="cnn", help="'cnn' (small, fast on CPU), 'wide' (31.5M parameters, most "
                        "memory in weights: step 05's; 'wide-N': N wide) or a torchvision model name, e.g. resnet18")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes per process")
    parser.add_argument("--checkpoint", default=None, help="write the model here (a plain state_dict)")
    parser.add_argument("--save-every", type=int, default=1, help="epochs between checkpoints")
    parser.add_argument("--save-every-steps", type=int, default=50, help="optimizer steps between snapshots")
    parser.add_argument("--allow-new-lr", action="store_true", help="resume with this command's --lr, not the "
                        "snapshot's: the schedule goes on from where it was, scaled (after a divergence)")
    parser.add_argument("--evaluate", default=None, metavar="CHECKPOINT", help="only evaluate this checkpoint")
    parser.add_argument("--amp", action="store_true", help="mixed precision: bf16 on CPU, fp16 + GradScaler on CUDA")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--tensorboard", default=None, metavar="DIR", help="write TensorBoard logs here")
    parser.add_argument("--metrics", default=None, metavar="PATH", help="append one JSON line per epoch here")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a collective waits for a missing "
                        "process before it fails (the steps with several processes)")
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "save_every", "grad_accum", "train_samples", "val_samples",
                 "save_every_steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.num_workers < 0:
        parser.error(f"--num-workers must be 0 or more, got {args.num_workers}")
    if not (0 < args.lr < float("inf") and 0 < args.timeout < float("inf")):
        parser.error(f"--lr and --timeout must be positive numbers, got {args.lr} and {args.timeout}")
    if args.model != "cnn" and not re.fullmatch(r"wide(-[1-9][0-9]*)?", args.model):
        import torchvision  # only here, for a model by name (see the imports)
        if args.model not in torchvision.models.list_models(torchvision.models):
            parser.error(f"--model {args.model}: unknown; use 'cnn', 'wide' or a torchvision classification model, "
                         "listed by python -c 'import torchvision; "
                         "print(torchvision.models.list_models(torchvision.models))'")
    if args.data == "cifar10" and not args.download and not os.path.isdir(f"{args.data_dir}/cifar-10-batches-py"):
        parser.error(f"--data cifar10: not found in {args.data_dir}/; add --download (needs internet)")
    if args.evaluate and not os.path.isfile(args.evaluate):
        parser.error(f"--evaluate {args.evaluate}: " + ("a folder, not a checkpoint file (of 05's snapshot folder PATH,"
                     " give PATH.model.pt)" if os.path.isdir(args.evaluate) else "no such file"))
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but PyTorch sees no GPU")
    return args


def check_inputs(args, world_size):
    """Refuses, in one line and before any process group forms, an input that could only fail later or train
    silently on nothing. --help lists the flags; docs/flags.md lists what is refused."""
    def refuse(message):
        sys.exit(f"error: {message}")

    num_classes, train_samples = 10, args.train_samples or 16_000  # the built-in data: any size, 10 classes
    if args.data != "synthetic":
        import torchvision  # only for real images (see the imports)
    if args.data == "cifar10":
        train_samples = min(50_000, args.train_samples or 50_000)
        cifar = torchvision.datasets.CIFAR10  # its files and their MD5s: a damaged one is named now, not mid-run
        files = [*cifar.train_list, *cifar.test_list, (cifar.meta["filename"], cifar.meta["md5"])]
        damaged = [name for name, md5 in files if not args.download and not torchvision.datasets.utils.check_integrity(
            os.path.join(args.data_dir, cifar.base_folder, name), md5)]
        if damaged:
            refuse(f"--data cifar10: {', '.join(damaged)} in {os.path.join(args.data_dir, cifar.base_folder)}: missing "
                   "or damaged (not the MD5 CIFAR-10 publishes); add --download to fetch it again")
    elif args.data != "synthetic":  # an ImageFolder: train/ and val/, each with one folder of images per class
        images = {}
        for split in ("train", "val"):
            folder = os.path.join(args.data, split)
            if not os.path.isdir(folder):
                refuse(f"--data {args.data}: no {split}/ folder (expected {args.data}/train/CLASS/IMAGE and val/)")
            classes = sorted(entry.name for entry in os.scandir(folder) if entry.is_dir())
            images[split] = {name: sum(file.lower().endswith(torchvision.datasets.folder.IMG_EXTENSIONS)  # as
                                       for _, _, files in os.walk(os.path.join(folder, name), followlinks=True)
                                       for file in files) for name in classes}  # ImageFolder finds them
            if not images[split] or 0 in images[split].values():
                empty = [name for name, count in images[split].items() if count == 0]
                refuse(f"--data {args.data}: {split}/ has " + (f"no images in {', '.join(empty)}/" if empty else
                                                                "no class folders"))
        if list(images["train"]) != list(images["val"]):  # ImageFolder numbers classes per split, by name
            refuse(f"--data {args.data}: train/ and val/ hold different class folders, so their labels would not "
                   f"match: {sorted(set(images['train']) ^ set(images['val']))}")
        num_classes = len(images["train"])
        train_samples = min(sum(images["train"].values()), args.train_samples or sum(images["train"].values()))
    global_batch = args.batch_size * world_size * args.grad_accum
    if train_samples < global_batch:  # drop_last: not one step would be taken
        refuse(f"{train_samples} training samples are fewer than one global batch: --batch-size {args.batch_size} "
               f"x {world_size} processes x --grad-accum {args.grad_accum} = {global_batch}")
    try:  # a dry run on the meta device (no memory, no compute): can the model take 32x32 images at all?
        with torch.device("meta"):
            build_model(args.model, num_classes)(torch.empty(2, 3, 32, 32))
    except NotImplementedError:
        pass  # a few models cannot be built on the meta device: they meet real images instead
    except (RuntimeError, AssertionError, ValueError) as error:
        refuse(f"--model {args.model} cannot take 32x32 images: {str(error).splitlines()[0]}")
    for flag, path in (("--checkpoint", args.checkpoint), ("--metrics", args.metrics)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if path and (os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK)):
            refuse(f"{flag} {path}: not a file in a folder that exists and is writable")


class SyntheticImages(Dataset):
    """A learnable 10-class task built in, so nothing needs downloading: each class is a smooth colour
    pattern, each sample that pattern shifted and buried in noise. Sample i is drawn from (seed, i) alone,
    so every process and every restart sees exactly the same data without a file on disk."""

    def __init__(self, num_samples, seed, first_index=0, num_classes=10, image_size=32):
        generator = torch.Generator().manual_seed(seed)
        coarse = torch.randn(num_classes, 3, 4, 4, generator=generator)
        self.patterns = F.interpolate(coarse, size=image_size, mode="bilinear", align_corners=False)
        self.num_samples, self.seed, self.first_index = num_samples, seed, first_index
        self.classes = [f"pattern{c}" for c in range(num_classes)]

    def __len__(self):
        return self.num_samples

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.first_index + index)
        label = int(torch.randint(len(self.patterns), (), generator=generator))
        shift = torch.randint(-4, 5, (2,), generator=generator).tolist()
        noise = torch.randn(self.patterns.shape[1:], generator=generator)
        return torch.roll(self.patterns[label], shift, dims=(1, 2)) + 5 * noise, label


def build_datasets(args):
    """Returns (train_set, val_set, number of classes)."""
    if args.data == "synthetic":
        train_set = SyntheticImages(args.train_samples or 16_000, args.seed)
        val_set = SyntheticImages(args.val_samples or 2_000, args.seed, first_index=10_000_000)  # held out
    else:
        import torchvision  # only for real images (see the imports)
        from torchvision import transforms
        to_tensor = transforms.Compose([transforms.Resize((32, 32)), transforms.ToTensor(),
                                        transforms.Normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))])
        if args.data == "cifar10":
            train_set = torchvision.datasets.CIFAR10(args.data_dir, True, to_tensor, download=args.download)
            val_set = torchvision.datasets.CIFAR10(args.data_dir, False, to_tensor, download=args.download)
        else:
            train_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "train"), to_tensor, loader=load_image)
            val_set = torchvision.datasets.ImageFolder(os.path.join(args.data, "val"), to_tensor, loader=load_image)
        num_classes = len(train_set.classes)
        # N samples spread evenly over the set, not its first N: ImageFolder lists its samples class by class
        train_count = min(len(train_set), args.train_samples or len(train_set))
        val_count = min(len(val_set), args.val_samples or len(val_set))
        train_set = Subset(train_set, [i * len(train_set) // train_count for i in range(train_count)])
        val_set = Subset(val_set, [i * len(val_set) // val_count for i in range(val_count)])
        return train_set, val_set, num_classes
    return train_set, val_set, len(train_set.classes)


class UnreadableImage(Exception):
    """An image that load_image could not read, and has named: batches_of() then stops the run."""


def load_image(path):
    import torchvision  # in each process that reads images (a loader's worker too); at once after its first time
    try:
        return torchvision.datasets.folder.default_loader(path)
    except OSError as error:  # a broken file found mid-training: name it, rather than a bare PIL traceback
        # said by the process that read it: a DataLoader worker's exception reaches its parent as a traceback
        print(f"error: unreadable image {path}: {error}; replace or remove it", file=sys.stderr, flush=True)
        raise UnreadableImage(path) from None


def batches_of(loader):
    """The loader's batches, until an unreadable image (already named by load_image) stops this process."""
    try:
        yield from loader
    except UnreadableImage:  # raised here, or in a DataLoader worker and raised again here
        sys.exit(1)


def build_model(name, num_classes):
    if name == "wide" or name.startswith("wide-"):  # many wide layers: weights, gradients, momentum dominate
        width = int(name[5:] or 2048)  # wide: 31.5M parameters (120 MiB in fp32); wide-256: 1.2M, for quick runs
        blocks = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(6)]
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, width), nn.ReLU(), *blocks,
                             nn.Linear(width, num_classes))
    if name == "cnn":
        def block(c_in, c_out):
            return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]
        return nn.Sequential(*block(3, 32), nn.MaxPool2d(2), *block(32, 64), nn.MaxPool2d(2), *block(64, 128),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, num_classes))
    import torchvision  # only for a model by name (see the imports)
    model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    # ResNets (and the like): keep 32x32 inputs from shrinking to 1x1
    if isinstance(getattr(model, "conv1", None), nn.Conv2d) and hasattr(model, "maxpool"):
        model.conv1 = nn.Conv2d(3, model.conv1.out_channels, 3, padding=1, bias=False)
        model.maxpool = nn.Identity()
    return model


def environment_problem(required, numbers):
    """What is wrong with the environment variables this script reads, or None: one of `required` not set, one of
    `numbers` set to something other than a whole number, a rank outside its world. Checked before any work, so
    that a launcher's environment copied in part, or a typo in a job script, is named in one line, not met later
    as a KeyError or ValueError traceback."""
    problems = [f"{name} is not set" for name in required if name not in os.environ]
    problems += [f"{name}={os.environ[name]!r} is not a whole number" for name in numbers
                 if not os.environ.get(name, "0").isdecimal()]
    for rank, size in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        if not problems and {rank, size} <= set(required) and int(os.environ[rank]) >= int(os.environ[size]):
            problems.append(f"{rank}={os.environ[rank]} is not below {size}={os.environ[size]}")
    return ", ".join(problems) or None


def choose_device(name):
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def log(message):
    # global rank 0: one voice for the whole job (local rank 0 would print the same line once per node)
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def train_one_epoch(model, loader, optimizer, scaler, args, device, epoch, after_step):
    """One pass over `loader`, calling after_step(batches done) after every optimizer step; returns (mean
    training loss, samples seen)."""
    model.train()
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, samples
    last_report = time.perf_counter()
    for step, (images, labels) in enumerate(batches_of(loader)):
        # pinned memory + non_blocking lets the copy to the GPU overlap with compute (a no-op on CPU)
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        last_micro_step = (step + 1) % args.grad_accum == 0 or step + 1 == len(loader)
        # no_sync: skip the gradient all-reduce on micro-batches before the last; it runs once, on the sum
        with (nullcontext() if last_micro_step else model.no_sync()), autocast(device, args.amp):
            loss = F.cross_entropy(model(images), labels)
        scaler.scale(loss / args.grad_accum).backward()  # each micro-batch adds its share of the gradient
        totals += torch.stack([loss.detach().double() * len(labels), torch.tensor(len(labels), device=device)])
        if last_micro_step:
            # a NaN or inf loss (a too high --lr, say) would make every weight NaN at this step, and every checkpoint
            # after it garbage: check this epoch's loss sum before the optimizer applies it. (fp16's GradScaler skips
            # steps whose gradients overflow, but a non-finite loss means the forward pass did: no scale cures that)
            loss_so_far = totals[0].clone()
            dist.all_reduce(loss_so_far)  # summed over ranks: every rank sees the same value and stops at the same step
            if not loss_so_far.isfinite():
                log(f"error: the loss is {loss_so_far.item()} at step {step + 1} of epoch {epoch}; the run stopped "
                    f"before that step changed any weight. Try a lower --lr (this run: {args.lr})"
                    + " or leave out --amp" * args.amp
                    + f"; {args.checkpoint} holds the last finite weights saved (not the steps since): resume from it "
                    "with a lower --lr and --allow-new-lr" * bool(args.checkpoint and os.path.exists(args.checkpoint)))
                dist.barrier()  # rank 0 has said why before any rank exits (the launcher then stops the others)
                sys.exit(1)  # a failure: Slurm and torchrun must not count a diverged run as done
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)  # frees the gradients instead of writing zeros into them
            after_step(step + 1)
        if time.perf_counter() - last_report > 10:  # progress during long epochs
            last_report = time.perf_counter()
            log(f"  step {step + 1}/{len(loader)}  loss {loss.item():.4f}")
    dist.all_reduce(totals)  # sum over all processes: the loss and throughput of the whole job
    loss_sum, samples = totals.tolist()
    return loss_sum / max(samples, 1), int(samples)


@torch.no_grad()
def evaluate(model, loader, device, amp):
    """Returns (mean loss, accuracy) over every sample in `loader`."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    for images, labels in batches_of(loader):
        images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        with autocast(device, amp):
            logits = model(images)
        totals += torch.stack([F.cross_entropy(logits.float(), labels, reduction="sum").double(),
                               (logits.argmax(1) == labels).sum().double(),
                               torch.tensor(len(labels), dtype=torch.float64, device=device)])
    if dist.is_initialized():
        dist.all_reduce(totals)  # each process saw a disjoint part of the validation set; add them up
    loss_sum, correct, samples = totals.tolist()
    return loss_sum / samples, correct / samples


def autocast(device, enabled):
    # bf16 needs no loss scaling; fp16 (CUDA) is faster on older GPUs and needs the GradScaler
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    return torch.autocast(device.type, dtype=dtype) if enabled else nullcontext()


def read_checkpoint(path, device):
    """torch.load of a file a user handed over. weights_only: a checkpoint is a pickle, and unpickling an untrusted
    one could run arbitrary code. Quietly: a plain pickle gets a warning about its protocol, then a one-line refusal."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(path, map_location=device, weights_only=True)


def describe(error):
    """Why a file could not be used, in a few words: what the system said and the file's name, or the error's type."""
    if isinstance(error, OSError) and error.filename:
        return f"{error.strerror}: {os.path.basename(error.filename)}"
    return type(error).__name__


def save_checkpoint(path, checkpoint):
    """Writes so that a crash at any moment leaves a usable snapshot: the new one goes to a temporary file, is
    forced to disk, and only then takes the place of the old one, which is kept as PATH.prev."""
    # global rank 0, not local rank 0: on a filesystem all nodes share, one writer per node would race on the
    # same file (pytorch/examples' multinode example did until #1357). Nodes that share none: local rank 0 it is
    if dist.get_rank() != 0:
        dist.barrier()  # the others wait until the file exists before moving on
        return
    began = time.perf_counter()
    with open(path + ".tmp", "wb") as f:
        torch.save(checkpoint, f)
        time.sleep(float(os.environ.get("SNAPSHOT_WRITE_DELAY", 0)))  # lets the tests kill the writer mid-write
        f.flush()
        os.fsync(f.fileno())  # on the disk, not only in the page cache, before it replaces anything
    if os.path.exists(path):
        os.replace(path, path + ".prev")
    os.replace(path + ".tmp", path)  # atomic: a crash mid-write never leaves a half-written checkpoint
    log(f"saved snapshot {path} (epoch {checkpoint['epoch']}, +{checkpoint['samples_done']} samples) "
        f"in {1000 * (time.perf_counter() - began):.1f} ms")
    dist.barrier()


def load_snapshot(args, device, num_classes):
    """(The newest usable snapshot of PATH or PATH.prev, the flags changed since), or (None, []). All ranks read it."""
    candidates = [p for p in (args.checkpoint, args.checkpoint + ".prev") if os.path.exists(p)]
    unusable = {}  # candidate: why it could not be read
    for candidate in candidates:
        try:
            snapshot = read_checkpoint(candidate, device)
        except Exception as error:  # truncated by a crash, corrupted, or not a torch file at all
            unusable[candidate] = describe(error)
            continue
        if not isinstance(snapshot, dict) or "optimizer" not in snapshot or (
                snapshot.get("model_name"), snapshot.get("num_classes")) != (args.model, num_classes):
            sys.exit(f"error: --checkpoint {candidate}: not a snapshot of --model {args.model} with {num_classes} "
                     "classes; give another path to start over")
        # a resume computes what the snapshot's run would have (on any world size): flags that change it are refused
        changed = {name: f"--{name.replace('_', '-')} {value} (snapshot: {snapshot['args'].get(name)})"
                   for name, value in vars(args).items() if value != snapshot["args"].get(name)}
        refused = [said for name, said in changed.items() if name in (
            "model", "data", "train_samples", "seed", "epochs", "batch_size", "grad_accum", "amp")
                   or name == "lr" and not args.allow_new_lr]
        if refused:
            sys.exit(f"error: --checkpoint {candidate}: a resume cannot change {', '.join(refused)}; repeat the "
                     "snapshot's values, or give another --checkpoint path to start afresh"
                     + " (or, after a divergence, add --allow-new-lr)" * ("lr" in changed))
        if unusable:  # the newest could not be read: the run goes on from the one before
            log(f"warning: snapshot {args.checkpoint} is unusable ({unusable[args.checkpoint]}); resuming from "
                f"{candidate}")
        return snapshot, list(changed.values())  # the rest (workers, paths, intervals, device...) follows this command
    if candidates:  # said by every rank: each read them (on one node, the same files)
        sys.exit(f"error: --checkpoint {args.checkpoint}: no usable snapshot among " + ", ".join(
            f"{path} ({why})" for path, why in unusable.items()) + "; move them away to start over")
    return None, []


def ignore_stop_signals(worker_id):
    # DataLoader workers get the same signals when a whole process group is signalled; if they died first, the
    # main process could not fetch the next batch, reach the next step, and save (KempnerForge#177)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def init_process_group_per_attempt(backend, timeout):
    """init_process_group that survives torchrun's restarts. The workers' store, which torchrun's agent hosts,
    outlives an attempt, and the next attempt's gloo workers can read the previous one's peer addresses and fail
    or hang (pytorch/pytorch#135712). TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (the documented commands) gives every
    attempt a fresh store. Without it, on one node, this attempt takes keys of its own in the shared store,
    named by the restart count. On several nodes that count can differ (each agent keeps its own, and a restart
    for a joining node does not count), so nodes would take different keys and hang: refused."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return dist.init_process_group(backend, timeout=timeout)
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:  # the number of nodes in this attempt
        sys.exit("error: on more than one node, set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node and use "
                 "--rdzv_backend=c10d: a restart could hang otherwise (pytorch/pytorch#135712)")
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    store = dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}", store)
    dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)


def evaluate_checkpoint(args):
    """Loads a checkpoint written by any numbered script and evaluates it in this one process."""
    device = choose_device(args.device)
    try:  # a torch file of another kind (a plain state_dict, 05's train_state.pt, the port's snapshot) fails in here
        checkpoint = read_checkpoint(args.evaluate, device)
        saved = argparse.Namespace(**{**checkpoint["args"], "train_samples": 1})  # its data, model, seed
        model = build_model(checkpoint["model_name"], checkpoint["num_classes"]).to(device)
        model.load_state_dict(checkpoint["model"])  # strict: every name and shape
        epoch = checkpoint["epoch"]
    except torch.cuda.OutOfMemoryError:  # a checkpoint of these scripts, too big for this GPU
        sys.exit(f"error: --evaluate {args.evaluate}: does not fit --device {args.device}; try --device cpu")
    except Exception as error:  # not a torch file, or a torch file of something else
        sys.exit(f"error: --evaluate {args.evaluate}: not a checkpoint of these scripts ({describe(error)}); give a "
                 "file that --checkpoint wrote (05: PATH.model.pt)")
    try:
        _, val_set, _ = build_datasets(saved)
    except (OSError, RuntimeError) as error:  # its data moved or damaged since: torchvision's traceback, in one line
        sys.exit(f"error: --evaluate {args.evaluate}: its --data {saved.data} is unreadable ({describe(error)}); put "
                 "it back where it was when the checkpoint was written")
    loader = DataLoader(val_set, batch_size=args.batch_size, num_workers=args.num_workers)
    val_loss, val_accuracy = evaluate(model, loader, device, args.amp)
    log(f"{args.evaluate} (epoch {epoch}): val loss {val_loss:.4f}  val acc {val_accuracy:.2%}")
    print(json.dumps({"checkpoint": args.evaluate, "val_loss": val_loss, "val_accuracy": val_accuracy}))


@record  # under torchrun: a worker's exception and traceback go into torchrun's failure summary
def main(args):
    # torchrun started this process and says who it is: its rank among all processes, its index on this
    # machine (which GPU it drives), and how many processes there are
    rank, local_rank, world_size = (int(os.environ[name]) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    torch.manual_seed(args.seed)
    device = choose_device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)  # one GPU per process
        torch.cuda.set_device(device)  # before init_process_group, so NCCL and barrier() use this GPU
    else:  # the processes on this machine (not all world_size of them) share the cores they may use
        local_processes = int(os.environ["LOCAL_WORLD_SIZE"])
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # not on macOS
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 0)) or max(1, cores // local_processes))
    # gloo on CPU, NCCL on GPU; a peer that never answers fails the collective after the timeout, not never
    # rank, world size and where to meet (MASTER_ADDR:MASTER_PORT) come from torchrun's environment variables
    init_process_group_per_attempt("nccl" if device.type == "cuda" else "gloo", timedelta(seconds=args.timeout))
    # every process says where it runs and who it is: the first thing to read when a multi-node job misbehaves
    # (newline inside, end="": one write per line, so lines of different processes never run into each other)
    print(f"[{socket.gethostname()}] node {os.environ.get('GROUP_RANK', '?')}, local rank {local_rank}: "
          f"rank {rank} of {world_size}\n", end="", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # faster fp32 on Ampere+
    # node-local work: every machine has its own disk, so one process per machine prepares the data there. (With
    # --data-dir on a filesystem all nodes share, keep 02's `rank` here: one writer for the whole job.)
    # waiting for a download may outlast --timeout: a group of its own (a failed download stops every process)
    preparing = dist.new_group(backend="gloo", timeout=timedelta(hours=3))
    if local_rank != 0:
        dist.barrier(group=preparing)
    train_set, val_set, num_classes = build_datasets(args)
    if local_rank == 0:
        time.sleep(float(os.environ.get("DATA_PREPARE_DELAY", 0)))  # lets the tests make the preparation slow
        print(f"[{socket.gethostname()}] local rank 0 prepared the data for this node\n", end="", flush=True)
        dist.barrier(group=preparing)
    # loader workers start from a fork server, a clean process started once, not by forking this one: this process
    # runs other threads (torch's, gloo's, the loaders'), and one may hold a lock at the fork that the new worker
    # then waits for forever (pytorch/pytorch#130610; Python 3.14 makes it the default on Linux). It imports torch
    # once (torchvision too, for real images), so that each worker starts in milliseconds and shares that memory
    # rather than importing them anew
    multiprocessing.set_forkserver_preload(["torch"] if args.data == "synthetic" else ["torch", "torchvision"])
    loader_options = dict(batch_size=args.batch_size, num_workers=args.num_workers,
                          pin_memory=device.type == "cuda", persistent_workers=args.num_workers > 0,
                          multiprocessing_context="forkserver" if args.num_workers > 0 else None,
                          worker_init_fn=ignore_stop_signals)
    # not DistributedSampler: it pads shards to equal length by repeating samples, which would count twice
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), **loader_options)

    model = build_model(args.model, num_classes).to(device)
    snapshot, followed = load_snapshot(args, device, num_classes) if args.checkpoint else (None, [])
    if snapshot:
        model.load_state_dict(snapshot["model"])
    # DDP copies rank 0's weights and buffers to all now, and averages gradients in backward(). BatchNorm normalizes
    # per process; rank 0's running stats are copied to all at the first forward and the one after each grad-enabled
    # forward outside no_sync() (forward_sync_buffers; tiny batches: SyncBatchNorm). gradient_as_bucket_view: .grad
    # becomes a view into DDP's bucket: saves the copy back out, not the copy in (gain not resolved on CPU)
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    raw_model = model.module  # the plain model inside DDP: checkpoints hold it, with no "module." prefix
    if args.compile:
        model = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp and device.type == "cuda")
    start_epoch, samples_done = 1, 0  # samples_done: of the current epoch, by all ranks together
    if snapshot:
        optimizer.load_state_dict(snapshot["optimizer"])
        scheduler.load_state_dict(snapshot["scheduler"])
        scaler.load_state_dict(snapshot["scaler"])
        torch.set_rng_state(snapshot["rng"]["torch"].cpu())
        if device.type == "cuda" and torch.is_tensor(snapshot["rng"]["cuda"]):  # rank 0's GPU RNG state, set
            torch.cuda.set_rng_state(snapshot["rng"]["cuda"].cpu(), device)  # on each rank's own: all draw alike
        random.setstate(snapshot["rng"]["python"])
        if args.lr != snapshot["args"]["lr"]:  # --allow-new-lr: the schedule goes on from its place, scaled
            for group in optimizer.param_groups:
                group["lr"], group["initial_lr"] = group["lr"] * args.lr / snapshot["args"]["lr"], args.lr
            scheduler.base_lrs = [args.lr for _ in scheduler.base_lrs]
        start_epoch, samples_done = snapshot["epoch"] + 1, snapshot["samples_done"]
        log(f"resumed from {args.checkpoint}: epoch {start_epoch}, {samples_done} samples into it; world size "
            f"{snapshot['world_size']} then, {world_size} now" + (f"; from this command: {', '.join(followed)}" if
                                                                   followed else ""))

    def make_snapshot(epochs_done, samples_done):  # everything the next step depends on, not only the weights
        # never a snapshot of non-finite weights. BatchNorm's running stats differ between ranks, so the ranks agree
        # on the verdict (one all_reduce per snapshot): every rank stops here together, and the snapshot on disk stays
        state = [*raw_model.state_dict().values(), *(value for kept in optimizer.state.values() for value in
                                                        kept.values() if torch.is_tensor(value))]
        finite = torch.tensor(float(all(t.isfinite().all() for t in state if t.is_floating_point())), device=device)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)  # 0 if any rank holds a non-finite number
        if not finite:
            log(f"error: the weights are not finite in epoch {epoch}; this snapshot was not saved. Try a lower --lr "
                f"(this run: {args.lr})" + f"; {args.checkpoint} holds the last finite weights saved (not the steps "
                "since): resume from it with a lower --lr and --allow-new-lr" * os.path.exists(args.checkpoint))
            dist.barrier()  # rank 0 has said why before any rank exits
            sys.exit(1)
        return {"model": raw_model.state_dict(), "model_name": args.model, "num_classes": num_classes,
                "optimizer": optimizer.state_dict(),  # momentum: without it the next steps would differ
                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),  # the LR's place; fp16's scale
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),  # dropout's draws, and
                        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None},  # augmentation's
                "epoch": epochs_done, "samples_done": samples_done,  # where in the data, to resume mid-epoch
                "args": vars(args), "world_size": world_size}

    writer = None
    if args.tensorboard and rank == 0:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(args.tensorboard)
    # Slurm sends SIGTERM (or SIGUSR1, with --signal) before it kills a job; torchrun forwards TERM (and USR1 if
    # --signals-to-handle lists it)
    stop_requested = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)
    if args.num_workers > 0:  # the fork server, started now, inherits "ignore" and its workers too: see lesson 04
        multiprocessing.forkserver.ensure_running()
        # so, after a failure, Python's exit would wait forever for the workers it asks to stop: kill them first
        atexit.register(lambda: [worker.kill() for worker in multiprocessing.active_children()])
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, lambda *_: stop_requested.set())

    def after_step(batches_done):
        stop = torch.tensor([float(stop_requested.is_set())], device=device)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # stop together: a rank that went on alone would hang
        done = samples_done + batches_done * args.batch_size * world_size
        if args.checkpoint and (stop.item() or batches_done % (args.save_every_steps * args.grad_accum) == 0):
            save_checkpoint(args.checkpoint, make_snapshot(epoch - 1, done))
        if stop.item():
            log(f"stopped by a signal in epoch {epoch}, {done} samples in; the same command resumes from there")
            if writer:
                writer.close()  # what it holds reaches its file: the process leaves by os._exit, no clean-up
            dist.destroy_process_group()
            sys.exit(0)  # not a failure: torchrun must not spend a restart on it

    log(f"{args.model} on {device}: {len(train_set)} train / {len(val_set)} val samples, "
        f"batch {args.batch_size}, {torch.get_num_threads()} CPU threads per process")
    for epoch in range(start_epoch, args.epochs + 1):
        # DistributedSampler cannot start mid-epoch: shuffle here, skip what all ranks together trained on before
        # a restart (whatever the world size was then), and give each rank every world_size-th of the rest
        order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(args.seed + epoch))
        order = order[samples_done:].tolist()
        shard = order[rank:len(order) // world_size * world_size:world_size]
        # its own generator, seeded from (seed, epoch, rank): loader workers draw differently on every rank and in
        # every epoch, and a resume seeds this epoch's loader alike. (Creating it must not draw from the global RNG,
        # which the snapshot restores.) Unique while epochs < 1000 and ranks < 100 000
        loader_seed = ((args.seed * 1000 + epoch) * 100_000 + rank) % 2**63  # (any --seed)
        train_loader = DataLoader(train_set, sampler=shard, drop_last=True,
                                  generator=torch.Generator().manual_seed(loader_seed), **loader_options)
        start = time.perf_counter()
        train_loss, samples = train_one_epoch(model, train_loader, optimizer, scaler, args, device, epoch, after_step)
        samples_done = 0
        samples_per_s = samples / (time.perf_counter() - start)
        scheduler.step()
        val_loss, val_accuracy = evaluate(model, val_loader, device, args.amp)
        if not math.isfinite(val_loss):  # weights or BatchNorm stats non-finite, or fp16 logits overflowed: save none
            log(f"error: the validation loss is {val_loss} after epoch {epoch}; these weights were not saved. Try a "
                f"lower --lr (this run: {args.lr})")
            dist.barrier()  # rank 0 has said why before any rank exits
            sys.exit(1)
        log(f"epoch {epoch}/{args.epochs}  train loss {train_loss:.4f}  val loss {val_loss:.4f}  "
            f"val acc {val_accuracy:.2%}  {samples_per_s:.0f} samples/s  {time.perf_counter() - start:.1f} s")
        metrics = {"epoch": epoch, "train_samples": samples, "train_loss": train_loss, "val_loss": val_loss,
                   "val_accuracy": val_accuracy, "samples_per_s": samples_per_s, "world_size": world_size}
        if args.metrics and rank == 0:
            with open(args.metrics, "a") as f:
                f.write(json.dumps(metrics) + "\n")
        if writer:
            for name, value in metrics.items():
                writer.add_scalar(name, value, epoch)
        if args.checkpoint and (epoch % args.save_every == 0 or epoch == args.epochs):
            save_checkpoint(args.checkpoint, make_snapshot(epoch, 0))
    if writer:
        writer.close()
    checksum = sum(p.double().sum().item() for p in raw_model.parameters())  # equal on every rank, every node
    print(f"[{socket.gethostname()}] rank {rank} done: parameter checksum {checksum!r}\n", end="", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    if args.evaluate:
        evaluate_checkpoint(args)
    elif problem := environment_problem(
            required=("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"),
            numbers=("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT", "OMP_NUM_THREADS",
                     "GROUP_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")):
        # Stop rather than train as a world of one: on a cluster, a forgotten launcher would otherwise quietly
        # train on one GPU while the job holds eight. torchrun sets each of these variables for each process.
        sys.exit(f"{sys.argv[0]} must be started by torchrun on every node: TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                 "torchrun --nnodes=2 --nproc_per_node=2 --rdzv_backend=c10d --rdzv_endpoint=FIRST_NODE:29500 "
                 f"--rdzv_id=job1 {sys.argv[0]} ({problem})")
    else:
        check_inputs(args, world_size=int(os.environ["WORLD_SIZE"]))
        main(args)
        # leave without Python's shutdown: once DDP or FSDP2 has used gloo's group, destroy_process_group leaves its
        # threads running, and one still freeing a collective's tensors as Python shuts down aborts the process (-6)
        sys.stdout.flush()
        os._exit(0)
