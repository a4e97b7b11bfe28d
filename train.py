"""
Train ENLACE from a run file.

    python train.py configs/smoke-cpu.yaml                      # single process
    python train.py configs/pretrain-2060.yaml train.seed=99    # overrides: section.key=value
    python train.py configs/pretrain-2060.yaml --resume         # continue from the newest checkpoint
    python train.py configs/smoke-cpu.yaml --resume-check train.max_steps=20
    torchrun --nproc_per_node=2 train.py configs/pretrain-2060.yaml

Everything a run writes lives in <train.runs_dir>/<run_name>/: config.yaml (resolved), metrics.jsonl
and ckpt_<step>.pt (atomic, the last `keep_last` kept). train.objective picks what a step minimizes
(objective.py: the next token's cross-entropy for pretraining and SFT, or DPO on preference pairs); the
optimizers and their schedule are optim.py's. How boards differ is hardware.py's business; the hardware
profile (configs/hardware/) is the only config layer that knows.
"""

import contextlib
import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

import checkpoint
import config
import data
import fileio
import objective
import optim
from chat import template
from checkpoint import (
    list_checkpoints,
    load_newest_checkpoint,
    save_checkpoint,
)
from corpus import token_budget
from hardware import (
    Dist,
    Hardware,
    HardwareError,
    all_ranks_true,
    init_distributed,
    not_exercised,
    setup_hardware,
)
from model import Transformer

# Keys that fix tensor shapes or the meaning of a step: a resume that changes one of them cannot
# continue the same run. Schedule lengths and intervals may change.
SHAPE_KEYS = [
    ("model", k) for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden")
]
SHAPE_KEYS += [("model", "seq_len"), ("train", "micro_batch_size"), ("train", "grad_accum_steps")]
SHAPE_KEYS += [("data", "format"), ("train", "objective")]


class TrainError(Exception):
    """A problem the user can fix; main() prints it without a traceback and exits 2."""


def shape_differences(saved, current):
    differences = []
    for section, key in SHAPE_KEYS:
        before, now = saved.get(section, {}).get(key), current[section][key]
        if before != now:
            differences.append(f"{section}.{key}: checkpoint has {before!r}, config has {now!r}")
    return differences


# -----------------------------------------------------------------------------
# Logging helpers


def format_duration(seconds):
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def format_rate(tokens_per_second):
    if tokens_per_second >= 1e6:
        return f"{tokens_per_second / 1e6:.2f}M"
    if tokens_per_second >= 1e3:
        return f"{tokens_per_second / 1e3:.1f}k"
    return f"{tokens_per_second:.0f}"


# -----------------------------------------------------------------------------
# Signals: a stop at a step boundary


class StopSignals:
    """SIGINT/SIGTERM ask for a safe stop at a step boundary: the loop finishes the optimizer step in flight,
    writes a checkpoint and returns. A second signal acts at once (the handler before ours), or with
    then_ignore is ignored (--resume-check: its scratch runs must still be removed). enabled=False leaves
    signals to the caller's handlers. Entering it again while entered changes nothing, so that the phases
    of a --resume-check share the check's."""

    def __init__(self, enabled=True, then_ignore=False):
        self.enabled, self.then_ignore = enabled, then_ignore
        self.signum = None  # the signal that asked for the stop
        self.previous, self.depth = {}, 0

    def __enter__(self):
        self.depth += 1
        # Signals only reach the main thread.
        if self.depth == 1 and self.enabled and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.previous[sig] = signal.signal(sig, self.handle)
        return self

    def handle(self, signum, frame):
        self.signum = signum
        if self.then_ignore:
            for sig in self.previous:
                signal.signal(sig, signal.SIG_IGN)
        else:
            signal.signal(signum, self.previous[signum])

    def __exit__(self, *exc):
        self.depth -= 1
        if self.depth == 0:
            for sig, handler in self.previous.items():
                signal.signal(sig, handler)
            self.previous = {}


# -----------------------------------------------------------------------------
# The run


def run_dir_of(cfg):
    return os.path.join(cfg["train"]["runs_dir"], cfg["run_name"])


def training_eval(cfg, ctx, tokenizer, hardware, log):
    """train.eval's benchmark (harness.TrainingEval) on rank 0, its tasks loaded before the first
    step so that a dataset it cannot read stops the run now; None without train.eval."""
    if not cfg["train"].get("eval"):
        return None
    benchmark, problem = None, None
    if ctx.is_main:
        from evaluation import (
            harness,  # lm-evaluation-harness is imported only by the runs that use it
        )

        try:
            benchmark = harness.TrainingEval(cfg, tokenizer, hardware.autocast, log)
        except harness.EvalError as e:
            problem = str(e)
    if not all_ranks_true(problem is None, ctx, hardware.device):
        raise TrainError(f"train.eval: {problem or 'rank 0 could not load its tasks'}")
    return benchmark


def train(cfg, resume=False, stop_after=None, log=print, stop=None):
    """Train `cfg` (a resolved config). Returns the final step. `stop_after` ends the run as an
    interruption would (checkpoint, no final eval), and so does a signal heard by `stop`, a StopSignals
    (None: the run's own): --resume-check passes the one its phases share."""
    ctx = init_distributed(cfg["hardware"], cfg["train"]["dist_timeout_s"])
    try:
        hardware = setup_hardware(
            cfg["hardware"], ctx.local_rank, model_cfg=cfg["model"]
        )  # the one read of the section
        quiet = lambda *a, **k: None
        step = _train(cfg, ctx, hardware, resume, stop_after, log if ctx.is_main else quiet, stop)
        if ctx.enabled:
            dist.barrier()  # rank 0 may still be sampling: no rank tears down gloo under a busy peer
        return step
    finally:
        if ctx.enabled:
            dist.destroy_process_group()


# -----------------------------------------------------------------------------
# Setup: the run directory, the tokenizer, the model and everything a resume restores


def previous_run(cfg, ctx, run_dir, resume, log):
    """(path, checkpoint) to resume from, or (None, None) for a fresh run: checkpoints already in run_dir
    are continued (--resume), removed (train.replace_run) or refused."""
    if resume:
        try:
            ckpt_path, state = load_newest_checkpoint(run_dir, log)
        except checkpoint.CheckpointError as e:
            raise TrainError(f"--resume: {e}") from None
        differences = shape_differences(state["config"], cfg)
        if state.get("world_size", 1) != ctx.world_size:
            differences.append(
                f"world size: checkpoint was written by {state['world_size']} processes, this run has "
                f"{ctx.world_size} (loader and RNG states are per rank; resume with the same count)"
            )
        if differences:
            raise TrainError(
                f"cannot resume {ckpt_path}: shape-defining settings changed:\n  " + "\n  ".join(differences)
            )
        return ckpt_path, state
    if cfg["train"]["replace_run"]:
        if ctx.is_main and list_checkpoints(run_dir):
            log(
                f"replacing the previous run in {run_dir}/ (train.replace_run: true): {checkpoint.replace_run(run_dir)}"
            )
        if ctx.enabled:
            dist.barrier()  # no rank goes on before the old run is gone
    elif list_checkpoints(run_dir):
        raise TrainError(
            f"{run_dir}/ already holds checkpoints; pass --resume to continue it, or choose another run "
            f"name (run_name=...), or set train.replace_run=true to start it afresh"
        )
    return None, None


def run_tokenizer(cfg, ckpt_path, state):
    """(tokenizer, its checkpoint record) of the data, checked against model.vocab_size and against the
    tokenizer a resumed run was trained with."""
    tokenizer = data.load_tokenizer(cfg["data"])
    vocab_size = cfg["model"]["vocab_size"]
    if tokenizer.vocab_size != vocab_size:
        raise TrainError(
            f"model.vocab_size is {vocab_size} but the {tokenizer.name} tokenizer has "
            f"{tokenizer.vocab_size} tokens; set model.vocab_size={tokenizer.vocab_size}"
        )
    record = checkpoint.tokenizer_record(tokenizer)
    ours = record.get("sha256")
    trained_with = checkpoint.stored_tokenizer_sha256(state) if state is not None else None
    if trained_with and trained_with != ours:
        raise TrainError(
            f"cannot resume {ckpt_path}: it was trained with the tokenizer of sha256 {trained_with}, but "
            f"{tokenizer.path} has sha256 {ours}; point data.dir at the data it was trained on (or start a "
            "new run)"
        )
    return tokenizer, record


class Metrics:
    """metrics.jsonl, one JSON record per line, written by rank 0 only; a resume first drops the lines from
    beyond its checkpoint."""

    def __init__(self, run_dir, ctx, step):
        self.file, self.path = None, os.path.join(run_dir, "metrics.jsonl")
        if ctx.is_main:
            _truncate_metrics(self.path, step)
            self.file = open(self.path, "a", encoding="utf-8")

    def write(self, record):
        if self.file:
            with fileio.reporting_storage(self.path, what="a metrics line"):
                self.file.write(json.dumps(record) + "\n")
                self.file.flush()

    def close(self):
        if self.file:
            self.file.close()


@dataclass
class Run:
    """What the loop works on, built by setup(): `model` is what a step calls (compiled and/or DDP-wrapped),
    `raw_model` the Transformer whose weights a checkpoint holds."""

    cfg: dict
    ctx: Dist
    hardware: Hardware
    log: object
    run_dir: str
    tokenizer: object
    tokenizer_record: dict  # what each checkpoint stores of it (checkpoint.tokenizer_record)
    raw_model: Transformer
    optimizer: torch.optim.Optimizer
    loader: object
    benchmark: object  # train.eval's TrainingEval on rank 0, else None
    model: torch.nn.Module = None
    objective: object = None  # what a step minimizes: objective.NextToken or objective.DPO
    step: int = 0
    skipped_steps: int = 0
    metrics: Metrics = None


def check_token_budget(cfg, ctx, log):
    """The passes the run makes over its data, refused past data.max_epochs before anything is built:
    pretraining's tokens against its shards, SFT's conversations and DPO's pairs against their packed
    split (corpus/token_budget.py)."""
    token_budget.check_run_budget(cfg, ctx.world_size, log)


def setup(cfg, ctx, hardware, resume, log):
    """The run, ready for its first step: a fresh one seeded the same on every rank, a resumed one in the
    state its checkpoint saved, a fine-tuning one with the weights of train.init_from."""
    check_token_budget(cfg, ctx, log)
    model_cfg, train_cfg = cfg["model"], cfg["train"]
    run_dir = run_dir_of(cfg)
    ckpt_path, state = previous_run(cfg, ctx, run_dir, resume, log)
    try:
        init = checkpoint.init_checkpoint(cfg, log) if state is None and train_cfg["init_from"] else None
    except checkpoint.CheckpointError as e:
        raise TrainError(str(e)) from None
    os.makedirs(run_dir, exist_ok=True)

    # Seed everything, then build: identical initial weights on every rank.
    random.seed(train_cfg["seed"])
    np.random.seed(train_cfg["seed"])
    torch.manual_seed(train_cfg["seed"])

    tokenizer, tokenizer_record = run_tokenizer(cfg, ckpt_path, state)
    benchmark = training_eval(cfg, ctx, tokenizer, hardware, log)
    model = Transformer(
        model_cfg, attention_backend=hardware.attention_backend, loss_chunk_size=hardware.loss_chunk_size
    ).to(hardware.device)
    optimizer = optim.build_optimizer(model, train_cfg, hardware.muon_ns_dtype)
    loader = data.build_loader(
        cfg["data"], "train", train_cfg["micro_batch_size"], model_cfg["seq_len"], train_cfg["seed"], ctx.rank,
        ctx.world_size,
    )  # fmt: skip
    run = Run(
        cfg, ctx, hardware, log, run_dir, tokenizer, tokenizer_record, model, optimizer, loader, benchmark
    )
    if state is not None:
        restore(run, ckpt_path, state)
    elif init is not None:  # fine-tuning: the weights only; optimizer, schedule and step start afresh
        init_path, init_state = init
        model.load_state_dict(init_state["model"])
        log(f"initialized from {init_path} (step {init_state['step']}); fresh optimizer and schedule")
    run.objective = objective.build(cfg, model, tokenizer, hardware, ctx, state, log)
    # Room on runs_dir's disk for keep_last + 1 checkpoints, before the first step (train.space_check).
    per_checkpoint = checkpoint.estimate_checkpoint_bytes(
        model, optimizer, len(tokenizer_record.get("model", b""))
    )
    checkpoint.check_room_for_checkpoints(
        run_dir, per_checkpoint, train_cfg["keep_last"], train_cfg["space_check"], log
    )

    run.model = torch.compile(model) if hardware.compile else model
    if ctx.enabled:
        run.model = torch.nn.parallel.DistributedDataParallel(
            run.model, device_ids=[ctx.local_rank] if hardware.device.type == "cuda" else None
        )
    return run


def restore(run, ckpt_path, state):
    """Continue a run where its checkpoint left it: weights, optimizer, loss scale, this rank's loader
    position and RNG states, the step."""
    run.raw_model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    if state.get("scaler"):
        run.hardware.scaler.load_state_dict(state["scaler"])
    own = state["ranks"][run.ctx.rank]
    run.loader.load_state_dict(own["loader"])
    checkpoint.set_rng_state(own["rng"])
    run.step = state["step"]
    run.skipped_steps = state.get("skipped_steps", 0)
    run.log(f"resumed from {ckpt_path} at step {run.step}")


def start_log(run):
    """Rank 0 writes the resolved config.yaml and says what trains where, with which batch."""
    cfg, hardware, log = run.cfg, run.hardware, run.log
    fileio.write_atomic(
        os.path.join(run.run_dir, "config.yaml"), lambda f: f.write(config.dump(cfg).encode())
    )
    log(
        f"run {cfg['run_name']}: {run.raw_model.num_params() / 1e6:.2f}M parameters on "
        f"{hardware.description}, {hardware.dtype}, attention {hardware.attention_backend}, "
        f"matmul peak {hardware.peak_tflops:.3g} TFLOP/s (MFU reference)"
    )
    if not_exercised(cfg["hardware"]):
        log(not_exercised(cfg["hardware"]))
    for line in run.objective.describe():
        log(line)


# -----------------------------------------------------------------------------
# One optimizer step, its log line, evaluation and checkpoint


@dataclass
class StepResult:
    loss_sum: torch.Tensor  # the step's mean loss (this rank's until the log line averages the ranks)
    figure_sums: torch.Tensor  # the objective's figures summed over this rank's micro-batches
    grad_norm: torch.Tensor
    finite: bool  # False: the step was skipped (a non-finite loss or gradient on some rank)
    tokens: int  # tokens this rank trained on


def update_loss_scale(scaler, finite, gradients_finite):
    """GradScaler's own update: unscale_ recorded any overflow in this rank's gradients, so a skipped step
    backs off by backoff_factor and resets the growth tracker (the scale cannot grow straight back). A step
    skipped for what the gradients here did not show (a non-finite loss, another rank's overflow) gets the
    same backoff through the scaler's state: update(new_scale) would leave the tracker counting."""
    scale = scaler.get_scale()
    scaler.update()
    if not finite and gradients_finite:
        state = scaler.state_dict()
        scaler.load_state_dict(state | {"scale": scale * state["backoff_factor"], "_growth_tracker": 0})


def optimizer_step(run, lr):
    """One optimizer step at learning rate `lr`: grad_accum_steps micro-steps (DDP syncs gradients only on
    the last, no_sync on the others), the gradient clipped, the step applied unless the loss or a gradient
    is not finite on some rank, the GradScaler updated."""
    model, optimizer, hardware, ctx = run.model, run.optimizer, run.hardware, run.ctx
    train_cfg = run.cfg["train"]
    accum = train_cfg["grad_accum_steps"]
    optim.set_lr(optimizer, lr, train_cfg)
    loss_sum = torch.zeros((), device=hardware.device)
    figure_sums, step_tokens = None, 0
    for micro in range(accum):
        sync = micro == accum - 1
        with model.no_sync() if ctx.enabled and not sync else contextlib.nullcontext():
            loss, sums, tokens = run.objective.micro_step(model, run.loader.next_batch())
            loss = loss / accum
            hardware.scaler.scale(loss).backward()
        loss_sum += loss.detach()
        figure_sums = sums if figure_sums is None else figure_sums + sums
        step_tokens += tokens

    hardware.scaler.unscale_(optimizer)
    max_norm = train_cfg["grad_clip"] if train_cfg["grad_clip"] > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), max_norm)
    # Every rank must agree whether to apply this step (with float16 the GradScaler decides per rank
    # from its own gradients; DDP makes them equal, the all-reduce makes it certain).
    finite = all_ranks_true(
        bool(torch.isfinite(grad_norm)) and bool(torch.isfinite(loss_sum)), ctx, hardware.device
    )
    if finite:
        hardware.scaler.step(optimizer)
    if hardware.scaler.is_enabled():
        update_loss_scale(hardware.scaler, finite, bool(torch.isfinite(grad_norm)))
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_sum, figure_sums, grad_norm, finite, step_tokens)


class Window:
    """Training tokens and wall time since the last log line; evaluation, checkpoint and benchmark time
    restart it, so tokens/s and MFU measure training only."""

    def __init__(self, start_step):
        self.run_start, self.start_step = time.perf_counter(), start_step
        self.restart()

    def restart(self):
        self.start, self.tokens = time.perf_counter(), 0


def log_step(run, result, lr, window):
    """The step's record in metrics.jsonl and its log line, the loss averaged over the ranks."""
    ctx, hardware, train_cfg, step = run.ctx, run.hardware, run.cfg["train"], run.step
    if ctx.enabled:
        dist.all_reduce(result.loss_sum)  # gloo has no AVG
        result.loss_sum /= ctx.world_size
        if result.figure_sums.numel():
            result.figure_sums = result.figure_sums.to(hardware.device)
            dist.all_reduce(result.figure_sums)
    if hardware.device.type == "cuda":
        torch.cuda.synchronize()
    now = time.perf_counter()
    tokens_per_second = window.tokens * ctx.world_size / (now - window.start)
    flops_per_token = run.raw_model.flops_per_token(run.cfg["model"]["seq_len"])
    mfu = flops_per_token * tokens_per_second / (hardware.peak_tflops * 1e12 * ctx.world_size)
    elapsed = now - window.run_start
    eta = elapsed / (step - window.start_step) * (train_cfg["max_steps"] - step)
    record = {
        "step": step,
        "loss": result.loss_sum.item(),
        "lr": lr,
        "grad_norm": result.grad_norm.item(),
        "tokens_per_s": tokens_per_second,
        "mfu": mfu,
        "elapsed_s": elapsed,
        "eta_s": eta,
        "skipped_steps": run.skipped_steps,
    }
    if hardware.scaler.is_enabled():
        record["loss_scale"] = hardware.scaler.get_scale()
    figures, figures_text = run.objective.figures(result.figure_sums.cpu())
    record |= figures
    run.metrics.write(record)
    run.log(
        f"step {step}/{train_cfg['max_steps']} | loss {record['loss']:.4f} | "
        + figures_text
        + f"lr {lr:.1e} | gnorm {record['grad_norm']:.2f} | {format_rate(tokens_per_second)} tok/s | "
        f"mfu {100 * mfu:.0f}% | {format_duration(elapsed)} | eta {format_duration(eta)}"
        + (f" | skipped {run.skipped_steps}" if run.skipped_steps else "")
    )
    window.restart()


def evaluate_run(run):
    """The held-out evaluation of the objective being trained, into metrics.jsonl and the log."""
    result, text = run.objective.evaluate(run.model)
    run.metrics.write({"step": run.step, **result})
    run.log(f"eval step {run.step} | {text}")


def write_checkpoint(run):
    """Every rank's loader position and RNG states gathered to rank 0, which writes the checkpoint; all
    ranks wait until it is on disk."""
    ctx = run.ctx
    rank_state = {"rng": checkpoint.rng_state(), "loader": run.loader.state_dict()}
    ranks = [None] * ctx.world_size
    if ctx.enabled:
        dist.all_gather_object(ranks, rank_state)
    else:
        ranks = [rank_state]
    if ctx.is_main:
        state = {
            "step": run.step,
            "model": run.raw_model.state_dict(),
            "optimizer": run.optimizer.state_dict(),
            "scaler": run.hardware.scaler.state_dict() if run.hardware.scaler.is_enabled() else {},
            "ranks": ranks,
            "skipped_steps": run.skipped_steps,
            "world_size": ctx.world_size,
            "tokenizer": run.tokenizer_record,
            **run.objective.checkpoint_state(),
            "config": run.cfg,
            "code_version": fileio.code_version(),
        }
        path = save_checkpoint(run.run_dir, run.step, state, run.cfg["train"]["keep_last"])
        run.log(f"checkpoint {path}")
    if ctx.enabled:
        dist.barrier()


# -----------------------------------------------------------------------------
# The loop


def _train(cfg, ctx, hardware, resume, stop_after, log, stop):
    train_cfg = cfg["train"]
    run = setup(cfg, ctx, hardware, resume, log)
    if ctx.is_main:
        start_log(run)
    run.metrics = Metrics(run.run_dir, ctx, run.step)
    window = Window(run.step)
    nonfinite_streak = 0
    stopped_by = None
    with stop or StopSignals() as stop:
        while run.step < train_cfg["max_steps"]:
            lr = optim.lr_at(run.step, train_cfg)
            result = optimizer_step(run, lr)
            run.step += 1
            window.tokens += result.tokens
            if result.finite:
                nonfinite_streak = 0
            else:
                run.skipped_steps += 1
                nonfinite_streak += 1
            if not result.finite and nonfinite_streak >= train_cfg["max_nonfinite"]:
                raise TrainError(
                    f"step {run.step}: {nonfinite_streak} consecutive non-finite losses/gradients "
                    f"(train.max_nonfinite={train_cfg['max_nonfinite']}); stopping. The last good checkpoint "
                    f"in {run.run_dir}/ is intact; lower train.lr or check the data."
                )
            at_end = run.step == train_cfg["max_steps"]
            if run.step % train_cfg["log_interval"] == 0 or at_end:
                log_step(run, result, lr, window)

            stop_now = stop.signum is not None or (stop_after is not None and run.step >= stop_after)
            if ctx.enabled:  # a signal may reach one rank first; stop together
                stop_now = not all_ranks_true(not stop_now, ctx, run.hardware.device)
            eval_due = train_cfg["eval_interval"] and run.step % train_cfg["eval_interval"] == 0
            if (eval_due or at_end) and not stop_now:
                evaluate_run(run)
            benchmark_due = run.benchmark is not None and run.benchmark.due(run.step, at_end) and not stop_now
            if benchmark_due:  # rank 0 only; the other ranks wait at the next step's all-reduce
                record = run.benchmark(run.raw_model, run.step)
                run.metrics.write(record)
                log(run.benchmark.line(record))
            checkpoint_due = run.step % train_cfg["ckpt_interval"] == 0
            if checkpoint_due or at_end or stop_now:
                write_checkpoint(run)
            if eval_due or at_end or checkpoint_due or benchmark_due:
                window.restart()  # training only
            if stop_now:
                stopped_by = (
                    signal.Signals(stop.signum).name if stop.signum else f"stop after step {stop_after}"
                )
                break

    run.metrics.close()
    if stopped_by:
        log(f"stopped at step {run.step} ({stopped_by}); continue with --resume")
    elif ctx.is_main and train_cfg["sample_tokens"] > 0:
        chat_run = cfg["data"]["format"] in ("chat", "preference")
        log(f"sample: {sample_text(run.raw_model, run.tokenizer, train_cfg, run.hardware, chat_run)}")
    return run.step


def _truncate_metrics(path, step):
    """On resume, drop metric lines from beyond the checkpoint (logged, then lost in an interruption)."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
    fileio.write_atomic(path, lambda f: f.write("".join(lines).encode()))


def sample_text(model, tokenizer, train_cfg, hardware, chat_run=False):
    from decode import engine

    stop_token = tokenizer.eos_id
    if chat_run:  # a fine-tuned run answers sample_prompt as a user message
        conversation = {"messages": [{"role": "user", "content": train_cfg["sample_prompt"]}]}
        prompt_ids, _ = template.render(conversation, tokenizer, for_generation=True)
        stop_token = tokenizer.special_ids["<|end|>"]
    else:
        prompt_ids = tokenizer.encode(train_cfg["sample_prompt"])
        if tokenizer.bos_id is not None:  # documents are trained as <|bos|> text <|eos|>
            prompt_ids = [tokenizer.bos_id] + prompt_ids
    idx = torch.tensor([prompt_ids], dtype=torch.long, device=hardware.device)
    generator = torch.Generator().manual_seed(train_cfg["seed"])  # CPU: the same text on any device
    model.eval()
    with hardware.autocast():
        new_ids = list(
            engine.generate(
                model,
                idx,
                train_cfg["sample_tokens"],
                temperature=0.8,
                top_k=50,
                stop_token=stop_token,
                generator=generator,
            )
        )
    model.train()
    if chat_run:
        return f"{train_cfg['sample_prompt']} -> {tokenizer.decode(new_ids)}"
    return tokenizer.decode(prompt_ids + new_ids)


# -----------------------------------------------------------------------------
# Resume check (checkpoint.resume_check) with this module's train()


def check_resume(cfg, log=print):
    """--resume-check with quiet phases that share one StopSignals: SIGINT/SIGTERM end the whole check at
    the next step boundary, without a verdict, rather than one phase."""
    if cfg["train"]["max_steps"] < 2:
        raise TrainError("--resume-check needs train.max_steps >= 2")
    quiet = lambda *a, **k: None
    with StopSignals(then_ignore=True) as stop:
        train_phase = lambda run_cfg, **kwargs: train(run_cfg, log=quiet, stop=stop, **kwargs)
        return checkpoint.resume_check(cfg, train_phase, stop, log)


# -----------------------------------------------------------------------------

USAGE = "usage: python train.py CONFIG [section.key=value ...] [--resume | --resume-check]"


def main(argv):
    flags = [a for a in argv if a.startswith("--")]
    args = [a for a in argv if not a.startswith("--")]
    unknown = set(flags) - {"--resume", "--resume-check"}
    if not args or unknown or "-h" in args:
        print(USAGE + (f"\nunknown option: {', '.join(sorted(unknown))}" if unknown else ""), file=sys.stderr)
        return 2
    try:
        cfg = config.load(args[0], args[1:])
        if "--resume-check" in flags:
            return 0 if check_resume(cfg) else 1
        train(cfg, resume="--resume" in flags)
    except config.ConfigError as e:
        print(f"{args[0]}: config problems:\n  " + "\n  ".join(e.problems), file=sys.stderr)
        return 2
    except (TrainError, HardwareError, data.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except fileio.StorageError as e:  # a full disk: its own status, and where the run can go on from
        newest = list_checkpoints(run_dir_of(cfg))
        last = (f"the last good checkpoint is {newest[0]} (free space, then --resume)" if newest
                else "no checkpoint was written yet (free space, then start it again)")  # fmt: skip
        return fileio.exit_on_storage_error(e, then=last)
    except checkpoint.CheckInterrupted as e:
        print(f"resume-check interrupted by {e}: no verdict; its scratch runs were removed", file=sys.stderr)
        return 128 + e.signum
    return 0


if __name__ == "__main__":
    exit_code = main(sys.argv[1:])
    if "RANK" in os.environ:
        # A torchrun worker ends here without interpreter finalization: gloo's worker threads may still
        # hold tensors whose release needs the GIL while the interpreter is torn down, which aborts the
        # process (SIGABRT, "terminate called without an active exception"; seen under CPU load after a
        # complete run). Checkpoints and metrics are written, synced and closed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
    sys.exit(exit_code)
