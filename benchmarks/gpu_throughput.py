"""The GPU benchmark: what the scripts reach on one GPU, beside what that GPU can give. Run by the GPU check
(tools/gpu_check.py, `make test-gpu`), in about 2 minutes; it has not run yet: no GPU has been lent to this project.

    python benchmarks/gpu_throughput.py --out benchmark.json

Each figure is a run's steady rate from the scripts' own --metrics (an epoch or step rate after the first, which
pays for warm-up and cuDNN's choices), two repeats in turn where a ratio is taken, both printed:
- samples/s of 00 and of 02 under torchrun with one process, fp32 and --amp (fp16 + GradScaler): DDP's cost with
  nothing to communicate is their ratio;
- the input pipeline: 00's samples/s against the same model's training steps on batches already on the GPU (the
  bound the loader can at best reach); far below it, the GPU waits for data, and loader workers or larger
  batches are what would help;
- tokens/s of the ported GPT, fp32 (TF32 matmuls) and bf16 autocast, and its model FLOPs utilisation: 6 x the
  parameters + 12 x layers x context x width FLOPs per token, against the GPU's dense peak from its datasheet.
"""
import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
CNN = ["--device", "cuda", "--train-samples", "32768", "--val-samples", "512", "--epochs", "3", "--batch-size", "256"]
GPT = {"n-layer": 8, "n-embd": 512, "n-head": 8, "block-size": 256, "batch-size": 32}
GPT_FLAGS = ["--device", "cuda", "--steps", "60", "--eval-every", "60", "--eval-windows", "1", "--sample-bytes", "0",
             "--log-every", "60", *(f"--{name}={value}" for name, value in GPT.items())]
# dense (no sparsity) peaks from NVIDIA's datasheets, in FLOP/s: bf16 tensor cores, TF32 tensor cores
PEAKS = {"H100 PCIe": {"bf16": 756e12, "tf32": 378e12}, "H100": {"bf16": 989e12, "tf32": 494e12},
         "H200": {"bf16": 989e12, "tf32": 494e12}, "A100": {"bf16": 312e12, "tf32": 156e12}}


def rates(command, key, skip):
    """The steady rate of one run: the median of its --metrics lines after the first `skip`."""
    with tempfile.TemporaryDirectory() as folder:
        metrics = Path(folder) / "m.jsonl"
        result = subprocess.run([*command, "--metrics", metrics], cwd=REPO, capture_output=True, text=True,
                                timeout=120)
        if result.returncode != 0:
            return {"error": (result.stdout + result.stderr)[-1500:]}
        values = [json.loads(line)[key] for line in metrics.read_text().splitlines() if key in json.loads(line)]
        return statistics.median(values[skip:])


def gpu_bound(amp):
    """00's model trained on batches already on the GPU: samples/s with no loader at all."""
    import torch

    sys.path.insert(0, str(REPO))
    model = __import__("00_single_gpu").build_model("cnn", 10).cuda()  # the scripts' own model
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
    for amp in (False, True):
        flag = ["--amp"] if amp else []
        pairs = [(rates([sys.executable, "00_single_gpu.py", *CNN, *flag], "samples_per_s", 1),
                  rates([*TORCHRUN, "02_torchrun.py", *CNN, *flag], "samples_per_s", 1)) for _ in range(2)]
        figures[f"cnn {'amp' if amp else 'fp32'}"] = {
            "00 samples/s": [a for a, _ in pairs], "02 on 1 process samples/s": [b for _, b in pairs],
            "02/00": [b / a if isinstance(a, float) and isinstance(b, float) else None for a, b in pairs],
            "bound: batches already on the GPU, samples/s": gpu_bound(amp)}
    sys.path.insert(0, str(REPO / "port"))
    for amp in (False, True):
        tokens = rates([*TORCHRUN, "port/gpt_ddp.py", *GPT_FLAGS, *(["--amp"] if amp else [])], "tokens_per_s", 10)
        model = __import__("gpt_single").GPT(**{"n_layer": GPT["n-layer"], "n_embd": GPT["n-embd"],
                                                "n_head": GPT["n-head"], "block_size": GPT["block-size"],
                                                "dropout": 0.0})
        parameters = sum(p.numel() for p in model.parameters())
        per_token = 6 * parameters + 12 * GPT["n-layer"] * GPT["block-size"] * GPT["n-embd"]
        peak = next((peaks for key, peaks in PEAKS.items() if key in name), None)
        entry = {"tokens/s": tokens, "parameters": parameters, "FLOPs per token": per_token}
        if peak and isinstance(tokens, float):
            entry["MFU"] = tokens * per_token / peak["bf16" if amp else "tf32"]
            entry["peak FLOP/s"] = peak["bf16" if amp else "tf32"]
        figures[f"port {'bf16' if amp else 'fp32 (TF32)'}"] = entry
    args.out.write_text(json.dumps(figures, indent=1) + "\n")
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
