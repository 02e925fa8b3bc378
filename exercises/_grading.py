"""What every exercise's check.py uses: the claims' verdict lines, and processes that cannot hang."""
import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

EXERCISES = Path(__file__).resolve().parent
REPO = EXERCISES.parent
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))  # the launcher of the same environment
# Launcher variables that must not leak in from a shell that was itself started by torchrun or Slurm.
# Every deadline is for a hang, set at about twice a check's run on a busy 2-core machine. On a slower or busier
# one (make check-setup says so when importing torch is slow) a correct run can outlast it: SLOWER=2 doubles them.
SLOWER = float(os.environ.get("SLOWER") or 1)
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                      "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def exercise_names():
    """The exercises in the course's order: their folders' names sort so (01_..., 02_..., then by lecture)."""
    return sorted(path.parent.name for path in EXERCISES.glob("*/check.py"))


class Grade:
    """Prints one line per claim as it is decided; a failed one says what was seen, what was expected, and where
    in the lecture to look."""

    def __init__(self, lecture):
        self.lecture, self.passed, self.failed = lecture, 0, 0

    @property
    def total(self):
        return self.passed + self.failed

    def claim(self, text, ok, observed="", expected="", see=""):
        ok = bool(ok)
        self.passed += ok
        self.failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}  {text}", flush=True)
        if not ok:
            for label, value in (("saw", observed), ("expected", expected), ("see", see)):
                for number, line in enumerate(str(value).strip().splitlines() if value else []):
                    print(f"      {label if number == 0 else '':<8}  {line}", flush=True)
        return ok

    def not_checked(self, texts, why):
        """Claims that depend on a run that failed: each one fails, saying so once."""
        for text in texts:
            self.claim(text, False, observed=f"not checked: {why}")


def load_learner(learner_file):
    """The learner's file as a module, for the parts the task gives (its model, its data): its main() does not
    run, for the file guards it with `if __name__ == "__main__"`."""
    spec = importlib.util.spec_from_file_location("learner", learner_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def environment(**extra):
    """The processes of a check: on the CPU (GPUs hidden: the exercises teach gloo on a laptop, and two processes
    on a one-GPU laptop would need two GPUs), one thread each (two processes share a laptop's cores), and no
    launcher variables from the shell."""
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update({key: str(value) for key, value in extra.items()})
    return env


class Result:
    def __init__(self, returncode, output, timed_out, seconds):
        self.returncode, self.output, self.timed_out, self.seconds = returncode, output, timed_out, seconds

    @property
    def ok(self):
        return self.returncode == 0 and not self.timed_out

    def tail(self, lines=12):
        """The last lines of the output, for a verdict: where a learner's run went wrong."""
        text = re.sub(r"\n{2,}", "\n", self.output.strip())
        return "\n".join(text.splitlines()[-lines:]) or "(no output)"

    def summary(self):
        if self.timed_out:
            return (f"still running after {self.seconds:.0f} s, stopped: a hang, or a machine too slow or busy for "
                    f"this deadline (if the last lines below show training going on, run the check again with "
                    f"SLOWER=2: make check EX=... SLOWER=2); its last lines:\n{self.tail()}")
        return f"exit status {self.returncode}; its last lines:\n{self.tail()}"


def start(command, cwd=None, **extra_env):
    """Starts a command in a session of its own, stdout and stderr together in a temporary file (a pipe nobody
    reads while it runs could fill and block it)."""
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by finish, after the process ends)
    process = subprocess.Popen([str(part) for part in command], cwd=cwd or REPO, env=environment(**extra_env),
                               stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    process.log, process.began = log, time.monotonic()
    return process


def finish(process, timeout):
    """Waits for a started command up to `timeout` seconds from its start; past it, kills it and every process
    below it (torchrun's workers run in sessions of their own, so a process group is not enough)."""
    timed_out = False
    try:
        process.wait(timeout=max(0.1, timeout * SLOWER - (time.monotonic() - process.began)))
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_tree(process.pid)
        process.wait()
    process.log.seek(0)
    output = process.log.read()
    process.log.close()
    return Result(process.returncode, output, timed_out, time.monotonic() - process.began)


def run(command, timeout, cwd=None, **extra_env):
    return finish(start(command, cwd=cwd, **extra_env), timeout)


def kill_tree(pid, sig=signal.SIGKILL):
    try:
        below = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        below = []
    for process in [*below, psutil.Process(pid) if psutil.pid_exists(pid) else None]:
        if process is not None:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(sig)


def torchrun(nproc, file, *args):
    """torchrun on one machine, a free port chosen by itself (--standalone)."""
    return [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", file, *args]


def python(file, *args):
    return [PYTHON, file, *args]
