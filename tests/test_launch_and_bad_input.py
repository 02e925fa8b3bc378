"""Every script under every launcher a workshop uses: torchrun with one process runs 00 and 01 as plain python;
bad input and the wrong launcher give a clear one-line error and a non-zero exit within seconds (never a hang,
a silent no-op, or a wall of traceback), and so does an environment variable a script reads that is missing or
malformed. tests/test_refused_input.py holds the full table of refused input."""
import ast
import runpy
import sys

import pytest
from helpers import PYTHON, REPO, SCRIPTS, clean_env, run, torchrun

pytestmark = pytest.mark.launch

# One case per way a script refuses (argparse, its input checks, --evaluate, the launcher checks): every refused
# input of every script is in tests/test_refused_input.py's table, checked in-process; here, that the command line
# shows it in one line with a non-zero exit. (02 without torchrun: PARTIAL below, the same line of 02.)
CASES = {
    "missing data path": ([PYTHON, "00_single_gpu.py", "--data", "/no/such/dir"], "/no/such/dir: no train/ folder"),
    "missing checkpoint": ([PYTHON, "00_single_gpu.py", "--evaluate", "nope.pt"], "--evaluate nope.pt: no such file"),
    "zero processes": ([PYTHON, "01_mp_spawn.py", "--nproc", "0"], "--nproc 0: need at least 1 process"),
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
    """Workshops launch everything with torchrun: with one process, 00 and 01 just run. (01 with --nproc 1, after
    `--`: without it torchrun stops at --nproc, an ambiguous abbreviation of its own options (troubleshooting).)"""
    smallest = ["--", "--nproc", "1"] if script == "01_mp_spawn.py" else []
    result = run(torchrun(1, script, *smallest, "--train-samples", "256", "--val-samples", "64", "--epochs", "1",
                          "--metrics", tmp_path / "m.jsonl"), timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "epoch 1/1" in result.stdout
    assert (tmp_path / "m.jsonl").read_text().count('"world_size": ') == 1


# --- the environment: every variable a script reads is checked before any work --------------------------------

# torchrun's variables for rank 0 of 2 on one node: each case below breaks one of them
TORCHRUN_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "GROUP_WORLD_SIZE": "1",
                "TORCHELASTIC_RESTART_COUNT": "0"}
# read, but needing no check: test hooks (tests/test_troubleshooting.py makes one fail on purpose, inside main),
# a flag compared as text, a name only printed, an address any text may be
UNCHECKED = {"DATA_PREPARE_DELAY", "SNAPSHOT_WRITE_DELAY", "TORCHELASTIC_USE_AGENT_STORE", "GROUP_RANK", "MASTER_ADDR"}


def environment_checked(script):
    """The `required` and `numbers` a script passes to environment_problem, read from its source."""
    call = next(node for node in ast.walk(ast.parse((REPO / script).read_text())) if isinstance(node, ast.Call)
                and getattr(node.func, "id", "") == "environment_problem")
    return {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords}


def environment_read(script):
    """Every name a script reads with os.environ[...] or os.environ.get(...)."""
    names = set()
    for node in ast.walk(ast.parse((REPO / script).read_text())):
        is_read = isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
        if is_read and ast.unparse(node.value) == "os.environ":
            names.add(ast.literal_eval(node.slice)) if isinstance(node.slice, ast.Constant) else None
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "os.environ.get":
            names.add(ast.literal_eval(node.args[0])) if isinstance(node.args[0], ast.Constant) else None
    return names


def refusal(script, monkeypatch, environment):
    """What the script's own start (its __main__ block) says, in this process, with exactly `environment`."""
    for name in set(TORCHRUN_ENV) | {"OMP_NUM_THREADS"}:
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", [script])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(REPO / script), run_name="__main__")
    return str(stop.value.code)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_environment_variable_a_script_reads_is_checked(script):
    checked = environment_checked(script)
    assert environment_read(script) - UNCHECKED <= set(checked["required"]) | set(checked["numbers"])


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_missing_or_malformed_launcher_variable_is_named_in_one_line(script, monkeypatch):
    """In-process, through the script's own start: each required variable left out, each number made text."""
    checked = environment_checked(script)
    environment = {name: TORCHRUN_ENV[name] for name in checked["required"]}
    for name in checked["required"]:
        said = refusal(script, monkeypatch, {key: value for key, value in environment.items() if key != name})
        assert f"{name} is not set" in said and "\n" not in said
    for name in checked["numbers"]:
        said = refusal(script, monkeypatch, {**environment, name: "2,1"})
        assert f"{name}='2,1' is not a whole number" in said and "\n" not in said
    for rank, size in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        if {rank, size} <= set(checked["required"]):
            said = refusal(script, monkeypatch, {**environment, rank: "2"})
            assert said.endswith(f"({rank}=2 is not below {size}=2)")


PARTIAL = {  # as a user would meet them: a launcher's environment copied in part, a typo in a job script
    "02 with part of torchrun's environment": (
        [PYTHON, "02_torchrun.py"], {"RANK": "0", "WORLD_SIZE": "2"},
        "02_torchrun.py must be started by torchrun: torchrun --standalone --nproc_per_node=2 02_torchrun.py "
        "(LOCAL_RANK is not set, MASTER_ADDR is not set, MASTER_PORT is not set)"),
    "04 with a malformed MASTER_PORT": ([PYTHON, "04_fault_tolerant.py"], {**TORCHRUN_ENV, "MASTER_PORT": "29500/tcp"},
                                        "(MASTER_PORT='29500/tcp' is not a whole number)"),
    "00 with a malformed WORLD_SIZE": ([PYTHON, "00_single_gpu.py"], {"WORLD_SIZE": "two"},
                                       "error: WORLD_SIZE='two' is not a whole number; start this step as: python"),
}


@pytest.mark.parametrize("case", PARTIAL)
def test_a_partial_environment_is_refused_in_one_line(case):
    command, environment, message = PARTIAL[case]
    result = run(command, timeout=60, env=clean_env(**environment))
    assert result.returncode != 0
    assert message in result.stdout and "Traceback" not in result.stdout
    assert len(result.stdout.strip().splitlines()) == 1, result.stdout
