"""Exercise 11_tensor_parallel's claims: an MLP split across 2 processes by hand holds half of its numbers on each,
computes one process's output, and trains as one process trains: the same losses, and the same layers before and
after it, on both processes."""
import json
import tempfile
from pathlib import Path

from _grading import finish, load_learner, start, torchrun

FILE = "train.py"
LECTURE = "notebooks/past_fsdp.ipynb"
RANKS, RTOL = 2, 1e-5
# fp32: one process sums the MLP's 64 hidden units' products in one matrix product; 2 processes sum 32 each and add
# the two partial outputs, another order of additions (measured over the 5 steps: the losses equal, the layers 7.9e-8
# relative): 1e-5 leaves a wide margin, and a bias added twice or a gradient summed twice misses it by far (0.56 and
# 0.047 relative on the layers)
STARTER_FAILS = "each process holds about half of the MLP's numbers (between 45 % and 55 %)"
CLAIMS = ["the 2-process run finishes",
          STARTER_FAILS,
          "step 1's loss (the forward alone) equals one process's with the whole MLP (1e-5 relative)",
          "every step's loss, and the input and output layers after the last step, equal one process's (1e-5) on "
          "both processes"]
SEE_IDEAS = ("notebooks/past_fsdp.ipynb, section '1. The ideas', part 'Tensor parallelism: each matrix split across a "
             "group' (its picture)")
SEE_MISTAKES = ("notebooks/past_fsdp.ipynb, section '1. The ideas', part 'Tensor parallelism: each matrix split across "
                "a group': the picture (forward) and the paragraph 'Backward runs the other way'")


def one_process(learner):
    """The given model, data and optimizer of the learner's file, trained whole in this process: the losses and the
    input and output layers after the last step."""
    import torch
    import torch.nn.functional as F

    model = learner.build()
    optimizer = torch.optim.SGD(model.parameters(), lr=learner.LR)
    losses = []
    for step in range(learner.STEPS):
        inputs, targets = learner.batch(step)
        loss = F.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    whole = sum(p.numel() for p in model.mlp.parameters())
    return losses, whole, {name: p.detach() for name, p in model.named_parameters()
                           if name.startswith(("embed.", "out."))}


def relative(a, b):
    return abs(a - b) / abs(b)


def check(learner_file, grade):
    import torch

    with tempfile.TemporaryDirectory(prefix="exercise-11-") as folder:
        run = start(torchrun(RANKS, learner_file, "--out", folder))
        try:  # meanwhile, one process with the whole MLP, from the given parts of the learner's file
            reference = one_process(load_learner(learner_file))
        except Exception as error:  # the given parts broken: said after the run's own verdict
            reference = error
        result = finish(run, 60)
        try:
            records = [json.loads((Path(folder) / f"rank{rank}.json").read_text()) for rank in range(RANKS)]
        except (OSError, ValueError):
            records = None
    if not grade.claim(CLAIMS[0], result.ok and records, observed=result.summary(), see=SEE_MISTAKES,
                       expected="exit status 0, and rank0.json and rank1.json"):
        grade.not_checked(CLAIMS[1:], "the run failed")
        return
    if isinstance(reference, Exception):
        grade.not_checked(CLAIMS[1:], "the given parts of your file (build, batch, LR, STEPS) failed in one process: "
                                      f"{type(reference).__name__}: {reference}")
        return
    losses, whole, layers = reference

    shares = [record["mlp_elements"] / whole for record in records]
    held = [f"rank {rank} holds {record['mlp_elements']} of the MLP's {whole} numbers ({share:.0%})"
            for rank, (record, share) in enumerate(zip(records, shares, strict=True))]
    grade.claim(CLAIMS[1], all(0.45 <= share <= 0.55 for share in shares), see=SEE_IDEAS,
                observed=", ".join(held)
                + "\ndoes each process keep only its share of the hidden units: the first layer's rows (and bias), "
                  "the second layer's columns?",
                expected="about half on each: the first layer's rows of its hidden units, the second's columns, and "
                         "the second's bias (whole, on each)")

    first = [record["losses"][0] for record in records]
    off = max(relative(value, losses[0]) for value in first)
    grade.claim(CLAIMS[2], off <= RTOL, see=SEE_MISTAKES,
                observed=f"step 1's loss: rank 0 {first[0]:.6f}, rank 1 {first[1]:.6f}; one process {losses[0]:.6f}"
                         "\nis the output the sum of both processes' partial outputs, and the second layer's bias "
                         "added once (after the sum, not by each process before it)?",
                expected=f"{losses[0]:.6f} on both (within {RTOL:.0e} relative)")

    worst_loss = max(relative(value, reference_value) for record in records
                     for value, reference_value in zip(record["losses"], losses, strict=True))
    worst_layer = max(((torch.tensor(record["whole_layers"][name]) - layer).norm() / layer.norm()).item()
                      for record in records for name, layer in layers.items())
    apart = max(((torch.tensor(records[0]["whole_layers"][name]) - torch.tensor(records[1]["whole_layers"][name]))
                 .norm() / layer.norm()).item() for name, layer in layers.items())
    hint = ("\nthe two processes' input layers differ: each took its own gradient. The gradient that reaches the "
            "input layer through the MLP is a sum over all the hidden units: is it summed across the processes in "
            "backward (CopyToRanks)?" if apart > RTOL else
            "\nboth processes agree, with each other but not with one process: is a gradient summed twice? The "
            "gradient of the sum's output is already whole on every process: SumOverRanks' backward sends nothing (an "
            "all-reduce that is differentiable, torch.distributed.nn.functional.all_reduce, sums it again)")
    grade.claim(CLAIMS[3], worst_loss <= RTOL and worst_layer <= RTOL and apart <= RTOL, see=SEE_MISTAKES,
                observed=f"the losses, step by step: rank 0 {[round(v, 6) for v in records[0]['losses']]}; one process "
                         f"{[round(v, 6) for v in losses]}; the layers after step {len(losses)}: {worst_layer:.1e} "
                         f"relative from one process's, {apart:.1e} between the two processes" + hint,
                expected=f"every loss and both layers within {RTOL:.0e} of one process's, and on both processes")
