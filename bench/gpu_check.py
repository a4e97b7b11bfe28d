"""
The GPU acceptance check: one command that says whether ENLACE works on the board this machine has.

    make gpu-check                       on the board (a bare machine gets the check's own venv first)
    make gpu-check PYTHON=... OFFLINE=1  an interpreter with a CUDA torch and the wheelhouse (make wheelhouse):
                                         no venv, no package index, no download (bench/wheelhouse.py)
    make gpu-check DEVICE=cpu            the same plumbing with tiny shapes, in seconds (CI runs it)
    python -m bench.gpu_check [--device cuda|cpu] [--train-seconds S] [--profile NAME] [--work DIR] [--report FILE]
                              [--data WHEELHOUSE/data] [--measured-file PROFILE.yaml]

Each step prints what it does as it goes; every figure lands in gpu-report.md. A failing step is reported
and the next ones still run when they can; the exit status is 1 if any step failed.

  board     the device, its CUDA capability and whether bf16 runs on silicon; the shipped hardware profile
            of that board (by capability, or --profile), checked by hardware.check_hardware; a matmul in the
            profile's dtype against the profile's peak_tflops, and in bfloat16 and float16 (the two policies)
  data      with --data (the wheelhouse's): its pretokenised smoke corpus, nothing built; else the stage-1
            example's shards (data/corpus) if they are built, else the smoke corpus (built if missing);
            tiny-50m takes that tokenizer's vocabulary
  pretrain  train.py on the board's run file (configs/pretrain-<board>.yaml: tiny-50m with the profile's
            dtype, attention kernel and compile setting) for --train-seconds after its first step, then
            SIGINT: tokens/s and MFU (anchors: llm.c ~50% on an H100 in bf16, nanochat ~41%); its tokens/s
            become the profile's `measured:` entry (--measured-file; on a board, the profile's own file)
  pretrain-2060  on a board, the same under the 2060's policy (configs/pretrain-2060.yaml: float16, GradScaler,
            mem_efficient attention): the kernels the 2060 runs, on this board
  memory    on a board, torch.cuda.max_memory_allocated over training steps against the plan's estimate
  resume    the resume check (checkpoint.resume_check) on the board: bit-identical, or which ops have no deterministic kernel and
            the largest difference
  ddp       with 2+ GPUs: torchrun on all of them, stopped half-way, then --resume to the end
  export    the pretrained run as Hugging Face files; transformers' logits and greedy tokens against
            ENLACE's on the same device (TF32 off for the comparison)
  serve     serve/app.py on the device: chat completions through the server's worker, decode tokens/s
  eval      evaluation/runs.py on its local fixture tasks, when this checkout has evaluation/runs.py and such tasks
            and this interpreter has lm-eval (the offline wheelhouse leaves it out)
"""

import argparse
import contextlib
import datetime
import glob
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
import warnings

import torch

import checkpoint
import config
import data
import fileio
import hardware
import microbatch
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")
# The shipped profile of each board, by CUDA capability: an H100 is sm90 like the H200 and has its dense
# bf16 peak. A board missing here needs --profile (and a configs/pretrain-<board>.yaml of its own).
BOARDS = {(7, 5): "turing-2060", (9, 0): "hopper-h200", (12, 0): "blackwell-5090"}
CPU_RUN = os.path.join(CONFIGS, "gpu-check-cpu.yaml")
DEFAULTS = {  # measurement sizes: the board's own, or seconds of plumbing on a CPU
    "cuda": {"train_seconds": 120, "matmul_size": 8192, "resume_steps": 20, "ddp_steps": 20, "decode_tokens": 256},
    "cpu": {"train_seconds": 3, "matmul_size": 512, "resume_steps": 4, "ddp_steps": 4, "decode_tokens": 16},
}  # fmt: skip


class CheckError(Exception):
    """A step that cannot go on; the message says why and what to do."""


class Skip(Exception):  # noqa: N818 - a verdict, not an error
    """A step that does not apply to this machine; the message says why."""


class Check:
    """The steps' results as they come, printed with the elapsed time and kept for the report."""

    def __init__(self, args):
        self.args, self.start, self.rows, self.details = args, time.monotonic(), [], []
        self.failed = False

    def say(self, message):
        elapsed = time.monotonic() - self.start
        print(f"[{int(elapsed // 60):2d}m{int(elapsed % 60):02d}s] {message}", flush=True)

    def run(self, name, function, *args):
        """function(check, *args) -> (summary, detail lines, result); Skip skips the step, any other exception
        (or a detail line starting with FAIL) fails it."""
        self.say(f"{name} ...")
        started = time.monotonic()
        try:
            summary, lines, result = function(self, *args)
            verdict = "PASS"
        except Skip as e:
            summary, lines, result, verdict = str(e), [], None, "skipped"
        except CheckError as e:
            summary, lines, result, verdict = str(e), [], None, "FAIL"
        except Exception as e:  # noqa: BLE001 - any failure of a step is its verdict; the check goes on
            trace = traceback.format_exc().strip().splitlines()[-20:]  # a bug to diagnose: kept in the report
            summary, lines, result, verdict = f"{type(e).__name__}: {e}", trace, None, "FAIL"
        summary = " ".join(summary.split()).replace("|", "\\|")  # one line of the report's table
        if verdict == "PASS" and any(line.startswith("FAIL") for line in lines):
            verdict = "FAIL"
        self.failed |= verdict == "FAIL"
        seconds = time.monotonic() - started
        self.rows.append((name, verdict, summary, seconds))
        self.details.append((name, lines))
        self.say(f"{name}: {verdict}: {summary} ({seconds:.0f} s)")
        for line in lines:
            print(f"           {line}", flush=True)
        return result

    def report(self, path):
        args = self.args
        lines = [
            "# ENLACE GPU acceptance check",
            "",
            f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, code {fileio.code_version()}, "
            f"`python -m bench.gpu_check --device {args.device}`; total {time.monotonic() - self.start:.0f} s"
            + (
                f" after {args.setup_seconds} s of setup (venv and packages)"
                if args.setup_seconds is not None
                else ""
            ),
            "",
            "| step | verdict | result | seconds |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {name} | {verdict} | {summary} | {seconds:.0f} |"
            for name, verdict, summary, seconds in self.rows
        ]
        for name, details in self.details:
            if details and details[0].startswith("Traceback"):
                lines += ["", f"## {name}", "", "```", *details, "```"]
            elif details:
                lines += ["", f"## {name}", ""] + [f"- {line}" for line in details]
        fileio.write_atomic(path, lambda f: f.write(("\n".join(lines) + "\n").encode("utf-8")))


def write_run_file(cfg, path):
    """A resolved config as a run file train.py reads, validated as train.py will validate it."""
    fileio.write_atomic(path, lambda f: f.write(config.dump(cfg).encode("utf-8")))
    try:
        return config.load(path)
    except config.ConfigError as e:
        raise CheckError(f"{path}: " + "; ".join(e.problems)) from None


def with_train(cfg, name, work, **train_settings):
    """A copy of cfg as the run `name` under the work folder, with some train settings changed."""
    copy = json.loads(json.dumps(cfg))
    copy["run_name"] = name
    copy["train"] |= {"runs_dir": work, "replace_run": True, "sample_tokens": 0} | train_settings
    return copy


def metrics_of(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# -----------------------------------------------------------------------------
# board


def pick_profile(device, caps, name=None):
    """(profile name, its resolved layer): --profile, or the board's by capability, or cpu."""
    if device == "cpu":
        name = name or "cpu"
    elif not caps.cuda_available:
        raise CheckError(
            "no CUDA device on this machine; `make gpu-check DEVICE=cpu` runs the plumbing on the CPU"
        )
    elif name is None:
        sm = f"sm{caps.capability[0]}{caps.capability[1]}"
        name = BOARDS.get(tuple(caps.capability))
        if name is None:
            shipped = ", ".join(f"{n} (sm{c[0]}{c[1]})" for c, n in BOARDS.items())
            raise CheckError(f"no shipped hardware profile for {caps.name} ({sm}); profiles: {shipped}. Write "
                             "configs/hardware/<board>.yaml and configs/pretrain-<board>.yaml, then pass "
                             "--profile <board's profile name>")  # fmt: skip
    path = os.path.join(CONFIGS, "hardware", f"{name}.yaml")
    if not os.path.exists(path):
        raise CheckError(f"--profile {name}: {path} does not exist")
    try:
        profile = config.load_layer("hardware", path)
    except config.ConfigError as e:
        raise CheckError(f"{path}: " + "; ".join(e.problems)) from None
    problems = hardware.check_hardware(profile, caps)
    if problems:
        raise CheckError(" ".join(problems))
    return name, profile


def step_board(check):
    args = check.args
    caps = hardware.probe_device() if args.device == "cuda" else hardware.DeviceCaps(cuda_available=False)
    name, profile = pick_profile(args.device, caps, args.profile)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    dtype = getattr(torch, profile["dtype"])
    measured = hardware.measure_peak_tflops(device, dtype, size=args.matmul_size, seconds=2.0)
    board_name = caps.name if caps.cuda_available else "cpu"
    if caps.cuda_available:
        memory = torch.cuda.get_device_properties(0).total_memory / 2**30
        found = (f"sm{caps.capability[0]}{caps.capability[1]}, bf16 on silicon: {'yes' if caps.bf16_native else 'no'}, "
                 f"{torch.cuda.device_count()} GPU(s) of {memory:.0f} GiB")  # fmt: skip
    else:
        found = f"{os.cpu_count()} CPUs, {torch.get_num_threads()} threads"
    lines = [
        f"device: {board_name}, {found}",
        f"torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}",
        f"profile {name}: {profile['dtype']}, attention {profile['attention_backend']}, compile "
        f"{profile['compile']}, grad scaler {profile['grad_scaler']}, peak_tflops {profile['peak_tflops']}",
        f"matmul {args.matmul_size}x{args.matmul_size} in {profile['dtype']}: {measured:.1f} TFLOP/s measured",
    ]
    for other in ("bfloat16", "float16"):  # the two policies: the 2060's float16, the newer boards' bfloat16
        if other != profile["dtype"]:
            rate = hardware.measure_peak_tflops(
                device, getattr(torch, other), size=args.matmul_size, seconds=1.0
            )
            lines.append(
                f"matmul {args.matmul_size}x{args.matmul_size} in {other}: {rate:.3g} TFLOP/s measured"
            )
    summary = f"profile {name}, {board_name}, matmul {measured:.3g} TFLOP/s"
    if profile["peak_tflops"]:
        ratio = measured / profile["peak_tflops"]
        lines.append(f"measured / profile peak: {100 * ratio:.0f}% of {profile['peak_tflops']} TFLOP/s")
        summary += f" = {100 * ratio:.0f}% of the profile's {profile['peak_tflops']}"
    machine = f"{board_name}, torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}"
    return summary, lines, {"name": name, "profile": profile, "measured_tflops": measured, "machine": machine}


# -----------------------------------------------------------------------------
# data


def step_data(check):
    """The data layer tiny-50m trains on, built if missing (the corpus steps skip what is up to date)."""
    args = check.args
    if args.data:
        return packed_data(args)
    from corpus import pipeline  # datatrove and the filters' libraries: only where the corpus is built

    if args.device == "cpu":
        layer = config.load(CPU_RUN)["data"] | {"dir": os.path.join(args.work, "data")}
        what = "a small smoke corpus (configs/gpu-check-cpu.yaml)"
    else:
        stage1 = config.load_layer("data", os.path.join(CONFIGS, "data", "corpus.yaml"))
        if data.shard_paths(stage1, "train") and os.path.exists(data.tokenizer_path(stage1)):
            layer, what = stage1, "the stage-1 example's shards (data/corpus)"
        else:
            layer = config.load_layer("data", os.path.join(CONFIGS, "data", "corpus-smoke.yaml"))
            what = "the smoke corpus (data/corpus-smoke; the stage-1 shards are not built here)"
    # Its training runs stop by the clock (max_steps 10**9), not by their steps: no token budget to check.
    layer = layer | {"warn_epochs": None, "max_epochs": None}
    for step in (pipeline.build_corpus, pipeline.train_tokenizer, pipeline.encode):
        step(layer, log=check.say)
    tokenizer = data.load_tokenizer(layer)
    tokens = sum(data.read_shard_header(path)[0] for path in data.shard_paths(layer, "train"))
    summary = f"{what}: {tokens:,} train tokens, {tokenizer.vocab_size:,}-token vocabulary"
    return summary, [summary], layer


def packed_data(args):
    """The wheelhouse's pretokenised shards (bench/wheelhouse.py), read where they are: nothing is built."""
    from bench import wheelhouse

    name = "gpu-check-cpu" if args.device == "cpu" else "corpus-smoke"
    layer = config.load(os.path.join(ROOT, wheelhouse.DATA[name]))["data"]
    layer = layer | {"dir": os.path.join(args.data, name), "warn_epochs": None, "max_epochs": None}
    if not data.shard_paths(layer, "train") or not os.path.exists(data.tokenizer_path(layer)):
        raise CheckError(f"{layer['dir']}: no train shards or tokenizer.model; make the wheelhouse again")
    tokenizer = data.load_tokenizer(layer)
    tokens = sum(data.read_shard_header(path)[0] for path in data.shard_paths(layer, "train"))
    summary = (
        f"the wheelhouse's {name} shards: {tokens:,} train tokens, {tokenizer.vocab_size:,}-token vocabulary"
    )
    return summary, [summary, f"read from {layer['dir']} (pretokenised; nothing built here)"], layer


# -----------------------------------------------------------------------------
# pretrain


def run_file_of(args, board):
    if args.device == "cpu":
        return CPU_RUN
    path = os.path.join(CONFIGS, f"pretrain-{board['name'].split('-')[-1]}.yaml")
    if not os.path.exists(path):
        raise CheckError(
            f"no run file {path} for the profile {board['name']}: write one like pretrain-5090.yaml"
        )
    return path


def timed_training(check, run_file, seconds):
    """train.py RUN_FILE until `seconds` after its first logged step, then SIGINT (it checkpoints and
    stops); returns its output lines."""
    command = [sys.executable, os.path.join(ROOT, "train.py"), run_file]
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines, first_step = [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("step "):
                first_step.set()
                check.say(line.rstrip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while not first_step.wait(1.0):  # start-up, data loading and (with compile) compilation
        if proc.poll() is not None:
            break
    if proc.poll() is None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
    proc.wait()
    reader.join()
    if proc.returncode != 0 or not any(line.startswith("stopped at step") for line in lines):
        raise CheckError(f"train.py ended with status {proc.returncode}: " + " | ".join(lines[-5:]))
    return lines


def model_layer_name(run_file):
    """The model layer's file name of a run file (model/tiny-50m.yaml -> tiny-50m): what measured: is keyed by."""
    import yaml

    with open(run_file, encoding="utf-8") as f:
        include = (yaml.safe_load(f) or {}).get("include") or {}
    return os.path.splitext(os.path.basename(include.get("model", "")))[0]


def step_pretrain(check, board, data_layer, run_file=None, name="gpu-check-pretrain"):
    args = check.args
    run_file = run_file or run_file_of(args, board)
    cfg = config.load(run_file)
    cfg["data"] = data_layer
    cfg["model"]["vocab_size"] = data.load_tokenizer(data_layer).vocab_size
    huge = 10**9  # stopped by time: no evaluation, no checkpoint but the one the stop writes
    cfg = with_train(cfg, name, args.work, max_steps=huge, eval_interval=0, ckpt_interval=huge)
    path = os.path.join(args.work, f"{name}.yaml")
    cfg = write_run_file(cfg, path)
    lines = timed_training(check, path, args.train_seconds)
    run_dir = train.run_dir_of(cfg)
    records = [r for r in metrics_of(run_dir) if "tokens_per_s" in r]
    timed = records[1:] or records  # the first window holds the warm-up (and compilation)
    if not timed:
        raise CheckError("train.py logged no step: " + " | ".join(lines[-5:]))
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in timed)
    mfu = statistics.median(r["mfu"] for r in timed)
    header = next(line for line in lines if line.startswith("run "))
    peak = float(re.search(r"matmul peak (\S+) TFLOP/s", header).group(1))  # the profile's, or measured there
    mfu_measured = mfu * peak / board["measured_tflops"]
    details = [
        header,
        next(line for line in lines if line.startswith("global batch")),
        f"{records[-1]['step']} steps in {records[-1]['elapsed_s']:.0f} s, loss {records[0]['loss']:.3f} -> "
        f"{records[-1]['loss']:.3f}",
        f"tokens/s (median of {len(timed)} logged windows): {tokens_per_s:,.0f}",
        f"MFU: {100 * mfu:.1f}% of train.py's reference peak ({peak:g} TFLOP/s: the profile's, or measured), "
        f"{100 * mfu_measured:.1f}% of the board step's matmul ({board['measured_tflops']:.3g}); anchors: llm.c "
        "~50% (H100, bf16), nanochat ~41%",
    ]
    summary = f"{tokens_per_s:,.0f} tokens/s, MFU {100 * mfu:.1f}% ({records[-1]['step']} steps)"
    if cfg["hardware"]["dtype"] == "float16":
        details.append(f"{cfg['hardware']['name']}'s policy: float16 autocast, GradScaler, attention "
                       f"{cfg['hardware']['attention_backend']}")  # fmt: skip
    if name == "gpu-check-pretrain" and args.measured_file:
        entry = {"tokens_per_s": round(tokens_per_s), "date": f"{datetime.date.today():%Y-%m-%d}",
                 "machine": board["machine"]}  # fmt: skip
        write_measured(args.measured_file, model_layer_name(run_file), entry)
        details.append(f"{args.measured_file}: measured.{model_layer_name(run_file)} = {entry}")
    return summary, details, cfg


def write_measured(path, model, entry):
    """The profile's `measured:` block with this model's entry, the rest of the file (its comments) kept;
    the file is validated as a hardware layer before it replaces the old one."""
    import yaml

    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    measured = dict(yaml.safe_load("\n".join(lines))["hardware"].get("measured") or {})
    measured[model] = entry
    start = next((i for i, line in enumerate(lines) if line.startswith("  measured:")), len(lines))
    end = start + 1
    while end < len(lines) and lines[end].startswith("    "):
        end += 1
    block = yaml.safe_dump({"measured": measured}, sort_keys=True, allow_unicode=True, width=200)
    comment = "  # bench/gpu_check.py's pretrain step: tokens/s of the whole run on the machine named"
    lines[start:end] = [comment] + ["  " + line for line in block.splitlines()]
    text = "\n".join(lines) + "\n"
    staged = path + ".measured"  # validated where it will live (its includes resolve the same way)
    fileio.write_atomic(staged, lambda f: f.write(text.encode("utf-8")))
    try:
        config.load_layer("hardware", staged)
    except config.ConfigError as e:
        os.remove(staged)
        raise CheckError(
            f"{path}: the measured block would make it invalid: " + "; ".join(e.problems)
        ) from None
    os.replace(staged, path)


def step_pretrain_2060(check, board, data_layer):
    """tiny-50m under the 2060's policy on this board: float16 autocast, GradScaler, mem_efficient attention."""
    if check.args.device == "cpu":
        raise Skip("the 2060's kernels (float16 with mem_efficient attention) are CUDA's")
    return step_pretrain(
        check, board, data_layer, os.path.join(CONFIGS, "pretrain-2060.yaml"), "gpu-check-2060"
    )


# -----------------------------------------------------------------------------
# memory


def step_memory(check, cfg):
    """torch.cuda.max_memory_allocated over three training steps of the run's shapes, against the plan's
    estimate (microbatch.py's step + the attention kernel's workspace: chain/plan.py)."""
    from chain import plan as chain_plan
    from model import Transformer

    estimate = chain_plan.step_memory_bytes(cfg)
    if check.args.device == "cpu":
        raise Skip(
            f"torch.cuda.max_memory_allocated needs a board; the estimate: {estimate / microbatch.GIB:.2f} GiB"
        )
    board = hardware.setup_hardware(cfg["hardware"])
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = Transformer(cfg["model"], attention_backend=board.attention_backend,
                        loss_chunk_size=board.loss_chunk_size).to(board.device)  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    shape = (cfg["train"]["micro_batch_size"], cfg["model"]["seq_len"])
    for _ in range(3):
        x, y = (torch.randint(0, cfg["model"]["vocab_size"], shape, device=board.device) for _ in range(2))
        with board.autocast():
            _, losses = model(x, y)
        board.scaler.scale(losses["loss"]).backward()
        board.scaler.step(optimizer)
        board.scaler.update()
        optimizer.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated()
    del model, optimizer
    torch.cuda.empty_cache()
    details = [
        f"micro-batch {shape[0]} x {shape[1]} tokens, {cfg['hardware']['dtype']}, AdamW: "
        f"torch.cuda.max_memory_allocated {peak / microbatch.GIB:.2f} GiB (measured)",
        f"the plan's estimate: {estimate / microbatch.GIB:.2f} GiB ({100 * estimate / peak:.0f}% of the measured)",
    ]
    return (
        f"{peak / microbatch.GIB:.2f} GiB measured, {estimate / microbatch.GIB:.2f} GiB estimated",
        details,
        None,
    )


# -----------------------------------------------------------------------------
# resume


def nondeterministic_ops(cfg):
    """The ops of one training step that have no deterministic kernel on this device (torch names them
    when deterministic algorithms are asked for with warn_only)."""
    from model import Transformer

    board = hardware.setup_hardware(cfg["hardware"])
    torch.manual_seed(0)
    model = Transformer(
        cfg["model"],
        attention_backend=board.attention_backend,
        loss_chunk_size=board.loss_chunk_size,
    ).to(board.device)  # built as train.py builds it, so the probe runs the training step's kernels
    shape = (cfg["train"]["micro_batch_size"], cfg["model"]["seq_len"])
    x, y = (torch.randint(0, cfg["model"]["vocab_size"], shape, device=board.device) for _ in range(2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            with board.autocast():
                _, losses = model(x, y)
            losses["loss"].backward()
        finally:
            torch.use_deterministic_algorithms(False)
    found = {
        str(w.message).split(" does not have a deterministic")[0]
        for w in caught
        if "deterministic" in str(w.message)
    }
    return sorted(found)


def step_resume(check, cfg):
    args = check.args
    steps = args.resume_steps
    short = with_train(cfg, "gpu-check-resume", args.work, max_steps=steps, warmup_steps=1, decay_fraction=0.25,
                       log_interval=1, eval_interval=0, ckpt_interval=steps)  # fmt: skip
    short = write_run_file(short, os.path.join(args.work, "gpu-check-resume.yaml"))
    said = []
    identical = train.check_resume(short, log=said.append)
    verdict = said[-1]
    details = [verdict]
    if identical:
        return f"bit-identical after {steps} steps", details, None
    ops = nondeterministic_ops(short)
    details.append(
        "ops without a deterministic kernel in one training step: "
        + (", ".join(ops) if ops else "none reported")
    )
    largest = re.search(r"largest abs diff ([^)]+)\)", verdict)
    return f"differs after {steps} steps (largest {largest.group(1) if largest else '?'})", details, None


# -----------------------------------------------------------------------------
# ddp


def step_ddp(check, cfg):
    args = check.args
    ranks = torch.cuda.device_count() if args.device == "cuda" else args.cpu_ranks
    if ranks < 2:
        raise Skip(f"{ranks} {'GPU' if args.device == 'cuda' else 'CPU rank'}(s); DDP needs 2 or more")
    steps = args.ddp_steps
    ddp = with_train(cfg, "gpu-check-ddp", args.work, max_steps=steps, warmup_steps=1, decay_fraction=0.25,
                     log_interval=1, eval_interval=0, ckpt_interval=steps)  # fmt: skip
    path = os.path.join(args.work, "gpu-check-ddp.yaml")
    ddp = write_run_file(ddp, path)
    torchrun = [
        os.path.join(os.path.dirname(sys.executable), "torchrun"),
        "--standalone",
        f"--nproc_per_node={ranks}",
    ]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    outputs = []
    for extra in ([f"train.max_steps={steps // 2}"], ["--resume"]):
        done = subprocess.run(
            [*torchrun, "train.py", path, *extra], cwd=ROOT, env=env, capture_output=True, text=True
        )
        outputs.append(done.stdout)
        if done.returncode != 0:
            raise CheckError(
                f"torchrun {' '.join(extra)} ended with status {done.returncode}: {done.stderr[-500:]}"
            )
    if "resumed from" not in outputs[1]:
        raise CheckError("the second torchrun did not resume: " + outputs[1][-300:])
    last = checkpoint.load_checkpoint(train.list_checkpoints(train.run_dir_of(ddp))[0])
    if (last["step"], last["world_size"]) != (steps, ranks):
        raise CheckError(f"the last checkpoint is step {last['step']} of {last['world_size']} ranks")
    rate = [r for r in metrics_of(train.run_dir_of(ddp)) if "tokens_per_s" in r][-1]["tokens_per_s"]
    details = [
        f"{ranks} ranks: {steps // 2} steps, stopped, resumed to {steps}; {rate:,.0f} tokens/s at the end"
    ]
    return f"{ranks} ranks trained and resumed to step {steps}", details, None


# -----------------------------------------------------------------------------
# export


def step_export(check, cfg):
    import transformers

    import export
    from checkpoint import load_run
    from decode import engine

    args = check.args
    run_dir = train.run_dir_of(cfg)
    out = os.path.join(args.work, "export-hf")
    export.export(run_dir, "hf", out, force=True, log=check.say)
    device = "cuda" if args.device == "cuda" else "cpu"
    model, run_cfg, tokenizer, _ = load_run(run_dir, device, log=check.say)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(device).eval()
    tokens = data.load_split_tokens(run_cfg["data"], "val")[: run_cfg["model"]["seq_len"]].astype("int64")
    ids = torch.tensor(tokens, device=device)[None]
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.no_grad():
            difference = (model(ids)[0] - hf(ids).logits).abs().max().item()
        prompt = ids[0, :16]
        ours = list(engine.generate(model, prompt, 32, temperature=0))
        theirs = hf.generate(prompt[None], max_new_tokens=32, do_sample=False)[0, len(prompt) :].tolist()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    stops = {tokenizer.special_ids[t] for t in export.STOP_TOKENS}
    first_stop = next((i + 1 for i, t in enumerate(ours) if t in stops), len(ours))
    same = theirs == ours[:first_stop]  # transformers stops at the eos ids of generation_config, inclusive
    details = [
        f"exported to {out}/ ({', '.join(sorted(os.listdir(out)))})",
        f"float32 logits of {ids.shape[1]} val tokens on {device}: largest |difference| {difference:.2e} "
        f"(tolerance {args.parity_tolerance:g})",
        f"greedy continuation of 16 tokens: {'identical' if same else 'DIFFERENT'} ({len(theirs)} tokens)",
    ]
    if difference > args.parity_tolerance or not same:
        details.append("FAIL: transformers does not reproduce ENLACE on this device")
    return f"logits within {difference:.1e}, greedy {'identical' if same else 'different'}", details, None


# -----------------------------------------------------------------------------
# serve


def post(url, body, key):
    """The JSON answer of a POST to the local server (no proxy: the server is on this machine)."""
    request = urllib.request.Request(url, json.dumps(body).encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    request.add_header("Authorization", f"Bearer {key}")
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=600) as answer:
        return json.load(answer)


def step_serve(check, cfg):
    args = check.args
    run_dir = train.run_dir_of(cfg)
    database = os.path.join(args.work, "serve.sqlite")
    for leftover in glob.glob(database + "*"):
        os.remove(leftover)
    db = f"serve.database={database}"
    serve_py = [sys.executable, "-m", "serve"]
    added = subprocess.run([*serve_py, "member", "add", "gpu", "--role", "adult", db], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)  # fmt: skip
    if added.returncode != 0:
        raise CheckError(f"python -m serve member add: {added.stderr.strip()}")
    key = added.stdout.strip().splitlines()[-1]
    log_path = os.path.join(args.work, "serve.log")
    with open(log_path, "w") as log:
        server = subprocess.Popen([*serve_py, run_dir, "--device", args.device, "--port", "0", db, "serve.tools=false"],
                                  cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)  # fmt: skip
    try:
        line = server.stdout.readline()
        if " at http://" not in line:
            raise CheckError(f"serve/app.py did not start (see {log_path}): {open(log_path).read()[-300:]}")
        url, model_id = line.split(" at ")[1].split()[0].rstrip("/"), line.split("'")[1]
        body = {"model": model_id, "messages": [{"role": "user", "content": "Había una vez"}], "seed": 1}
        try:
            post(url + "/v1/chat/completions", body | {"max_tokens": 4}, key)  # warm-up
            started = time.perf_counter()
            answer = post(url + "/v1/chat/completions", body | {"max_tokens": args.decode_tokens}, key)
            seconds = time.perf_counter() - started
        except urllib.error.HTTPError as e:
            raise CheckError(
                f"the server answered {e.code}: {e.read().decode(errors='replace')[:300]}"
            ) from None
    finally:
        server.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=30)
        if server.poll() is None:
            server.kill()
    usage = answer["usage"]
    rate = usage["completion_tokens"] / seconds
    details = [
        f"serve/app.py {run_dir} --device {args.device}: {usage['prompt_tokens']} prompt tokens, "
        f"{usage['completion_tokens']} generated ({answer['choices'][0]['finish_reason']}) in {seconds:.2f} s",
        f"decode through the server's worker and HTTP: {rate:,.0f} tokens/s (one request, the model alone)",
    ]
    return f"{rate:,.0f} tokens/s for one request ({usage['completion_tokens']} tokens)", details, None


# -----------------------------------------------------------------------------
# eval


def fixture_tasks():
    """(folder, task names) of lm-eval task YAMLs with local data under tests/fixtures/, if any."""
    folders = {}
    for path in glob.glob(os.path.join(ROOT, "tests", "fixtures", "**", "*.yaml"), recursive=True):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        task = re.search(r"^task:\s*(\S+)", text, re.MULTILINE)
        if task and re.search(r"^dataset_path:", text, re.MULTILINE):
            folders.setdefault(os.path.dirname(path), []).append(task.group(1))
    return sorted(folders.items())


def step_eval(check, cfg):
    args = check.args
    if not os.path.exists(os.path.join(ROOT, "evaluation", "runs.py")):
        raise Skip("evaluation/runs.py is not in this checkout")
    if importlib.util.find_spec("lm_eval") is None:
        raise Skip("lm-eval is not installed (the offline wheelhouse leaves it out)")
    tasks = fixture_tasks()
    if not tasks:
        raise Skip("no local lm-eval task under tests/fixtures/")
    details, failed = [], False
    for folder, names in tasks:
        command = [sys.executable, "-m", "evaluation", train.run_dir_of(cfg), "--include-path", folder, "--tasks",
                   ",".join(sorted(names)), "--device", args.device]  # fmt: skip
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
        details.append(f"{' '.join(command[1:])}: status {done.returncode}")
        details += [line for line in done.stdout.splitlines()[-15:] if line.strip()]
        failed |= done.returncode != 0
        if done.returncode != 0:
            details.append("FAIL: " + done.stderr.strip()[-300:])
    count = sum(len(names) for _, names in tasks)
    return f"{count} local task(s) {'failed' if failed else 'ran'}", details, None


# -----------------------------------------------------------------------------


def parse_args(argv):
    parser = argparse.ArgumentParser(description="The GPU acceptance check (writes gpu-report.md).")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--profile", help="a configs/hardware/ profile name (default: the board's, by capability)"
    )
    parser.add_argument("--train-seconds", type=float, help="pretraining time after the first step")
    parser.add_argument("--matmul-size", type=int)
    parser.add_argument("--resume-steps", type=int)
    parser.add_argument("--ddp-steps", type=int)
    parser.add_argument(
        "--cpu-ranks", type=int, default=0, help="with --device cpu: gloo ranks for the DDP step"
    )
    parser.add_argument("--decode-tokens", type=int)
    parser.add_argument(
        "--parity-tolerance", type=float, default=1e-3, help="largest float32 logit difference"
    )
    parser.add_argument(
        "--work", default=os.path.join(ROOT, "runs", "gpu-check"), help="scratch folder (replaced)"
    )
    parser.add_argument("--report", default=os.path.join(ROOT, "gpu-report.md"))
    parser.add_argument(
        "--setup-seconds", type=int, help="the setup time to report (make gpu-check passes it)"
    )
    parser.add_argument("--data", help="the wheelhouse's data folder: pretokenised shards, nothing is built")
    parser.add_argument("--measured-file", help="the hardware profile whose measured: block the pretrain step "
                        "writes (default on a board: the board's profile; on the CPU: none)")  # fmt: skip
    args = parser.parse_args(argv)
    for key, value in DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.work = os.path.abspath(args.work)
    return args


def main(argv):
    args = parse_args(argv)
    check = Check(args)
    if args.setup_seconds is not None:
        check.say(f"setup (venv and packages) took {args.setup_seconds} s")
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    board = check.run("board", step_board)
    if board is not None:
        layer = check.run("data", step_data)
        if args.device == "cuda" and args.measured_file is None:
            args.measured_file = os.path.join(CONFIGS, "hardware", f"{board['name']}.yaml")
        cfg = check.run("pretrain", step_pretrain, board, layer) if layer is not None else None
        if layer is not None:
            check.run("pretrain-2060", step_pretrain_2060, board, layer)
        if cfg is not None:
            check.run("memory", step_memory, cfg)
            check.run("resume", step_resume, cfg)
            check.run("ddp", step_ddp, cfg)
            check.run("export", step_export, cfg)
            check.run("serve", step_serve, cfg)
            check.run("eval", step_eval, cfg)
    check.report(args.report)
    check.say(f"{'FAILED' if check.failed else 'all steps passed'}; report: {args.report}")
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
