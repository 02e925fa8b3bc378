"""Exercise 07: the trainer run on 2 gloo ranks; it must end, and every rank must hold the whole set's loss."""
import re
import tempfile
from pathlib import Path

import torch

FILE = "train.py"
LECTURE = "notebooks/when_it_breaks.ipynb"
STARTER_FAILS = "the 2-rank run ends within 50 s, every rank with exit status 0"
HANG = "notebooks/when_it_breaks.ipynb, section '1. A hang: which rank is stuck, on which line' (then 'The fix')"
CLAIMS = (STARTER_FAILS,
          "both ranks end with the same weights (DDP still averages the gradients)",
          "every rank's validation loss is the final weights' mean loss over the whole validation set")


def where_each_rank_waited(output, learner_file):
    """From the ranks' tracebacks (the collective timeout raises in the waiting call): each rank's innermost line
    of the learner's file, and its source."""
    places = []
    for rank in (0, 1):
        found = re.findall(rf'^\[rank{rank}\]:\s+File "[^"]*{re.escape(learner_file.name)}", line (\d+), in (\w+)\n'
                           rf'\[rank{rank}\]:\s+(.*)$', output, re.M)
        if found:
            line, function, source = found[-1]
            places.append(f"rank {rank} was in {function}(), line {line}: {source.strip()}")
    return places


def whole_set_loss(learner_file, weights):
    """The final weights' mean cross-entropy over all the validation samples, computed here in one process, with the
    model and the validation set of the learner's file."""
    from _grading import load_learner

    module = load_learner(learner_file)
    model = module.make_model()
    model.load_state_dict(weights)
    inputs, targets = module.validation_set()
    with torch.no_grad():
        losses = torch.nn.functional.cross_entropy(model(inputs), targets, reduction="none")
    shards = [losses[rank::2].mean().item() for rank in (0, 1)]
    return losses.mean().item(), shards


def check(learner_file, grade):
    from _grading import run, torchrun  # here: grade.py puts exercises/ on sys.path, the tests import this file bare

    with tempfile.TemporaryDirectory(prefix="ex07-") as folder:
        result = run(torchrun(2, learner_file, "--out", folder), timeout=50)
        files = [Path(folder) / f"rank{rank}.pt" for rank in (0, 1)]
        places = where_each_rank_waited(result.output, learner_file)
        finished = grade.claim(
            CLAIMS[0], result.ok and all(file.is_file() for file in files),
            observed="\n".join([*places, "each rank waits for a collective the other never calls: does every rank "
                                         "reach every collective, in the same order?"] if places else
                               [result.summary() if not result.ok else "a rank wrote no result file"]),
            expected="every rank through every collective, and out with status 0", see=HANG)
        if not finished:
            grade.not_checked(CLAIMS[1:], "the run did not finish (the first claim)")
            return
        ranks = [torch.load(file, weights_only=True) for file in files]

    weights = [rank["weights"] for rank in ranks]
    same = weights[0].keys() == weights[1].keys() and all(torch.equal(weights[0][key], weights[1][key])
                                                          for key in weights[0])
    grade.claim(CLAIMS[1], same, observed="the ranks' final weights differ: is the model still wrapped in "
                                          "DistributedDataParallel?", expected="torch.equal for every tensor",
                see=HANG)

    truth, shards = whole_set_loss(learner_file, weights[0])
    reported = [rank["val_loss"] for rank in ranks]
    # The ranks add their shards' losses in another order than one process adding all 9: float32 rounding, about
    # 1e-7 relative; 1e-5 allows it and is far below the gap to a shard's own mean (printed when it fails).
    right = all(isinstance(value, float) and abs(value - truth) <= 1e-5 * abs(truth) for value in reported)
    grade.claim(CLAIMS[2], right,
                observed=f"rank 0 holds {reported[0]}, rank 1 holds {reported[1]}; the mean loss of each rank's own "
                         f"shard: {shards[0]:.6f} (rank 0), {shards[1]:.6f} (rank 1): does every rank evaluate its "
                         "shard, and are the shards' sums of losses and counts added over the ranks before the "
                         "division?",
                expected=f"{truth:.6f} on every rank (relative tolerance 1e-5)",
                see="notebooks/when_it_breaks.ipynb, section 'The fix'")
