"""
`make bench ARGS=eval`: log-likelihood requests per second of ENLACE inside lm-evaluation-harness
(harness.EnlaceLM on the checkpoint) against lm-eval's own `hf` backend on the export of the same run:
the same requests, batch 1 and 16, timed side by side in interleaved rounds.
"""

import os
import statistics
import tempfile
import time

import torch

import checkpoint
import export
from bench.common import ROOT
from bench.serve import serve_bench_run
from evaluation import harness

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "eval")


def choice_requests(shots=(0, 1, 2, 3)):
    """The multiple-choice fixture's loglikelihood requests at several few-shot counts: 45 questions'
    choices each time, contexts of about 15 to 120 tokens, no two requests alike (lm-eval's `hf` would
    score a repeated one once)."""
    harness.prepare_hub_access(harness.load_settings(), offline=True)
    plan = harness.plan_of("enlace_fixture_choice", harness.load_settings(), False, FIXTURES)
    manager = harness.task_manager_for(plan)
    requests = []
    for k in shots:
        [task] = harness.load_tasks(manager, plan)
        task.set_config(key="num_fewshot", value=k)
        task.set_fewshot_seed(seed=1234)
        task.build_all_requests()
        requests += task.instances
    return requests


def bench_eval(batch_sizes=(1, 16), rounds=5):
    """Requests per second of each backend at each batch size (medians of `rounds` timings) and the
    enlace/hf ratio: the median, and the range, of the ratios of the rounds, each round timing the two
    back to back so that a neighbour process slows both alike. Also the largest difference of a request's
    log-likelihood between them."""
    from lm_eval.models.huggingface import HFLM  # transformers: a development dependency, only here

    with tempfile.TemporaryDirectory() as folder:
        run = serve_bench_run(folder)
        hf_dir = os.path.join(folder, "hf")
        export.export(run, "hf", hf_dir, log=lambda *a: None)
        backend = harness.load_settings()["attention_backend"]["cpu"]  # as evaluation/runs.py runs on the CPU
        model, cfg, tokenizer, path = checkpoint.load_run(run, log=lambda *a: None, attention_backend=backend)
        requests = choice_requests()
        enlace = harness.EnlaceLM.from_model(model, tokenizer, 1, 256, 1234, path)
        hf = HFLM(pretrained=hf_dir, device="cpu", batch_size=1, dtype="float32", add_bos_token=True)
        contenders = {"enlace": enlace, "hf": hf}
        print(f"eval: {len(requests)} loglikelihood requests of {os.path.basename(run)} ({model.num_params() / 1e6:.1f}M "
              f"parameters, context {model.seq_len}), {torch.get_num_threads()} threads; load average "
              f"{load_average()} on {os.cpu_count()} CPUs", flush=True)  # fmt: skip
        for batch_size in batch_sizes:
            enlace.batch_size, hf.batch_size_per_gpu = batch_size, batch_size
            times, answers = {label: [] for label in contenders}, {}
            for _ in range(rounds + 1):  # the first round warms up and is not counted
                for label, lm in contenders.items():
                    start = time.perf_counter()
                    answers[label] = lm.loglikelihood(requests, disable_tqdm=True)
                    times[label].append(time.perf_counter() - start)
            rate = {label: len(requests) / statistics.median(t[1:]) for label, t in times.items()}
            ratios = sorted(h / e for e, h in zip(times["enlace"][1:], times["hf"][1:], strict=True))
            gap = max(abs(a[0] - b[0]) for a, b in zip(answers["enlace"], answers["hf"], strict=True))
            print(f"  batch {batch_size:>2}: enlace {rate['enlace']:6.1f} requests/s | hf {rate['hf']:6.1f} requests/s | "
                  f"enlace/hf {statistics.median(ratios):.2f}x (rounds {ratios[0]:.2f}-{ratios[-1]:.2f}) | largest "
                  f"log-likelihood difference {gap:.1e} | load average {load_average()}", flush=True)  # fmt: skip


def load_average():
    with open("/proc/loadavg") as f:
        return f.read().split()[0]
