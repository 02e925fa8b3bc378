"""make check-setup: is this machine ready for the exercises? One line per check, and for a failed one what to do.
It starts with the Python that would make the venv (standard library only), then uses the venv's Python.

    make check-setup            # or: python3 exercises/check_setup.py
"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV_PYTHON = REPO / ".venv" / "bin" / "python"
# Run by the venv's Python in 2 processes: a real gloo group on the CPU and one all-reduce, as every exercise's
# check forms; each process sums its rank + 1, so 2 processes must both print 3.
ALL_REDUCE = """
import time
began = time.perf_counter()
import os, sys, datetime
import torch, torch.distributed as dist
import_seconds = time.perf_counter() - began
import torch.multiprocessing as mp

def worker(rank, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    value = torch.tensor([rank + 1.0])
    dist.all_reduce(value)
    print(f"rank {rank}: {value.item():g}", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port,), nprocs=2)
    print("torch", torch.__version__, "cuda visible:", torch.cuda.is_available())
    print(f"import seconds {import_seconds:.1f}")
"""


SLOW_IMPORT = 6  # seconds: about 2-4 on this project's 2-core machines when idle, 13 when heavily loaded


def line(ok, text, fix="", bad="FAIL"):
    print(f"{'OK  ' if ok else bad}  {text}")
    if not ok and fix:
        print("      what to do: " + fix.replace("\n", "\n      "))
    return ok


def run(script, env, timeout=90):
    try:
        result = subprocess.run([VENV_PYTHON, script], env=env, text=True, timeout=timeout,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        return result.stdout, result.returncode
    except subprocess.TimeoutExpired as error:  # a hang: say so, never wait on
        partial = error.stdout or ""
        partial = partial.decode(errors="replace") if isinstance(partial, bytes) else partial
        return partial + f"\n(stopped after {timeout} s)", "timeout"


def main():
    version = sys.version_info[:2]
    ok = line((3, 11) <= version <= (3, 13), f"Python {version[0]}.{version[1]} ({sys.executable})",
              "the course needs Python 3.11 (tested) to 3.13: install one, then make setup PYTHON=python3.11")
    if not line(VENV_PYTHON.exists() and (REPO / ".venv" / ".installed").exists(), "the venv .venv, installed",
                "run make setup (about 3 GB to download: on a slow network, pair up with a neighbour meanwhile)"):
        return 1
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                                              "MASTER_PORT", "LOCAL_RANK")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")  # as the checks run: on the CPU, one thread each
    with tempfile.TemporaryDirectory() as folder:  # a file, not -c: mp.spawn's children re-import the main module
        script = Path(folder) / "all_reduce.py"
        script.write_text(ALL_REDUCE)
        output, returncode = run(script, env)
    reduced = returncode == 0 and sorted(text for text in output.splitlines() if text.startswith("rank ")) == [
        "rank 0: 3", "rank 1: 3"]
    ok &= line(reduced, "2 processes formed a gloo group on the CPU and all-reduced (1 + 2 = 3 on both)",
               "the last lines of its output are below; a firewall or VPN can block 127.0.0.1 ports: try without "
               "the VPN; otherwise pair up and read the committed notebooks (docs/workshop.md)\n"
               + "\n".join(output.strip().splitlines()[-8:]))
    versions = [text for text in output.splitlines() if text.startswith("torch ")]
    if versions:
        line(True, f"{versions[0].split(' cuda')[0]}; the checks hide any GPU (they run on the CPU with gloo)")
    imports = [float(text.split()[-1]) for text in output.splitlines() if text.startswith("import seconds ")]
    if imports:  # the checks' deadlines assume a few seconds per process start (most of it this import)
        fast = imports[0] <= SLOW_IMPORT
        line(fast, f"importing torch took {imports[0]:.1f} s" + ("" if fast else f", over {SLOW_IMPORT} s"),
             "this machine is slow or busy: close what else runs, and give the checks more time with SLOWER=2 "
             "(make check EX=NAME SLOWER=2); a correct run can otherwise outlast a check's deadline", bad="SLOW")
    print("Ready: make check lists the exercises." if ok else "Not ready: fix each FAIL above, then run this again.")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
