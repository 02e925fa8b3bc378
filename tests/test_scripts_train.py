"""Each script's documented command runs end to end, really learns, and saves a usable checkpoint."""
import json

import pytest
import torch
from conftest import DOCUMENTED
from helpers import PYTHON, load_script, run_ok

pytestmark = pytest.mark.launch


@pytest.mark.parametrize("script", DOCUMENTED)
def test_documented_command_learns(trained, script):
    output, metrics, checkpoint = trained(script)
    assert [m["epoch"] for m in metrics] == [1, 2]
    assert metrics[-1]["world_size"] == (1 if script.startswith("00") else 2)
    assert metrics[-1]["train_loss"] < metrics[0]["train_loss"], "the training loss must go down"
    assert metrics[-1]["val_accuracy"] > 0.4, "well above chance (10 classes: 10 %)"
    assert all(m["samples_per_s"] > 0 for m in metrics)
    assert "epoch 2/2" in output and "val acc" in output
    assert checkpoint.is_file()


@pytest.mark.parametrize("script", ["01_mp_spawn.py", "02_torchrun.py"])
def test_distributed_checkpoint_loads_into_a_plain_model(trained, script):
    """Saved from model.module: no "module." prefix, loads strictly into a model that never saw DDP."""
    checkpoint = torch.load(trained(script)[2], weights_only=True)
    assert not any(key.startswith("module.") for key in checkpoint["model"])
    model = load_script("00_single_gpu.py").build_model(checkpoint["model_name"], checkpoint["num_classes"])
    model.load_state_dict(checkpoint["model"], strict=True)


def test_all_reduced_validation_equals_single_process_evaluation(trained):
    """02's validation accuracy, computed on 2 processes over 501 samples (shards of 251 and 250) and summed
    with all_reduce, equals 00 --evaluate of the same weights in one process: no sample counted twice."""
    _, metrics, checkpoint = trained("02_torchrun.py")
    output = run_ok([PYTHON, "00_single_gpu.py", "--evaluate", checkpoint]).stdout
    evaluation = json.loads(output.strip().splitlines()[-1])
    assert evaluation["val_accuracy"] == metrics[-1]["val_accuracy"]
    assert evaluation["val_loss"] == pytest.approx(metrics[-1]["val_loss"], rel=1e-5)
