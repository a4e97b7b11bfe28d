"""
The resume check, the owner's acceptance test of training on any config and board:

    python train.py configs/smoke-cpu.yaml --resume-check train.max_steps=20
    make resume-check CONFIG=configs/smoke-cpu.yaml

N steps uninterrupted against N/2 steps, a stop and a resume to N, in scratch runs under train.runs_dir that
are removed afterwards: every parameter and optimizer tensor must be bit-identical. It lives in bench/ beside
the GPU acceptance check, whose resume step runs it on the board (gpu_check.py). train.py calls it with its
own train function, since a module that train.py imports cannot import train.py back.
"""

import json
import os
import signal
import tempfile

import torch

import checkpoint


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


def run(cfg, train_phase, stop, log=print):
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
        a = checkpoint.load_checkpoint(checkpoint.list_checkpoints(os.path.join(scratch, "uninterrupted"))[0])
        b = checkpoint.load_checkpoint(checkpoint.list_checkpoints(os.path.join(scratch, "resumed"))[0])
    count, differing, largest = compare_states(a, b)
    if differing or a["step"] != b["step"]:
        log(
            f"FAIL resume-check: {len(differing)}/{count} tensors differ after {total} steps "
            f"(largest abs diff {largest:.3e}); first: {', '.join(differing[:5])}"
        )
        return False
    log(f"PASS resume-check: {count} tensors bit-identical after {total} steps (largest abs diff 0)")
    return True
