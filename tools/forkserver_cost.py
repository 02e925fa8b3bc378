"""Measures what the loader workers' fork server costs (docs/versions.md, "The cure"): the time from a loader's
first `iter()` to its first batch, and the private memory of each worker and of the fork server, with and without
`multiprocessing.set_forkserver_preload`, against workers forked from the process itself. Each measurement is a
fresh Python that imports what a numbered script imports (torch; torchvision too on real images, as the rows say;
step 05's also DCP and FSDP), as the scripts' loaders do: 2 workers, a tiny dataset of random tensors (the imports are
what is measured, not the data). A second loader then starts from the same fork server.

    .venv/bin/python tools/forkserver_cost.py > tools/forkserver_cost.md     # about 3 minutes on 2 cores

Private memory is what a process does not share with another (smaps_rollup's Private_Clean + Private_Dirty):
the cost of one more process. A worker's is read while it runs; the fork server's once its workers have ended
(while they run, they share its pages). Rows are min-max over the repeats, one fresh process each.
"""
import json
import multiprocessing
import multiprocessing.forkserver
import platform
import subprocess
import sys
import time

import torch

REAL_IMAGES = "--real-images" in sys.argv
if REAL_IMAGES:  # as the scripts import it for real images: the workers run these imports again
    import torchvision  # noqa: F401
STEP05 = "--step05" in sys.argv
if STEP05:
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401

# (label, start method, modules the fork server preloads, the step-05 imports, torchvision imported as on real
# images); None: Python's default preload
STEP05_PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.fsdp"]
CASES = [
    ("fork (the start method before the cure), real images", "fork", None, False, True),
    ("fork server, no preload (CPython 3.11's default: the script is not preloaded), real images", "forkserver", None,
     False, True),
    ("fork server, preload torch and torchvision (steps 00-04, real images)", "forkserver", ["torch", "torchvision"],
     False, True),
    ("step 05's imports, preload torch and torchvision only, real images", "forkserver", ["torch", "torchvision"],
     True, True),
    ("step 05's imports, preload also DCP and FSDP (step 05, real images)", "forkserver",
     [*STEP05_PRELOAD, "torchvision"], True, True),
    ("fork server, no preload, the built-in data (torch alone)", "forkserver", None, False, False),
    ("fork server, preload torch (steps 00-04, the built-in data)", "forkserver", ["torch"], False, False),
    ("step 05's imports, preload torch, DCP and FSDP (step 05, the built-in data)", "forkserver", STEP05_PRELOAD,
     True, False),
]
REPEATS = 3


def private_mb(pid):
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        fields = dict(line.split(":", 1) for line in rollup if line.startswith("Private_"))
    return sum(int(value.split()[0]) for value in fields.values()) / 1024


def first_batch(loader):
    began = time.monotonic()
    iterator = iter(loader)
    next(iterator)
    return time.monotonic() - began, iterator


def measure(method, preload):
    """One fresh process's figures: the first loader's wait, its workers' and the fork server's private MB, and
    a second loader's wait."""
    if preload is not None:
        multiprocessing.set_forkserver_preload(preload)
    data = torch.utils.data.TensorDataset(torch.randn(64, 3, 8, 8), torch.zeros(64, dtype=torch.long))
    options = dict(batch_size=8, num_workers=2, multiprocessing_context=method, persistent_workers=True)
    wait, iterator = first_batch(torch.utils.data.DataLoader(data, **options))
    time.sleep(1)  # the workers settle (their first batches done)
    workers = [private_mb(worker.pid) for worker in iterator._workers]
    later, second = first_batch(torch.utils.data.DataLoader(data, **options))
    processes = iterator._workers + second._workers
    del iterator, second  # the loaders stop their workers
    while any(process.is_alive() for process in processes):
        time.sleep(0.1)
    server = multiprocessing.forkserver._forkserver._forkserver_pid  # measured alone: no worker shares its pages
    return {"first_s": wait, "worker_mb": workers, "server_mb": private_mb(server) if server else None,
            "later_s": later}


def span(values, form):
    return form.format(min(values)) if form.format(min(values)) == form.format(max(values)) else \
        f"{form.format(min(values))}–{form.format(max(values))}"


def main():
    print("# The loader workers' fork server: measured\n")
    print(f"`python tools/forkserver_cost.py`, {time.strftime('%Y-%m-%d', time.gmtime())}: Python "
          f"{platform.python_version()}, torch {torch.__version__}, {multiprocessing.cpu_count()} cores; "
          f"{REPEATS} fresh processes per row, min–max; 2 workers per loader.\n")
    print("| case | first loader: to its first batch | a later loader | private MB per worker | "
          "the fork server's private MB |")
    print("|---|---|---|---|---|")
    for label, method, preload, step05, real_images in CASES:
        runs = []
        for _ in range(REPEATS):
            command = [sys.executable, __file__, "--one", json.dumps([method, preload]), *["--step05"] * step05,
                       *["--real-images"] * real_images]
            done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True)
            runs.append(json.loads(done.stdout.splitlines()[-1]))
        servers = [run["server_mb"] for run in runs if run["server_mb"] is not None]
        print(f"| {label} | {span([r['first_s'] for r in runs], '{:.2f} s')} | "
              f"{span([r['later_s'] for r in runs], '{:.2f} s')} | "
              f"{span([mb for r in runs for mb in r['worker_mb']], '{:.0f}')} | "
              f"{span(servers, '{:.0f}') if servers else 'none'} |", flush=True)


if __name__ == "__main__":
    if "--one" in sys.argv:
        method, preload = json.loads(sys.argv[sys.argv.index("--one") + 1])
        print(json.dumps(measure(method, preload)))
    else:
        main()
