import collections
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

# OpenMP's idle threads sleep instead of spinning while they wait, in this process and every one a test starts:
# under `make test` both cores are busy, and a spinning thread takes a core from another test's processes (a
# 2-thread run of 00 beside one busy loop: 40 to 43 % less CPU, 21 to 25 % less time; docs/tests.md). Only the
# scheduling of waiting threads changes, not what they compute.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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


# The markers of the tests that start processes (or need a GPU); every other test gets `quick`: `make test-quick`
STARTS_PROCESSES = ("launch", "multiproc", "multihost", "faults", "slurm", "notebooks", "exercises", "gpu")


def pytest_collection_modifyitems(items):
    for item in items:
        if ROOT_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.root)
        if item.get_closest_marker("root") and unit_of(item.nodeid) != "root":
            raise pytest.UsageError(f"{item.nodeid} needs root: add its file to ROOT_FILES in tests/conftest.py")
        if not any(item.get_closest_marker(name) for name in STARTS_PROCESSES):
            item.add_marker(pytest.mark.quick)
    # Under `make test` and `make test-lessons` (which keep this order: --no-loadscope-reorder) the units are dealt
    # out in this order, each to the first process that is free: the longest first, so that the last ones are short
    # and both processes finish together; the quick tests last.
    cost = collections.Counter()
    for item in items:
        marked = [seconds for name, seconds in SECONDS.items() if item.get_closest_marker(name)]
        cost[unit_of(item.nodeid)] += max(marked, default=0)
    items.sort(key=lambda item: (item.get_closest_marker("quick") is not None, -cost[unit_of(item.nodeid)]))


# About how long a test of each kind takes under `make test`, in seconds (docs/ci.md has the measured figures): enough
# to deal out the longest units first. A test with several of these markers counts as its slowest.
SECONDS = {"notebooks": 50, "exercises": 20, "multihost": 15, "faults": 8, "launch": 5, "multiproc": 2}


# `make test` runs the tests in 2 processes (pytest-xdist), in units: a unit runs in one process, in order. Each
# test file is a unit, so that a fixture serving a whole file runs once; each notebook is one, so that the
# notebooks share both processes; and the files with root tests are one unit together, as they share one Slurm
# cluster and the fixed names of the network-namespace hosts. (Marks and `--dist loadgroup` would say this, but
# under pytest 9.2 that groups nothing: pytest-dev/pytest-xdist#1386.)
ROOT_FILES = {"test_multinode.py", "test_preflight.py", "test_slurm.py"}
ROOT_TESTS = {"tests/test_notebooks.py::test_notebook_runs_from_a_clean_kernel[making_ddp_fast]"}
SPREAD_FILES = {"test_notebooks.py"}


def unit_of(nodeid):
    file = nodeid.split("::")[0].rsplit("/", 1)[-1]
    if file in ROOT_FILES or nodeid in ROOT_TESTS:
        return "root"
    return nodeid if file in SPREAD_FILES else file


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: called only under `pytest -n N`
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") not in ("load", "loadscope", "loadfile"):
        return None  # another --dist asked for by name: xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return unit_of(nodeid)

    return ByUnit(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI, as root, a root test must run: a skip there (no Slurm installed, say) would turn a missing
    capability into a green run. As an ordinary user (CI's laptop run) they skip, and say why."""
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") and os.geteuid() == 0 and report.skipped and item.get_closest_marker("root"):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI as root, where this test must run: {report.longrepr}"
