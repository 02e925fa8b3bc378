"""Bad input never trains silently and never crashes late: every input that cannot work is refused before any
process group forms or any step is taken, with one line naming it and a non-zero exit, by all six scripts
alike. The table below is the list of what the scripts refuse; docs/flags.md points here.

Each case runs in-process through the script's own checks (parse_args, then check_inputs), for every script;
a few real launches then prove the exit code, the single line and that a refused run writes nothing."""
import contextlib
import io
import pickle
import re
import warnings

import pytest
import torch
from helpers import PYTHON, SCRIPTS, clean_env, load_script, run, torchrun
from PIL import Image
from torch.utils.data import DataLoader


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


def damaged_cifar10(root):
    """A CIFAR-10 folder as an interrupted copy leaves it: the first batch cut short, the others missing."""
    (root / "cifar-10-batches-py").mkdir()
    (root / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"\x80\x02}q\x00" * 100)
    return root


# name: (make the files it needs in a fresh folder, the flags ({tmp}: that folder), world size, message)
REFUSED = {
    "unknown model": (no_files, ["--model", "resnet_18"], 1, "--model resnet_18: unknown; use 'cnn', 'wide' or a "
                      "torchvision classification model, listed by python -c"),
    "model that cannot take 32x32 images": (no_files, ["--model", "vit_b_16"], 1, "--model vit_b_16 cannot take 32x32"),
    "negative learning rate": (no_files, ["--lr", "-0.1"], 1, "--lr and --timeout must be positive numbers"),
    "learning rate not a number": (no_files, ["--lr", "nan"], 1, "--lr and --timeout must be positive numbers"),
    "zero timeout": (no_files, ["--timeout", "0"], 1, "--lr and --timeout must be positive numbers"),
    "negative epochs": (no_files, ["--epochs", "-1"], 1, "--epochs must be at least 1, got -1"),
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
    # (04 used to train until its first snapshot, then crash on rank 0 and hang rank 1: refused here, before training)
    "checkpoint in a folder that does not exist": (no_files, ["--checkpoint", "{tmp}/no/such/folder/snapshot.pt"], 1,
                                                   "in a folder that exists and is writable"),
    "checkpoint path that is a folder": (no_files, ["--checkpoint", "{tmp}"], 1, "not a file in a folder that exists"),
    "metrics in a folder that does not exist": (no_files, ["--metrics", "{tmp}/no/metrics.jsonl"], 1, "--metrics"),
    "evaluate a file that does not exist": (no_files, ["--evaluate", "{tmp}/nope.pt"], 1, "nope.pt: no such file"),
    "evaluate a folder (05's snapshot)": (no_files, ["--evaluate", "{tmp}"], 1, "a folder, not a checkpoint file (of "
                                          "05's snapshot folder PATH, give PATH.model.pt)"),
    "cifar10 with damaged files": (damaged_cifar10, ["--data", "cifar10", "--data-dir", "{tmp}"], 1,
                                   "data_batch_1, data_batch_2, data_batch_3, data_batch_4, data_batch_5, test_batch, "
                                   "batches.meta in {tmp}/cifar-10-batches-py: missing or damaged (not the MD5 "
                                   "CIFAR-10 publishes); add --download to fetch it again"),
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
    before = snapshot_of(tmp_path)
    said = refusal(script, [flag.replace("{tmp}", str(path)) for flag in flags], world_size)
    assert said is not None, f"{script} accepted {flags}"
    assert message.replace("{tmp}", str(path)) in said and len(said.strip().splitlines()) == 1, said
    assert snapshot_of(tmp_path) == before, "a refusal changed the user's files"


def snapshot_of(folder):
    """Every file under folder and its bytes: what a refusal must leave as it was."""
    return {path: path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_documented_defaults_are_accepted(script):
    assert refusal(script, [], 2) is None


@pytest.mark.parametrize("script", SCRIPTS)
def test_torchvision_names_are_torchvisions_and_05_refuses_a_model_the_meta_device_cannot_build(script):
    """wide_resnet50_2 is torchvision's model, not the scripts' wide-N. A RegNet reads its own numbers while it is
    built, which the meta device does not hold: 05, which builds there, refuses it in one line; 00-04 train it."""
    assert refusal(script, ["--model", "wide_resnet50_2"], 2) is None
    said = refusal(script, ["--model", "regnet_x_400mf"], 2)
    if script == "05_fsdp.py":
        assert "regnet_x_400mf cannot be built on the meta device" in said and len(said.strip().splitlines()) == 1
    else:
        assert said is None


# --- damaged, empty and foreign files handed to a script: one line naming the file, nothing changed ------------

def checkpoint_of(model_name="cnn", data="synthetic", **extra):
    """A checkpoint as 00-03's --checkpoint writes it (the cnn's weights, the default flags), changed by `extra`."""
    module = load_script("00_single_gpu.py")
    args = {**vars(module.parse_args([])), "data": data}
    return {"model": module.build_model("cnn", 10).state_dict(), "model_name": model_name, "num_classes": 10,
            "epoch": 1, "args": args, **extra}


def saved(name, content):
    """A maker of the file `name` in a test's folder: bytes as they are, anything else through torch.save."""
    def make(root):
        if isinstance(content, bytes):
            (root / name).write_bytes(content)
        else:
            torch.save(content() if callable(content) else content, root / name)
        return root / name
    return make


def pickled(name):
    """A maker of a plain pickle (protocol 4, not a torch file): torch.load warns of its protocol, then refuses it."""
    def make(root):
        with open(root / name, "wb") as f:
            pickle.dump({"model": {}}, f, protocol=4)
        return root / name
    return make


class Malicious:
    """Unpickling this runs code: here, creating a marker file, MARKER beside the snapshot."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


MARKER = "pwned"


def malicious(name):
    """A maker of a pickle whose loading would run code (Malicious): weights_only=True must refuse to run it."""
    def make(root):
        with open(root / name, "wb") as f:
            pickle.dump({"model": Malicious(str(root / MARKER))}, f)
        return root / name
    return make


def cut(name, content, keep=0.5):
    """A maker of a torch file cut short, as an interrupted copy leaves it."""
    def make(root):
        torch.save(content(), root / name)
        whole = (root / name).read_bytes()
        (root / name).write_bytes(whole[:int(len(whole) * keep)])
        return root / name
    return make


PORT_SNAPSHOT = {"model": {}, "optimizer": {}, "scheduler": {}, "step": 3, "position": 96, "data_sha256": "0" * 64,
                 "args": {"data": "text.txt", "seed": 0, "steps": 10}, "world_size": 2}
# 05's train_state.pt: the snapshot folder's small part, without the weights (they are in the pieces)
TRAIN_STATE = {"param_groups": [], "model_name": "cnn", "num_classes": 10, "epoch": 1, "samples_done": 0,
               "args": {"data": "synthetic"}, "world_size": 2}
# name: (make the file in a fresh folder, what --evaluate says of it after "error: --evaluate PATH: ")
DAMAGED_FOR_EVALUATE = {
    "empty file": (saved("empty.pt", b""), "not a checkpoint of these scripts (EOFError); give a file that "
                   "--checkpoint wrote (05: PATH.model.pt)"),
    "checkpoint cut short": (cut("cut.pt", checkpoint_of), "not a checkpoint of these scripts ("),
    "text file": (saved("notes.txt", b"not a checkpoint\n"), "not a checkpoint of these scripts ("),
    "plain pickle (no torch file)": (pickled("p.pkl"), "not a checkpoint of these scripts (UnpicklingError)"),
    "plain state_dict": (saved("weights.pt", lambda: load_script("00_single_gpu.py").build_model("cnn", 10)
                               .state_dict()), "not a checkpoint of these scripts (KeyError)"),
    "05's train_state.pt": (saved("train_state.pt", TRAIN_STATE), "not a checkpoint of these scripts (KeyError)"),
    "the port's snapshot": (saved("gpt.pt", PORT_SNAPSHOT), "not a checkpoint of these scripts (KeyError)"),
    "weights of another model": (saved("other.pt", lambda: checkpoint_of("resnet18")),
                                 "not a checkpoint of these scripts (RuntimeError)"),
    "checkpoint whose data folder is gone": (lambda root: saved("moved.pt", checkpoint_of(data=str(root / "gone")))(
        root), "its --data {tmp}/gone is unreadable (No such file or directory: train); put it back where it was"),
}


def evaluation(script, path):
    """What the script's --evaluate says of `path`, in-process: everything it printed, and its exit."""
    module, output = load_script(script), io.StringIO()
    with contextlib.redirect_stderr(output), contextlib.redirect_stdout(output), pytest.raises(SystemExit) as stop:
        module.evaluate_checkpoint(module.parse_args(["--evaluate", str(path)]))
    assert stop.value.code not in (0, None)
    return output.getvalue() + (stop.value.code if isinstance(stop.value.code, str) else "")


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize("case", DAMAGED_FOR_EVALUATE)
def test_evaluate_refuses_a_damaged_or_foreign_file_in_one_line_and_leaves_it(case, script, tmp_path):
    make, message = DAMAGED_FOR_EVALUATE[case]
    path = make(tmp_path)
    before = snapshot_of(tmp_path)
    said = evaluation(script, path)
    expected = f"error: --evaluate {path}: " + message.replace("{tmp}", str(tmp_path))
    assert said.startswith(expected) and len(said.strip().splitlines()) == 1, said
    assert snapshot_of(tmp_path) == before


# name: (make the file, what 04 says after "error: --checkpoint PATH: "); the snapshot it would resume from
DAMAGED_FOR_04 = {
    "empty file": (saved("s.pt", b""), "no usable snapshot among {path} (EOFError); move them away to start over"),
    "snapshot cut short": (cut("s.pt", lambda: checkpoint_of(optimizer={})), "no usable snapshot among {path} ("),
    "text file": (saved("s.pt", b"not a snapshot\n"), "no usable snapshot among {path} ("),
    "plain pickle": (pickled("s.pt"), "no usable snapshot among {path} (UnpicklingError)"),
    "malicious pickle": (malicious("s.pt"), "no usable snapshot among {path} (UnpicklingError); move them away to "
                         "start over"),
    "folder at PATH.prev": (lambda root: (root / "s.pt.prev").mkdir() or root / "s.pt",
                            "no usable snapshot among {path}.prev (Is a directory: s.pt.prev)"),
    "plain state_dict": (saved("s.pt", lambda: load_script("00_single_gpu.py").build_model("cnn", 10).state_dict()),
                         "not a snapshot of --model cnn with 10 classes; give another path to start over"),
    "00-03's checkpoint": (saved("s.pt", checkpoint_of), "not a snapshot of --model cnn with 10 classes"),
    "the port's snapshot": (saved("s.pt", PORT_SNAPSHOT), "not a snapshot of --model cnn with 10 classes"),
    "05's train_state.pt": (saved("s.pt", TRAIN_STATE), "not a snapshot of --model cnn with 10 classes"),
}


@pytest.mark.parametrize("case", DAMAGED_FOR_04)
def test_04_refuses_a_damaged_or_foreign_snapshot_in_one_line_and_leaves_it(case, tmp_path):
    """In-process: 04's own load_snapshot, which every rank runs before any step (tests/test_fsdp.py: 05's); every
    rank refusing under torchrun: test_04_refuses_a_damaged_snapshot_on_every_rank_before_any_step_and_leaves_it. A
    malicious pickle's code never runs: the file it would create (MARKER) does not exist."""
    make, message = DAMAGED_FOR_04[case]
    path, module = make(tmp_path), load_script("04_fault_tolerant.py")
    before, output = snapshot_of(tmp_path), io.StringIO()
    with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output), pytest.raises(SystemExit) as stop, \
            warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")  # (torch warns of a plain pickle's protocol: 04 must keep it quiet)
        module.load_snapshot(module.parse_args(["--checkpoint", str(path)]), "cpu", 10)
    assert stop.value.code.startswith(f"error: --checkpoint {path}: " + message.replace("{path}", str(path)))
    assert "\n" not in stop.value.code and output.getvalue() == "" and not warned, "one line, no warning before it"
    assert not (tmp_path / MARKER).exists(), "weights_only=True must refuse to run the pickle's code"
    assert snapshot_of(tmp_path) == before


@pytest.mark.parametrize("content", [b"not a PNG", b""], ids=["not an image", "empty"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_an_unreadable_image_stops_the_loop_in_one_line(script, content, tmp_path):
    """In-process, no loader workers: load_image names the file, batches_of stops (launched with workers: below)."""
    module, broken = load_script(script), image_folder(tmp_path) / "train" / "class1" / "broken.png"
    broken.write_bytes(content)
    train_set, _, _ = module.build_datasets(module.parse_args(["--data", str(tmp_path)]))
    output = io.StringIO()
    with contextlib.redirect_stderr(output), pytest.raises(SystemExit) as stop:
        list(module.batches_of(DataLoader(train_set, batch_size=2)))
    assert stop.value.code == 1
    assert output.getvalue().startswith(f"error: unreadable image {broken}: ") and output.getvalue().count("\n") == 1
    assert output.getvalue().endswith("; replace or remove it\n") and broken.read_bytes() == content


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


def assert_said_once(result, start):
    """A non-zero exit and one error line, starting with `start` (each rank that read the file may say it: the same
    line), and no traceback through the script."""
    assert result.returncode != 0
    errors = {line for line in result.stdout.splitlines() if line.startswith("error:")}
    assert len(errors) == 1 and errors.pop().startswith(start), result.stdout[-3000:]
    assert not re.search(r'(\d\d_\w+|gpt_\w+)\.py", line', result.stdout), "a traceback through the script"


@pytest.mark.launch
def test_unreadable_images_found_by_every_rank_s_loader_workers_are_named_and_the_job_ends(tmp_path):
    """Every training image unreadable, read by DataLoader workers (--num-workers 2) on both ranks of 04: a worker
    names its file and each rank stops on the exception it gets from its worker, in no traceback of DataLoader's.
    04's workers ignore SIGTERM (to outlive a scheduler's signal), so Python's exit, which ends its workers with
    SIGTERM and waits, would wait forever: every rank failing at once hung the job until 04 killed them at exit;
    and no worker or fork server is left running after it."""
    image_folder(tmp_path / "images")
    for image in (tmp_path / "images" / "train").rglob("*.png"):
        image.write_bytes(image.read_bytes()[:40])  # cut short: a header and no picture
    from test_fault_tolerance import left_behind

    before = snapshot_of(tmp_path)
    result = run(torchrun(2, "04_fault_tolerant.py", "--data", tmp_path / "images", "--batch-size", "1", "--epochs",
                          "1", "--num-workers", "2"), env=clean_env(TEST_MARK=tmp_path.name), timeout=90)
    errors = [line for line in result.stdout.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) >= 2, result.stdout[-3000:]  # each rank's first batch at least
    assert all(line.startswith(f"error: unreadable image {tmp_path / 'images' / 'train'}/") for line in errors)
    assert not re.search(r'(\d\d_\w+|dataloader)\.py", line', result.stdout), "a traceback through the script"
    assert snapshot_of(tmp_path) == before
    assert left_behind(tmp_path.name) == []  # 04 killed its loader workers, and their fork servers ended


@pytest.mark.launch
def test_04_refuses_a_damaged_snapshot_on_every_rank_before_any_step_and_leaves_it(tmp_path):
    """2 ranks each read a snapshot cut short: one line (from each), no step, no hang, and nothing written over it
    or beside it (PATH.prev, PATH.tmp). In-process, every other damage: test_04_refuses_a_damaged_or_foreign_..."""
    snapshot = cut("s.pt", lambda: checkpoint_of(optimizer={}))(tmp_path)
    before = snapshot_of(tmp_path)
    result = run(torchrun(2, "04_fault_tolerant.py", "--train-samples", "256", "--checkpoint", snapshot), timeout=90)
    assert_said_once(result, f"error: --checkpoint {snapshot}: no usable snapshot among {snapshot} (")
    assert "epoch 1/" not in result.stdout and snapshot_of(tmp_path) == before


@pytest.mark.launch
def test_a_preparation_slower_than_the_collective_timeout_does_not_time_out_the_others(tmp_path):
    """Rank 0 prepares the data for 6 s while rank 1 waits; collectives time out after 3 s here. The wait is on a
    group of its own, bounded by the preparation, so both train and finish."""
    result = run(torchrun(2, "02_torchrun.py", "--train-samples", "256", "--val-samples", "64", "--epochs", "1",
                          "--timeout", "3", "--metrics", tmp_path / "m.jsonl"),
                 env=clean_env(DATA_PREPARE_DELAY=6), timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "epoch 1/1" in result.stdout


def test_a_few_samples_of_an_image_folder_come_from_every_class(tmp_path):
    """ImageFolder lists its samples class by class: --train-samples 2 of two classes must not mean class0 only."""
    args = load_script("00_single_gpu.py").parse_args(["--data", str(image_folder(tmp_path)), "--train-samples", "2",
                                                       "--val-samples", "2"])
    train_set, val_set, _ = load_script("00_single_gpu.py").build_datasets(args)
    assert sorted(label for _, label in train_set) == [0, 1] and sorted(label for _, label in val_set) == [0, 1]
