"""Exercise 01_ddp's claims, from one run of the learner's file with 2 processes (what each process recorded in
--out) and one single-process reference computed here: the processes form one group, end with identical weights,
read disjoint and complete shards in a new order every epoch, equal one process with the global batch, leave one
checkpoint written by rank 0 that a plain model loads, and report the loss of the whole job."""
import json
import tempfile
from pathlib import Path

from _grading import finish, load_learner, python, start

FILE = "train.py"
LECTURE = "notebooks/01_mp_spawn.ipynb"
BATCH, EPOCHS, LR, SEED = 16, 2, 0.1, 0  # per process; the reference takes 2 x BATCH in one process
STARTER_FAILS = "python train.py --nproc 2 starts 2 processes that form one group: two process IDs, ranks 0 and 1, " \
                "world size 2"
CLAIMS = [STARTER_FAILS,
          "both ranks end with bitwise-identical weights",
          "in every epoch the two ranks' shards are disjoint and together hold every sample once",
          "every epoch reads its shard in a new order (set_epoch)",
          f"2 processes with batch {BATCH} each end with the weights of 1 process with batch {2 * BATCH}, "
          "within 1e-5",
          "only rank 0 wrote the checkpoint, and rank 1 waited until it was written",
          "the checkpoint loads into a plain model (no 'module.' prefix) and holds the trained weights",
          "the mean loss each rank reports is the mean over both ranks' samples"]
SECTION = "notebooks/01_mp_spawn.ipynb, section '{}'"
WHAT_DDP_DOES, THE_DIFF = (SECTION.format(name) for name in (
    "2. What DDP does, and what the rest of the script must do", "3. The diff, hunk by hunk"))



def one_process_with_the_global_batch(learner, torch):
    """What 1 process with batch 2 x BATCH computes: the order a DistributedSampler of 1 replica deals (the one
    permutation that 2 replicas split between them), each step on the mean loss of 2 x BATCH samples."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    dataset = learner.make_dataset(SEED)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, seed=SEED, drop_last=True)
    model = learner.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for _, features, labels in DataLoader(dataset, batch_size=2 * BATCH, sampler=sampler, drop_last=True):
            loss = torch.nn.functional.cross_entropy(model(features), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return model.state_dict()


def largest_difference(weights, reference):
    return max((weights[name] - reference[name]).abs().max().item() for name in reference)


def check(learner_file, grade):
    with tempfile.TemporaryDirectory(prefix="ex01-") as folder:
        out = Path(folder)
        run = start(python(learner_file, "--nproc", 2, "--batch-size", BATCH, "--epochs", EPOCHS, "--lr", LR,
                           "--seed", SEED, "--timeout", 20, "--out", out))
        import torch  # while the run goes on: it takes seconds

        result = finish(run, timeout=50)
        if not result.ok:
            grade.claim(CLAIMS[0], False, observed=f"python {Path(learner_file).name} --nproc 2 ... failed: "
                        f"{result.summary()}", expected="both processes finish and exit 0", see=THE_DIFF)
            grade.not_checked(CLAIMS[1:], "the run failed")
            return
        records = [torch.load(path, weights_only=True) for path in sorted(out.glob("rank*.pt"))]
        pids = {record["pid"] for record in records}
        formed = (sorted(record["rank"] for record in records) == [0, 1] and len(pids) == 2
                  and run.pid not in pids and all(record["group_size"] == 2 for record in records))
        grade.claim(CLAIMS[0], formed,
                    observed="; ".join(f"a record of rank {record['rank']} from process {record['pid']}, group size "
                                       f"{record['group_size']}" for record in records) or "no record at all",
                    expected=f"records of ranks 0 and 1 from two processes (neither the first one, {run.pid}), "
                             "each in a group of 2: are --nproc processes started with mp.spawn, and does each "
                             "call init_process_group?", see=THE_DIFF)
        if not formed:
            grade.not_checked(CLAIMS[1:], "needs the two processes of the first claim")
            return
        first, second = sorted(records, key=lambda record: record["rank"])

        differing = [name for name in first["weights"] if not torch.equal(first["weights"][name],
                                                                          second["weights"][name])]
        grade.claim(CLAIMS[1], not differing, observed=f"different on the ranks: {', '.join(differing)} (largest "
                    f"difference {largest_difference(first['weights'], second['weights']):.2g})",
                    expected="equal bit for bit: is the model wrapped in DDP, so that every backward() averages "
                             "the gradients over the processes?", see=WHAT_DDP_DOES)

        samples = len(load_learner(learner_file).make_dataset(SEED))
        shards = list(zip(first["seen"], second["seen"], strict=True))
        overlaps = [len(set(zero) & set(one)) for zero, one in shards]
        complete = all(sorted(zero + one) == list(range(samples)) for zero, one in shards)
        grade.claim(CLAIMS[2], complete and not any(overlaps),
                    observed=f"per epoch, samples both ranks read: {overlaps}; every sample read once: {complete}",
                    expected=f"no sample on both ranks, all {samples} read once per epoch: does each process's "
                             "DataLoader take its samples from a DistributedSampler?", see=WHAT_DDP_DOES)

        repeated = [rank for rank, record in enumerate((first, second)) if record["seen"][0] == record["seen"][1]]
        grade.claim(CLAIMS[3], not repeated, observed=f"rank(s) {repeated} read epoch 1 in epoch 0's order",
                    expected="a new order each epoch: is sampler.set_epoch(epoch) called at the start of every "
                             "epoch?", see=WHAT_DDP_DOES)

        learner = load_learner(learner_file)
        reference = one_process_with_the_global_batch(learner, torch)
        # Tolerance: DDP averages two means of 16 losses' gradients, the reference takes one mean of 32; the same
        # float32 numbers added in another order differ by rounding (about 1e-7 relative per addition), and 16
        # steps carry that on. Measured here: a few 1e-8. A wrong shard, scale or order differs by 1e-3 or more.
        difference = largest_difference(first["weights"], reference)
        grade.claim(CLAIMS[4], difference <= 1e-5, observed=f"largest difference {difference:.3g}",
                    expected=f"at most 1e-5: does DDP average (not sum) the gradients, and do the shards come from "
                             f"one DistributedSampler seeded with --seed, each rank taking batches of {BATCH}?",
                    see=SECTION.format("4. What changes when the number of processes changes"))

        writers = [json.loads(note.read_text()) for note in sorted(out.glob("checkpoint.pt.written-by-*"))]
        grade.claim(CLAIMS[5], [(writer["rank"], writer["pid"]) for writer in writers] == [(0, first["pid"])]
                    and all(record["checkpoint_there_after_save"] for record in records),
                    observed=f"{len(writers)} writer(s): " + ("; ".join(f"rank {writer['rank']} (process "
                             f"{writer['pid']})" for writer in writers) or "none") + "; the checkpoint existed "
                             f"when saving was over on rank 0: {first['checkpoint_there_after_save']}, on rank 1: "
                             f"{second['checkpoint_there_after_save']}",
                    expected="one writer, rank 0, and the file there on both ranks afterwards: does only rank 0 "
                             "call save_checkpoint, and do all ranks then wait at dist.barrier()?", see=THE_DIFF)

        checkpoint = out / "checkpoint.pt"
        try:
            plain = learner.build_model()
            plain.load_state_dict(torch.load(checkpoint, weights_only=True))
            loaded, why = all(torch.equal(value, first["weights"][name]) for name, value in
                              plain.state_dict().items()), "weights other than rank 0's final ones"
        except (OSError, RuntimeError, KeyError) as error:
            loaded, why = False, f"{type(error).__name__}: " + " ".join(str(error).split())[:300]
        grade.claim(CLAIMS[6], loaded, observed=why, expected="build_model().load_state_dict(torch.load(...)) "
                    "works and gives rank 0's final weights: is the checkpoint the state_dict of the model inside "
                    "DDP (model.module), saved after training?", see=THE_DIFF)

        wrong = []
        for epoch, totals in enumerate(zip(first["local_totals"], second["local_totals"], strict=True)):
            whole = sum(loss for loss, _ in totals) / sum(count for _, count in totals)
            # float64: the same two sums added in any order agree to rounding (1e-16 relative); 1e-9 leaves room
            wrong += [f"epoch {epoch}, rank {rank}: {record['reported_loss'][epoch]:.9f}, the whole job's "
                      f"{whole:.9f}" for rank, record in enumerate((first, second))
                      if abs(record["reported_loss"][epoch] - whole) > 1e-9 * abs(whole)]
        grade.claim(CLAIMS[7], not wrong, observed="\n".join(wrong), expected="every rank reports the loss sum of "
                    "both ranks over their sample count: are the sum and the count all-reduced before the division?",
                    see=WHAT_DDP_DOES)
