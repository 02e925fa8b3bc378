"""A run that goes wrong loses nothing but the steps since its last snapshot, and says why. A non-finite loss stops
every step's run (00-05) at once, on every rank together (a rank that stopped alone would leave the others waiting
in the next all-reduce), with one line and a failing exit status, before the optimizer applies it; 04 and 05 never
write a snapshot whose weights or momentum are not finite, so the last good snapshot and its .prev survive; and a
resume from it with a lower --lr, said on purpose with --allow-new-lr, finishes the run (04)."""
import re
import signal
import time

import pytest
import torch
from conftest import DOCUMENTED
from helpers import TORCHRUN, clean_env, finish, run, start, torchrun

pytestmark = pytest.mark.launch

TINY = ["--train-samples", "512", "--val-samples", "64", "--batch-size", "32", "--epochs", "2"]
DIVERGING = ["--lr", "1e6"]  # the CNN's loss is NaN within a few steps
STOPPED = re.compile(r"^error: the loss is (nan|inf) at step \d+ of epoch 1; the run stopped before that step changed "
                     r"any weight\. Try a lower --lr \(this run: 1000000\.0\)$", re.M)
COMMANDS = {**DOCUMENTED, "03_multinode.py": torchrun(2, "03_multinode.py"), "05_fsdp.py": torchrun(2, "05_fsdp.py")}


@pytest.mark.parametrize("script", COMMANDS)
def test_a_diverging_run_stops_at_the_first_non_finite_loss_on_every_rank_with_one_line(script, tmp_path):
    """00-03 and 05 with a learning rate that makes the loss NaN: one line from rank 0, exit status 1 (Slurm and
    torchrun see a failure), no epoch finished, no checkpoint written, and no rank left waiting for the group's
    timeout."""
    checkpoint = tmp_path / "checkpoint.pt"
    began = time.monotonic()
    result = run([*COMMANDS[script], *TINY, *DIVERGING, "--checkpoint", checkpoint], timeout=120)
    assert result.returncode != 0
    assert len(STOPPED.findall(result.stdout)) == 1, result.stdout[-3000:]
    assert "epoch 1/2" not in result.stdout and not checkpoint.exists()
    assert f'{script}", line' not in result.stdout, "one line, not a traceback through the script"
    assert time.monotonic() - began < 60, "every rank stopped at once; none waited for the 300 s timeout"


def test_weights_made_non_finite_by_an_epochs_last_step_are_not_saved(tmp_path):
    """One step per epoch: the step's loss is finite, the update it makes is not. The validation loss (the same on
    every rank: all-reduced) is then non-finite, and the run stops without writing a checkpoint of those weights."""
    checkpoint = tmp_path / "checkpoint.pt"
    result = run(torchrun(2, "02_torchrun.py", "--train-samples", "64", "--val-samples", "64", "--batch-size", "32",
                          "--epochs", "2", "--lr", "3e38", "--checkpoint", checkpoint), timeout=120)
    assert result.returncode != 0
    assert re.search(r"^error: the validation loss is (nan|inf) after epoch 1; these weights were not saved\. Try a "
                     r"lower --lr \(this run: 3e\+38\)$", result.stdout, re.M), result.stdout[-3000:]
    assert result.stdout.count("error: the validation loss") == 1 and not checkpoint.exists()


# --- 04: the last good snapshot survives a divergence, and a resume with a lower --lr finishes ----------------

TRAIN_04 = ["--train-samples", "1024", "--val-samples", "64", "--epochs", "2", "--batch-size", "32",
            "--save-every-steps", "4"]


def run_04(snapshot, *extra, timeout=120):
    command = [TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=0", "04_fault_tolerant.py", *TRAIN_04,
               "--checkpoint", snapshot, *extra]
    return run(command, timeout=timeout, env=clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1))


@pytest.fixture(scope="module")
def healthy_run(tmp_path_factory):
    """A healthy run (--lr 0.05) stopped by SIGTERM after two snapshots: s.pt and s.pt.prev, both good."""
    folder = tmp_path_factory.mktemp("healthy")
    command = [TORCHRUN, "--standalone", "--nproc_per_node=2", "04_fault_tolerant.py", *TRAIN_04,
               "--checkpoint", folder / "s.pt"]
    with open(folder / "healthy.log", "w") as log:
        agent = start(command, env=clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), output=log)
    deadline = time.monotonic() + 120
    while not (folder / "s.pt.prev").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    agent.send_signal(signal.SIGTERM)  # torchrun forwards it: every rank saves once more and stops
    finish(agent, 120)
    output = (folder / "healthy.log").read_text()
    assert "stopped by a signal" in output, output[-3000:]
    return folder


@pytest.fixture
def good_snapshot(healthy_run, tmp_path):
    """A copy of the healthy run's s.pt and s.pt.prev, for one test to diverge from."""
    for name in ("s.pt", "s.pt.prev"):
        (tmp_path / name).write_bytes((healthy_run / name).read_bytes())
    return tmp_path / "s.pt"


def snapshots(folder):
    return {path.name: path.read_bytes() for path in folder.glob("s.pt*")}


def test_a_divergence_writes_nothing_and_a_resume_with_a_lower_lr_finishes(good_snapshot, tmp_path):
    snapshot = good_snapshot
    before = snapshots(tmp_path)
    # 1. a learning rate that makes the loss NaN at the next step: stopped before the step, nothing saved, and the
    #    line names the snapshot to resume from. (Finite is not the same as good: see notebook 04.)
    result = run_04(snapshot, "--lr", "3e38", "--allow-new-lr")
    assert result.returncode != 0
    line = re.search(r"^error: the loss is (nan|inf) at step \d+ of epoch \d; the run stopped before that step "
                     r"changed any weight\. Try a lower --lr \(this run: 3e\+38\); (.*) holds the last finite weights "
                     r"saved \(not the steps since\): resume from it with a lower --lr and --allow-new-lr$",
                     result.stdout, re.M)
    assert line and line.group(2) == str(snapshot), result.stdout[-3000:]
    assert "saved snapshot" not in result.stdout and snapshots(tmp_path) == before
    # (without --allow-new-lr, another --lr is refused, naming the flag: in-process, tests/test_fault_tolerance.py's
    # test_a_resume_refuses_or_follows_each_flag)
    # 2. the lower learning rate, on purpose: said in the resume line, and the run finishes
    result = run_04(snapshot, "--lr", "0.02", "--allow-new-lr")
    assert result.returncode == 0, result.stdout[-3000:]
    resumed = next(line for line in result.stdout.splitlines() if line.startswith("resumed from"))
    assert "from this command: --lr 0.02 (snapshot: 0.05), " in resumed
    assert "--allow-new-lr True (snapshot: False)" in resumed
    assert "epoch 2/2" in result.stdout
    saved = torch.load(snapshot, weights_only=True)
    assert saved["args"]["lr"] == 0.02 and saved["epoch"] == 2
    assert saved["scheduler"]["base_lrs"] == [0.02] and saved["optimizer"]["param_groups"][0]["initial_lr"] == 0.02
    # the schedule went on from where it was, scaled by 0.02 / 0.05: epoch 2's learning rate is 0.01, not 0.025
    # (s.pt.prev: the last snapshot of epoch 2, before the schedule's step at its end)
    last_in_epoch_2 = torch.load(snapshot.with_name("s.pt.prev"), weights_only=True)
    assert last_in_epoch_2["epoch"] == 1 and last_in_epoch_2["samples_done"] == 1024
    assert last_in_epoch_2["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.01, rel=1e-12)


def test_a_snapshot_of_non_finite_weights_is_never_written(good_snapshot, tmp_path):
    """Optimizer state gone NaN (here: one momentum buffer, planted in a copy of a good snapshot) makes the weights
    NaN at the next step while that step's loss is still finite: the snapshot due right after it is refused."""
    folder = tmp_path / "planted"
    folder.mkdir()
    planted = torch.load(good_snapshot, weights_only=True)
    next(iter(planted["optimizer"]["state"].values()))["momentum_buffer"].fill_(float("nan"))
    torch.save(planted, folder / "s.pt")
    before = snapshots(folder)
    result = run_04(folder / "s.pt", "--save-every-steps", "1")  # (a resume may change how often it saves)
    assert result.returncode != 0
    assert result.stdout.count("error: the weights are not finite in epoch ") == 1, result.stdout[-3000:]
    assert (f"this snapshot was not saved. Try a lower --lr (this run: 0.05); {folder / 's.pt'} holds the last finite "
            "weights saved (not the steps since)") in result.stdout
    assert "saved snapshot" not in result.stdout and snapshots(folder) == before


def test_05_never_writes_a_snapshot_of_non_finite_state(tmp_path):
    """05's own check, over its sharded state (each rank's pieces, to_local()) and BatchNorm's running statistics
    (each rank's own). --lr 1e17 makes the first step's weights huge but finite: that step is saved. In the second
    step's forward BatchNorm normalises the huge activations, so the loss stays finite and the loss check lets the
    step pass, but its running variance overflows: the snapshot due after that step is refused, on both ranks
    together, in one line naming the snapshot that stays."""
    snapshot = tmp_path / "snapshot"
    result = run([*torchrun(2, "05_fsdp.py"), *TINY, "--lr", "1e17", "--save-every-steps", "1", "--checkpoint",
                  snapshot], timeout=120)
    assert result.returncode != 0
    refused = re.findall(r"^error: the weights are not finite in epoch 1; this snapshot was not saved\. Try a lower "
                         r"--lr \(this run: 1e\+17\); (.*) holds the last finite weights saved \(not the steps "
                         r"since\): resume from it with a lower --lr and --allow-new-lr$", result.stdout, re.M)
    assert refused == [str(snapshot)] and len(re.findall("^error:", result.stdout, re.M)) == 1, result.stdout[-3000:]
    assert result.stdout.count("saved snapshot") == 1, "only the first step's, finite"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["snapshot"]  # no .tmp, no .prev: nothing after it
