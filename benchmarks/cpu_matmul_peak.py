"""A CPU's peak for the model FLOPs utilisation (the port's --peak-tflops): the rate of one large fp32 matmul on the
cores one rank uses. A CPU has no datasheet figure that a rank can reach, so the course measures one and says so:
MFU against it says how much of what these cores can do at their best the training step does, not how close it is
to a theoretical bound.

    .venv/bin/python benchmarks/cpu_matmul_peak.py                 # this process's threads (all cores)
    .venv/bin/python benchmarks/cpu_matmul_peak.py --threads 1     # what one of 2 ranks on 2 cores gets

Each repeat times --iters matmuls of two --size x --size matrices (2 x size^3 FLOPs each), after one untimed
matmul; the line gives the median of the repeats, with their min and max: give the median to --peak-tflops, and
read the spread before trusting a second figure (this machine may be shared).
"""
import argparse
import statistics
import time

import torch


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument("--size", type=int, default=2048, help="rows and columns of each matrix")
    parser.add_argument("--iters", type=int, default=5, help="matmuls per timed repeat")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    a, b = torch.randn(args.size, args.size), torch.randn(args.size, args.size)
    a @ b  # untimed: the first call pays for allocation and the library's set-up
    rates = []
    for _ in range(args.repeats):
        began = time.perf_counter()
        for _ in range(args.iters):
            a @ b
        rates.append(2 * args.size ** 3 * args.iters / (time.perf_counter() - began) / 1e12)
    median = statistics.median(rates)
    print(f"fp32 matmul {args.size}x{args.size}, {torch.get_num_threads()} thread(s): median {median:.4f} TFLOP/s "
          f"(min {min(rates):.4f}, max {max(rates):.4f}, {args.repeats} repeats): --peak-tflops {median:.4f}")


if __name__ == "__main__":
    main()
