"""
Checkpoint files: writing, finding, reading, and loading a run for inference.

A checkpoint is runs/<run>/ckpt_<step>.pt, written atomically by train.py through save_checkpoint. It is
self-contained: besides weights, optimizer and loader state it carries the resolved config and the
tokenizer it was trained with (the sentencepiece model's bytes, their sha256 and the chat template
version), so sample.py, serve/app.py and export.py decode with exactly that tokenizer even when the data
directory's one has been retrained since, and refuse a run whose chat template version is not this
code's. Checkpoints written before this carried only the tokenizer's name: they still load, with the
tokenizer of their data directory and warnings.

Each checkpoint records its format (CHECKPOINT_FORMAT; none before release 2026-12-02, which is format 0
and loads as is); a newer one than this code reads is refused by name. A checkpoint holds tensors and plain
containers only (torch.load weights_only=True reads it), never a module path of ours, so that moving a file
of this code never stops an old checkpoint from loading.

Besides the files: each rank's RNG state that a checkpoint carries, and the check that a checkpoint fits
a run it initializes (train.init_from), and the resume check. This file knows nothing about the training
loop; train.py, sample.py, decode/load.py, evaluation/, export.py and the server import it.
"""

import contextlib
import hashlib
import json
import os
import random
import signal
import sys
import tempfile

import numpy as np
import torch
import yaml

import config
import data
import fileio
from chat import template
from model import Transformer

# 1: "format" recorded (release 2026-12-02 and before: no key, format 0; the same contents otherwise).
CHECKPOINT_FORMAT = 1


class CheckpointError(Exception):
    """A checkpoint (or run directory) that cannot be used; the message names the file and why."""


# -----------------------------------------------------------------------------
# Files


def checkpoint_path(run_dir, step):
    return os.path.join(run_dir, f"ckpt_{step:07d}.pt")


def list_checkpoints(run_dir):
    """Complete checkpoints, newest first. Temp files of an interrupted write never match."""
    if not os.path.isdir(run_dir):
        return []
    names = [n for n in os.listdir(run_dir) if n.startswith("ckpt_") and n.endswith(".pt")]
    return sorted((os.path.join(run_dir, n) for n in names), reverse=True)


def save_checkpoint(run_dir, step, state, keep_last):
    """Write ckpt_<step>.pt atomically, then drop all but the newest keep_last. A full disk is a
    fileio.StorageError naming the file, its likely size (the newest checkpoint's) and the bytes free;
    the checkpoints already there stay."""
    path = checkpoint_path(run_dir, step)
    state = {"format": CHECKPOINT_FORMAT} | state
    previous = list_checkpoints(run_dir)
    needed = os.path.getsize(previous[0]) if previous else None
    fileio.write_atomic(path, lambda f: torch.save(state, f), needed=needed, what=f"checkpoint {step}")
    for old in list_checkpoints(run_dir)[keep_last:]:
        os.unlink(old)
    # Temp files of writes that were killed (never trusted, since they never got the real name).
    for name in os.listdir(run_dir):
        if name.startswith(".ckpt_") and name.endswith(".tmp"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(run_dir, name))
    return path


def estimate_checkpoint_bytes(model, optimizer, extra_bytes=0):
    """About the bytes of one checkpoint: the weights, the optimizer's state, and extra_bytes (a tokenizer,
    a DPO reference). An optimizer that has stepped is measured as it is; a fresh one is counted as AdamW
    keeps it (exp_avg and exp_avg_sq: two tensors the size of each parameter)."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.state_dict().values()
    }
    weights = sum(storages.values())  # tied weights (embedding and LM head) are saved once
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    if state:
        moments = sum(v.numel() * v.element_size() for v in state)
    else:
        moments = 2 * sum(p.numel() * p.element_size() for g in optimizer.param_groups for p in g["params"])
    return weights + moments + extra_bytes


def check_room_for_checkpoints(run_dir, per_checkpoint, keep_last, mode, log=print):
    """train.space_check: keep_last checkpoints stay while the next is written, so run_dir's disk must hold
    keep_last + 1 of them (less those already there). refuse: a fileio.StorageError; warn: a warning."""
    existing = sum(os.path.getsize(p) for p in list_checkpoints(run_dir))
    needed = max(0, (keep_last + 1) * per_checkpoint - existing)
    free = fileio.free_bytes(run_dir)
    if needed <= free:
        return
    what = (f"{keep_last + 1} checkpoints of about {fileio.size_text(per_checkpoint)} (train.keep_last={keep_last} "
            "kept while the next is written; free space, lower train.keep_last or set train.space_check=warn)")  # fmt: skip
    problem = fileio.StorageError(os.path.join(run_dir, "ckpt_*.pt"), "too full", needed, free, what)
    if mode == "refuse":
        raise problem
    log(f"warning: {problem} (train.space_check=warn: training anyway)")


def replace_run(run_dir):
    """Delete what a run wrote in run_dir (checkpoints, their temp files, metrics, resolved config) and
    nothing else; returns what was removed, for the log."""
    checkpoints = list_checkpoints(run_dir)
    for path in checkpoints:
        os.unlink(path)
    for name in os.listdir(run_dir):
        if (name.startswith(".ckpt_") and name.endswith(".tmp")) or name in ("metrics.jsonl", "config.yaml"):
            os.unlink(os.path.join(run_dir, name))
    return f"removed {len(checkpoints)} checkpoint(s) and its metrics"


def load_checkpoint(path):
    # map_location="cpu": RNG states must stay CPU tensors, and any rank can read any checkpoint.
    state = torch.load(path, map_location="cpu", weights_only=True)
    missing = {"step", "model", "optimizer", "ranks", "config"} - set(state)
    if missing:
        raise ValueError(f"not a training checkpoint (missing {', '.join(sorted(missing))})")
    written = state.get("format", 0)
    if not isinstance(written, int) or written > CHECKPOINT_FORMAT:
        commit = state.get("code_version", "unknown")
        raise CheckpointError(
            f"{path}: checkpoint format {written!r}, newer than this code reads ({CHECKPOINT_FORMAT}); "
            f"it was written by commit {commit}: update this checkout to read it"
        )
    return state


def load_newest_checkpoint(run_dir, log=print):
    """The newest checkpoint that loads; a truncated or corrupt one is reported and skipped."""
    for path in list_checkpoints(run_dir):
        try:
            return path, load_checkpoint(path)
        except CheckpointError:  # a whole checkpoint from newer code: never skipped in silence
            raise
        except Exception as e:  # noqa: BLE001 - any unreadable file is skipped, and said so
            log(f"warning: skipping unreadable checkpoint {path}: {type(e).__name__}: {e}")
    raise CheckpointError(f"no usable checkpoint in {run_dir}/ (expected ckpt_<step>.pt files)")


def read_run(path, log=print):
    """(checkpoint path, checkpoint) of a run directory (its newest checkpoint) or a checkpoint file."""
    if os.path.isdir(path):
        return load_newest_checkpoint(path, log)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such run directory or checkpoint file")
    try:
        return path, load_checkpoint(path)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever torch raises, the file is not usable
        raise CheckpointError(f"{path}: not a loadable ENLACE checkpoint ({type(e).__name__}: {e})") from None


# -----------------------------------------------------------------------------
# RNG state: each rank's, in every checkpoint


def rng_state():
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        # numpy's state holds an ndarray; stored as plain values so weights_only=True can load it.
        "numpy": {
            "keys": np_state[1].tolist(),
            "pos": int(np_state[2]),
            "gauss": [int(np_state[3]), np_state[4]],
        },
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    return state


def _cpu_bytes(tensor):
    # torch's RNG setters want a CPU ByteTensor; a state that travelled to the GPU (map_location="cuda")
    # makes set_rng_state raise "RNG state must be a torch.ByteTensor". Always hand them CPU uint8.
    return tensor.detach().to(device="cpu", dtype=torch.uint8)


def set_rng_state(state):
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_keys = np.array(state["numpy"]["keys"], dtype=np.uint32)
    np.random.set_state(("MT19937", np_keys, state["numpy"]["pos"], *state["numpy"]["gauss"]))
    torch.set_rng_state(_cpu_bytes(state["torch_cpu"]))
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_cpu_bytes(s) for s in state["torch_cuda"]])


# -----------------------------------------------------------------------------
# The tokenizer inside a checkpoint


def tokenizer_record(tokenizer):
    """What a checkpoint stores about its tokenizer: the model file's bytes for sentencepiece."""
    record = {"name": tokenizer.name, "chat_template_version": template.CHAT_TEMPLATE_VERSION}
    if tokenizer.name == "sentencepiece":
        with open(tokenizer.path, "rb") as f:
            model_bytes = f.read()
        record |= {"model": model_bytes, "sha256": hashlib.sha256(model_bytes).hexdigest()}
    return record


def stored_tokenizer_sha256(checkpoint):
    """The sha256 of the sentencepiece model a checkpoint was trained with; None for old or byte-level
    ones. (Checkpoints written between the SFT stage and self-contained checkpoints kept only the hash,
    under "tokenizer_sha256".)"""
    record = checkpoint.get("tokenizer")
    if isinstance(record, dict):
        return record.get("sha256")
    return checkpoint.get("tokenizer_sha256")


# Model keys that may differ between a run and the run it is initialized from (train.init_from): none of
# them changes a weight's shape or meaning (the RoPE table is rebuilt for any seq_len).
INIT_FREE_MODEL_KEYS = {"seq_len", "init_std", "zero_init_out_proj", "z_loss_coef"}


def tokenizer_sha256(tokenizer):
    path = getattr(tokenizer, "path", None)
    return fileio.sha256_of_file(path) if path else tokenizer.name


def init_checkpoint(cfg, log):
    """(path, checkpoint) named by train.init_from, checked against this run: the model shape (seq_len
    aside) and the tokenizer must be the same."""
    source = cfg["train"]["init_from"]
    if os.path.isdir(source):
        try:
            path, state = load_newest_checkpoint(source, log)
        except CheckpointError as e:
            raise CheckpointError(f"train.init_from: {e}") from None
    elif os.path.isfile(source):
        path = source
        try:
            state = load_checkpoint(source)
        except Exception as e:  # noqa: BLE001 - any unreadable file is the same problem for the user
            raise CheckpointError(f"train.init_from: {source}: not a loadable checkpoint ({e})") from None
    else:
        raise CheckpointError(f"train.init_from: {source}: no such run directory or checkpoint file")
    saved, model_cfg = state["config"], cfg["model"]
    differences = [
        f"model.{key}: {path} has {saved['model'].get(key)!r}, this run has {model_cfg[key]!r}"
        for key in sorted(set(model_cfg) | set(saved["model"]))
        if key not in INIT_FREE_MODEL_KEYS and saved["model"].get(key) != model_cfg.get(key)
    ]
    ours = tokenizer_sha256(data.load_tokenizer(cfg["data"]))
    theirs = stored_tokenizer_sha256(state)
    if theirs is None:  # an older checkpoint: its tokenizer is the one its data config names
        try:
            theirs = tokenizer_sha256(data.load_tokenizer(saved["data"]))
        except data.DataError as e:
            raise CheckpointError(f"train.init_from: cannot check the tokenizer of {path}: {e}") from None
    if theirs != ours:
        differences.append(
            f"tokenizer: {path} was trained with {str(theirs)[:12]}, this run's data gives {ours[:12]} "
            "(sha256 of tokenizer.model; `python -m chat prepare` must copy the pretraining tokenizer)"
        )
    if differences:
        raise CheckpointError(
            f"train.init_from: {path} does not fit this run:\n  " + "\n  ".join(differences)
        )
    return path, state


def check_chat_template_version(checkpoint, ckpt_path, log=print):
    """Refuse a run trained with another chat template than chat.render's: its prompts would not be laid
    out as it learned them. Checkpoints written before the version was recorded load with a warning."""
    record = checkpoint.get("tokenizer")
    trained_with = record.get("chat_template_version") if isinstance(record, dict) else None
    ours = template.CHAT_TEMPLATE_VERSION
    if trained_with is None:
        log(
            f"warning: {ckpt_path} does not record the chat template version it was trained with; "
            f"assuming this code's (version {ours})"
        )
    elif trained_with != ours:
        commit = checkpoint.get("code_version", "unknown")
        where = (
            f"the commit it was trained with ({commit})"
            if commit != "unknown"
            else "the code it was trained with"
        )
        raise CheckpointError(
            f"{ckpt_path}: trained with chat template version {trained_with}, but this code renders version "
            f"{ours} (chat.CHAT_TEMPLATE_VERSION); check out {where} to use it, or fine-tune it on "
            f"conversations rendered with version {ours}"
        )


def tokenizer_of(checkpoint, ckpt_path, log=print):
    """The tokenizer a checkpoint was trained with: the one inside it, or (old checkpoints) the data dir's.
    A run that can chat (not byte-level) must also have been trained with this code's chat template."""
    cfg = checkpoint["config"]
    record = checkpoint.get("tokenizer")
    if isinstance(record, dict) and record.get("name") == "bytes":
        tokenizer = data.ByteTokenizer()
    elif isinstance(record, dict) and "model" in record:
        model_bytes = bytes(record["model"])
        if hashlib.sha256(model_bytes).hexdigest() != record.get("sha256"):
            raise CheckpointError(f"{ckpt_path}: the tokenizer stored inside does not match its sha256")
        tokenizer = data.SentencePieceTokenizer(f"{ckpt_path}:tokenizer", model_proto=model_bytes)
    else:
        tokenizer = data.load_tokenizer(cfg["data"])
        trained_with = record if isinstance(record, str) else tokenizer.name
        if tokenizer.name != trained_with:
            raise CheckpointError(
                f"{ckpt_path}: trained with the {trained_with} tokenizer, but its data config gives "
                f"the {tokenizer.name} tokenizer"
            )
        if tokenizer.name != "bytes":
            log(
                f"warning: {ckpt_path} predates self-contained checkpoints; using the tokenizer of "
                f"{tokenizer.path}, which must be the one it was trained with"
            )
    if tokenizer.name != "bytes":  # the byte tokenizer has no control tokens: no chat template applies
        check_chat_template_version(checkpoint, ckpt_path, log)
    if tokenizer.vocab_size != cfg["model"]["vocab_size"]:
        raise CheckpointError(
            f"{ckpt_path}: the model has {cfg['model']['vocab_size']} tokens but its tokenizer has "
            f"{tokenizer.vocab_size}"
        )
    return tokenizer


# -----------------------------------------------------------------------------
# A run for inference


def device_for(path, requested="auto", log=lambda message: print(message, file=sys.stderr)):
    """The device to run a saved run on: `requested` when it names one (cpu, cuda), else (auto) the device
    its hardware profile trained on, read from the run's config.yaml, where this machine has it; the CPU
    otherwise, said in one line when the run trained on CUDA."""
    if requested != "auto":
        return requested
    run_dir = path if os.path.isdir(path) else os.path.dirname(path)
    try:
        with open(os.path.join(run_dir, "config.yaml"), encoding="utf-8") as f:
            trained_on = yaml.safe_load(f)["hardware"]["device"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):  # no resolved config beside it: a copied file
        return "cpu"
    if trained_on == "cuda" and not torch.cuda.is_available():
        log(f"{path}: trained on cuda, but this machine has no CUDA device: running on the CPU")
        return "cpu"
    return trained_on if trained_on in ("cpu", "cuda") else "cpu"


def load_run(
    path, device="cpu", log=lambda message: print(message, file=sys.stderr), attention_backend="math"
):
    """(model in eval mode, resolved config, tokenizer, checkpoint path) of a run directory or file."""
    ckpt_path, checkpoint = read_run(path, log)
    cfg = checkpoint["config"]
    if isinstance(cfg.get("model"), dict):  # written before model.zero_init_out_proj: an init-only key
        cfg["model"].setdefault("zero_init_out_proj", False)
    try:
        model = Transformer(cfg["model"], attention_backend)
        model.load_state_dict(checkpoint["model"])
    except (KeyError, TypeError, ValueError, RuntimeError, config.ConfigError) as e:
        first_lines = "\n  ".join(str(e).strip().splitlines()[:6])
        raise CheckpointError(
            f"{ckpt_path}: the weights do not fit the model config stored with them:\n  {first_lines}"
        ) from None
    tokenizer = tokenizer_of(checkpoint, ckpt_path, log)
    model.to(device).eval()
    return model, cfg, tokenizer, ckpt_path


# -----------------------------------------------------------------------------
# The resume check, the owner's acceptance test of training on any config and board:
#     python train.py configs/smoke-cpu.yaml --resume-check train.max_steps=20
#     make resume-check CONFIG=configs/smoke-cpu.yaml
# N steps uninterrupted against N/2 steps, a stop and a resume to N, in scratch runs under train.runs_dir that
# are removed afterwards: every parameter and optimizer tensor must be bit-identical. bench/gpu_check.py runs
# it on the board. train.py calls resume_check with its own train function (this module is below train.py).


def tensors_of(state, prefix=""):
    """Flatten a state dict into {name: tensor}."""
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    items = (
        state.items()
        if isinstance(state, dict)
        else enumerate(state)
        if isinstance(state, list | tuple)
        else []
    )
    flat = {}
    for key, value in items:
        flat.update(tensors_of(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def compare_states(a, b):
    """(number of tensors, names that differ, largest absolute difference) of two checkpoints."""
    ta = tensors_of({"model": a["model"], "optimizer": a["optimizer"]["state"]})
    tb = tensors_of({"model": b["model"], "optimizer": b["optimizer"]["state"]})
    differing, largest = [], 0.0
    for name in sorted(set(ta) | set(tb)):
        if name not in ta or name not in tb or ta[name].shape != tb[name].shape:
            differing.append(name)
            largest = float("inf")
        elif not torch.equal(ta[name], tb[name]):
            differing.append(name)
            largest = max(largest, (ta[name].double() - tb[name].double()).abs().max().item())
    return len(ta), differing, largest


class CheckInterrupted(Exception):
    """SIGINT/SIGTERM during the check: it ends with no verdict, its scratch runs removed."""

    def __init__(self, signum):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def resume_check(cfg, train_phase, stop, log=print):
    """Uninterrupted N steps vs N/2 + resume to N: every parameter and optimizer tensor must be equal.
    train_phase(run_cfg, resume=False, stop_after=None) trains one phase (train.py's train, quiet) and
    stops at a step boundary when `stop` (its StopSignals) hears a signal: then the check ends."""
    total = cfg["train"]["max_steps"]

    def phase(run_cfg, **kwargs):
        train_phase(run_cfg, **kwargs)
        if stop.signum is not None:  # no verdict, and no next phase
            raise CheckInterrupted(stop.signum)

    os.makedirs(cfg["train"]["runs_dir"], exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="resume-check-", dir=cfg["train"]["runs_dir"]) as scratch:
        runs = {}
        for name in ("uninterrupted", "resumed"):
            run_cfg = json.loads(json.dumps(cfg))
            run_cfg["run_name"] = name
            run_cfg["train"]["runs_dir"] = scratch
            run_cfg["train"]["sample_tokens"] = 0
            run_cfg["train"]["keep_last"] = max(run_cfg["train"]["keep_last"], 2)
            runs[name] = run_cfg
        log(f"resume-check: {total} steps uninterrupted ...")
        phase(runs["uninterrupted"])
        log(f"resume-check: {total // 2} steps, stop, resume to {total} ...")
        phase(runs["resumed"], stop_after=total // 2)
        phase(runs["resumed"], resume=True)
        a = load_checkpoint(list_checkpoints(os.path.join(scratch, "uninterrupted"))[0])
        b = load_checkpoint(list_checkpoints(os.path.join(scratch, "resumed"))[0])
    count, differing, largest = compare_states(a, b)
    if differing or a["step"] != b["step"]:
        log(
            f"FAIL resume-check: {len(differing)}/{count} tensors differ after {total} steps "
            f"(largest abs diff {largest:.3e}); first: {', '.join(differing[:5])}"
        )
        return False
    log(f"PASS resume-check: {count} tensors bit-identical after {total} steps (largest abs diff 0)")
    return True
