"""Running the repository's scripts for real from a notebook: commands started from the repository root with
their output in a log, logs followed as they are written (with arrival times, to draw a run against the clock),
bounded waits that kill stragglers, metrics files, and Processes: a few long-lived processes that form a gloo
group on demand. Everything prints no absolute path or host name, so committed outputs say nothing about the
machine that made them."""
import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# No GPU for the lectures, whatever the attendee exported: they teach the CPU path (gloo), as measured, and on a
# laptop with one NVIDIA GPU the scripts would pick CUDA, and their 2 processes would need 2 GPUs. Set in the
# kernel that imports this module, so that every process a lecture starts inherits it (start and run, Processes,
# run_group, torchrun's workers).
os.environ["CUDA_VISIBLE_DEVICES"] = ""
# The tests' own helpers, written once: a process tree killer, a free port, a script loaded as a module, gloo
# groups started in fresh processes.
sys.path.insert(0, str(REPO / "tests"))
from helpers import free_port, kill_tree, load_script, run_group  # noqa: E402, F401


def workdir():
    """A scratch folder for metrics and snapshots (its path is never printed), deleted when the kernel exits."""
    folder = Path(tempfile.mkdtemp(prefix="ddp-steps-notebook-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def environment(**extra):
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    return {**env, **{key: str(value) for key, value in extra.items()}}


def start(command, log, **env):
    """Starts a command from the repository root, its output going to the file `log`."""
    with open(log, "w") as out:
        return subprocess.Popen([TORCHRUN if part == "torchrun" else sys.executable if part == "python" else
                                 str(part) for part in command], cwd=REPO, env=environment(**env),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def run(command, timeout=600, **env):
    """Runs a command to its end and returns its output (torchrun's own warnings left out)."""
    log = workdir() / "output.log"
    process = start(command, log, **env)
    try:
        process.wait(timeout)
    finally:
        process.kill()
    output = "\n".join(line for line in log.read_text().splitlines() if not line.startswith(("W1", "I1")))
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, command))} exited {process.returncode}:\n{output[-2000:]}")
    return output


def scrub(text):
    """Output as it may be shown: no temporary paths, no host names."""
    text = re.sub(r"/\S*ddp-steps-notebook-\w+/", "", text)
    return re.sub(r"\[[\w.-]+\] ", "", text)


def read_metrics(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def wait_for(condition, timeout=120):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("gave up waiting")
        time.sleep(0.05)



class Processes:
    """`size` processes started once, that wait for work: run(worker, *args) makes them a gloo process group,
    calls worker(rank, size, *args) in each, as mp.spawn calls main, and returns what each rank returned, in
    rank order. Starting a process costs seconds (each imports torch); forming a group in running ones, a
    fraction of one. A worker must live in an importable module (lessons.ddp_concepts, say): a fresh process
    imports it."""

    def __init__(self, size=2):
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")  # fresh interpreters, started the way mp.spawn starts them
        self.size, self.results, self.jobs = size, context.Queue(), [context.Queue() for _ in range(size)]
        self.all_done = context.Barrier(size)  # the ranks leave each group together (serve)
        self.processes = [context.Process(target=serve, args=(rank, size, jobs, self.results, self.all_done),
                                          daemon=True)
                          for rank, jobs in enumerate(self.jobs)]
        for process in self.processes:
            process.start()

    def run(self, worker, *args, collective_timeout=60, form_group=True, timeout=300):
        """form_group=False: the worker forms the group itself (01's main does) from MASTER_ADDR:MASTER_PORT."""
        import queue

        port, results, deadline = free_port(), {}, time.monotonic() + timeout
        for jobs in self.jobs:
            jobs.put((worker, args, port, collective_timeout, form_group))
        while len(results) < self.size:
            dead = [rank for rank, process in enumerate(self.processes) if not process.is_alive()]
            if dead or time.monotonic() > deadline:  # an error, never a hang
                self.close()
                raise RuntimeError(f"ranks {dead} died" if dead else f"{worker.__name__} ran past {timeout} s")
            try:
                rank, failed, result = self.results.get(timeout=0.5)
            except queue.Empty:
                continue
            results[rank] = (failed, result)
        for rank, (failed, result) in results.items():  # every rank has answered: the next job starts clean
            if failed:
                raise RuntimeError(f"{worker.__name__} failed on rank {rank}:\n{result}")
        return [results[rank][1] for rank in range(self.size)]

    def close(self):
        for jobs in self.jobs:
            jobs.put(None)
        for process in self.processes:
            process.join(1)
            process.kill()  # a process still tearing PyTorch down after a second: nothing of it is needed


def serve(rank, size, jobs, results, all_done):
    """What each process of Processes does until it is told to stop: wait for a job; join a process group with
    the others, as 01's main does (gloo, MASTER_ADDR:MASTER_PORT, its rank, the world size); run the job; send
    back what it returned; once every rank has done so, leave the group."""
    import contextlib
    import queue
    import threading
    import traceback
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # two processes share this machine's cores
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the scripts' logs: the notebook reads their metrics files
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    parent = os.getppid()
    while True:
        try:
            job = jobs.get(timeout=1)
        except queue.Empty:
            if os.getppid() != parent:  # the notebook's kernel is gone: no orphan stays behind
                return
            continue
        if job is None:
            return
        worker, args, port, collective_timeout, form_group = job
        os.environ["MASTER_PORT"] = str(port)
        try:
            if form_group:
                dist.init_process_group("gloo", rank=rank, world_size=size,
                                        timeout=timedelta(seconds=collective_timeout))
            results.put((rank, False, worker(rank, size, *args)))
        except (Exception, SystemExit):  # SystemExit: argparse refusing a script's flags
            results.put((rank, True, traceback.format_exc()))
        finally:
            # A rank that left at once would end a peer's wait in a collective it skipped with "Connection closed
            # by peer", before the peer's own timeout: a lesson could show that timeout only by keeping the rank
            # busy for longer. A rank still busy after the bound: the others leave without it.
            with contextlib.suppress(threading.BrokenBarrierError):
                all_done.wait(timeout=collective_timeout + 60)
            if dist.is_initialized():
                dist.destroy_process_group()


def script_main(rank, world_size, script, *argv):
    """What 01's mp.spawn runs in each process: the script's own main(rank, world_size, args), which forms the
    process group itself. For 00, its main(args), in rank 0 alone: one process."""
    module = load_script(script)
    args = module.parse_args([str(part) for part in argv])
    if script == "00_single_gpu.py":
        if rank == 0:
            module.main(args)
    else:
        module.main(rank, world_size, args)



def wait_all(processes, began, timeout):
    """Waits for processes started at `began` (time.monotonic()); returns {process: (exit status, seconds after
    `began` when it ended)}. One still running `timeout` seconds after `began` is killed with all it started,
    and its status is None."""
    ended = {}
    while len(ended) < len(processes) and time.monotonic() - began < timeout:
        ended.update({process: (process.returncode, time.monotonic() - began) for process in processes
                      if process not in ended and process.poll() is not None})
        time.sleep(0.1)
    for process in set(processes) - set(ended):
        kill_tree(process.pid)
        process.wait()
        ended[process] = None, time.monotonic() - began
    return ended


def lines_with(output, *words):
    """The lines of `output` that contain any of `words`, scrubbed, each once: what to read in a long log."""
    found = [re.sub(r"^[IWE]\d{4} [\d:.]+ \d+ \S+\] ", "torchrun: ", line.strip())  # its log prefix
             for line in scrub(output).replace(f"{REPO}/", "").splitlines() if any(word in line for word in words)]
    return "\n".join(dict.fromkeys(found))


class Follow:
    """Reads a log as it is written, and notes when each line arrived (seconds since the Follow began), so
    that a run can be drawn against the wall clock (`began`: the clock of an earlier Follow, to draw one run
    after another). `marks` holds moments the notebook adds (a kill, say)."""

    def __init__(self, log, began=None):
        import threading

        self.log, self.began, self.lines, self.marks = Path(log), began or time.monotonic(), [], {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def now(self):
        return time.monotonic() - self.began

    def _read(self):
        position, partial = 0, ""
        while True:
            stopping = self._stop.is_set()  # one last read after the stop, so no line is missed
            if self.log.exists():
                with open(self.log) as f:
                    f.seek(position)
                    chunk = f.read()
                    position = f.tell()
                *complete, partial = (partial + chunk).split("\n")
                self.lines += [(self.now(), line) for line in complete]
            if stopping:
                return
            time.sleep(0.02)

    def matches(self, pattern):
        """(arrival, match) of every line so far that matches `pattern`."""
        return [(at, found) for at, line in list(self.lines) if (found := re.search(pattern, line))]

    def wait_for(self, pattern, count=1, timeout=120):
        """Waits until `count` lines match `pattern`; returns the last of them (a re.Match)."""
        deadline = time.monotonic() + timeout
        while len(found := self.matches(pattern)) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {count} lines matching {pattern!r} within {timeout} s")
            time.sleep(0.02)
        return found[count - 1][1]

    def stop(self):
        self._stop.set()
        self._thread.join()
        return self


