import os

import pytest
from helpers import (
    CLUSTER_DIR,
    PYTHON,
    SLURM,
    TINY,
    clean_env,
    missing_tools,
    read_metrics,
    run,
    run_ok,
    separate_hosts,
    torchrun,
)

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
        pytest.skip("needs root (the local Slurm cluster): sudo -E make test-root runs these")
    missing = missing_tools("slurmctld", "slurmd", "sbatch", "unshare")
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)}): sudo slurm/local_cluster.sh install")
    env = clean_env(DDP_STEPS_SLURM_DIR=CLUSTER_DIR)
    result = run([SLURM / "local_cluster.sh", "up"], timeout=120, env=env)
    try:
        assert result.returncode == 0, result.stdout
        yield
    finally:
        run([SLURM / "local_cluster.sh", "down"], timeout=120, env=env)


# Tests that need root (network namespaces, the local Slurm cluster) carry the `root` marker: those that use
# these fixtures get it here, the others say it themselves. `make test-root` runs just them.
ROOT_FIXTURES = {"two_hosts", "cluster"}


def pytest_collection_modifyitems(items):
    for item in items:
        if ROOT_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.root)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI, as root, a root test must run: a skip there (no Slurm installed, say) would turn a missing
    capability into a green run. As an ordinary user (CI's laptop run) they skip, and say why."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") and os.geteuid() == 0 and report.skipped and item.get_closest_marker("root"):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI as root, where this test must run: {report.longrepr}"
