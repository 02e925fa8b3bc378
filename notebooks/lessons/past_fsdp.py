"""The lecture past_fsdp's experiments: the classic mistakes of tensor parallelism on a 2-D mesh, pipeline schedules and
ZeRO-1, each run for real in a gloo group of CPU processes beside its correct version. Each worker(rank, world_size)
returns a small dict of what happened. The models are small stand-ins for gpt_tp.py's parts: an MLP split as a block's
MLP is (ColwiseParallel, then RowwiseParallel), and the tied head's logits split by vocabulary."""
import logging
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

WIDTH, VOCABULARY = 32, 256
# torch warns, once in each process, the first time a parameter split two ways (or a norm over two mesh dimensions)
# is made whole: two collectives in turn, one per dimension. Said once in the lecture, silenced here (in every
# process that imports this module: the lecture's workers do)
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
TIMEOUT = timedelta(seconds=3)  # every group's collective timeout in the lecture's runs: a mistake waits this long


def mlp(seed=0):
    """A block's MLP (gpt_tp.py's mlp.0 and mlp.2), the same weights on every rank."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))


def grid_2x2():
    """gpt_tp.py's grid on 4 processes: 2 rows ("data") of 2 columns ("tensor"); its groups given the lecture's
    collective timeout, TIMEOUT (init_device_mesh gives a new group torch's default, 30 minutes for gloo)."""
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tensor"))
    for name in ("data", "tensor"):
        dist.set_timeout(TIMEOUT, grid.get_group(name))
    return grid


def wrong_slice(rank, world_size):
    """The MLP split across grid["tensor"] (a row: the processes that read the same windows) and across grid["data"]
    (a column: processes of different rows, which read different windows); each row's input its own, as gpt_tp.py's
    rows read their own windows. The largest difference from the whole MLP on the same input."""
    grid = grid_2x2()
    row = grid["data"].get_local_rank()
    inputs = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(row))  # this row's windows
    expected = mlp()(inputs)
    result = {"row": row}
    for name in ("tensor", "data"):
        model = parallelize_module(mlp(), grid[name], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        result[f'grid["{name}"]'] = {"with ranks": dist.get_process_group_ranks(grid.get_group(name)),
                                     "largest difference": (model(inputs) - expected).abs().max().item(),
                                     "hidden units held": model[0].weight.to_local().shape[0]}
    return result


def split_logits(rank, world_size):
    """The head's logits split by vocabulary (gpt_tp.py's head: ColwiseParallel(output_layouts=Shard(-1),
    use_local_output=False)), the loss three ways: with loss_parallel (gpt_tp.py), and on this rank's local logits as
    if they were whole, with the bytes 0-255 as targets and with targets all below 128."""
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(1)
    head = nn.Linear(WIDTH, VOCABULARY, bias=False)
    features = torch.randn(16, WIDTH)
    targets = torch.randint(0, VOCABULARY, (16,))
    low = targets % (VOCABULARY // world_size)  # every target among the first rank's bytes
    whole = {"0-255": F.cross_entropy(head(features), targets).item(),
             "below 128": F.cross_entropy(head(features), low).item()}
    split = parallelize_module(head, mesh, ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
    logits = split(features)
    result = {"logits": f"{type(logits).__name__} {tuple(logits.shape)}, {logits.placements}",
              "local logits": tuple(logits.to_local().shape), "whole loss": whole}
    with loss_parallel():
        result["loss_parallel"] = F.cross_entropy(logits, targets).full_tensor().item()
    try:
        result["local, as if whole, 0-255"] = F.cross_entropy(logits.to_local(), targets).item()
    except IndexError as error:
        result["local, as if whole, 0-255"] = f"{type(error).__name__}: {error}"
    result["local, as if whole, below 128"] = F.cross_entropy(logits.to_local(), low).item()
    return result


def gather_alone(rank, world_size):
    """A parameter split both ways (TP across a row, then FSDP2 across the rows, as gpt_tp.py's): its placements and
    this rank's piece; full_tensor() called by every rank, then by rank 0 alone (the others call no collective)."""
    grid = grid_2x2()
    model = parallelize_module(mlp(), grid["tensor"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=grid["data"])
    weight = model[0].weight
    whole_rows = mlp()[0].weight.detach()
    first = next(row for row in range(len(whole_rows)) if torch.equal(whole_rows[row], weight.to_local()[0].detach()))
    result = {"placements": str(weight.placements), "whole shape": tuple(weight.shape),
              "this rank's piece": tuple(weight.to_local().shape),
              "rows of the whole": f"{first}-{first + weight.to_local().shape[0] - 1}"}
    result["every rank calls full_tensor()"] = torch.equal(weight.full_tensor(), mlp()[0].weight.detach())
    began = time.monotonic()
    if rank == 0:
        try:
            weight.full_tensor()
            result["rank 0 alone"] = "returned"
        except Exception as error:  # the group's timeout
            result["rank 0 alone"] = f"{type(error).__name__}: {str(error).splitlines()[0][:150]}"
        result["rank 0 waited, s"] = time.monotonic() - began
    return result


def too_few_micro_batches(rank, world_size):
    """2 stages of one linear layer each: torch's schedules given 1 micro-batch."""
    torch.manual_seed(0)
    stage = PipelineStage(nn.Linear(8, 8), rank, world_size, torch.device("cpu"))
    result = {}
    for name, kind in (("ScheduleGPipe", ScheduleGPipe), ("Schedule1F1B", Schedule1F1B)):
        try:
            kind(stage, 1, loss_fn=lambda output, target: F.mse_loss(output, target))
            result[name] = "built"
        except ValueError as error:
            result[name] = f"ValueError: {error}"
    return result


def zero_alone(rank, world_size):
    """ZeroRedundancyOptimizer's snapshot: consolidate_state_dict(to=0) called by every rank, then by rank 0 alone."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    result = {"parameters whose AdamW state this rank holds": len(optimizer.optim.state)}
    optimizer.consolidate_state_dict(to=0)
    if rank == 0:
        result["every rank calls it: rank 0's state_dict() holds"] = len(optimizer.state_dict()["state"])
        began = time.monotonic()
        try:
            optimizer.consolidate_state_dict(to=0)
            result["rank 0 alone"] = "returned"
        except Exception as error:
            result["rank 0 alone"] = f"{type(error).__name__}: {str(error).splitlines()[0][:150]}"
        result["rank 0 waited, s"] = time.monotonic() - began
    return result


def schedule_orders(stages, micro_batches):
    """Each stage's order of forwards and backwards in torch 2.15.0's schedules (their _step_microbatches):
    ScheduleGPipe runs every micro-batch's forward, then every backward; Schedule1F1B runs min(micro_batches,
    stages - stage) forwards ("Last stage has 1 warmup, second-to-last 2 warmups, ..."), then one backward and one
    forward in turn while forwards remain, then the remaining backwards. {"gpipe": {stage: ["F0", ..., "B0", ...]},
    "1f1b": ...}; no "1f1b" with fewer micro-batches than stages, which Schedule1F1B refuses when it is built."""
    forwards, backwards = ([f"{kind}{m}" for m in range(micro_batches)] for kind in "FB")
    orders = {"gpipe": dict.fromkeys(range(stages), forwards + backwards)}
    if micro_batches < stages:
        return orders
    orders["1f1b"] = {}
    for stage in range(stages):
        warmup = min(micro_batches, stages - stage)
        steady = [action for pair in zip(backwards, forwards[warmup:], strict=False) for action in pair]
        orders["1f1b"][stage] = forwards[:warmup] + steady + backwards[micro_batches - warmup:]
    return orders


def on_four(rank, world_size):
    """The experiments that need a 2 x 2 grid, in one group of 4."""
    return {"wrong slice": wrong_slice(rank, world_size), "gather alone": gather_alone(rank, world_size)}


def simulate(orders, forward=1, backward=2):
    """When each action of `orders` ({stage: ["F0", ..., "B0", ...]}) runs if a forward takes `forward` time units, a
    backward `backward`, and sends none: a stage runs its actions in its order, each as soon as the one before it on
    the stage has ended and its input is there (a forward needs the stage before's forward of the micro-batch; a
    backward the stage after's backward of it, or on the last stage its own forward). Returns {(stage, action):
    (start, end)}."""
    last, times, pending = max(orders), {}, {stage: list(actions) for stage, actions in orders.items()}
    free = dict.fromkeys(orders, 0)
    while any(pending.values()):
        progressed = False
        for stage, actions in pending.items():
            if not actions:
                continue
            kind, micro = actions[0][0], actions[0][1:]
            needs = ((stage - 1, f"F{micro}") if kind == "F" and stage > 0 else
                     (stage + 1, f"B{micro}") if kind == "B" and stage < last else
                     (stage, f"F{micro}") if kind == "B" else None)
            if needs and needs not in times:
                continue
            start = max(free[stage], times[needs][1] if needs else 0)
            free[stage] = start + (forward if kind == "F" else backward)
            times[(stage, actions.pop(0))], progressed = (start, free[stage]), True
        if not progressed:
            raise ValueError("the orders wait on each other")
    return times


def bubble(times):
    """The idle share of the step: 1 - busy time / (stages x the step's length)."""
    end = max(finish for _, finish in times.values())
    stages = {stage for stage, _ in times}
    return 1 - sum(finish - start for start, finish in times.values()) / (len(stages) * end)


def held_at_most(orders):
    """{stage: the most micro-batches whose forward has run and whose backward has not, at any moment}: whose
    activations the stage holds."""
    most = {}
    for stage, actions in orders.items():
        held = peak = 0
        for action in actions:
            held += 1 if action[0] == "F" else -1
            peak = max(peak, held)
        most[stage] = peak
    return most


def draw_schedules(orders, micro_batches):
    """The two schedules' timelines, one row per stage, as simulate() times them."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(orders), 1, figsize=(11, 1.1 + 0.55 * len(orders) * len(next(iter(orders.values())))),
                             sharex=True)
    for axis, (name, order) in zip(axes, orders.items(), strict=True):
        times = simulate(order)
        for (stage, action), (start, finish) in times.items():
            micro = int(action[1:])
            axis.barh(stage, finish - start, left=start, color=plt.cm.tab10(micro),
                      alpha=1 if action[0] == "F" else 0.45, edgecolor="black", linewidth=0.5)
            axis.text((start + finish) / 2, stage, action, ha="center", va="center", fontsize=8)
        axis.set_yticks(sorted(order), [f"stage {stage}" for stage in sorted(order)])
        axis.invert_yaxis()
        axis.set_title(f"{name}: {micro_batches} micro-batches; idle share {bubble(times):.2f}; micro-batches held at "
                       f"most, by stage: {list(held_at_most(order).values())}", fontsize=10)
    axes[-1].set_xlabel("time (a forward F takes 1 unit, a backward B 2; sends take none)")
    plt.tight_layout()
    plt.show()


def draw_split():
    """A block's MLP split across 2 processes: the first layer's weight by rows (ColwiseParallel: its outputs, the
    hidden units), the second's by columns (RowwiseParallel: its inputs), and where the sums are."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    fig, axis = plt.subplots(figsize=(11, 3.6))
    colours = ("#4a6fa5", "#d98c3a")

    def matrix(x, y, width, height, split, label, below):
        for part in range(2):
            if split == "rows":
                box = Rectangle((x, y + height / 2 * (1 - part)), width, height / 2, facecolor=colours[part], alpha=0.8)
            else:
                box = Rectangle((x + width / 2 * part, y), width / 2, height, facecolor=colours[part], alpha=0.8)
            axis.add_patch(box)
        axis.add_patch(Rectangle((x, y), width, height, fill=False, edgecolor="black"))
        axis.text(x + width / 2, y + height + 0.15, label, ha="center", va="bottom", fontsize=9)
        axis.text(x + width / 2, y - 0.15, below, ha="center", va="top", fontsize=8)

    axis.add_patch(Rectangle((0, 1), 0.6, 1, facecolor="#bbbbbb"))
    axis.text(0.3, 2.15, "x, whole\non both", ha="center", va="bottom", fontsize=9)
    matrix(1.6, 0.2, 0.9, 2.6, "rows", "mlp.0.weight\n(hidden x width)", "ColwiseParallel:\nrows = hidden units")
    for part in range(2):
        axis.add_patch(Rectangle((3.0, 1.5 - part * 1.1), 0.4, 0.9, facecolor=colours[part], alpha=0.8))
    axis.text(3.2, 2.55, "GELU of its\nhidden units", ha="center", va="bottom", fontsize=9)
    matrix(4.2, 0.8, 2.6, 0.9, "columns", "mlp.2.weight (width x hidden)", "RowwiseParallel: columns = hidden units")
    for part in range(2):
        axis.add_patch(Rectangle((7.6, 1.5 - part * 1.1), 0.6, 0.9, facecolor=colours[part], alpha=0.8))
    axis.text(7.9, 2.55, "partial\noutputs", ha="center", va="bottom", fontsize=9)
    axis.add_patch(Rectangle((9.4, 0.8), 0.6, 1, facecolor="#bbbbbb"))
    axis.text(9.7, 2.0, "sum + bias:\nwhole on both", ha="center", va="bottom", fontsize=9)
    for start, end, text in ((0.6, 1.6, ""), (2.5, 3.0, ""), (3.4, 4.2, ""), (6.8, 7.6, ""),
                             (8.2, 9.4, "forward:\nall-reduce")):
        axis.annotate("", xy=(end, 1.3), xytext=(start, 1.3), arrowprops=dict(arrowstyle="-|>", color="#555"))
        axis.text((start + end) / 2, 0.95, text, ha="center", va="top", fontsize=8, color="#a33")
    axis.text(1.1, 0.95, "backward:\nall-reduce\nof x's gradient", ha="center", va="top", fontsize=8, color="#a33")
    axis.text(5.5, -0.35, "process 0 holds the blue parts, process 1 the orange ones", ha="center", fontsize=9)
    axis.set(xlim=(-0.2, 10.3), ylim=(-0.6, 3.4))
    axis.axis("off")
    axis.set_title("a block's MLP split across a row of 2 processes: one all-reduce forward, one backward", fontsize=10)
    plt.show()


def on_two(rank, world_size):
    """The experiments of 2 processes, in one group of 2."""
    return {"split logits": split_logits(rank, world_size), "micro-batches": too_few_micro_batches(rank, world_size),
            "zero alone": zero_alone(rank, world_size)}



def run_port(rank, world_size, argv, script):
    """A port script's main in a process of runs.Processes (lessons.port.train), returning what it printed (rank 0's
    log; the others print their closing line)."""
    import contextlib
    import io

    from lessons.port import train

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train(rank, world_size, argv, script)
    return printed.getvalue()
