"""Exercise 08: the port run twice, at once: 1 process with 16 samples a step, 2 processes with 8 each."""
import socket
import tempfile
from pathlib import Path

import torch

FILE = "train.py"
LECTURE = "notebooks/port_your_model.ipynb"
STARTER_FAILS = "each step, the 2 ranks take the 1-process run's 16 samples between them, each sample once"
SEE = "notebooks/port_your_model.ipynb, section '{}'"
IDEAS, CLIPPING, METRICS = (SEE.format(name) for name in ("1. The ideas", "Clipping norms: the same on every rank",
                                                          "Metrics: per shard, averaged, padded, exact"))
CLAIMS = (STARTER_FAILS,
          "every rank computes the same pre-clip gradient norm at every step: the whole batch's (1 process's)",
          "2 processes with 8 samples each end with the weights of 1 process with 16",
          "every rank reports the validation loss that one process computes on the same weights")
# fp32 on the CPU: the two runs differ only in the order of their additions (two means of 8 averaged by the
# all-reduce against one mean of 16), ~1e-7 relative at step 1; 1e-4 allows the 12 steps to carry it (the port's
# tests use the same). atol for the weights near 0, where a relative tolerance means nothing: 1e-6, ten times the
# largest difference seen (~1e-7, the rounding of numbers of order 0.1-1).
RTOL, ATOL = 1e-4, 1e-6
# Validation: the same weights, only the order of 9 additions differs: float32 rounding, ~1e-7 relative.
VALIDATION_RTOL = 1e-5


def first_step_apart(these, those, close):
    return next((step for step, (a, b) in enumerate(zip(these, those, strict=True), start=1) if not close(a, b)),
                None)


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def whole_set_loss(learner_file, weights):
    """The validation loss of `weights`, computed here in one process on every validation sample, with the model and
    the validation set of the learner's file."""
    from _grading import load_learner

    module = load_learner(learner_file)
    model = module.make_model()
    model.load_state_dict(weights)
    inputs, targets = module.validation_set()
    with torch.no_grad():
        losses = torch.nn.functional.cross_entropy(model(inputs), targets, reduction="none")
    return losses.mean().item(), [losses[rank::2].mean().item() for rank in (0, 1)]


def check(learner_file, grade):
    from _grading import finish, python, start, torchrun  # here: grade.py puts exercises/ on sys.path (the tests
    #                                                       import this file bare)

    with tempfile.TemporaryDirectory(prefix="ex08-") as folder:
        one, two = Path(folder) / "one", Path(folder) / "two"
        # Both at once: 3 single-threaded workers on 2 cores, and one start-up's wait. The 1-process run gets the
        # variables torchrun would give its one worker, without a torchrun process of its own (one torch import less).
        runs = [start(python(learner_file, "--batch-size", 16, "--out", one), RANK=0, LOCAL_RANK=0, WORLD_SIZE=1,
                      LOCAL_WORLD_SIZE=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port()),
                start(torchrun(2, learner_file, "--batch-size", 8, "--out", two))]
        single, double = (finish(process, timeout=55) for process in runs)
        files = [one / "rank0.pt", two / "rank0.pt", two / "rank1.pt"]
        missing = [str(file.relative_to(folder)) for file in files if not file.is_file()]
        if not (single.ok and double.ok) or missing:
            why = (f"1 process: {single.summary()}" if not single.ok else
                   f"2 processes: {double.summary()}" if not double.ok else
                   f"{', '.join(missing)} not written (the given code names its file by torchrun's RANK)")
            grade.not_checked(CLAIMS, f"a run did not finish: {why}")
            return
        alone, *ranks = (torch.load(file, weights_only=True) for file in files)

    per_step = [sorted(a + b) for a, b in zip(ranks[0]["seen"], ranks[1]["seen"], strict=True)]
    bad = next((step for step, (both, whole) in enumerate(zip(per_step, alone["seen"], strict=True), start=1)
                if both != sorted(whole)), None)
    shown = bad or 1
    grade.claim(CLAIMS[0], bad is None and len(per_step) == len(alone["seen"]),
                observed=f"step {shown}: rank 0 took {ranks[0]['seen'][shown - 1]}, rank 1 "
                         f"{ranks[1]['seen'][shown - 1]}; 1 process took {alone['seen'][shown - 1]}: is --batch-size "
                         "per process, and does each rank take every world_size-th sample of the global batch?",
                expected="together, the 1-process run's samples of that step, none twice", see=IDEAS)

    norms = [rank["grad_norms"] for rank in ranks]
    apart = first_step_apart(*norms, lambda a, b: a == b)
    off = first_step_apart(norms[0], alone["grad_norms"], lambda a, b: abs(a - b) <= RTOL * abs(b))
    if apart:
        observed = (f"at step {apart} rank 0's norm is {norms[0][apart - 1]!r}, rank 1's {norms[1][apart - 1]!r}: "
                    "is the norm taken after backward(), on the gradients DDP has averaged, or on each rank's own?")
    else:
        observed = (f"at step {off} both ranks' norm is {norms[0][(off or 1) - 1]!r}, 1 process's "
                    f"{alone['grad_norms'][(off or 1) - 1]!r}: are the gradients averaged over the ranks (DDP), "
                    "and the data split as the first claim says?")
    grade.claim(CLAIMS[1], not apart and not off and len(norms[0]) == len(alone["grad_norms"]), observed=observed,
                expected=f"the same float on both ranks, and 1 process's within {RTOL:g} (relative)", see=CLIPPING)

    weights = ranks[0]["weights"]
    names = sorted(weights) if sorted(weights) == sorted(alone["weights"]) else []
    worst = max(((weights[name] - alone["weights"][name]).abs().max().item(), name) for name in names) \
        if names else (float("inf"), "(the parameters' names differ)")
    grade.claim(CLAIMS[2], names and all(torch.allclose(weights[name], alone["weights"][name], rtol=RTOL, atol=ATOL)
                                         for name in names),
                observed=f"largest difference {worst[0]:.3g} in {worst[1]}: does every step average the gradients "
                         "over the ranks before clipping and stepping?",
                expected=f"every weight within rtol {RTOL:g}, atol {ATOL:g}", see=IDEAS)

    truth, shards = whole_set_loss(learner_file, weights)
    reported = [rank["val_loss"] for rank in ranks]
    right = all(isinstance(value, float) and abs(value - truth) <= VALIDATION_RTOL * abs(truth) for value in reported)
    grade.claim(CLAIMS[3], right,
                observed=f"rank 0 reported {reported[0]}, rank 1 {reported[1]}; the mean over each rank's every "
                         f"second sample: {shards[0]:.6f}, {shards[1]:.6f}: are the sums of the losses and the counts "
                         "added over the ranks before the one division?",
                expected=f"{truth:.6f} on every rank (relative tolerance {VALIDATION_RTOL:g})", see=METRICS)
