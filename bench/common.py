"""
What every bench section shares: the repository root, a shipped config layer, CPU and wall time of a call,
the median of repeated calls, a percentile; for tables in rounds, a fresh process per row, the order in
which the rows take turns, and a row's "median (min-max)".
"""

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
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


def run_fresh(module, *args):
    """`python -m module args` in a fresh Python process (whatever ran before in one process slows the next
    measurement by 10-30% at the benches' shapes), with an empty inductor cache, as a first run sees it;
    returns the JSON of its last line of output."""
    with tempfile.TemporaryDirectory(prefix="bench-inductor-") as cache:
        result = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                                env=os.environ | {"TORCHINDUCTOR_CACHE_DIR": cache})  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"{module} {' '.join(map(repr, args))} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def in_turns(items, index):
    """items in the order of round `index`: each round starts one further down the list, so that no item is
    always the one that runs first on a cool machine."""
    start = index % len(items)
    return list(items[start:]) + list(items[:start])


def spread(values, digits=",.0f"):
    """'median (min-max)' of a row's values over the rounds."""
    return f"{statistics.median(values):{digits}} ({min(values):{digits}}-{max(values):{digits}})"
