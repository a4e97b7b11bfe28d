"""
The CPU's reference peak for MFU (hardware.measure_peak_tflops), taken on a busy machine and on a free one:
`python -m bench peak`. The peak must stay at or above what the cores then do once the work is gone, so a
run's MFU stays at or below 100% (a rehearsal on a busy CPU once logged `mfu 119%`: its peak had been
measured at start, under load, the old way).
"""

import multiprocessing
import time

import torch

import hardware
from bench.common import spread

ROUNDS = 3


def spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def matmul_rate(size=1024, seconds=1.0):
    """TFLOP/s of the matmuls a training step runs on every thread, the best of a second of them."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def busy_peak(neighbours_per_thread=2):
    """The peak measured while twice as many spinning processes as threads compete for the cores."""
    neighbours = [multiprocessing.Process(target=spin, args=(30,))
                  for _ in range(neighbours_per_thread * torch.get_num_threads())]  # fmt: skip
    for neighbour in neighbours:
        neighbour.start()
    try:
        time.sleep(0.5)
        return hardware.measure_peak_tflops(torch.device("cpu"))
    finally:
        for neighbour in neighbours:
            neighbour.terminate()
            neighbour.join()


def bench_peak(rounds=ROUNDS):
    busy, free, done = [], [], []
    for _ in range(rounds):
        busy.append(busy_peak())
        free.append(hardware.measure_peak_tflops(torch.device("cpu")))
        done.append(matmul_rate())
    threads = torch.get_num_threads()
    print(f"peak: CPU reference peak over {rounds} rounds on {threads} thread(s), TFLOP/s median (min-max)")
    print(f"peak:   measured beside {2 * threads} spinning processes  {spread(busy, '.3f')}")
    print(f"peak:   measured without them                {spread(free, '.3f')}")
    print(f"peak:   1024² matmuls done without them        {spread(done, '.3f')}")
    ratios = [rate / peak for rate, peak in zip(done, busy, strict=True)]
    print(f"peak:   done / busy peak (the MFU a run would log, ≤ 1.0 wanted) {spread(ratios, '.2f')}")
