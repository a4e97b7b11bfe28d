"""
make recipe: the training recipes side by side at a fixed token budget (issue 33's protocol).

    python -m bench.recipe [--config configs/smoke-cpu.yaml] [--steps 100] [--batch 16] [--seeds 3]
                           [--recipes adamw muon muon+zero_init] [--lr-factors 0.5 1 2]
    python -m bench.recipe --overhead              (the optimizer's step-time overhead at tiny-50m)

A recipe is a base optimizer (adamw or muon) with options after "+": zero_init (model.zero_init_out_proj)
and bos (data.packing bos_aligned; shards configs only). Each base recipe's peak learning rate (train.lr for
adamw, train.muon.lr for muon) is chosen by the same sweep: the config's value times each --lr-factors, the
first seed, lowest final val bpb; the other seeds then train at the chosen rate, and a recipe with options
reuses its base's rate. Runs are interleaved (seed by seed, recipe by recipe) so that the load of a shared
machine falls on every recipe alike. Printed per recipe, mean and spread over the seeds: val bpb at the
budget (equal tokens), val bpb at the shortest run's training seconds (equal wall-clock, linear between
evaluations), the tokens needed to reach adamw's final val bpb (on the seed-mean curve), and seconds per
step, median over the seeds and its range (training only: the logged windows, evaluations and
checkpoints excluded). Runs go to
runs/recipe/<config>/<recipe>-lr<rate>-s<seed>/ (metrics.jsonl; checkpoints deleted) and the table to
summary.json there; `make plot RUN="runs/recipe/smoke-cpu/adamw-... runs/recipe/smoke-cpu/muon-..."`
overlays the curves.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

import config
import fileio
import optim
import train
from bench.common import ROOT, layer
from model import Transformer

OPTIONS = {"zero_init": ["model.zero_init_out_proj=true"], "bos": ["data.packing=bos_aligned"]}
SWEPT_KEY = {"adamw": "train.lr", "muon": "train.muon.lr"}


def recipe_overrides(recipe):
    base, *options = recipe.split("+")
    if base not in SWEPT_KEY or any(option not in OPTIONS for option in options):
        raise SystemExit(f"recipe {recipe!r}: expected adamw or muon, then +{' +'.join(OPTIONS)}")
    return [f"train.optimizer={base}", *(o for option in options for o in OPTIONS[option])]


def budget_overrides(args, runs_dir):
    evals = max(1, args.steps // args.evals)
    return [
        f"train.runs_dir={runs_dir}",
        f"train.max_steps={args.steps}",
        f"train.micro_batch_size={args.batch}",
        "train.grad_accum_steps=1",
        f"train.warmup_steps={max(1, args.steps // 10)}",
        f"train.eval_interval={evals}",
        f"train.log_interval={max(1, evals // 2)}",
        f"train.ckpt_interval={args.steps}",
        "train.sample_tokens=0",
        "train.replace_run=true",
        "hardware.peak_tflops=1.0",  # no start-up matmul to measure the MFU reference: MFU is not compared
    ]


def curve(run_dir, tokens_per_step):
    """[(step, tokens, training seconds, val bpb)] at each evaluation, and the seconds of each logged step
    window (per step): training only, since a window restarts after every evaluation and checkpoint."""
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8")]
    seconds, previous, elapsed, step_seconds = {0: 0.0}, 0, 0.0, []
    for record in records:
        if "tokens_per_s" in record:
            steps = record["step"] - previous
            window = steps * tokens_per_step / record["tokens_per_s"]
            elapsed += window
            seconds[record["step"]], previous = elapsed, record["step"]
            if previous > steps:  # the first window holds the start-up (allocations, first kernels)
                step_seconds.append(window / steps)
    points = [
        (r["step"], r["step"] * tokens_per_step, seconds[r["step"]], r["val_bpb"])
        for r in records
        if "val_bpb" in r
    ]
    return points, step_seconds


def run_once(config_path, name, overrides, tokens_per_step):
    cfg = config.load(config_path, [*overrides, f"run_name={name}"])
    run_dir = train.run_dir_of(cfg)
    started = time.perf_counter()
    train.train(cfg, log=lambda *a, **k: None, stop=train.StopSignals(enabled=False))
    for path in os.listdir(run_dir):
        if path.startswith("ckpt_"):
            os.remove(os.path.join(run_dir, path))
    points, step_seconds = curve(run_dir, tokens_per_step)
    print(
        f"  {name}: val bpb {points[-1][3]:.4f} | {statistics.median(step_seconds):.3f} s/step | "
        f"{time.perf_counter() - started:.0f}s with evaluations",
        flush=True,
    )
    return {"run": run_dir, "points": points, "step_seconds": step_seconds}


def rate_name(value):
    return f"{value:.2e}".replace("e-0", "e-")


def measure(args):
    """Sweep, then seeds: {recipe: [run result per seed]} and {base: chosen rate}."""
    name = os.path.splitext(os.path.basename(args.config))[0]
    runs_dir = os.path.join(args.runs_dir, name)
    cfg = config.load(args.config, budget_overrides(args, runs_dir))
    tokens_per_step = args.batch * cfg["model"]["seq_len"]
    base_rate = {"adamw": cfg["train"]["lr"], "muon": cfg["train"]["muon"]["lr"]}
    bases = sorted({recipe.split("+")[0] for recipe in args.recipes}, key=list(SWEPT_KEY).index)
    seeds = [args.first_seed + i for i in range(args.seeds)]

    def run(recipe, rate, seed):
        base = recipe.split("+")[0]
        overrides = [*budget_overrides(args, runs_dir), *recipe_overrides(recipe), f"train.seed={seed}"]
        overrides.append(f"{SWEPT_KEY[base]}={rate}")
        name = f"{recipe.replace('+', '-')}-lr{rate_name(rate)}-s{seed}"
        return run_once(args.config, name, overrides, tokens_per_step)

    print(
        f"recipe: {args.config}, {args.steps} steps x {tokens_per_step} tokens, sweep on seed {seeds[0]}",
        flush=True,
    )
    sweep = {base: {} for base in bases}
    for factor in args.lr_factors:
        for base in bases:
            rate = base_rate[base] * factor
            sweep[base][rate] = run(base, rate, seeds[0])
    chosen = {base: min(sweep[base], key=lambda r: sweep[base][r]["points"][-1][3]) for base in bases}
    rates = ", ".join(f"{base} {SWEPT_KEY[base]}={chosen[base]:.2e}" for base in bases)
    print(f"chosen peak rates: {rates}", flush=True)
    results = {recipe: [] for recipe in args.recipes}
    for seed in seeds:
        for recipe in args.recipes:
            base = recipe.split("+")[0]
            if recipe == base and seed == seeds[0]:
                results[recipe].append(sweep[base][chosen[base]])
            else:
                results[recipe].append(run(recipe, chosen[base], seed))
    return results, chosen, runs_dir, tokens_per_step


def interpolate(points, x_index, x):
    """val bpb at x (tokens or seconds) on a curve, linear between evaluations; None past its end."""
    for a, b in zip(points, points[1:], strict=False):
        if a[x_index] <= x <= b[x_index]:
            share = (x - a[x_index]) / (b[x_index] - a[x_index]) if b[x_index] > a[x_index] else 1.0
            return a[3] + share * (b[3] - a[3])
    return None


def tokens_to_reach(runs, target):
    """Tokens at which the seed-mean val bpb curve first reaches `target` (linear between evaluations)."""
    mean = [statistics.mean(r["points"][i][3] for r in runs) for i in range(len(runs[0]["points"]))]
    tokens = [p[1] for p in runs[0]["points"]]
    for i, value in enumerate(mean):
        if value <= target:
            if i == 0:
                return tokens[0]
            share = (mean[i - 1] - target) / (mean[i - 1] - value)
            return tokens[i - 1] + share * (tokens[i] - tokens[i - 1])
    return None


def spread(values):
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    deviation = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.4f} ± {deviation:.4f}"


def summarize(results, chosen):
    baseline = "adamw" if "adamw" in results else next(iter(results))
    target = statistics.mean(r["points"][-1][3] for r in results[baseline])
    equal_seconds = min(r["points"][-1][2] for runs in results.values() for r in runs)  # every run got there
    base_step = statistics.median(statistics.median(r["step_seconds"]) for r in results[baseline])
    budget = results[baseline][0]["points"][-1][1]
    rows = []
    for recipe, runs in results.items():
        step_s = [statistics.median(r["step_seconds"]) for r in runs]
        reach = tokens_to_reach(runs, target)
        rows.append(
            {
                "recipe": recipe,
                "rate": chosen[recipe.split("+")[0]],
                "seeds": len(runs),
                "bpb_equal_tokens": [r["points"][-1][3] for r in runs],
                "bpb_equal_seconds": [interpolate(r["points"], 2, equal_seconds) for r in runs],
                "tokens_to_baseline": reach,
                "step_seconds": step_s,
                "overhead": statistics.median(step_s) / base_step - 1,
                "runs": [r["run"] for r in runs],
            }
        )
    header = (
        f"{'recipe':<22} {'peak lr':>9} | val bpb at {budget / 1e3:.0f}k tokens | val bpb at "
        f"{equal_seconds:.0f} s | tokens to {baseline}'s {target:.4f} | s/step median (min-max) (vs {baseline})"
    )
    print(header)
    for row in rows:
        reach = row["tokens_to_baseline"]
        reached = f"{reach / 1e3:.0f}k ({reach / budget:.2f}x)" if reach is not None else "not reached"
        print(
            f"{row['recipe']:<22} {row['rate']:>9.2e} | {spread(row['bpb_equal_tokens']):>17} | "
            f"{spread(row['bpb_equal_seconds']):>15} | {reached:>19} | "
            f"{statistics.median(row['step_seconds']):.3f} ({min(row['step_seconds']):.3f}-"
            f"{max(row['step_seconds']):.3f}) ({100 * row['overhead']:+.1f}%)"
        )
    return {"baseline": baseline, "target_bpb": target, "equal_seconds": equal_seconds, "rows": rows}


def step_seconds(function, rounds):
    function()  # warm-up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), max(times)


def optimizer_overhead(rounds=5, rows=1, seq_len=512):
    """Muon's extra seconds per optimizer step at tiny-50m on this CPU, against the seconds of a training
    step of configs/train/pretrain.yaml's tokens (forward + backward timed on `rows` x `seq_len` tokens)."""
    torch.manual_seed(0)
    model_cfg = layer("model", "tiny-50m")
    net = Transformer(model_cfg, "flash", 1024)
    train_cfg = config.load(os.path.join(ROOT, "configs", "pretrain-2060.yaml"))["train"]
    tokens_per_step = train_cfg["micro_batch_size"] * train_cfg["grad_accum_steps"] * model_cfg["seq_len"]
    x = torch.randint(0, model_cfg["vocab_size"], (rows, seq_len))

    def forward_backward():
        net(x, x)[1]["loss"].backward()

    fb = step_seconds(forward_backward, max(2, rounds // 2))
    timings = {}
    for name in ("adamw", "muon"):
        opt = optim.build_optimizer(net, train_cfg | {"optimizer": name}, "float32")
        timings[name] = step_seconds(opt.step, rounds)
    per_step = fb[0] / (rows * seq_len) * tokens_per_step
    extra = timings["muon"][0] - timings["adamw"][0]
    print(f"tiny-50m on this CPU, median (min-max) of {rounds} steps:")
    for name, (median, low, high) in timings.items():
        print(f"  {name} optimizer step: {median:.3f} s ({low:.3f}-{high:.3f})")
    print(
        f"  forward + backward: {fb[0] / (rows * seq_len) * 1e3:.2f} ms/token ({fb[1]:.2f}-{fb[2]:.2f} s for "
        f"{rows * seq_len} tokens) -> {per_step:.0f} s per step of {tokens_per_step} tokens (pretrain)"
    )
    print(
        f"  Muon's overhead: {extra:+.3f} s per step = {100 * extra / (per_step + timings['adamw'][0]):+.2f}%"
    )


def main(argv):
    parser = argparse.ArgumentParser(description="Training recipes side by side at a fixed token budget.")
    parser.add_argument("--config", default="configs/smoke-cpu.yaml")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps of every run (the budget)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (train.micro_batch_size)")
    parser.add_argument("--evals", type=int, default=10, help="evaluations per run")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--recipes", nargs="+", default=["adamw", "muon", "muon+zero_init"])
    parser.add_argument("--lr-factors", nargs="+", type=float, default=[0.5, 1.0, 2.0])
    parser.add_argument("--runs-dir", default="runs/recipe")
    parser.add_argument("--overhead", action="store_true", help="only the optimizer overhead at tiny-50m")
    args = parser.parse_args(argv)
    if args.overhead:
        optimizer_overhead()
        return 0
    for recipe in args.recipes:
        recipe_overrides(recipe)
    results, chosen, runs_dir, _ = measure(args)
    summary = summarize(results, chosen)
    fileio.write_json(os.path.join(runs_dir, "summary.json"), summary | {"argv": argv})
    print(
        f'summary: {runs_dir}/summary.json; curves: make plot RUN="{" ".join(results[r][0]["run"] for r in results)}"'
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
