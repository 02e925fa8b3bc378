"""Exercise 05_fsdp's claims: each rank holds about half of the parameters (its pieces); every rank gathers the same
whole state dict; the 2-process sharded run's losses and final weights equal one process's with the same global
batch, within float rounding."""
import json
import tempfile
from pathlib import Path

import torch
from _grading import finish, load_learner, start, torchrun

FILE = "train.py"
LECTURE = "notebooks/05_fsdp.ipynb"
CLAIMS = ["the 2-process run finishes",
          "each rank holds about half of the parameters, and the two ranks' pieces add up to the whole model",
          "every rank's whole_state(model) is the whole model (plain tensors, the model's names and shapes), the same "
          "on both ranks",
          "the 2 ranks' losses equal one process's with the same global batch (relative difference under 1e-5)",
          "the final weights equal one process's with the same global batch (difference under 1e-5)"]
STARTER_FAILS = CLAIMS[1]
# Float rounding is the only difference allowed: one process adds the 16 samples' gradients in one sum, 2 ranks add 8
# each and average the two (FSDP2's reduce-scatter): another order of additions. Measured on this model over its 5
# steps: 2e-8 on the weights, 1e-7 relative on the losses. 1e-5 leaves a wide margin above that, and is far below what
# the training moves: 5 steps move the weights by 2e-2 to 1.4e-1, one step by about a fifth of that.
TOLERANCE = 1e-5
SEE_WORDS = "notebooks/05_fsdp.ipynb, section '1. Words first'"
SEE_LIVE = ("notebooks/05_fsdp.ipynb, section '3. Live, on 2 and 4 ranks: does the sharded model compute what DDP "
            "computes?'")
SEE_MISTAKES = "notebooks/05_fsdp.ipynb, section '5. The classic mistakes, run live'"



def one_process(learner):
    """The given model, optimizer and data of the learner's file, trained in this one process on each whole global
    batch: what the 2 ranks together must compute."""
    model = learner.build_model()
    optimizer = learner.make_optimizer(model.parameters())
    losses = []
    for step in range(learner.STEPS):
        inputs, targets = learner.global_batch(step)
        loss = (model(inputs) - targets).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {name: value.detach() for name, value in model.state_dict().items()}


def read_rank(folder, rank):
    """(its json, its state dict or the reason it could not be read)."""
    record = json.loads((folder / f"rank{rank}.json").read_text())
    try:
        state = torch.load(folder / f"rank{rank}.pt", weights_only=True)
    except Exception as error:
        return record, f"torch.load(weights_only=True) failed: {type(error).__name__}: {str(error).splitlines()[0]}"
    return record, state


def state_problem(state, reference):
    """Why `state` is not the whole model, or None."""
    if isinstance(state, str):
        return state + "\ndoes it hold DTensors (this rank's pieces) instead of whole tensors?"
    if not isinstance(state, dict) or state.keys() != reference.keys():
        names = list(state) if isinstance(state, dict) else type(state).__name__
        return f"names {names}, not the model's {list(reference)}"
    for name, value in state.items():
        if type(value) is not torch.Tensor or value.shape != reference[name].shape:
            return (f"{name}: a {type(value).__name__} of shape {tuple(getattr(value, 'shape', ()))}, not a whole "
                    f"tensor of shape {tuple(reference[name].shape)}: are the pieces gathered (every rank calls the "
                    "gathering function)?")
    return None


def check(learner_file, grade):
    with tempfile.TemporaryDirectory(prefix="exercise-05-") as folder:
        check_in(learner_file, grade, Path(folder))


def check_in(learner_file, grade, folder):
    launched = start(torchrun(2, learner_file, "--out", folder))
    try:  # meanwhile, the one-process reference: the run spends its first seconds starting processes, importing torch
        learner = load_learner(learner_file)
        reference = one_process(learner)
    except Exception as error:  # the given parts broken: said after the run's own verdict
        reference = error
    result = finish(launched, 50)
    finished = result.ok and all((folder / f"rank{rank}.{kind}").exists() for rank in (0, 1) for kind in ("json", "pt"))
    if not grade.claim(CLAIMS[0], finished, observed=result.summary(), expected="exit status 0, and each rank's files",
                       see=SEE_MISTAKES):
        grade.not_checked(CLAIMS[1:], "the run failed")
        return
    if isinstance(reference, Exception):
        grade.not_checked(CLAIMS[1:], "the given parts of your file (build_model, make_optimizer, global_batch) "
                                      f"failed in one process: {type(reference).__name__}: {reference}")
        return
    losses, weights = reference
    total = sum(value.numel() for value in weights.values())
    records, states = zip(*(read_rank(folder, rank) for rank in (0, 1)), strict=True)

    held = [record["elements_held"] for record in records]
    grade.claim(CLAIMS[1], all(0.4 * total <= count <= 0.6 * total for count in held) and sum(held) == total,
                observed=f"elements held by rank 0 and rank 1: {held}, of {total} in the model"
                         + ("\neach rank holds the whole model: is fully_shard called, on each layer and then the "
                            "whole model (DDP, or no wrapper, keeps a whole copy per rank)?" if min(held) >= total
                            else ""),
                expected=f"about {total // 2} each (a parameter's rows split in 2 by torch.chunk), {total} together",
                see=SEE_WORDS)

    problems = [state_problem(state, weights) for state in states]
    if not any(problems) and not all(torch.equal(states[0][name], states[1][name]) for name in weights):
        problems[1] = "rank 1's tensors differ from rank 0's: do the ranks train one model, or a copy each?"
    grade.claim(CLAIMS[2], not any(problems), see=SEE_MISTAKES,
                observed="\n".join(f"rank {rank}: {problem}" for rank, problem in enumerate(problems) if problem),
                expected="on each rank: every parameter whole, under the plain model's names, equal on both ranks")

    learner_losses = records[0]["losses"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(learner_losses, losses, strict=True))
    frozen = len(set(learner_losses)) == 1 or (not problems[0] and all(
        torch.equal(states[0][name], value) for name, value in learner.build_model().state_dict().items()))
    grade.claim(CLAIMS[3], worst < TOLERANCE, see=SEE_LIVE,
                observed=f"losses {[f'{x:.6f}' for x in learner_losses]}, largest relative difference {worst:.1e}"
                         + ("\nthe weights never moved: was the optimizer built before fully_shard replaced the "
                            "parameters (it then holds tensors the model no longer uses)?" if frozen else
                            "\nare the ranks' gradients averaged (one model, sharded), and does each rank train on "
                            "its own rows?"),
                expected=f"losses {[f'{x:.6f}' for x in losses]}")
    if problems[0]:
        grade.not_checked(CLAIMS[4:], "rank 0's whole_state(model) is not the whole model")
        return
    differences = {name: (states[0][name] - value).abs().max().item() for name, value in weights.items()}
    grade.claim(CLAIMS[4], max(differences.values()) < TOLERANCE, see=SEE_LIVE,
                observed="largest difference per tensor: " + ", ".join(f"{name} {value:.1e}"
                                                                       for name, value in differences.items()),
                expected=f"every difference under {TOLERANCE} (float rounding: the order of additions)")
