"""
What every bench section shares: the repository root, a shipped config layer, CPU and wall time of a call,
the median of repeated calls, a percentile.
"""

import os
import resource
import statistics
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def layer(kind, name):
    with open(os.path.join(ROOT, "configs", kind, f"{name}.yaml"), encoding="utf-8") as f:
        return yaml.safe_load(f)[kind]


def cpu_seconds():
    """CPU time of this process and of its finished, waited-for children, user + system."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed(function, *args, **kwargs):
    """(result, wall seconds, CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), cpu_seconds()
    result = function(*args, **kwargs)
    return result, time.perf_counter() - wall, cpu_seconds() - cpu


def per_call_seconds(function, repeats):
    """Median seconds of one call over `repeats` calls, after one warm-up call."""
    function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def percentile(values, fraction):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]
