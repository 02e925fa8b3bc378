import os
import shutil

import pytest
from helpers import CLUSTER_DIR, PYTHON, SLURM, TINY, clean_env, read_metrics, run, run_ok, separate_hosts, torchrun

# Each script's documented command (the README's ladder table), which the tests run with TINY settings.
DOCUMENTED = {
    "00_single_gpu.py": [PYTHON, "00_single_gpu.py"],
    "01_mp_spawn.py": [PYTHON, "01_mp_spawn.py", "--nproc", "2"],
    "02_torchrun.py": torchrun(2, "02_torchrun.py"),
}


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """trained(script) runs that script's documented command once per session, with a checkpoint and a
    metrics file, and returns (output, metrics, checkpoint path); several claims are checked on one run."""
    runs = {}

    def train(script):
        if script not in runs:
            folder = tmp_path_factory.mktemp(script.removesuffix(".py"))
            command = [*DOCUMENTED[script], *TINY, "--metrics", folder / "metrics.jsonl",
                       "--checkpoint", folder / "checkpoint.pt"]
            output = run_ok(command).stdout
            runs[script] = output, read_metrics(folder / "metrics.jsonl"), folder / "checkpoint.pt"
        return runs[script]

    return train


@pytest.fixture
def two_hosts():
    """Two hosts, nodeA and nodeB, in network namespaces joined by a veth pair (helpers.separate_hosts)."""
    with separate_hosts() as hosts:
        yield hosts


@pytest.fixture(scope="session")
def cluster():
    """The real local Slurm cluster (slurm/local_cluster.sh), started by the first test that needs it and
    stopped at the end of the session, even if a test fails."""
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root")
    missing = [tool for tool in ("slurmctld", "slurmd", "sbatch", "unshare") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)}): sudo slurm/local_cluster.sh install")
    env = clean_env(DDP_STEPS_SLURM_DIR=CLUSTER_DIR)
    result = run([SLURM / "local_cluster.sh", "up"], timeout=120, env=env)
    try:
        assert result.returncode == 0, result.stdout
        yield
    finally:
        run([SLURM / "local_cluster.sh", "down"], timeout=120, env=env)


# In CI these must run: a skip there (no root, no Slurm) would turn a missing capability into a green run.
REQUIRED_IN_CI = {"multihost", "slurm"}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") and report.skipped and REQUIRED_IN_CI & {mark.name for mark in item.iter_markers()}:
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, where this test must run: {report.longrepr}"
