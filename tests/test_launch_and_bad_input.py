"""Every script under every launcher a workshop uses: torchrun with one process runs 00 and 01 as plain python;
bad input and the wrong launcher give a clear one-line error and a non-zero exit within seconds (never a hang,
a silent no-op, or a wall of traceback). tests/test_refused_input.py holds the full table of refused input."""
import pytest
from helpers import PYTHON, run, torchrun

pytestmark = pytest.mark.launch

CASES = {
    "zero batch size": ([PYTHON, "00_single_gpu.py", "--batch-size", "0"], "--batch-size must be at least 1"),
    "negative epochs": ([PYTHON, "01_mp_spawn.py", "--epochs", "-1"], "--epochs must be at least 1"),
    "missing data path": ([PYTHON, "00_single_gpu.py", "--data", "/no/such/dir"], "/no/such/dir: no train/ folder"),
    "cifar10 not downloaded": ([PYTHON, "01_mp_spawn.py", "--data", "cifar10", "--data-dir", "/nonexistent"],
                               "--data cifar10: not found in /nonexistent/; add --download"),
    "missing checkpoint": ([PYTHON, "00_single_gpu.py", "--evaluate", "nope.pt"], "--evaluate nope.pt: no such file"),
    "zero processes": ([PYTHON, "01_mp_spawn.py", "--nproc", "0"], "--nproc 0: need at least 1 process"),
    "02 without torchrun": ([PYTHON, "02_torchrun.py"], "must be started by torchrun: torchrun --standalone"),
    "03 without torchrun": ([PYTHON, "03_multinode.py"], "started by torchrun on every node: torchrun --nnodes"),
    "00 under torchrun x2": (torchrun(2, "00_single_gpu.py"), "does not use torchrun's processes: with 2 of them"),
    "01 under torchrun x2": (torchrun(2, "01_mp_spawn.py"), "does not use torchrun's processes: with 2 of them"),
}


@pytest.mark.parametrize("case", CASES)
def test_clear_error(case):
    command, message = CASES[case]
    result = run(command, timeout=60)
    assert result.returncode != 0
    assert message in result.stdout
    script = next(part for part in command if part.endswith(".py"))
    assert f'{script}", line' not in result.stdout, "the script itself must not crash with a traceback"
    if command[0] == PYTHON:  # (torchrun adds a traceback of its own when a worker fails; that one stays)
        assert "Traceback" not in result.stdout


@pytest.mark.parametrize("script", ["00_single_gpu.py", "01_mp_spawn.py"])
def test_single_process_torchrun_runs_as_plain_python(script, tmp_path):
    """Workshops launch everything with torchrun: with one process, 00 and 01 just run."""
    result = run(torchrun(1, script, "--train-samples", "256", "--val-samples", "64", "--epochs", "1",
                          "--metrics", tmp_path / "m.jsonl"), timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "epoch 1/1" in result.stdout
    assert (tmp_path / "m.jsonl").read_text().count('"world_size": ') == 1
