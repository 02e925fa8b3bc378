"""Bad input never trains silently and never crashes late: every input that cannot work is refused before any
process group forms or any step is taken, with one line naming it and a non-zero exit, by all six scripts
alike. The table below is the list of what the scripts refuse; docs/flags.md points here.

Each case runs in-process through the script's own checks (parse_args, then check_inputs), for every script;
a few real launches then prove the exit code, the single line and that a refused run writes nothing."""
import contextlib
import io
import re

import pytest
import torch
from helpers import PYTHON, SCRIPTS, TORCHRUN, clean_env, load_script, run, torchrun
from PIL import Image


def image_folder(root, train=("class0", "class1"), val=("class0", "class1"), empty=()):
    """An ImageFolder tree of 8x8 PNGs, two per class and split; classes in `empty` get a folder and no image."""
    for split, classes in (("train", train), ("val", val)):
        for label, name in enumerate(classes):
            (root / split / name).mkdir(parents=True)
            for index in range(0 if name in empty else 2):
                Image.new("RGB", (8, 8), (100 * label, 50, 50)).save(root / split / name / f"{index}.png")
    return root


def not_a_checkpoint(root):
    (root / "notes.txt").write_text("not a checkpoint\n")
    return root / "notes.txt"


def no_files(root):
    return root


# name: (make the files it needs in a fresh folder, the flags ({tmp}: that folder), world size, message)
REFUSED = {
    "unknown model": (no_files, ["--model", "resnet_18"], 1, "--model resnet_18: unknown; use 'cnn', 'wide' or a "
                      "torchvision classification model, listed by python -c"),
    "model that cannot take 32x32 images": (no_files, ["--model", "vit_b_16"], 1, "--model vit_b_16 cannot take 32x32"),
    "negative learning rate": (no_files, ["--lr", "-0.1"], 1, "--lr and --timeout must be positive numbers"),
    "learning rate not a number": (no_files, ["--lr", "nan"], 1, "--lr and --timeout must be positive numbers"),
    "zero timeout": (no_files, ["--timeout", "0"], 1, "--lr and --timeout must be positive numbers"),
    "zero batch size": (no_files, ["--batch-size", "0"], 1, "--batch-size must be at least 1, got 0"),
    "zero gradient accumulation": (no_files, ["--grad-accum", "0"], 1, "--grad-accum must be at least 1, got 0"),
    "negative DataLoader workers": (no_files, ["--num-workers", "-1"], 1, "--num-workers must be 0 or more, got -1"),
    "cifar10 not downloaded": (no_files, ["--data", "cifar10", "--data-dir", "{tmp}"], 1, "add --download"),
    "data folder that does not exist": (no_files, ["--data", "{tmp}/nothing"], 1, "nothing: no train/ folder"),
    "ImageFolder without val/": (lambda p: image_folder(p, val=()), ["--data", "{tmp}"], 1, "no val/ folder"),
    "ImageFolder whose val/ lacks a class": (lambda p: image_folder(p, val=("class0",)), ["--data", "{tmp}"], 1,
                                             "train/ and val/ hold different class folders, so their labels would "
                                             "not match: ['class1']"),
    "ImageFolder with an empty class folder": (lambda p: image_folder(p, empty=("class1",)), ["--data", "{tmp}"], 1,
                                               "train/ has no images in class1/"),
    "ImageFolder with no class folders": (lambda p: (p / "train").mkdir() or (p / "val").mkdir() or p,
                                          ["--data", "{tmp}"], 1, "train/ has no class folders"),
    "fewer samples than one batch": (no_files, ["--train-samples", "60"], 1, "60 training samples are fewer than one "
                                     "global batch: --batch-size 64 x 1 processes x --grad-accum 1 = 64"),
    "fewer samples than one global batch": (no_files, ["--train-samples", "100"], 2, "100 training samples are fewer "
                                            "than one global batch: --batch-size 64 x 2 processes"),
    "fewer samples than one accumulated batch": (no_files, ["--train-samples", "200", "--grad-accum", "4"], 1,
                                                 "x --grad-accum 4 = 256"),
    "ImageFolder smaller than one batch": (lambda p: image_folder(p), ["--data", "{tmp}"], 1,
                                           "4 training samples are fewer than one global batch"),
    "checkpoint in a folder that does not exist": (no_files, ["--checkpoint", "{tmp}/no/such/folder/snapshot.pt"], 1,
                                                   "in a folder that exists and is writable"),
    "checkpoint path that is a folder": (no_files, ["--checkpoint", "{tmp}"], 1, "not a file in a folder that exists"),
    "metrics in a folder that does not exist": (no_files, ["--metrics", "{tmp}/no/metrics.jsonl"], 1, "--metrics"),
    "evaluate a file that does not exist": (no_files, ["--evaluate", "{tmp}/nope.pt"], 1, "nope.pt: no such file"),
}


def refusal(script, flags, world_size):
    """What the script's own checks say of these flags: the message it exits with, or None if accepted."""
    module, stderr = load_script(script), io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = module.parse_args(flags)
            module.check_inputs(args, world_size)
    except SystemExit as exit:
        assert exit.code not in (0, None)
        return exit.code if isinstance(exit.code, str) else stderr.getvalue()
    return None


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("case", REFUSED)
def test_refused_in_one_line_naming_the_input(case, script, tmp_path):
    if script == "05_fsdp.py" and case == "checkpoint path that is a folder":
        pytest.skip("05's snapshot is a folder (tests/test_fsdp.py: it refuses a file)")
    make, flags, world_size, message = REFUSED[case]
    path = make(tmp_path)
    said = refusal(script, [flag.replace("{tmp}", str(path)) for flag in flags], world_size)
    assert said is not None, f"{script} accepted {flags}"
    assert message in said and len(said.strip().splitlines()) == 1, said


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_documented_defaults_are_accepted(script):
    assert refusal(script, [], 2) is None


# --- real launches: the exit code, the single line, and nothing written ---------------------------------------

def assert_refused(result, message, folder):
    assert result.returncode != 0
    assert message in result.stdout, result.stdout[-2000:]
    # (torchrun prints a traceback of its own when a worker exits non-zero; the script itself must not crash)
    assert not re.search(r'\d\d_\w+\.py", line', result.stdout), "a traceback through the script"
    assert not [p for p in folder.rglob("*") if p.suffix in (".pt", ".jsonl", ".tmp")], "a refused run wrote"


@pytest.mark.launch
def test_a_global_batch_larger_than_the_data_is_refused_under_torchrun(tmp_path):
    """The issue's example: two processes of 64 and 100 samples would train nothing and report success."""
    result = run(torchrun(2, "02_torchrun.py", "--train-samples", "100", "--metrics", tmp_path / "m.jsonl",
                          "--checkpoint", tmp_path / "c.pt"), timeout=90)
    assert_refused(result, "error: 100 training samples are fewer than one global batch", tmp_path)
    assert result.stdout.count("error: 100 training samples") == 2, "each process refuses before the group forms"


@pytest.mark.launch
def test_mismatched_image_folder_is_refused_before_mp_spawn_starts_anything(tmp_path):
    image_folder(tmp_path / "images", val=("class0",))
    result = run([PYTHON, "01_mp_spawn.py", "--data", tmp_path / "images", "--metrics", tmp_path / "m.jsonl"],
                 timeout=60)
    assert_refused(result, "train/ and val/ hold different class folders", tmp_path)
    assert result.stdout.strip().count("\n") == 0, result.stdout


@pytest.mark.launch
def test_a_file_that_is_not_a_checkpoint_is_refused_by_evaluate(tmp_path):
    result = run([PYTHON, "00_single_gpu.py", "--evaluate", not_a_checkpoint(tmp_path)], timeout=60)
    assert_refused(result, "notes.txt: not a checkpoint of these scripts", tmp_path)


@pytest.mark.launch
def test_04_refuses_to_resume_from_a_snapshot_of_another_model(tmp_path):
    """A snapshot of resnet18 given to a cnn run: refused before any step, not a size-mismatch traceback."""
    torch.save({"model": {}, "model_name": "resnet18", "num_classes": 10, "optimizer": {}}, tmp_path / "s.pt")
    result = run([TORCHRUN, "--standalone", "--nproc_per_node=1", "--max-restarts=0", "04_fault_tolerant.py",
                  "--checkpoint", tmp_path / "s.pt", "--train-samples", "256"], timeout=90)
    assert result.returncode != 0
    assert "s.pt: not a snapshot of --model cnn with 10 classes; give another path" in result.stdout
    assert not re.search(r'\d\d_\w+\.py", line', result.stdout), "a traceback through the script"
    assert "epoch 1/" not in result.stdout


@pytest.mark.launch
def test_04_refuses_a_checkpoint_folder_that_does_not_exist_before_training(tmp_path):
    """It used to train until the first snapshot, crash on rank 0, hang rank 1 and spend the restarts."""
    result = run([TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=0", "04_fault_tolerant.py",
                  "--checkpoint", tmp_path / "missing" / "s.pt"], timeout=90)
    assert_refused(result, "s.pt: not a file in a folder that exists and is writable", tmp_path)
    assert "epoch 1/" not in result.stdout and "saved snapshot" not in result.stdout


@pytest.mark.launch
def test_an_unreadable_image_found_during_training_is_named(tmp_path):
    image_folder(tmp_path / "images")
    broken = tmp_path / "images" / "train" / "class1" / "broken.png"
    broken.write_bytes(b"not a PNG")
    result = run([PYTHON, "00_single_gpu.py", "--data", tmp_path / "images", "--batch-size", "2", "--epochs", "1"],
                 timeout=60)
    assert result.returncode != 0
    assert f"error: unreadable image {broken}" in result.stdout, result.stdout[-2000:]
    assert "Traceback" not in result.stdout


@pytest.mark.launch
def test_a_preparation_slower_than_the_collective_timeout_does_not_time_out_the_others(tmp_path):
    """Rank 0 prepares the data for 8 s while rank 1 waits; collectives time out after 3 s here. The wait is on a
    group of its own, bounded by the preparation, so both train and finish."""
    result = run(torchrun(2, "02_torchrun.py", "--train-samples", "256", "--val-samples", "64", "--epochs", "1",
                          "--timeout", "3", "--metrics", tmp_path / "m.jsonl"),
                 env=clean_env(DATA_PREPARE_DELAY=8), timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "epoch 1/1" in result.stdout


def test_a_few_samples_of_an_image_folder_come_from_every_class(tmp_path):
    """ImageFolder lists its samples class by class: --train-samples 2 of two classes must not mean class0 only."""
    args = load_script("00_single_gpu.py").parse_args(["--data", str(image_folder(tmp_path)), "--train-samples", "2",
                                                       "--val-samples", "2"])
    train_set, val_set, _ = load_script("00_single_gpu.py").build_datasets(args)
    assert sorted(label for _, label in train_set) == [0, 1] and sorted(label for _, label in val_set) == [0, 1]
