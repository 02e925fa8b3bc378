"""The options every script shares work for real: an ImageFolder of PNG files, and AMP, gradient
accumulation, torch.compile and TensorBoard together under DDP."""
import json
import os
import shutil

import pytest
import torch
from helpers import PYTHON, clean_env, read_metrics, run_ok, torchrun
from PIL import Image

pytestmark = pytest.mark.launch


def make_image_folder(root, per_class):
    """Two classes of 20x24 PNGs, red and blue with noise: a real ImageFolder tree, resized by the scripts."""
    generator = torch.Generator().manual_seed(0)
    for split, count in per_class.items():
        for label, colour in enumerate([(200, 40, 40), (40, 40, 200)]):
            folder = root / split / f"class{label}"
            folder.mkdir(parents=True)
            for index in range(count):
                noise = torch.randint(-40, 40, (24, 20, 3), generator=generator)
                pixels = (torch.tensor(colour) + noise).clamp(0, 255).to(torch.uint8).numpy()
                Image.fromarray(pixels).save(folder / f"{index}.png")


def test_image_folder_trains_saves_and_evaluates(tmp_path):
    make_image_folder(tmp_path / "images", {"train": 32, "val": 8})
    checkpoint = tmp_path / "checkpoint.pt"
    run_ok([PYTHON, "00_single_gpu.py", "--data", tmp_path / "images", "--epochs", "2", "--batch-size", "8",
            "--num-workers", "2", "--checkpoint", checkpoint, "--metrics", tmp_path / "metrics.jsonl"])
    assert torch.load(checkpoint, weights_only=True)["num_classes"] == 2
    assert read_metrics(tmp_path / "metrics.jsonl")[-1]["val_accuracy"] > 0.5
    output = run_ok([PYTHON, "00_single_gpu.py", "--evaluate", checkpoint]).stdout
    assert json.loads(output.splitlines()[-1])["val_accuracy"] == read_metrics(tmp_path / "metrics.jsonl")[-1][
        "val_accuracy"]


def test_amp_accumulation_compile_and_tensorboard_together_under_ddp(tmp_path):
    run_ok(torchrun(2, "02_torchrun.py", "--train-samples", "512", "--val-samples", "64", "--epochs", "1",
                    "--amp", "--grad-accum", "2", "--compile", "--tensorboard", tmp_path / "tb",
                    "--metrics", tmp_path / "metrics.jsonl"), timeout=300)
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 1, "one line per epoch, from rank 0 only"
    assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 1, "one TensorBoard writer: rank 0"


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or shutil.which("taskset") is None, reason="needs taskset")
def test_processes_share_the_cores_they_may_use_not_the_machines():
    """Slurm (--cpus-per-task) and containers restrict a job to some cores; os.cpu_count() would still count
    them all. Pinned to one core, the process takes one thread, not one per core of the machine."""
    env = {key: value for key, value in clean_env().items() if key != "OMP_NUM_THREADS"}
    output = run_ok(["taskset", "-c", "0", PYTHON, "01_mp_spawn.py", "--nproc", "1", "--train-samples", "64",
                     "--val-samples", "16", "--epochs", "1"], env=env).stdout
    assert "1 CPU threads per process" in output
