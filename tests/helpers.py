"""What the tests share: paths, the numbered scripts as modules, and subprocesses that cannot hang."""
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

import pytest

try:
    import psutil
except ImportError:  # the GPU check runs on a machine's own Python, which may lack it (tools/gpu_check.py)
    psutil = None

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))  # the real launcher, from the same environment
SCRIPTS = sorted(path.name for path in REPO.glob("[0-9][0-9]_*.py"))

# Small enough to finish in seconds on 2 cores, big enough that accuracy clearly beats chance (10 %).
# 501 validation samples: an odd number, so the shards of 2 processes differ in size.
TINY = ["--train-samples", "2048", "--val-samples", "501", "--epochs", "2", "--batch-size", "32"]

# Launcher variables that must not leak from a test runner that was itself started by torchrun or Slurm.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                      "MASTER_PORT", "TORCHELASTIC_RUN_ID")


@cache
def load_script(name):
    """A numbered script as a module (its `if __name__ == "__main__"` part does not run)."""
    spec = importlib.util.spec_from_file_location(Path(name).stem, REPO / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def clean_env(**extra):
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    env.update({key: str(value) for key, value in extra.items()})
    return env


def nodes_env(**extra):
    """The environment of each "node" of a multi-node test. The nodes share this 2-core machine, and with one
    process per node the scripts would give each process every core (torchrun sets OMP_NUM_THREADS=1 only when
    a node has several): 4 threads on 2 cores, several times slower. One thread each, as the notebooks do."""
    return clean_env(OMP_NUM_THREADS=1, **extra)


def start(command, env=None, cwd=REPO, output=subprocess.PIPE):
    """Starts a command in a session of its own, output (stdout and stderr together) captured as text, or
    written to the open file `output` (for long runs: nobody reads a pipe while they run, and a full pipe
    would block them)."""
    return subprocess.Popen([str(part) for part in command], cwd=cwd, env=env or clean_env(), text=True,
                            stdout=output, stderr=subprocess.STDOUT, start_new_session=True)


def finish(process, timeout=180, log=None):
    """Waits for a started command, or kills it and everything it started at `timeout`: a hang fails the
    test with the output so far (from its pipe, or from `log`, the file it writes to), and leaves no process
    behind."""
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        where = stacks(process.pid)
        kill_tree(process.pid)
        output, _ = process.communicate()
        if log is not None:
            output = Path(log).read_text(errors="replace")
        output = (output or "")[-3000:]
        raise AssertionError(f"timed out after {timeout} s: {process.args}\n{output}\n{where}") from None
    return subprocess.CompletedProcess(process.args, process.returncode, output, None)


def run(command, timeout=180, env=None, cwd=REPO):
    return finish(start(command, env, cwd), timeout)


def stacks(pid):
    """Where each process of a hung command is, for its test's failure: every thread's stack, Python and native,
    in the process and its descendants, from py-spy (in every venv's lock) where this user may read them."""
    spy = Path(sys.executable).with_name("py-spy")
    if not spy.exists():
        return f"(no py-spy beside {sys.executable}: no stacks)"
    dumps = ["the stacks at the timeout (py-spy dump):"]
    for member in [pid, *descendants(pid)]:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            dump = subprocess.run([spy, "dump", "--native", "--pid", str(member)], capture_output=True, text=True,
                                  timeout=30)  # --native: the C frames too (a hang inside fork() has no Python ones)
            command = Path(f"/proc/{member}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            dumps.append(f"{command[:160]}\n{dump.stdout or dump.stderr}")
    return "\n".join(dumps)[-20000:]


def descendants(pid):
    """A process's children, their children...: from psutil, or from /proc where the Python lacks psutil."""
    if psutil:
        with contextlib.suppress(psutil.NoSuchProcess):
            return [child.pid for child in psutil.Process(pid).children(recursive=True)]
        return []
    children = {}
    for entry in os.scandir("/proc"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parent = int(Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found, queue = [], list(children.get(pid, []))
    while queue:
        found.append(queue.pop(0))
        queue += children.get(found[-1], [])
    return found


def ignored_signals(pid):
    """The signals a process ignores (SIG_IGN: for the whole process, every thread), from the kernel's record of it
    (/proc/PID/status, Linux; signal n is bit n - 1); an empty set once the process has ended."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return set()
    mask = int(next(line for line in status.splitlines() if line.startswith("SigIgn:")).split()[1], 16)
    return {number for number in signal.Signals if mask >> (number - 1) & 1}


def kill_tree(pid):
    """SIGKILL to a process and all its descendants: torchrun puts its workers in sessions of their own. The
    process first, so that a launcher cannot start new workers once its present ones are gone."""
    for member in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


def run_ok(command, timeout=180, env=None):
    result = run(command, timeout, env)
    assert result.returncode == 0, f"exit {result.returncode}: {command}\n{result.stdout[-3000:]}"
    return result


def torchrun(nproc, script, *args):
    return [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", script, *args]


def read_metrics(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_group(worker, world_size, *args, timeout=120, collective_timeout=60):
    """Runs `worker(rank, world_size, *args)` in `world_size` new processes that form a real gloo group
    (see group_worker), and returns what each rank returned, in rank order."""
    import torch

    port, results_dir = free_port(), Path(os.environ.get("TMPDIR", "/tmp")) / f"ddp-steps-group-{os.getpid()}"
    results_dir.mkdir(exist_ok=True)
    context = start_group(world_size, port, str(results_dir), worker, args, collective_timeout)
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise AssertionError(f"process group did not finish within {timeout} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    results = [torch.load(results_dir / f"{rank}.pt", weights_only=False) for rank in range(world_size)]
    for rank in range(world_size):
        (results_dir / f"{rank}.pt").unlink()
    results_dir.rmdir()
    return results


# Modules most group processes need, imported once by the fork server (an optimizer's constructor, DDP's and
# FSDP2's import torch._dynamo: over a second of CPU per process, were each a fresh interpreter).
FORK_SERVER_PRELOAD = ["torch", "torch._dynamo"]


def start_group(world_size, port, results_dir, worker, args, collective_timeout):
    """Starts `world_size` processes that each run group_worker(rank, ...), without waiting for them (a
    torch.multiprocessing ProcessContext). They are forked from a fork server that imported torch once
    (start method "forkserver": a fresh interpreter per rank, as "spawn" gives, spends seconds importing it),
    and each takes this process's environment, working folder and sys.path as they are now, as a spawned one
    would (a forked one has the server's, from when it started)."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(FORK_SERVER_PRELOAD)  # used when this process first starts its server
    caller = (dict(os.environ), os.getcwd(), list(sys.path), worker.__module__, worker.__qualname__)
    return mp.start_processes(forked_group_worker, nprocs=world_size, join=False, start_method="forkserver",
                              args=(caller, world_size, port, results_dir, args, collective_timeout))


def forked_group_worker(rank, caller, world_size, port, results_dir, args, collective_timeout):
    import torch.distributed as dist

    environment, folder, path, module, name = caller
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(folder)
    sys.path[:] = path
    dist.set_debug_level_from_env()  # torch read TORCH_DISTRIBUTED_DEBUG when the server imported it
    worker = importlib.import_module(module)  # by name, now that sys.path is the caller's
    for part in name.split("."):
        worker = getattr(worker, part)
    group_worker(rank, world_size, port, results_dir, worker, args, collective_timeout)


def group_worker(rank, world_size, port, results_dir, worker, args, collective_timeout):
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=collective_timeout))
    torch.save(worker(rank, world_size, *args), Path(results_dir) / f"{rank}.pt")
    # The ranks leave together, once each has returned (its file exists): a rank that left at once would end a
    # peer's wait in a collective it skipped with "Connection closed by peer", before the peer's own timeout, so
    # a lesson would have to keep it busy for longer than the timeout to show that timeout.
    deadline = time.monotonic() + collective_timeout + 60
    while time.monotonic() < deadline and not all((Path(results_dir) / f"{peer}.pt").exists()
                                                  for peer in range(world_size)):
        time.sleep(0.02)
    # Then at once, without tearing the group down: some tests break it on purpose, and gloo's teardown
    # while a peer is already gone can abort ("terminate called without an active exception").
    os._exit(0)


# --- separate hosts: network namespaces joined by veth pairs -------------------------------------------------

HOSTS = {"nodeA": "10.200.0.1", "nodeB": "10.200.0.2"}  # addresses that exist only inside the namespaces
DATA_LINK = {"nodeA": "10.201.0.1", "nodeB": "10.201.0.2"}  # a second network, as a cluster's fast fabric


def in_host(name, command, prefix="ddp"):
    """`command` on host `name`: inside its network namespace, in a UTS namespace with its own hostname."""
    return ["ip", "netns", "exec", f"{prefix}-{name}", "unshare", "--uts", "sh", "-c",
            f'hostname {name} && exec "$@"', "sh", *map(str, command)]


def on_host(name, *command, prefix="ddp"):
    """Runs a short command (ip, cat) in host `name`'s network namespace and returns its output."""
    result = subprocess.run(["ip", "netns", "exec", f"{prefix}-{name}", *command], check=True, capture_output=True,
                            text=True, timeout=30)
    return result.stdout


def sh(*command):
    subprocess.run(command, check=True, capture_output=True, timeout=30)


def hosts_file(name, self_on_loopback):
    """The /etc/hosts host `name` sees. On a host in `self_on_loopback` its own name maps to 127.0.1.1, as
    Debian's installer writes it, instead of the address the other host knows it by."""
    lines = ["127.0.0.1 localhost"]
    for host, address in HOSTS.items():
        lines.append(f"127.0.1.1 {host}" if host == name and name in self_on_loopback else f"{address} {host}")
    return "\n".join(lines) + "\n"


SYSTEM_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])  # where Debian puts ip and tc


def missing_tools(*tools):
    """The tools of `tools` that are not installed: looked for in /usr/sbin and /sbin too, which an ordinary
    user's PATH leaves out."""
    return [tool for tool in tools if shutil.which(tool, path=SYSTEM_PATH) is None]


def hosts_unavailable(prefix="ddp"):
    """Why network-namespace hosts cannot be made here (no root, no iproute2), or None if they can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    missing = missing_tools("ip", "unshare", "hostname")
    if missing:
        return f"needs {', '.join(missing)} (iproute2, util-linux)"
    try:
        sh("ip", "netns", "add", f"{prefix}-probe")
        sh("ip", "netns", "del", f"{prefix}-probe")
    except (subprocess.CalledProcessError, PermissionError) as error:
        return f"cannot create network namespaces (needs root): {error}"
    return None


@contextlib.contextmanager
def separate_hosts(self_on_loopback=(), data_link=False, prefix="ddp"):
    """Two hosts, nodeA and nodeB, joined by a veth pair (and by a second one, `data-nodeA`/`data-nodeB`, with
    `data_link`), each resolving names through the hosts file that `ip netns exec` puts over /etc/hosts.
    Their namespaces are PREFIX-nodeA and PREFIX-nodeB (the benchmarks use another prefix than the tests, so
    both can run at once). Skips without root or iproute2. Everything made here is removed again, even on
    failure: deleting a namespace deletes its ends of the veth pairs, and so the pairs."""
    problem = hosts_unavailable(prefix)
    if problem:
        pytest.skip(f"{problem}: sudo -E make test-root runs these" if "root" in problem else problem)
    made = []
    try:
        for name in HOSTS:
            sh("ip", "netns", "add", f"{prefix}-{name}")
            made.append(name)
            hosts = Path(f"/etc/netns/{prefix}-{name}/hosts")
            hosts.parent.mkdir(parents=True, exist_ok=True)
            hosts.write_text(hosts_file(name, self_on_loopback))
            on_host(name, "ip", "link", "set", "lo", "up", prefix=prefix)
        for link, addresses in [("veth", HOSTS), *([("data", DATA_LINK)] if data_link else [])]:
            sh("ip", "link", "add", f"{link}-nodeA", "netns", f"{prefix}-nodeA", "type", "veth", "peer", "name",
               f"{link}-nodeB", "netns", f"{prefix}-nodeB")
            for name, address in addresses.items():
                on_host(name, "ip", "addr", "add", f"{address}/24", "dev", f"{link}-{name}", prefix=prefix)
                on_host(name, "ip", "link", "set", f"{link}-{name}", "up", prefix=prefix)
        yield list(HOSTS)
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", f"{prefix}-{name}"], capture_output=True, timeout=30)
            shutil.rmtree(f"/etc/netns/{prefix}-{name}", ignore_errors=True)
        with contextlib.suppress(OSError):
            Path("/etc/netns").rmdir()  # only if empty: it may hold other namespaces' files


# --- the local Slurm cluster (slurm/local_cluster.sh; the `cluster` fixture is in tests/conftest.py) ---------

SLURM = REPO / "slurm"
CLUSTER_DIR = "/tmp/ddp-steps-slurm-tests"


def slurm_env():
    """The jobs run the torch these tests run: when that is a venv's, the venv is active, as `source bin/activate`
    would make it (an active venv goes to the job with the environment, and the sbatch files then leave the
    repository's .venv alone)."""
    if sys.prefix == sys.base_prefix:  # not a venv: the sbatch files use the repository's .venv, as for a user
        return clean_env(SLURM_CONF=f"{CLUSTER_DIR}/slurm.conf")
    return clean_env(SLURM_CONF=f"{CLUSTER_DIR}/slurm.conf", VIRTUAL_ENV=sys.prefix,
                     PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', os.defpath)}")


def submit(name, *args, wait=True, options=()):
    """sbatch slurm/NAME from the repository root, as the README says; returns (result, job id, its log)."""
    command = ["sbatch", "--parsable", *(["--wait"] if wait else []), *options, f"slurm/{name}", *args]
    result = run(command, timeout=300, env=slurm_env())
    job = result.stdout.strip().splitlines()[0].split(";")[0]
    log = next(iter(SLURM.glob(f"logs/*-{job}.out")), None)
    return result, job, log


def read_log(log):
    text = log.read_text()
    log.unlink()
    return text
