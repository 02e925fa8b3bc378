"""Exercise 06: MyDDP, run on 2 ranks beside torch's DistributedDataParallel on the same model, data and SGD."""
import tempfile
from pathlib import Path

import torch

FILE = "my_ddp.py"
LECTURE = "notebooks/build_ddp_yourself.ipynb"
STARTER_FAILS = "after MyDDP(model), every rank holds rank 0's parameters"
SEE = "notebooks/build_ddp_yourself.ipynb, section '{}'"
NAIVE, HOOKS, NO_SYNC = (SEE.format(name) for name in ("2. Step 1: naive", "3. Step 2: overlap, a hook per parameter",
                                                       "5. Step 4: no_sync, and the parameter that gets no gradient"))
CLAIMS = (STARTER_FAILS,
          "MyDDP communicates by itself: its backward calls dist.all_reduce, and no torch DDP exists",
          "after 4 steps, every rank's parameters are bitwise those of torch's DDP trained alike",
          "inside no_sync, backward calls no all_reduce and each rank keeps its own gradients",
          "the backward after no_sync all-reduces as an ordinary one does, and leaves torch DDP's gradients, bitwise")


def largest_difference(these, those):
    return max((a - b).abs().max().item() for a, b in zip(these, those, strict=True))


def bitwise(these, those):
    return len(these) == len(those) and all(torch.equal(a, b) for a, b in zip(these, those, strict=True))


def ratio(these, those):
    """The gradients' size against DDP's, over the elements where DDP's is not tiny: 2.0 means a sum, not a mean."""
    mine, theirs = torch.cat([a.flatten() for a in these]), torch.cat([b.flatten() for b in those])
    kept = theirs.abs() > 1e-6
    return (mine[kept] / theirs[kept]).median().item() if kept.any() else float("nan")


def check(learner_file, grade):
    from _grading import run, torchrun  # here: grade.py puts exercises/ on sys.path, the tests import this file bare

    with tempfile.TemporaryDirectory(prefix="ex06-") as folder:
        result = run(torchrun(2, learner_file, "--out", folder), timeout=50)
        files = [Path(folder) / f"rank{rank}.pt" for rank in range(2)]
        if not result.ok or not all(file.is_file() for file in files):
            grade.not_checked(CLAIMS, f"the 2-rank run did not finish: {result.summary()}")
            return
        ranks = [torch.load(file, weights_only=False) for file in files]

    source = ranks[0]["parameters before wrapping"]
    assert not bitwise(ranks[1]["parameters before wrapping"], source), "the given code seeds each rank apart"
    off = [rank for rank, got in enumerate(ranks) if not bitwise(got["parameters after wrapping"], source)]
    broadcast = grade.claim(CLAIMS[0], not off,
                observed=f"rank {', '.join(map(str, off))} differs from rank 0's initial parameters after the wrap "
                         "(each rank initialised its own: seed = rank); does __init__ broadcast every parameter from "
                         "rank 0?",
                expected="every parameter of every rank equal to rank 0's, before the first step", see=NAIVE)

    mine = [rank["mine"] for rank in ranks]
    calls = mine[0]["all_reduce calls in one backward"]
    ddp_objects = ranks[0]["torch DDP objects while MyDDP trained"]
    grade.claim(CLAIMS[1], calls > 0 and ddp_objects == 0,
                observed=f"{calls} dist.all_reduce calls in one backward; {ddp_objects} torch "
                         f"DistributedDataParallel object(s) alive while MyDDP trained"
                         + ("; does MyDDP wrap torch's DDP instead of averaging the gradients itself?" if ddp_objects
                            else "; does __init__ register a hook on each parameter that all-reduces its gradient?"),
                expected="one or more all_reduce calls per backward, made by your hooks; no torch DDP",
                see=HOOKS)

    torch_ddp = [rank["torch"] for rank in ranks]
    # Bitwise, not a tolerance: on 2 ranks each element's all-reduce is one addition a + b, which is commutative,
    # and halving is exact in binary floating point, so every bucket layout and division order gives DDP's bits
    # (the lecture's section 4.3 measures it).
    differing = [rank for rank in range(2) if not bitwise(mine[rank]["parameters after training"],
                                                          torch_ddp[rank]["parameters after training"])]
    gap = largest_difference(mine[differing[0]]["parameters after training"],
                             torch_ddp[differing[0]]["parameters after training"]) if differing else 0.0
    first_ratio = ratio(mine[0]["gradients of the first step"], torch_ddp[0]["gradients of the first step"])
    # the first step's gradients compared with DDP's only mean something when both started from the same weights
    cause = (f"the first step's gradients are {first_ratio:.3g} x torch DDP's (2 would be a sum over the ranks)"
             if broadcast else "the ranks did not start from rank 0's weights (the first claim)")
    grade.claim(CLAIMS[2], not differing,
                observed=f"rank(s) {', '.join(map(str, differing))} differ from DDP's, by up to {gap:.2g}; {cause}: "
                         "is each gradient averaged (summed, then divided by the world size) before backward() "
                         "returns?",
                expected="torch.equal for every parameter of both ranks", see=HOOKS)

    inside_calls = mine[0]["all_reduce calls inside no_sync"]
    ranks_differ = not bitwise(mine[0]["gradients inside no_sync"], mine[1]["gradients inside no_sync"])
    grade.claim(CLAIMS[3], inside_calls == 0 and ranks_differ and calls > 0,
                observed=f"{inside_calls} all_reduce calls during the 2 backward passes inside no_sync (an ordinary "
                         f"backward: {calls}); the ranks' gradients {'differ' if ranks_differ else 'are identical'} "
                         "there: does no_sync turn off what your hooks do, until it exits?",
                expected="0 calls inside (one or more outside), and each rank's own, different, gradients",
                see=NO_SYNC)

    after_calls = mine[0]["all_reduce calls in the backward after no_sync"]
    same = all(bitwise(mine[rank]["gradients after no_sync"], torch_ddp[rank]["gradients after no_sync"])
               for rank in range(2))
    after_ratio = ratio(mine[0]["gradients after no_sync"], torch_ddp[0]["gradients after no_sync"])
    grade.claim(CLAIMS[4], after_calls == calls > 0 and same,
                observed=f"{after_calls} all_reduce calls (an ordinary backward: {calls}); gradients "
                         f"{'equal' if same else 'not equal'} to torch DDP's ({after_ratio:.3g} x them): does each "
                         "hook average the accumulated .grad (after accumulation), once no_sync has exited?",
                expected=f"{calls or 'one or more'} calls, and every gradient torch.equal to DDP's", see=NO_SYNC)
