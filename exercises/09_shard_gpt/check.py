"""Exercise 09_shard_gpt's claims: the GPT is sharded per block (each rank holds about half of it), its tied head is
still the token embedding's one parameter, and with ranks holding different numbers of targets the first step's
gradient and every step's loss equal one process's mean over all the step's targets; a mean of each rank's mean,
which the check computes too, is far off."""
import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from _grading import finish, load_learner, start, torchrun

FILE = "train.py"
LECTURE = "notebooks/shard_your_model.ipynb"
CLAIMS = ["the 2-process run finishes",
          "each transformer block and the whole model are FSDP2 units; each rank holds about half of the parameters",
          "the model is built on the meta device: rank 1 never builds it in memory, rank 0 once (for its values)",
          "the tie survives sharding: head.weight is token.weight, one parameter, and the model holds no second copy",
          "with unequal target counts on the ranks, the first step's gradient equals one process's mean over all "
          "targets (1e-5)",
          "every step's loss equals one process's (relative difference under 1e-5)"]
STARTER_FAILS = CLAIMS[1]
# Float rounding is the only difference allowed. One process sums the loss of all the step's targets in one reduction;
# 2 ranks each sum their own, scale by world_size / count, and FSDP2 averages the 2 gradients: another order of
# additions. Measured: 1.7e-7 (the norm of the difference over the gradient's norm; 1e-7 on the losses). A mean of each
# rank's mean is off by about 0.5 here, and weights left untrained change the third loss by 6e-3.
TOLERANCE = 1e-5
SEE_IDEAS = "notebooks/shard_your_model.ipynb, section '1. The ideas'"
SEE_TIE = ("notebooks/shard_your_model.ipynb, section '4. The classic mistakes, run live', part 'A tie broken, and two "
           "copies drifting apart'")
SEE_MEANS = ("notebooks/shard_your_model.ipynb, section '4. The classic mistakes, run live', part 'One rank's mean of "
             "means'")



def loss_of(model, inputs, targets):
    return F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), ignore_index=-100)


def references(learner, world_size=2):
    """From the given parts of the learner's file, in this one process: the first step's gradient of one mean over all
    the targets, and of the mean of each rank's mean (averaged, as FSDP2 averages); then every step's loss of one
    process trained on each whole global batch; and the first loss the given code logs for a mean of means."""
    model = learner.build_whole()
    inputs, targets = learner.global_batch(0)
    loss_of(model, inputs, targets).backward()
    one = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    for rank in range(world_size):
        (loss_of(model, inputs[rank::world_size], targets[rank::world_size]) / world_size).backward()
    means = {name: p.grad.clone() for name, p in model.named_parameters()}
    model = learner.build_whole()
    optimizer = learner.make_optimizer(model.parameters())
    losses = []
    for step in range(learner.STEPS):
        loss = loss_of(model, *learner.global_batch(step))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model = learner.build_whole()
    mean_of_means = sum(loss_of(model, inputs[rank::world_size], targets[rank::world_size]).item()
                        for rank in range(world_size)) / world_size
    return one, means, losses, mean_of_means


def close(value, reference):
    return abs(value - reference) <= TOLERANCE * abs(reference)


def relative(gradient, reference):
    """The norm of the difference over the reference's norm, over every parameter; None if the names differ."""
    if not isinstance(gradient, dict) or gradient.keys() != reference.keys():
        return None
    difference = torch.cat([(gradient[name] - reference[name]).flatten() for name in reference])
    return (difference.norm() / torch.cat([value.flatten() for value in reference.values()]).norm()).item()


def check(learner_file, grade):
    with tempfile.TemporaryDirectory(prefix="exercise-09-") as folder:
        check_in(learner_file, grade, Path(folder))


def check_in(learner_file, grade, folder):
    launched = start(torchrun(2, learner_file, "--out", folder))
    try:  # meanwhile, the one-process reference: the run spends its first seconds starting processes, importing torch
        learner = load_learner(learner_file)
        reference = references(learner)
    except Exception as error:  # the given parts broken: said after the run's own verdict
        reference = error
    result = finish(launched, 50)
    finished = result.ok and all((folder / name).exists() for name in ("rank0.json", "rank1.json", "gradient.pt"))
    if not grade.claim(CLAIMS[0], finished, observed=result.summary(), expected="exit status 0, and the files",
                       see=SEE_IDEAS):
        grade.not_checked(CLAIMS[1:], "the run failed")
        return
    if isinstance(reference, Exception):
        grade.not_checked(CLAIMS[1:], "the given parts of your file (GPT, build_whole, make_optimizer, global_batch) "
                                      f"failed in one process: {type(reference).__name__}: {reference}")
        return
    one, means, losses, mean_of_means = reference
    records = [json.loads((folder / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    total = sum(value.numel() for value in one.values())  # the tied matrix once

    held, units = [record["elements_held"] for record in records], records[0]["units"]
    sharded = all(units["blocks"]) and units["root"]
    grade.claim(CLAIMS[1], sharded and all(0.4 * total <= count <= 0.6 * total for count in held), see=SEE_IDEAS,
                observed=f"FSDP2 units: blocks {units['blocks']}, the whole model {units['root']}; elements held by "
                         f"rank 0 and rank 1: {held}, of {total} in the model"
                         + ("" if sharded else "\nis fully_shard called on each block, then on the whole model?"),
                expected=f"every block and the model units; about {total // 2} elements each")

    built = [record["built_on"] for record in records]
    on_meta = built[1] and set(built[1]) == {"meta"} and 0 < built[0].count("meta") == len(built[0]) - 1
    grade.claim(CLAIMS[2], on_meta, see=SEE_IDEAS,
                observed=f"the devices of the GPTs each rank built: rank 0 {built[0]}, rank 1 {built[1]}\nis the "
                         "sharded model built under torch.device('meta'), and only rank 0's whole build in memory?",
                expected="rank 0: 'meta' and one 'cpu' (build_whole, whose values every rank receives); rank 1: 'meta' "
                         "only")

    grade.claim(CLAIMS[3], records[0]["tied"] and records[0]["elements"] == total, see=SEE_TIE,
                observed=f"head.weight is token.weight: {records[0]['tied']}; the parameters hold "
                         f"{records[0]['elements']} elements, the whole model {total}\n"
                         "was the model given memory (to_empty) before fully_shard? "
                         "On a plain model to_empty makes the head a parameter of its own; or was the head made a unit "
                         "of its own?",
                expected=f"True; {total}")

    try:
        gradient = torch.load(folder / "gradient.pt", weights_only=True)
    except Exception as error:
        gradient = f"{type(error).__name__}: {error}"
    error, off = relative(gradient, one), relative(means, one)
    assert off > 1000 * TOLERANCE, f"the check's data no longer tells a mean of means apart ({off:.1e})"
    counts = [record["targets"] for record in records]
    if error is None:
        names = set(gradient) if isinstance(gradient, dict) else set()
        why = (f"the gradient holds other parameters than the model's: {sorted(names - set(one))} too, "
               f"{sorted(set(one) - names)} missing" if names else f"no gradient could be read: {gradient}")
    elif relative(gradient, means) is not None and relative(gradient, means) < TOLERANCE:
        why = ("this is the mean of each rank's mean: a rank holding fewer targets weighs each of them more. Is each "
               "rank's loss its sum over the count of all the step's targets, times the number of ranks?")
    elif not close(records[0]["losses"][0], losses[0]) and not close(records[0]["losses"][0], mean_of_means):
        why = (f"the first loss is already {records[0]['losses'][0]:.6f}, not {losses[0]:.6f}: were the pieces filled "
               "with rank 0's whole build after to_empty (which leaves whatever bytes were in memory)?")
    else:
        why = "is each rank's loss its sum over the count of all the step's targets, times the number of ranks?"
    grade.claim(CLAIMS[4], error is not None and error < TOLERANCE, see=SEE_MEANS,
                observed=f"relative difference {error if error is None else f'{error:.1e}'} (the ranks hold "
                         f"{counts[0]} and {counts[1]} targets)\n{why}",
                expected=f"under {TOLERANCE} (float rounding; the mean of each rank's mean is off by {off:.2f})")

    learner_losses = records[0]["losses"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(learner_losses, losses, strict=True))
    if close(learner_losses[0], losses[0]):
        why = ("the first loss is right, the next ones are not: is the optimizer built over the sharded parameters, "
               "and is the tie kept?")
    elif close(learner_losses[0], mean_of_means):
        why = "the first loss is the mean of each rank's mean, not one mean over all the step's targets"
    else:
        why = "the first loss is already off: does every rank start from rank 0's whole build?"
    grade.claim(CLAIMS[5], worst < TOLERANCE, see=SEE_MEANS,
                observed=f"losses {[f'{x:.6f}' for x in learner_losses]}, largest relative difference {worst:.1e}\n"
                         + why,
                expected=f"losses {[f'{x:.6f}' for x in losses]}")
