"""The CPU's reference peak for MFU (hardware.measure_peak_tflops) is one thread's best timing times the
threads a run computes with: a neighbour process can only slow a timing down, so the best one is the
machine's, however busy it was (`make bench ARGS=peak` measures it beside spinning processes and on the free
machine; timings live there, not here)."""

import pytest
import torch

import hardware


class ScriptedClock:
    """perf_counter for hardware.py: each matmul timing takes the next scripted duration; the loop's own
    deadline reads see time advance by nothing."""

    def __init__(self, durations):
        self.durations, self.now, self.reads = list(durations), 0.0, 0

    def perf_counter(self):
        self.reads += 1
        return self.now

    def finish_matmul(self):
        self.now += self.durations.pop(0) if self.durations else 10.0


@pytest.fixture
def scripted(monkeypatch):
    """Times each real matmul with the scripted clock: the product runs, its duration is the script's."""

    def install(durations):
        clock = ScriptedClock(durations)
        monkeypatch.setattr(hardware.time, "perf_counter", clock.perf_counter)
        real_matmul = torch.Tensor.__matmul__

        def matmul(a, b):
            result = real_matmul(a, b)
            clock.finish_matmul()
            return result

        monkeypatch.setattr(torch.Tensor, "__matmul__", matmul)
        return clock

    return install


def test_the_peak_is_the_best_timing_however_many_a_neighbour_slowed(scripted):
    size, threads = 512, torch.get_num_threads()
    # warm-up, then timings a neighbour slowed 10x, 3x and not at all (1 ms), then slowed again
    scripted([5.0, 0.010, 0.003, 0.001, 0.004, 0.002])
    peak = hardware.measure_peak_tflops(torch.device("cpu"), seconds=0.0, min_timings=5)
    assert peak == pytest.approx(2 * size**3 / 0.001 / 1e12 * threads)


def test_the_peak_is_one_threads_timing_times_the_threads_a_run_computes_with(monkeypatch, scripted):
    seen, threads = [], torch.get_num_threads()
    scripted([1.0] + [0.002] * 5)
    torch.set_num_threads(2)
    try:
        original = torch.Tensor.__matmul__  # the scripted one

        def counting(a, b):
            seen.append(torch.get_num_threads())
            return original(a, b)

        monkeypatch.setattr(torch.Tensor, "__matmul__", counting)
        peak = hardware.measure_peak_tflops(torch.device("cpu"), seconds=0.0, min_timings=5)
        assert set(seen) == {1}  # every timed matmul on one thread
        assert torch.get_num_threads() == 2  # and the run's threads given back
        assert peak == pytest.approx(2 * 512**3 / 0.002 / 1e12 * 2)
    finally:
        torch.set_num_threads(threads)


def test_the_run_gets_its_threads_back_when_the_measurement_fails():
    threads = torch.get_num_threads()
    with pytest.raises(RuntimeError):
        hardware.measure_peak_tflops(torch.device("cpu"), dtype=torch.bool)
    assert torch.get_num_threads() == threads
