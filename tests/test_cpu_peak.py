"""The CPU's reference peak for MFU (hardware.measure_peak_tflops): taken on a machine busy with other work, it
stays above what the cores then do when the work is gone, so a run's MFU stays at or below 100% (a rehearsal
on a busy CPU logged `mfu 119%`: the peak had been measured once, at start, under load)."""

import multiprocessing
import time

import torch

import hardware


def spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def matmul_rate(size=1024, seconds=1.0):
    """FLOP/s of the matmuls a training step runs on every thread, the best of a second of them."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def test_a_peak_taken_while_the_cpu_is_busy_stays_above_what_the_cpu_does_once_it_is_free():
    threads = torch.get_num_threads()
    neighbours = [multiprocessing.Process(target=spin, args=(30,)) for _ in range(2 * threads)]
    for neighbour in neighbours:
        neighbour.start()
    try:
        time.sleep(0.5)
        peak = hardware.measure_peak_tflops(torch.device("cpu")) * 1e12
    finally:
        for neighbour in neighbours:
            neighbour.terminate()
            neighbour.join()
    assert torch.get_num_threads() == threads  # the measurement gives the run its threads back
    rate = matmul_rate()
    assert rate <= 1.2 * peak, (
        f"{rate / 1e12:.3f} TFLOP/s done against a peak of {peak / 1e12:.3f}"
    )  # MFU <= 100%, give or take timing noise (a peak taken the old way was 5-10x lower)
