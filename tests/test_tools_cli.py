"""The instructor's tools answer --help and refuse a wrong command line without doing anything, the preflight
runs where os has no sched_getaffinity (macOS), and the CPU's matmul peak prints what the port takes. Each takes a
second or a few: a Python that imports nbformat, or the preflight and the matmul peak run here."""
import re
import subprocess

import pytest
from helpers import PYTHON, REPO, load_script

TOOLS = ["tools/handout.py", "tools/workshop_times.py"]


def tool(*argv):
    return subprocess.run([PYTHON, *argv], cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("path", TOOLS)
def test_help_prints_the_usage_and_exits_0(path):
    done = tool(path, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: "), done.stdout[:200]


@pytest.mark.parametrize("argv", [[], ["--no-such-flag"], ["one", "two"]])
def test_handout_refuses_a_wrong_command_line_with_its_usage(argv):
    done = tool("tools/handout.py", *argv)
    assert done.returncode == 2 and done.stderr.startswith("usage: "), (done.returncode, done.stderr)


@pytest.mark.parametrize("argv", [[], ["--all", "--table"], ["--all", "00_single_gpu"], ["no_such_lecture"]])
def test_workshop_times_refuses_a_wrong_command_line_and_leaves_the_committed_figures(argv):
    """With no argument it once re-measured every lecture (about 8 minutes) and overwrote the committed figures."""
    figures = REPO / "docs" / "workshop_times.json"
    before = figures.read_bytes(), figures.stat().st_mtime_ns
    done = tool("tools/workshop_times.py", *argv)
    assert done.returncode == 2 and done.stderr.startswith("usage: "), (done.returncode, done.stderr)
    assert (figures.read_bytes(), figures.stat().st_mtime_ns) == before


def test_preflight_takes_every_cpu_where_there_is_no_sched_getaffinity(monkeypatch):
    """As on macOS: its facts of this machine (what each rank reports) name every CPU as the ones it may use."""
    preflight = load_script("preflight.py")
    monkeypatch.delattr(preflight.os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(preflight.os, "cpu_count", lambda: 3)
    facts = preflight.local_facts({"rank": 0, "local_rank": 0, "node": 0, "local_world_size": 1,
                                   "master_addr": "127.0.0.1"})
    assert (facts["affinity"], facts["affinity_count"]) == ("0-2", 3)


def test_cpu_matmul_peak_prints_the_figure_the_port_takes_as_its_peak(capsys, monkeypatch):
    """benchmarks/cpu_matmul_peak.py: a measured rate, its spread, and the flag to give the port (whose MFU it
    becomes: tests/test_port.py). In this process: torch is imported here already."""
    import torch

    monkeypatch.setattr("sys.argv", ["cpu_matmul_peak.py", "--threads", "1", "--size", "128", "--iters", "2",
                                     "--repeats", "3"])
    threads = torch.get_num_threads()
    try:
        load_script("benchmarks/cpu_matmul_peak.py").main()
    finally:
        torch.set_num_threads(threads)
    line = (r"fp32 matmul 128x128, 1 thread\(s\): median ([\d.]+) TFLOP/s \(min ([\d.]+), max ([\d.]+), 3 repeats\): "
            r"--peak-tflops ([\d.]+)\n")
    median, low, high, peak = re.fullmatch(line, capsys.readouterr().out).groups()
    assert 0 < float(low) <= float(median) <= float(high) and peak == median
