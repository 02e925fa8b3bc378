"""05_fsdp.py, step 05's promises on real torchrun launches: FSDP2 trains what DDP trains (04, same flags); a run
stopped by a signal resumes bitwise on the same world size; a snapshot of 4 ranks resumes on 2 and on 3 (DCP
reshards) and ends within float rounding of an uninterrupted run; a writer killed mid-write leaves the previous
snapshot whole; the whole-model file loads with plain torch, as DCP's own converter writes it; a resume that
would change the global batch is refused.

The model is --model wide-256 (no BatchNorm: every rank's batch statistics would differ with the world size). The
global batch is 48, a multiple of 2, 3 and 4; 49 validation samples make the ranks' shards end after different
numbers of batches (2 ranks: 25 and 24 samples, 2 and 1 batches of 24), so every evaluation runs empty batches."""
import os
import shutil
import signal
import subprocess
import time

import psutil
import pytest
import torch
from helpers import PYTHON, TORCHRUN, clean_env, load_script, read_metrics, run
from test_fault_tolerance import checksums, launch, wait, wait_for_new_snapshot
from test_refused_input import assert_said_once, refusal, snapshot_of

pytestmark = pytest.mark.faults

SCRIPT = "05_fsdp.py"
GLOBAL_BATCH = 48
TRAIN = ["--model", "wide-256", "--train-samples", "480", "--val-samples", "49", "--epochs", "2", "--save-every-steps",
         "3"]  # 10 steps per epoch of 48: a signal after the second snapshot (step 6) lands mid-epoch 1
# 05 and 04 on 2 ranks sum the same two gradients in the same order: equal up to rounding (measured bitwise).
ATOL = 1e-5
# Resumed on another world size, a run sums each step's gradient in another order. Per step that is rounding: the
# 48-sample gradient as 4 parts or 2 differs by 7.5e-9 at most, the same on every CPU kernel set (ATEN_CPU_CAPABILITY
# avx512, avx2, default). Over the run's 20 steps a unit whose input is within rounding of 0 can take
# the other side of its ReLU in one run only, and then that step's gradient differs by that sample's whole share:
# whether that happens depends on the trajectory, so the end drift is heavy-tailed, not a capability's constant
# (measured at the end of this test when the run had twice the samples, 40 steps, one run each on this AVX-512
# machine: about 1e-7 with its own kernels, 5.6e-5 with ATEN_CPU_CAPABILITY=avx2, where 1e-5 failed; not measured
# again for 20 steps, which give a flip fewer chances). The bound, 1e-3, is about 18 times the largest of those two
# (few measurements of a heavy-tailed quantity) and 1/60 of the largest initial weight (0.0625): a resume that lost
# the momentum or a step moves weights by far more. The last validation loss must also agree to 4 decimals.
RESHARD_ATOL = 1e-3


def command(nproc, snapshot, *extra, script=SCRIPT, max_restarts=0):
    return [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}", script, *TRAIN,
            "--batch-size", str(GLOBAL_BATCH // nproc), "--checkpoint", snapshot, *extra]


def whole_model(snapshot):
    return torch.load(f"{snapshot}.model.pt", weights_only=True)["model"]


def stop_by_signal(tmp_path, name, nproc):
    """Runs on nproc ranks until two snapshots are written, then SIGUSR1 to every worker (what Slurm sends): they
    stop together at the next step, after a snapshot. Returns the snapshot folder."""
    snapshot = tmp_path / name
    agent, log = launch(tmp_path, name, command(nproc, snapshot))
    wait_for_new_snapshot(snapshot, wait_for_new_snapshot(snapshot, 0))
    for worker in psutil.Process(agent.pid).children():
        worker.send_signal(signal.SIGUSR1)
    code, output = wait(agent, log)
    assert code == 0 and "stopped by a signal" in output, output[-3000:]
    return snapshot


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run on 2 ranks: its output, metrics and snapshot folder."""
    folder = tmp_path_factory.mktemp("fsdp-reference")
    code, output = wait(*launch(folder, "reference", command(2, folder / "snapshot", "--metrics",
                                                              folder / "metrics.jsonl")))
    assert code == 0, output[-3000:]
    return output, read_metrics(folder / "metrics.jsonl"), folder / "snapshot"


def test_fsdp2_trains_what_ddp_trains(reference, tmp_path):
    """04 (DDP) with the same flags: the same losses and weights up to float rounding. (On 2 ranks both sum two
    gradients, a + b, and divide by 2: measured bitwise equal here; the test asks only for rounding.)"""
    output, metrics, snapshot = reference
    ddp = command(2, tmp_path / "ddp.pt", "--metrics", tmp_path / "metrics.jsonl", script="04_fault_tolerant.py")
    code, ddp_output = wait(*launch(tmp_path, "ddp", ddp))
    assert code == 0, ddp_output[-3000:]
    for fsdp_epoch, ddp_epoch in zip(metrics, read_metrics(tmp_path / "metrics.jsonl"), strict=True):
        for key in ("train_loss", "val_loss", "val_accuracy"):
            assert fsdp_epoch[key] == pytest.approx(ddp_epoch[key], rel=1e-6, abs=1e-7), key
    ddp_model, fsdp_model = torch.load(tmp_path / "ddp.pt", weights_only=True)["model"], whole_model(snapshot)
    assert ddp_model.keys() == fsdp_model.keys()
    assert all(torch.allclose(ddp_model[k], fsdp_model[k], rtol=0, atol=ATOL) for k in ddp_model)


def test_a_run_stopped_by_a_signal_resumes_bitwise_on_the_same_world_size(reference, tmp_path):
    output, _, snapshot = reference
    stopped = stop_by_signal(tmp_path, "snapshot", 2)
    code, resumed = wait(*launch(tmp_path, "resume", command(2, stopped)))
    assert code == 0 and "resumed from" in resumed, resumed[-3000:]
    assert checksums(resumed) == checksums(output)
    expected, got = whole_model(snapshot), whole_model(stopped)
    assert all(torch.equal(expected[k], got[k]) for k in expected), "bitwise equal to the uninterrupted run"


def test_a_snapshot_of_4_ranks_resumes_on_2_and_on_3(reference, tmp_path):
    """DCP reads, for each rank of the new world size, the parts of the saved pieces it now holds; with the global
    batch kept (4 x 12 = 2 x 24 = 3 x 16), the run ends where the uninterrupted one did, within float rounding."""
    _, metrics, snapshot = reference
    stopped = stop_by_signal(tmp_path, "four", 4)
    shutil.copytree(stopped, tmp_path / "three")
    expected = whole_model(snapshot)
    for nproc, folder in ((2, stopped), (3, tmp_path / "three")):
        code, output = wait(*launch(tmp_path, f"on{nproc}", command(nproc, folder)))
        assert code == 0, output[-3000:]
        assert f"world size 4 then, {nproc} now" in output
        got = whole_model(folder)
        differences = {k: (expected[k] - got[k]).abs().max().item() for k in expected}
        assert max(differences.values()) <= RESHARD_ATOL, differences
        assert f"val loss {metrics[-1]['val_loss']:.4f}" in output


def test_killing_the_writer_mid_write_keeps_the_previous_snapshot(reference, tmp_path):
    """Rank 0 is killed while the new snapshot is being written beside the old one (PATH.tmp/): the old folder is
    untouched, torchrun restarts the group, and it resumes from it to the uninterrupted run's exact weights."""
    output, _, expected = reference
    snapshot = tmp_path / "snapshot"
    env = clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", SNAPSHOT_WRITE_DELAY="1.5")
    # snapshots at the epochs' ends only, each write held 1.5 s: the first, the killed one (the run's last), and the
    # restart's
    agent, log = launch(tmp_path, "run", command(2, snapshot, "--save-every-steps", "1000", max_restarts=1), env)
    wait_for_new_snapshot(snapshot, 0)
    deadline = time.monotonic() + 120
    while not (tmp_path / "snapshot.tmp" / "train_state.pt").exists():  # the next write has begun and is paused
        assert agent.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.02)
    before = {path.name: path.read_bytes() for path in snapshot.iterdir()}
    writer = next(p for p in psutil.Process(agent.pid).children() if p.environ().get("RANK") == "0")
    writer.kill()
    assert {path.name: path.read_bytes() for path in snapshot.iterdir()} == before, "the previous snapshot is whole"
    code, resumed = wait(agent, log)
    assert code == 0 and "resumed from" in resumed, resumed[-3000:]
    assert checksums(resumed) == checksums(output)
    expected, got = whole_model(expected), whole_model(snapshot)
    assert all(torch.equal(expected[k], got[k]) for k in expected), "bitwise equal to the uninterrupted run"


def test_the_whole_model_file_is_a_plain_state_dict_that_needs_neither_this_project_nor_a_process_group(reference,
                                                                                                       tmp_path):
    """PATH.model.pt loads with torch.load(weights_only=True) into a model built from plain torch in a fresh
    interpreter outside the repository; it holds what DCP's own converter finds in the snapshot; --evaluate of it
    in one process gives the last epoch's validation loss, which 2 ranks computed with empty batches."""
    _, metrics, snapshot = reference
    plain = """import sys, torch, torch.nn as nn
width = 256
model = nn.Sequential(nn.Flatten(), nn.Linear(3072, width), nn.ReLU(),
                      *[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(6)], nn.Linear(width, 10))
model.load_state_dict(torch.load(sys.argv[1], weights_only=True)["model"])  # strict: every name and shape
print(model(torch.zeros(1, 3, 32, 32)).shape)"""
    result = run([PYTHON, "-I", "-c", plain, f"{snapshot}.model.pt"], cwd=tmp_path, timeout=120)
    assert result.returncode == 0 and "torch.Size([1, 10])" in result.stdout, result.stdout[-2000:]
    converted = tmp_path / "converted.pt"  # the command docs/fsdp.md gives: snapshot (model and momentum) to a file
    subprocess.run([PYTHON, "-m", "torch.distributed.checkpoint.format_utils", "dcp_to_torch", snapshot,
                    converted], check=True, capture_output=True, timeout=120, cwd=tmp_path)
    from_converter = torch.load(converted, weights_only=True)["model"]
    mine = whole_model(snapshot)
    assert from_converter.keys() == mine.keys() and all(torch.equal(from_converter[k], mine[k]) for k in mine)
    result = run([PYTHON, SCRIPT, "--evaluate", f"{snapshot}.model.pt"], timeout=120)
    assert result.returncode == 0, result.stdout[-2000:]
    assert f"val loss {metrics[-1]['val_loss']:.4f}" in result.stdout


def test_a_resume_that_changes_the_global_batch_is_refused_and_a_file_is_not_a_snapshot_folder(reference, tmp_path):
    """On 2 ranks: one line (from each), no step, and the folder as it was, with nothing beside it (PATH.prev,
    PATH.tmp, PATH.model.pt). Refused by load_snapshot's sys.exit on every rank, as a piece missing or cut short is
    (in-process: test_a_damaged_snapshot_folder_is_refused_in_one_line_and_left_as_it_was)."""
    _, _, snapshot = reference
    folder = tmp_path / "snapshot"
    shutil.copytree(snapshot, folder)
    before = snapshot_of(tmp_path)
    launch_ = command(2, folder)
    launch_[launch_.index("--batch-size") + 1] = "16"  # 2 x 16 = 32, not 48
    result = run(launch_, timeout=120, env=clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))
    assert_said_once(result, f"error: --checkpoint {folder}: a resume cannot change --batch-size 16 (snapshot: 24)")
    assert "keep --batch-size x processes = 48" in result.stdout
    assert "epoch 1/" not in result.stdout and "epoch 2/" not in result.stdout
    assert "saved snapshot" not in result.stdout
    assert snapshot_of(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["snapshot"]
    (tmp_path / "file").write_text("not a folder")
    said = refusal(SCRIPT, ["--checkpoint", str(tmp_path / "file")], 2)
    assert "not a folder (or a new name) in a folder that exists" in said and "\n" not in said.strip()


def test_the_snapshot_is_sharded_each_rank_writing_its_own_piece(reference):
    """The folder holds one data file per rank (__RANK_0.distcp), DCP's index (.metadata, a pickle: load only
    snapshots you wrote) and the rest of the training state (train_state.pt, loaded with weights_only=True)."""
    _, _, snapshot = reference
    names = sorted(path.name for path in snapshot.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "train_state.pt"], names
    sizes = [os.path.getsize(snapshot / name) for name in ("__0_0.distcp", "__1_0.distcp")]
    model_bytes = sum(t.numel() * 4 for t in whole_model(snapshot).values())
    assert all(0.9 * model_bytes < size < 1.1 * model_bytes for size in sizes), "half the weights and momentum each"


def cut_short(path, size=1000):
    path.write_bytes(path.read_bytes()[:size])


def zeroed(path):
    """The same size, every byte 0: damage only reading the piece finds."""
    path.write_bytes(bytes(path.stat().st_size))


# name: (damage the copy of a snapshot folder, what 05 says after "error: --checkpoint FOLDER: ")
DAMAGED_FOLDERS = {
    "a piece missing": (lambda f: (f / "__1_0.distcp").unlink(), "no usable snapshot among {f} (No such file or "
                        "directory: __1_0.distcp); move them away to start over"),
    "a piece cut short": (lambda f: cut_short(f / "__0_0.distcp"), "no usable snapshot among {f} (cut short: "
                          "__0_0.distcp)"),
    "the index missing": (lambda f: (f / ".metadata").unlink(), "no usable snapshot among {f} (No such file or "
                          "directory: .metadata)"),
    "the index damaged": (lambda f: (f / ".metadata").write_bytes(b"not a pickle"), "no usable snapshot among {f} ("),
    "train_state.pt missing": (lambda f: (f / "train_state.pt").unlink(), "no usable snapshot among {f} (No such file "
                               "or directory: train_state.pt)"),
    "train_state.pt cut short": (lambda f: cut_short(f / "train_state.pt"), "no usable snapshot among {f} ("),
    "train_state.pt empty": (lambda f: (f / "train_state.pt").write_bytes(b""), "no usable snapshot among {f} "
                             "(EOFError)"),
    "train_state.pt of another kind (04's snapshot)": (
        lambda f: torch.save({"model": {}, "optimizer": {}, "model_name": "wide-256", "num_classes": 10},
                             f / "train_state.pt"), "not a snapshot of --model wide-256 with 10 classes"),
    "an empty folder": (lambda f: [path.unlink() for path in f.iterdir()], "no usable snapshot among {f} (No such "
                        "file or directory: train_state.pt)"),
}


@pytest.mark.parametrize("case", DAMAGED_FOLDERS)
def test_a_damaged_snapshot_folder_is_refused_in_one_line_and_left_as_it_was(reference, tmp_path, case):
    """In-process: 05's own load_snapshot, which every rank runs before the model is sharded, on a copy of the
    reference snapshot damaged one way. A piece missing or cut short, or the index unreadable, is found here, before
    DCP reads any piece (DCP would say so in a traceback on every rank, after its own multi-line warnings)."""
    damage, message = DAMAGED_FOLDERS[case]
    folder = tmp_path / "snapshot"
    shutil.copytree(reference[2], folder)
    damage(folder)
    before, module = snapshot_of(tmp_path), load_script(SCRIPT)
    args = module.parse_args([*TRAIN, "--batch-size", str(GLOBAL_BATCH // 2), "--checkpoint", str(folder)])
    with pytest.raises(SystemExit) as stop:
        module.load_snapshot(args, "cpu", 10)
    assert stop.value.code.startswith(f"error: --checkpoint {folder}: " + message.replace("{f}", str(folder)))
    assert "\n" not in stop.value.code and snapshot_of(tmp_path) == before


def test_a_damaged_snapshot_folder_falls_back_to_the_previous_with_a_warning(reference, tmp_path, capsys):
    folder = tmp_path / "snapshot"
    shutil.copytree(reference[2], tmp_path / "snapshot.prev")
    shutil.copytree(reference[2], folder)
    (folder / "__1_0.distcp").unlink()
    module = load_script(SCRIPT)
    args = module.parse_args([*TRAIN, "--batch-size", str(GLOBAL_BATCH // 2), "--checkpoint", str(folder)])
    snapshot, _ = module.load_snapshot(args, "cpu", 10)
    assert snapshot["path"] == f"{folder}.prev"
    assert capsys.readouterr().out == (f"warning: snapshot {folder} is unusable (No such file or directory: "
                                       f"__1_0.distcp); resuming from {folder}.prev\n")


def test_a_damaged_piece_is_refused_under_torchrun_on_every_rank_and_nothing_is_written(reference, tmp_path):
    """On 2 ranks, a piece of the right size whose bytes are damaged: found by DCP's read, which gathers every rank's
    error, so both ranks stop together, no hang. One line, no step, and the folder as it was, with nothing beside it
    (PATH.prev, PATH.tmp, PATH.model.pt). (A piece missing or cut short is refused before DCP reads, by
    load_snapshot's sys.exit on every rank: in-process above, and under torchrun that exit is the global batch's.)"""
    folder = tmp_path / "snapshot"
    shutil.copytree(reference[2], folder)
    zeroed(folder / "__1_0.distcp")
    before = snapshot_of(tmp_path)
    result = run(command(2, folder), timeout=120, env=clean_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))
    assert_said_once(result, f"error: --checkpoint {folder}: a piece is unreadable")
    assert "epoch 1/" not in result.stdout and "epoch 2/" not in result.stdout
    assert snapshot_of(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["snapshot"]
