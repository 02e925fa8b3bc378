"""DDP between two hosts over a link of limited bandwidth: what it costs, and what each DDP knob wins back.

    sudo .venv/bin/python benchmarks/shaped_link.py               # docs/scaling.md's table: 26 min on 2 cores
    sudo .venv/bin/python benchmarks/shaped_link.py --repeats 5   # tighter spreads, on a quiet machine
    .venv/bin/python benchmarks/shaped_link.py --table-only       # redo table and plot from the raw figures

Two hosts (network namespaces bench-nodeA and bench-nodeB, joined by a veth pair: the tests' own fixture,
tests/helpers.separate_hosts) each run one torchrun node with one process. Each host shapes what it sends with
`tc ... tbf` (benchmarks/_link.py) to each link class in turn. Per model and link class, the worker
(benchmarks/shaped_link_worker.py) measures the link itself (latency, point-to-point and all-reduce bandwidth
for the model's gradient bytes), one node's step with no communication, and a DDP step with each knob; last,
the accuracy each knob that changes the arithmetic reaches. Every link class and knob runs once per repeat, in
an order that turns with each repeat, all in one run; ratios are taken within a repeat, then the median over
repeats is shown with the smallest and largest.

Writes benchmarks/shaped_link.json (every figure, as it comes), shaped_link.md (the table) and shaped_link.png.
Needs root (network namespaces, tc) and iproute2. Everything it makes is removed at the end, also on an error,
Ctrl-C or SIGTERM: the qdiscs, the namespaces (and with them the veth pair), their /etc/netns files.
"""
import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

from _link import LINKS, unshape

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from helpers import hosts_unavailable, in_host, kill_tree, separate_hosts  # noqa: E402 (written once, there)

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
PREFIX = "bench"  # namespaces bench-nodeA/B: the tests' are ddp-nodeA/B, so both can run at once
RAW, TABLE, PLOT = (REPO / "benchmarks" / f"shaped_link.{suffix}" for suffix in ("json", "md", "png"))
ONE_NODE = "one node (no communication)"


def problem(prefix=PREFIX):
    """Why the benchmark cannot run here, or None. Root first: an ordinary user often lacks /usr/sbin and /sbin
    in PATH, where tc and ip live, but what stops them is the missing root, not the tools."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc qdiscs); running as an ordinary user"
    for tool in ("tc", "ip"):
        if shutil.which(tool) is None:
            found = [str(Path(d) / tool) for d in ("/usr/sbin", "/sbin") if (Path(d) / tool).is_file()]
            return (f"{tool} is in {found[0]} but not in PATH: add {Path(found[0]).parent} to PATH" if found
                    else f"needs {tool} (iproute2), not found in PATH, /usr/sbin or /sbin")
    return hosts_unavailable(prefix)


def measure(models=("cnn", "mlp"), links=None, knobs=None, repeats=3, seconds=4.0, accuracy_samples=4096,
            accuracy_epochs=2, timeout=7200, prefix=PREFIX):
    """Runs the worker on two hosts (namespaces PREFIX-nodeA/B); yields its records (dicts) as they come.
    Cleans up on any exit."""
    links = LINKS if links is None else links
    worker = ["benchmarks/shaped_link_worker.py", "--models", ",".join(models), "--repeats", str(repeats),
              "--seconds", str(seconds), "--accuracy-samples", str(accuracy_samples),
              "--accuracy-epochs", str(accuracy_epochs),
              "--links", ",".join(f"{name}={rate or 'none'}" for name, rate in links.items()),
              *(["--knobs", ",".join(knobs)] if knobs else [])]
    reason = problem(prefix)
    if reason:
        raise RuntimeError(f"cannot build the two hosts: {reason}")
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    environment["OMP_NUM_THREADS"] = "1"  # one core per node: this machine has two
    logs = Path(tempfile.mkdtemp(prefix="ddp-steps-shaped-"))
    agents = []
    with separate_hosts(prefix=prefix) as hosts:
        try:
            for rank, name in enumerate(hosts):
                node = [TORCHRUN, "--nnodes=2", "--nproc_per_node=1", f"--node_rank={rank}", "--master_addr=nodeA",
                        "--master_port=29500", *worker, "--device", f"veth-{name}"]
                output = subprocess.PIPE if rank == 0 else open(logs / f"{name}.log", "w")  # noqa: SIM115
                agents.append(subprocess.Popen(in_host(name, node, prefix=prefix), cwd=REPO, env=environment,
                                               text=True, stdout=output, stderr=subprocess.STDOUT,
                                               start_new_session=True))
            deadline = threading.Timer(timeout, lambda: [kill_tree(agent.pid) for agent in agents])
            deadline.daemon = True  # an interrupted run must not wait for it at exit
            deadline.start()
            lines = []
            for line in agents[0].stdout:  # rank 0 is on the first host; it prints the figures
                if line.startswith("{"):
                    record = json.loads(line)
                    if record["kind"] == "done":
                        continue
                    yield record
                else:
                    lines.append(line.rstrip())
            codes = [agent.wait() for agent in agents]
            if any(codes):
                other = (logs / f"{hosts[1]}.log").read_text().splitlines()
                raise RuntimeError(f"the worker failed (exit {codes}):\n" + "\n".join(lines[-60:] + other[-60:]))
        finally:
            if agents:
                deadline.cancel()
            for agent in agents:
                kill_tree(agent.pid)
                agent.wait()
            for name in hosts:  # deleting the namespace would remove it too; this says so explicitly
                unshape(f"veth-{name}", netns=f"{prefix}-{name}")
            shutil.rmtree(logs, ignore_errors=True)


# --- the table --------------------------------------------------------------------------------------------------

def mbit(bytes_per_s):
    return bytes_per_s * 8 / 1e6


def spread(values, fmt):
    values = list(values)
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}–{fmt.format(max(values))})"


def organise(records):
    """{(model, link, repeat): {...}} views of the records."""
    models = {r["model"]: r for r in records if r["kind"] == "model"}
    # p2p bandwidth from the raw time, as the worker now computes it (runs before 2026-11-22 17:30 subtracted
    # the latency, which a busy machine measures too noisily to subtract)
    link = {(r["model"], r["link"], r["repeat"]): {**r, "p2p_bytes_per_s": models[r["model"]]["gradient_bytes"]
                                                   / r["p2p_s"]} for r in records if r["kind"] == "link"}
    step = {(r["model"], r["link"], r["repeat"], r["knob"]): r for r in records if r["kind"] == "step"}
    accuracy = {(r["model"], r["knob"]): r for r in records if r["kind"] == "accuracy"}
    return models, link, step, accuracy


def per_sample(step):
    return step["step_s"] / step["samples"]


def summarize(measured):
    """The markdown table (text) of a run's raw figures."""
    records = measured["records"]
    models, link, step, accuracy = organise(records)
    links = list(dict.fromkeys(r["link"] for r in records if r["kind"] == "link"))
    repeats = sorted({r["repeat"] for r in records if r["kind"] == "link"})
    knobs = list(dict.fromkeys(r["knob"] for r in records if r["kind"] == "step" and r["knob"] != ONE_NODE))
    out = [f"Measured {measured['date']} on {measured['machine']}: two network-namespace hosts, one process "
           f"(1 thread) each, gloo, per-rank batch {next(iter(models.values()))['batch_size']}, synthetic data; "
           f"{len(repeats)} repeats in one run ({measured.get('duration_s', 0) / 60:.0f} min). Each figure: median "
           "over repeats (smallest–largest); ratios are taken within a repeat. Bandwidth in Mbit/s.", ""]
    out += ["**The models.**", "", "| model | parameters | gradient bytes per step | FLOP per sample (fwd+bwd) "
            "| FLOP per gradient byte, per step |", "|---|---|---|---|---|"]
    for name, m in models.items():
        intensity = m["flops_per_sample"] * m["batch_size"] / m["gradient_bytes"]
        out.append(f"| {name} | {m['gradient_bytes'] // 4:,} | {m['gradient_bytes'] / 1e6:.2f} MB | "
                   f"{m['flops_per_sample'] / 1e6:.1f} M | {intensity:,.0f} |")
    out += ["", "**The links, and one step of each model on them.** p2p: one message of the model's gradient size, "
            "one way, timed to the one-number reply. "
            "all-reduce: algbw = size / time (busbw is the same for 2 ranks). compute: one node's step "
            "with no communication (FLOP/s per rank beside it); balance = FLOP/s ÷ p2p bytes/s. DDP: the default "
            "step (as in the scripts). exposed communication = DDP − compute. predicted: compute + size ÷ p2p "
            "bandwidth + latency (no overlap), and max(compute, that communication) (perfect overlap). "
            "2 nodes / 1 node: samples/s of both nodes over one node's.", "",
            "| model | link | tbf rate | latency (µs) | p2p | all-reduce algbw | compute (ms) | GFLOP/s | balance "
            "(FLOP/B) | DDP step (ms) | exposed comm. (ms) | predicted, no overlap / perfect overlap (ms) | "
            "DDP / predicted no overlap | 2 nodes / 1 node |", "|---|---|---|---|---|---|---|---|---|---|---|---|"
            "---|---|"]
    for name, m in models.items():
        for ln in links:
            lk = [link[name, ln, r] for r in repeats]
            compute = [step[name, ln, r, ONE_NODE]["step_s"] for r in repeats]
            ddp = [step[name, ln, r, "default"]["step_s"] for r in repeats]
            comm = [m["gradient_bytes"] / k["p2p_bytes_per_s"] + k["latency_s"] for k in lk]
            gflops = [m["flops_per_sample"] * m["batch_size"] / c / 1e9 for c in compute]
            out.append(
                f"| {name} | {ln} | {lk[0]['rate'] or '—'} | {spread([k['latency_s'] * 1e6 for k in lk], '{:.0f}')} "
                f"| {spread([mbit(k['p2p_bytes_per_s']) for k in lk], '{:.0f}')} "
                f"| {spread([mbit(k['algbw_bytes_per_s']) for k in lk], '{:.0f}')} "
                f"| {spread([c * 1e3 for c in compute], '{:.0f}')} | {spread(gflops, '{:.0f}')} "
                f"| {spread([g * 1e9 / k['p2p_bytes_per_s'] for g, k in zip(gflops, lk, strict=True)], '{:,.0f}')} "
                f"| {spread([d * 1e3 for d in ddp], '{:.0f}')} "
                f"| {spread([(d - c) * 1e3 for d, c in zip(ddp, compute, strict=True)], '{:.0f}')} "
                f"| {statistics.median(c + x for c, x in zip(compute, comm, strict=True)) * 1e3:.0f} / "
                f"{statistics.median(max(c, x) for c, x in zip(compute, comm, strict=True)) * 1e3:.0f} "
                f"| {spread([d / (c + x) for d, c, x in zip(ddp, compute, comm, strict=True)], '{:.2f}')} "
                f"| {spread([2 * c / d for d, c in zip(ddp, compute, strict=True)], '{:.2f}')} |")
    columns = [(name, ln) for name in models for ln in links]
    out += ["", "**Each knob: training samples/s of the two nodes, relative to the default DDP step on the same "
            "model and link** (per sample: an accumulation step trains 4 batches). Below each ratio, "
            "the bytes each node sent per sample (measured on the veth) relative to the default's.", "",
            "| knob | " + " | ".join(f"{name}, {ln}" for name, ln in columns) + " |",
            "|---|" + "---|" * len(columns)]
    out.append("| default (samples/s) | " + " | ".join(
        spread([2 * step[name, ln, r, "default"]["samples"] / step[name, ln, r, "default"]["step_s"]
                for r in repeats], "{:.0f}") for name, ln in columns) + " |")
    for knob in knobs[1:]:
        cells = []
        for name, ln in columns:
            if (name, ln, repeats[0], knob) not in step:
                cells.append("")
                continue
            ratio = [per_sample(step[name, ln, r, "default"]) / per_sample(step[name, ln, r, knob]) for r in repeats]
            sent = statistics.median(step[name, ln, r, knob]["bytes_sent"] / step[name, ln, r, knob]["samples"]
                                     / (step[name, ln, r, "default"]["bytes_sent"]
                                        / step[name, ln, r, "default"]["samples"]) for r in repeats)
            cells.append(f"{spread(ratio, '{:.2f}')}<br>bytes ×{sent:.2f}")
        out.append(f"| {knob} | " + " | ".join(cells) + " |")
    if accuracy:
        out += ["", f"**Accuracy** (the knobs that change the arithmetic; one run each, the same initial weights "
                f"and data; unlimited link): validation accuracy on 1024 held-out samples after "
                f"{next(iter(accuracy.values()))['epochs']} epochs of "
                f"{next(iter(accuracy.values()))['samples']} samples, and the last epoch's training loss.", "",
                "| knob | " + " | ".join(f"{name}: val acc | train loss" for name in models) + " |",
                "|---|" + "---|---|" * len(models)]
        for knob in dict.fromkeys(k for _, k in accuracy):
            cells = [f"{accuracy[name, knob]['val_accuracy']:.1%} | {accuracy[name, knob]['train_loss']:.3f}"
                     if (name, knob) in accuracy else " | " for name in models]
            out.append(f"| {knob} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def plot(measured, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = measured["records"]
    models, _, step, _ = organise(records)
    links = list(dict.fromkeys(r["link"] for r in records if r["kind"] == "link"))
    repeats = sorted({r["repeat"] for r in records if r["kind"] == "link"})
    knobs = list(dict.fromkeys(r["knob"] for r in records if r["kind"] == "step" and r["knob"] != ONE_NODE))
    fig, axes = plt.subplots(len(models), 1, figsize=(13, 3.6 * len(models)), squeeze=False)
    width = 0.8 / len(links)
    for axis, name in zip(axes[:, 0], models, strict=True):
        for index, ln in enumerate(links):
            rates = [statistics.median(2 * step[name, ln, r, k]["samples"] / step[name, ln, r, k]["step_s"]
                                       for r in repeats) if (name, ln, repeats[0], k) in step else 0 for k in knobs]
            axis.bar([x + (index - (len(links) - 1) / 2) * width for x in range(len(knobs))], rates, width,
                     label=f"{ln} ({measured['links'].get(ln) or 'not shaped'})", color=f"C{index}")
        # one node's compute does not depend on the link: the median over every link and repeat
        one = statistics.median(step[name, ln, r, ONE_NODE]["samples"] / step[name, ln, r, ONE_NODE]["step_s"]
                                for ln in links for r in repeats)
        axis.axhline(one, color="black", ls="--", lw=1, label="one node alone")
        axis.axhline(2 * one, color="black", ls=":", lw=1, label="2 × one node (perfect scaling)")
        axis.set_yscale("log")
        axis.set_xticks(range(len(knobs)), knobs, rotation=25, ha="right", fontsize=8)
        axis.set_ylabel("samples/s, both nodes (log)")
        axis.set_title(f"{name}: training throughput of two hosts by link and DDP knob (median of repeats)",
                       fontsize=10)
        axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def interrupt(signum, frame):
    """SIGTERM (kill, a CI timeout) ends the run as Ctrl-C does: through the clean-up."""
    raise KeyboardInterrupt


def machine():
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    import torch

    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="cnn,mlp", help="cnn, mlp (a wide MLP) or a torchvision model")
    parser.add_argument("--seconds", type=float, default=4, help="about how long each knob is timed per repeat")
    parser.add_argument("--knobs", default=None, help="only these (comma-separated names from KNOBS in the worker)")
    parser.add_argument("--accuracy-samples", type=int, default=4096, help="0: no accuracy runs")
    parser.add_argument("--output", default=None, help="write OUTPUT.json/.md/.png instead of benchmarks/shaped_link.*")
    parser.add_argument("--table-only", action="store_true", help="measure nothing: redo the table and plot")
    args = parser.parse_args()
    raw, table_path, plot_path = (Path(f"{args.output}.{suffix}") for suffix in ("json", "md", "png")) \
        if args.output else (RAW, TABLE, PLOT)
    if args.table_only:
        measured = json.loads(raw.read_text())
    else:
        reason = problem()
        if reason:
            sys.exit(f"error: {reason}")
        signal.signal(signal.SIGTERM, interrupt)
        command = "sudo .venv/bin/python benchmarks/shaped_link.py " + " ".join(sys.argv[1:])
        measured = {"date": str(date.today()), "machine": machine(), "command": command.strip(),
                    "links": LINKS, "records": []}
        began = time.monotonic()
        try:
            for record in measure(models=args.models.split(","), repeats=args.repeats, seconds=args.seconds,
                                  knobs=args.knobs and args.knobs.split(","), accuracy_samples=args.accuracy_samples):
                measured["records"].append(record)
                measured["duration_s"] = time.monotonic() - began
                raw.write_text(json.dumps(measured, indent=1) + "\n")
                print(" ".join(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
                               for key, value in record.items() if key != "kind"), flush=True)
        except KeyboardInterrupt:
            sys.exit(f"interrupted; the namespaces and qdiscs are removed, the figures so far are in {raw}")
    table = summarize(measured)
    print("\n" + table)
    table_path.write_text(table)
    plot(measured, plot_path)
    print(f"wrote {raw}, {table_path} and {plot_path}")


if __name__ == "__main__":
    main()
