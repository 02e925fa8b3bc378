"""One rank of benchmarks/shaped_link.py: started by torchrun on each of two namespace hosts, it shapes its own
end of the link (each host limits what it sends), measures the link, then DDP steps with each knob, and last
how far each knob that changes the arithmetic lets the model learn. Rank 0 prints one JSON line per figure.

The knobs (KNOBS) and the step (train_step) are imported by tests/test_knobs.py, which checks that every one
of them trains correctly on 2 ranks, and by notebooks/making_ddp_fast.md.
"""
import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _link import shape
from _shared import finish, start, step02  # 02_torchrun.py's model and data
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

# Each knob alone, then two combinations. "default" is DDP as the numbered scripts build it: 25 MB buckets,
# gradient_as_bucket_view=True. Every other knob changes that one thing (or the few it names).
KNOBS = {
    "default": {},
    "bucket_cap_mb=0.1": {"bucket_cap_mb": 0.1},
    "bucket_cap_mb=100": {"bucket_cap_mb": 100},
    "gradient_as_bucket_view=False": {"gradient_as_bucket_view": False},
    "static_graph": {"static_graph": True},
    "grad-accum 4": {"accumulate": 4},
    "fp16 hook": {"hook": "fp16"},
    "bf16 hook": {"hook": "bf16"},
    "PowerSGD rank 1": {"hook": "powersgd", "powersgd_rank": 1},
    "PowerSGD rank 4": {"hook": "powersgd", "powersgd_rank": 4},
    # not with static_graph: DDP(static_graph=True) fails inside no_sync() in this torch (an INTERNAL ASSERT on
    # the first backward, pytorch/pytorch#143580; tests/test_knobs.py shows it), so accumulation cannot use it
    "bf16 + accum 4": {"hook": "bf16", "accumulate": 4},
    "PowerSGD 4 + accum 4": {"hook": "powersgd", "powersgd_rank": 4, "accumulate": 4},
}
# The knobs that change what is computed (the others only change how the same sum is communicated): their
# accuracy is measured too, against "default".
CHANGE_THE_RESULT = [name for name, knob in KNOBS.items() if "hook" in knob or "accumulate" in knob]
POWERSGD_START = 10  # plain all-reduce for the first steps, as PowerSGD's authors advise, then compressed


def wide_mlp(num_classes=10, width=384):
    """Many parameters per FLOP: every weight is used once per sample, where a convolution's is used at every
    pixel. ~14x the cnn's gradient bytes for a tenth of its FLOPs."""
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, num_classes))


def build_model(name):
    return wide_mlp() if name == "mlp" else step02.build_model(name, 10)


def wrap(model, knob):
    """DDP with the knob's options and comm hook. Returns (DDP model, micro-batches per optimizer step)."""
    options = {key: value for key, value in knob.items() if key not in ("hook", "powersgd_rank", "accumulate")}
    ddp = DDP(model, **{"gradient_as_bucket_view": True, **options})
    if knob.get("hook") == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)  # casts to fp16, divides, sums in fp16
    elif knob.get("hook") == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif knob.get("hook") == "powersgd":  # low-rank P, Q instead of each weight matrix; error feedback keeps
        state = powerSGD_hook.PowerSGDState(  # what the approximation left out and adds it back next step
            process_group=None, matrix_approximation_rank=knob["powersgd_rank"], start_powerSGD_iter=POWERSGD_START,
            use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp, knob.get("accumulate", 1)


def train_step(ddp, optimizer, micro_batches, communicate=True):
    """One optimizer step over the micro-batches: no_sync on all but the last (the gradients add up locally
    and are all-reduced once, as --grad-accum does in the scripts). communicate=False: no_sync on all of them,
    each rank trains alone — the step of one node, with no network. Returns the mean loss of the micro-batches."""
    total = 0.0
    for index, (images, labels) in enumerate(micro_batches):
        last = communicate and index == len(micro_batches) - 1
        with contextlib.nullcontext() if last else ddp.no_sync():
            loss = F.cross_entropy(ddp(images), labels) / len(micro_batches)
            loss.backward()
        total += loss.item()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def static_graph_inside_no_sync(rank, world_size):
    """Why KNOBS joins no accumulation with static_graph: the first error of a static_graph model's first
    backward inside no_sync() (pytorch/pytorch#143580), or None if there is none. In any process group."""
    torch.manual_seed(0)
    ddp, _ = wrap(build_model("cnn"), {"static_graph": True, "accumulate": 2})
    try:
        train_step(ddp, sgd(ddp), batches(2, 8, first=16 * rank))
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return None


def sgd(model, name="cnn"):
    """The scripts' optimizer. The MLP's inputs are 3072 noisy pixels summed at once: at the scripts' 0.05 it
    diverges, at 0.01 it learns (91 % in 2 epochs of 2048 samples, one process)."""
    lr = 0.01 if name == "mlp" else 0.05
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)


def batches(count, batch_size, first, seed=0):
    data = step02.SyntheticImages(first + count * batch_size, seed=seed)
    return [(torch.stack([data[i][0] for i in range(b, b + batch_size)]),
             torch.tensor([data[i][1] for i in range(b, b + batch_size)]))
            for b in range(first, first + count * batch_size, batch_size)]


# --- measuring -------------------------------------------------------------------------------------------------

def emit(**record):
    if dist.get_rank() == 0:
        print(json.dumps(record), flush=True)


def slowest(value):
    """The largest of every rank's value: the slower node sets the pace."""
    tensor = torch.tensor([float(value)])
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def tx_bytes(device):
    return int(Path(f"/sys/class/net/{device}/statistics/tx_bytes").read_text())


def timed(function, repeats):
    """Median seconds of `repeats` calls, every rank starting together."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        began = time.perf_counter()
        function()
        times.append(time.perf_counter() - began)
    return slowest(statistics.median(times))


def measure_link(size_bytes, repeats=3):
    """The link's own limits, for a message of the model's gradient size: small-message latency (all-reduce of
    one number), point-to-point bandwidth (rank 0 sends, rank 1 answers with one number), and all-reduce
    bandwidth as nccl-tests defines it (algbw = size / time; busbw = algbw x 2(n-1)/n, the bytes each rank
    actually moves)."""
    one, message = torch.zeros(1), torch.zeros(size_bytes // 4)
    latency = timed(lambda: dist.all_reduce(one), 20)

    def ping():
        if dist.get_rank() == 0:
            dist.send(message, 1)
            dist.recv(one, 1)
        else:
            dist.recv(message, 0)
            dist.send(one, 0)

    p2p = timed(ping, repeats)
    all_reduce = timed(lambda: dist.all_reduce(message), repeats)
    n = dist.get_world_size()
    # the bandwidth from the whole exchange, reply included: a latency measured on a busy machine is too noisy
    # to subtract (it is reported apart, and it is a fraction of a percent of a shaped link's exchange)
    return {"latency_s": latency, "p2p_s": p2p, "p2p_bytes_per_s": size_bytes / p2p,
            "all_reduce_s": all_reduce, "algbw_bytes_per_s": size_bytes / all_reduce,
            "busbw_bytes_per_s": size_bytes / all_reduce * 2 * (n - 1) / n}


def measure_steps(ddp, optimizer, pool, accumulate, device, seconds, communicate=True):
    """Times optimizer steps (after one warm-up step): as many as fit in about `seconds`, 3 to 20, the same
    number on both ranks. Returns the median step time (the slower rank's) and the bytes sent per step."""
    cursor = iter(range(10**9))

    def step():
        train_step(ddp, optimizer, [pool[next(cursor) % len(pool)] for _ in range(accumulate)], communicate)

    began = time.perf_counter()
    step()
    count = torch.tensor([min(20, max(3, int(seconds / max(time.perf_counter() - began, 1e-3))))])
    dist.broadcast(count, 0)
    sent, times = tx_bytes(device), []
    dist.barrier()
    for _ in range(int(count)):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    per_step = (tx_bytes(device) - sent) / len(times)
    return slowest(statistics.median(times)), slowest(per_step), len(times)


def flops_per_sample(model, images):
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(model(images), torch.zeros(len(images), dtype=torch.long)).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / len(images)


def shape_both(rate, device):
    """Each host limits what it sends; then both wait until both have."""
    shape(device, rate)
    dist.barrier()


def turned(items, times):
    return items[times % len(items):] + items[:times % len(items)]


def benchmark_model(name, args, device, links):
    torch.manual_seed(0)
    pool = batches(16, args.batch_size, first=0)
    models = {knob: wrap(build_model(name), KNOBS[knob]) for knob in args.knobs}
    optimizers = {knob: sgd(ddp, name) for knob, (ddp, _) in models.items()}
    gradient_bytes = sum(p.numel() * p.element_size() for p in next(iter(models.values()))[0].parameters())
    emit(kind="model", model=name, gradient_bytes=gradient_bytes, batch_size=args.batch_size,
         flops_per_sample=flops_per_sample(build_model(name), pool[0][0]))
    # Warm-up on the unshaped link: buckets are rebuilt after the first step, PowerSGD starts compressing
    # after POWERSGD_START steps; neither should be timed.
    shape_both(None, device)
    for knob, (ddp, accumulate) in models.items():
        for step in range(POWERSGD_START + 2):
            train_step(ddp, optimizers[knob], [pool[(step + i) % len(pool)] for i in range(accumulate)])
    for repeat in range(args.repeats):
        # The order of links and knobs turns with each repeat, so that no knob always runs first or last.
        for link in turned(list(links), repeat):
            shape_both(links[link], device)
            emit(kind="link", model=name, repeat=repeat, link=link, rate=links[link],
                 **measure_link(gradient_bytes))
            ddp, _ = models["default"]
            seconds, sent, steps = measure_steps(ddp, optimizers["default"], pool, 1, device, args.seconds,
                                                 communicate=False)
            emit(kind="step", model=name, repeat=repeat, link=link, knob="one node (no communication)",
                 step_s=seconds, bytes_sent=sent, steps=steps, samples=args.batch_size)
            for knob in turned(list(models), repeat):
                ddp, accumulate = models[knob]
                seconds, sent, steps = measure_steps(ddp, optimizers[knob], pool, accumulate, device, args.seconds)
                emit(kind="step", model=name, repeat=repeat, link=link, knob=knob, step_s=seconds, bytes_sent=sent,
                     steps=steps, samples=args.batch_size * accumulate)
    shape_both(None, device)


def train_and_evaluate(name, knob, epochs, train_batches, val_batches):
    """Trains from the same initial weights on this rank's share of the data; returns (val accuracy over both
    ranks' validation shards, mean training loss of the last epoch)."""
    torch.manual_seed(0)
    ddp, accumulate = wrap(build_model(name), knob)
    optimizer = sgd(ddp, name)
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = train_batches[rank::world]
    for _ in range(epochs):
        losses = []
        for first in range(0, len(mine) - accumulate + 1, accumulate):
            losses.append(train_step(ddp, optimizer, mine[first:first + accumulate]))
    ddp.eval()
    with torch.no_grad():
        totals = torch.tensor([sum((ddp.module(x).argmax(1) == y).sum().item() for x, y in val_batches[rank::world]),
                               sum(len(y) for _, y in val_batches[rank::world]), statistics.mean(losses)])
    dist.all_reduce(totals)
    return (totals[0] / totals[1]).item(), (totals[2] / world).item()


def accuracy(name, args):
    train_batches = batches(args.accuracy_samples // args.batch_size, args.batch_size, first=0)
    val_batches = batches(1024 // args.batch_size, args.batch_size, first=10_000_000)  # held out
    for knob in ["default", *[k for k in CHANGE_THE_RESULT if k in args.knobs]]:
        began = time.perf_counter()
        val_accuracy, train_loss = train_and_evaluate(name, KNOBS[knob], args.accuracy_epochs,
                                                      train_batches, val_batches)
        emit(kind="accuracy", model=name, knob=knob, val_accuracy=val_accuracy, train_loss=train_loss,
             epochs=args.accuracy_epochs, samples=len(train_batches) * args.batch_size,
             seconds=time.perf_counter() - began)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", required=True, help="this host's end of the link (its network interface)")
    parser.add_argument("--models", default="cnn,mlp")
    parser.add_argument("--links", required=True, help="NAME=RATE,... (RATE as tc writes it, or none)")
    parser.add_argument("--knobs", default=",".join(KNOBS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4,
                        help="about how long each knob is timed per repeat: as many steps as fit, 3 to 20")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--accuracy-samples", type=int, default=4096, help="0: no accuracy runs")
    parser.add_argument("--accuracy-epochs", type=int, default=2)
    args = parser.parse_args()
    args.knobs = args.knobs.split(",")
    links = {name: (None if rate == "none" else rate) for name, rate in
             (item.split("=") for item in args.links.split(","))}
    start()
    for name in args.models.split(","):
        benchmark_model(name, args, args.device, links)
        if args.accuracy_samples:
            accuracy(name, args)
    emit(kind="done")
    finish()  # without Python's shutdown, where gloo's threads can abort a finished rank (-6) and fail the run


if __name__ == "__main__":
    main()
