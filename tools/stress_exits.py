"""Runs every multi-process script many times, stopping some of the runs by a signal, and counts the exits that are
not clean (issue 34: a rank that aborted at exit after a run that went well; before the cure, 1 of the port's 30
runs here: tools/stress_exits_before.md). Not a test: it takes about half an hour on 2 cores.

    .venv/bin/python tools/stress_exits.py                     # 100 port runs, 30 of each of 01-05
    .venv/bin/python tools/stress_exits.py --port 10 --each 2  # a quick look
    ATEN_CPU_CAPABILITY=avx2 .venv/bin/python tools/stress_exits.py ...   # another CPU kernel set

Each run is a short training of 2 processes. 01-03 run to their end; 04, 05 and the port end two ways, alternately
(half of their runs each): by themselves, and stopped by SIGTERM sent to every worker once the first snapshot exists
(what Slurm's signal becomes), which must also exit 0. A run counts as unclean when its launcher exits non-zero,
when any process printed "terminate called" (a C++ abort), or when it was still running after 180 s. The targets are
interleaved, so a slow spell of this shared machine falls on all of them alike. It writes tools/stress_exits.md (the
counts and each unclean run's last lines) unless --out says otherwise.
"""
import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
IMAGES = ["--train-samples", "384", "--val-samples", "65", "--epochs", "2", "--batch-size", "16"]
GPT = ["--steps", "8", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--block-size", "16", "--eval-windows",
       "9", "--eval-every", "4", "--log-every", "2", "--sample-bytes", "20", "--batch-size", "4", "--save-every-steps",
       "2"]
SIGNALLED = {"04_fault_tolerant.py", "05_fsdp.py", "port/gpt_ddp.py"}  # they snapshot and stop on SIGTERM


def command(script, folder):
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "--max-restarts=0"]
    if script == "01_mp_spawn.py":
        return [sys.executable, script, *IMAGES, "--nproc", "2"]
    if script == "port/gpt_ddp.py":
        return [*torchrun, script, *GPT, "--data", str(folder / "text.txt"), "--checkpoint", str(folder / "gpt.pt")]
    extra = ["--checkpoint", str(folder / ("snapshot" if script == "05_fsdp.py" else "snapshot.pt"))]
    if script in SIGNALLED:
        extra += ["--save-every-steps", "4"]
    if script == "05_fsdp.py":
        extra += ["--model", "wide-64"]
    return [*torchrun, script, *IMAGES, *extra]


def workers(agent, script):
    return [p for p in psutil.Process(agent.pid).children() if script in " ".join(p.cmdline())]


def one_run(script, stop, folder, timeout=180):
    """(return code, output, how it ended): the script run once in a fresh folder, stopped by SIGTERM to its
    workers after its first snapshot when `stop`."""
    for path in folder.iterdir():
        if path.name != "text.txt":
            subprocess.run(["rm", "-rf", str(path)], check=True)
    log = folder / "output.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    with open(log, "w") as output:
        agent = subprocess.Popen(command(script, folder), cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    deadline, signalled = time.monotonic() + timeout, False
    while agent.poll() is None and time.monotonic() < deadline:
        if stop and not signalled and "saved snapshot" in log.read_text(errors="replace"):
            for worker in workers(agent, script):
                worker.send_signal(signal.SIGTERM)
            signalled = True
        time.sleep(0.05)
    if agent.poll() is None:
        for process in [*psutil.Process(agent.pid).children(recursive=True), psutil.Process(agent.pid)]:
            process.kill()
        agent.wait()
        return None, log.read_text(errors="replace"), "stopped" if signalled else "ran"
    return agent.returncode, log.read_text(errors="replace"), "stopped" if signalled else "ran"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=100, help="runs of port/gpt_ddp.py")
    parser.add_argument("--each", type=int, default=30, help="runs of each of 01-05")
    parser.add_argument("--out", default=str(REPO / "tools" / "stress_exits.md"))
    args = parser.parse_args()
    import torch  # the version and CPU capability for the report only

    plan = [("port/gpt_ddp.py", i) for i in range(args.port)]
    plan += [(script, i) for script in ("01_mp_spawn.py", "02_torchrun.py", "03_multinode.py", "04_fault_tolerant.py",
                                        "05_fsdp.py") for i in range(args.each)]
    random.Random(0).shuffle(plan)  # interleaved
    counts, unclean, began = {}, [], time.monotonic()
    with tempfile.TemporaryDirectory(prefix="stress-exits-") as scratch:
        folder = Path(scratch)
        words = ["the", "model", "learns", "which", "byte", "comes", "next", "from", "the", "bytes", "before", "it"]
        rng = random.Random(0)
        (folder / "text.txt").write_text(" ".join(rng.choice(words) for _ in range(2400)))
        for done, (script, index) in enumerate(plan, 1):
            stop = script in SIGNALLED and index % 2 == 1
            code, output, ended = one_run(script, stop, folder)
            aborted = "terminate called" in output
            key = (script, ended)
            runs, bad = counts.get(key, (0, 0))
            clean = code == 0 and not aborted
            counts[key] = (runs + 1, bad + (not clean))
            if not clean:
                unclean.append((script, ended, code, "\n".join(output.splitlines()[-12:])))
            print(f"[{done}/{len(plan)} {time.monotonic() - began:.0f} s] {script} {ended}: exit {code}"
                  + (" ABORT" if aborted else ""), flush=True)
    lines = ["# Clean exits under stress", "",
             f"`tools/stress_exits.py --port {args.port} --each {args.each}` on this machine: "
             f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
             f"{os.cpu_count()} cores, {time.monotonic() - began:.0f} s, "
             f"{time.strftime('%Y-%m-%d')}.", "",
             "| script | how it ended | runs | not clean |", "|---|---|---|---|"]
    lines += [f"| `{script}` | {ended} | {runs} | {bad} |" for (script, ended), (runs, bad) in sorted(counts.items())]
    total = sum(bad for _, bad in counts.values())
    exits = "exit" if total == 1 else "exits"
    lines += ["", f"**{total} unclean {exits} in {len(plan)} runs.** (ran: ended by itself; stopped: SIGTERM to every "
              "worker after the first snapshot, a clean stop that must exit 0.)"]
    for script, ended, code, tail in unclean:
        lines += ["", f"## {script}, {ended}: exit {code}", "", "```", tail, "```"]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:len(counts) + 8]))
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
