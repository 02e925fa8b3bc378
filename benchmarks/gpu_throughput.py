"""The GPU benchmark: what the scripts reach on one GPU, beside what that GPU can give. Run by the GPU check
(tools/gpu_check.py, `make test-gpu`), in about 2.5 minutes. Its figures from each GPU run: docs/gpu-runs/README.md.

    python benchmarks/gpu_throughput.py --out benchmark.json

Each figure is one run's steady rate from the scripts' own --metrics (the second epoch, or the steps after the
first 10: the first pays for warm-up and cuDNN's choices); the file is rewritten after each figure, so that a run
stopped early keeps what it measured. What it measures:
- the input pipeline: 00's samples/s with 0 and with 4 loader workers (fp32 only: the loader does the same work
  under --amp), beside the same model's training steps on batches already on the GPU, the most any loader could
  reach; far below it, the GPU waits for data (the built-in data makes every sample on the CPU), and more loader
  workers or bigger batches are what would help;
- DDP's cost with nothing to communicate: those steps on batches already on the GPU, plain and in DDP (NCCL, one
  process), fp32 and --amp (fp16 + GradScaler); and 02 under torchrun with one process and 4 loader workers;
- tokens/s of the ported GPT, fp32 (TF32 matmuls) and bf16 autocast, and its model FLOPs utilisation: per token,
  6 x the parameters (the position table left out; the token matrix counted once, as the output layer shares it)
  + 12 x layers x context x width for attention, against the GPU's dense peak from NVIDIA's datasheet.
"""
import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
CNN = ["--device", "cuda", "--train-samples", "8192", "--val-samples", "512", "--epochs", "2", "--batch-size", "256"]
GPT = {"n-layer": 8, "n-embd": 512, "n-head": 8, "block-size": 256, "batch-size": 32}
GPT_FLAGS = ["--device", "cuda", "--steps", "40", "--eval-every", "40", "--eval-windows", "1", "--sample-bytes", "0",
             "--log-every", "40", *(f"--{name}={value}" for name, value in GPT.items())]
# dense (no sparsity) peaks from NVIDIA's datasheets, in FLOP/s: bf16 and TF32 tensor cores. The first name the
# GPU's name contains is taken: the longer names first (GH200 before H200, H100 NVL and PCIe before H100)
PEAKS = {"GH200": {"bf16": 989e12, "tf32": 494e12}, "H100 NVL": {"bf16": 835e12, "tf32": 418e12},
         "H100 PCIe": {"bf16": 756e12, "tf32": 378e12}, "H100": {"bf16": 989e12, "tf32": 494e12},
         "H200": {"bf16": 989e12, "tf32": 494e12}, "A100": {"bf16": 312e12, "tf32": 156e12}}


def rates(command, key, skip, seconds=60):
    """The steady rate of one run: the median of its --metrics lines after the first `skip`."""
    with tempfile.TemporaryDirectory() as folder:
        metrics = Path(folder) / "m.jsonl"
        process = subprocess.Popen([*map(str, command), "--metrics", str(metrics)], cwd=REPO, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            output, _ = process.communicate(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # torchrun's worker has a session of its own: killed by its agent
            process.communicate()
            return {"error": f"stopped after {seconds} s"}
        if process.returncode != 0:
            return {"error": output[-1500:]}
        values = [json.loads(line)[key] for line in metrics.read_text().splitlines() if key in json.loads(line)]
        return statistics.median(values[skip:])


def on_the_gpu(amp, ddp):
    """00's model trained on batches already on the GPU, plain or in DDP: samples/s with no loader at all."""
    import torch

    sys.path.insert(0, str(REPO))
    model = __import__("00_single_gpu").build_model("cnn", 10).cuda()  # the scripts' own model
    if ddp:
        import torch.distributed as dist

        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0], gradient_as_bucket_view=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda", enabled=amp)
    data, target = torch.randn(256, 3, 32, 32, device="cuda"), torch.randint(0, 10, (256,), device="cuda")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    for steps in (20, 100):  # warm-up, then the timed steps
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(steps):
            with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
                loss = torch.nn.functional.cross_entropy(model(data), target)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        torch.cuda.synchronize()
    if ddp:
        dist.destroy_process_group()
    return 100 * 256 / (time.perf_counter() - began)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("no GPU: nothing to measure")
    name = torch.cuda.get_device_name(0)
    figures = {"gpu": name, "torch": torch.__version__}

    def keep(key, value):  # each figure printed and on disk at once: a stopped run keeps what it measured
        figures[key] = value
        print(f"{key}: {value}", flush=True)
        args.out.write_text(json.dumps(figures, indent=1) + "\n")

    for amp in (False, True):
        label, flag = ("amp" if amp else "fp32"), (["--amp"] if amp else [])
        keep(f"cnn {label}: batches already on the GPU, samples/s", on_the_gpu(amp, ddp=False))
        keep(f"cnn {label}: the same in DDP (NCCL, 1 process), samples/s", on_the_gpu(amp, ddp=True))
        for workers in () if amp else (0, 4):
            keep(f"cnn {label}: 00, {workers} loader workers, samples/s",
                 rates([sys.executable, "00_single_gpu.py", *CNN, *flag, "--num-workers", workers], "samples_per_s", 1))
        keep(f"cnn {label}: 02 under torchrun, 1 process, 4 loader workers, samples/s",
             rates([*TORCHRUN, "02_torchrun.py", *CNN, *flag, "--num-workers", 4], "samples_per_s", 1))
    sys.path.insert(0, str(REPO / "port"))
    model = __import__("gpt_single").GPT(n_layer=GPT["n-layer"], n_embd=GPT["n-embd"], n_head=GPT["n-head"],
                                         block_size=GPT["block-size"], dropout=0.0)
    parameters = sum(p.numel() for name, p in model.named_parameters() if "position" not in name)
    per_token = 6 * parameters + 12 * GPT["n-layer"] * GPT["block-size"] * GPT["n-embd"]
    peak = next((peaks for key, peaks in PEAKS.items() if key in name), None)
    for amp in (False, True):
        tokens = rates([*TORCHRUN, "port/gpt_ddp.py", *GPT_FLAGS, *(["--amp"] if amp else [])], "tokens_per_s", 10)
        entry = {"tokens/s": tokens, "parameters (no position table)": parameters, "FLOPs per token": per_token}
        if peak and isinstance(tokens, float):
            entry["peak FLOP/s"] = peak["bf16" if amp else "tf32"]
            entry["MFU"] = tokens * per_token / entry["peak FLOP/s"]
        keep(f"port {'bf16' if amp else 'fp32 (TF32)'}", entry)


if __name__ == "__main__":
    main()
