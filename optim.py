"""
The optimizers of train.py (train.optimizer): AdamW alone, or Muon for the decoder blocks' hidden matrices with
AdamW for the rest; the parameter groups each one moves; the learning-rate schedule (lr_at) that set_lr puts
on them. The Newton-Schulz iteration runs in the board's dtype (hardware.muon_ns_dtype), passed in by the caller.
"""

import math

import torch

# The optimizer recipe: which parameters each optimizer moves, with which learning rate and weight decay.
#
# train.optimizer adamw: one AdamW; matrices (the tied embedding/LM head included) decay, norm weights don't.
# train.optimizer muon: Muon (Keller Jordan, https://kellerjordan.github.io/posts/muon/; modded-nanogpt,
# nanochat) for the 2-D hidden matrices of the decoder blocks (q/k/v/o projections, gate/up/down), AdamW for
# the rest: the tied embedding/LM head (AdamW's lr and weight decay) and the RMSNorm weights (AdamW's lr, no
# decay). Both live in one MuonWithAdamW object, so the training loop's GradScaler (unscale before the step:
# Muon's momentum must sum true gradients, not scaled ones), schedule, clipping and checkpoint see one
# optimizer. DDP all-reduces the gradients before the step, so every rank orthogonalizes the same matrix.
#
# Why our own Muon step: torch.optim.Muon (torch 2.13) hard-codes the Newton-Schulz iteration in bfloat16
# (`grad.bfloat16()` in torch/optim/_muon.py, no argument changes it). On a board without native bf16 (the
# RTX 2060, Turing) that matmul runs emulated, ~2.6x slower than float16, and on an AVX2-only CPU bf16 matmuls
# are slower than float32. So Muon here is torch's class (its constructor checks, its state layout) with
# step() redone on public API only (torch's private helpers may change with any torch but the pin): the
# iteration in hardware.muon_ns_dtype, the matrix normalised before the cast (torch casts first, which
# float16's exponent range cannot afford); with bfloat16 it follows torch's step to bfloat16's precision
# (tests/test_optimizer.py).

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch's and Keller Jordan's quintic, fastest slope at zero
NS_EPS = 1e-7


def newton_schulz(grad, steps, dtype, coefficients=NS_COEFFICIENTS, eps=NS_EPS):
    """Approximately orthogonalize a 2-D matrix (U S V^T -> U S' V^T, S' ~ 1) in `dtype`: torch's
    _zeropower_via_newtonschulz with the dtype as an argument instead of bfloat16. The matrix is divided by
    its norm in float32 before the cast: cast first, a float16 gradient of Frobenius norm 1e-5 loses most of
    its entries to underflow (the result then 90% off the float64 one; 0.14% normalised first). The
    division makes a new tensor: `grad` (a momentum buffer, with nesterov off) is never written."""
    a, b, c = coefficients
    grad = grad.float()
    x = (grad / grad.norm().clamp(min=eps)).to(dtype)  # spectral norm <= Frobenius norm = 1
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr, adjust_lr_fn, shape):
    """Muon's learning rate for a matrix of `shape`, as torch.optim.Muon's adjust_lr_fn documents it:
    "original" (or None) scales by sqrt(max(1, rows / cols)) (Keller Jordan), "match_rms_adamw" by
    0.2 * sqrt(max(rows, cols)) (Moonshot: the update's RMS of AdamW's)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


class Muon(torch.optim.Muon):
    """torch.optim.Muon whose Newton-Schulz iteration runs in `ns_dtype` (a dtype name). An attribute, not
    a param group value: a checkpoint's groups replace the live ones on resume, and a run resumed on
    another board must use that board's dtype."""

    def __init__(self, params, ns_dtype, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_dtype = getattr(torch, ns_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum, dtype = group["lr"], group["momentum"], self.ns_dtype
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad, state = param.grad, self.state[param]
                if "momentum_buffer" not in state:  # torch.optim.Muon's state layout, so checkpoints agree
                    state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
                buffer = state["momentum_buffer"]
                buffer.lerp_(grad, 1 - momentum)
                update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
                update = newton_schulz(
                    update, group["ns_steps"], dtype, group["ns_coefficients"], group["eps"]
                )
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-adjusted_lr(lr, group["adjust_lr_fn"], param.shape))
        return loss


class MuonWithAdamW:
    """Muon and AdamW stepped as one optimizer: what GradScaler (param_groups, step), the schedule and
    checkpoints (state_dict) need."""

    def __init__(self, muon, adamw):
        self.muon, self.adamw = muon, adamw

    @property
    def param_groups(self):
        return self.muon.param_groups + self.adamw.param_groups

    @property
    def state(self):
        return self.muon.state | self.adamw.state

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MuonWithAdamW.step takes no closure")
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none=True):
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        muon, adamw = self.muon.state_dict(), self.adamw.state_dict()
        return {
            "state": {"muon": muon["state"], "adamw": adamw["state"]},
            "param_groups": {"muon": muon["param_groups"], "adamw": adamw["param_groups"]},
        }

    def load_state_dict(self, state):
        if set(state.get("state", {})) != {"muon", "adamw"}:
            raise ValueError("the checkpoint's optimizer state is not Muon + AdamW (was the run trained with "
                             "another train.optimizer?)")  # fmt: skip
        for name in ("muon", "adamw"):
            getattr(self, name).load_state_dict(
                {"state": state["state"][name], "param_groups": state["param_groups"][name]}
            )


def is_hidden_matrix(name, param):
    """Muon's share: the 2-D weights inside the decoder blocks. The tied embedding/LM head is a lookup
    table and a classifier, not a hidden linear map: it stays with AdamW, as in modded-nanogpt and nanochat."""
    return param.dim() == 2 and name.startswith("layers.")


def adamw(groups, train_cfg):
    return torch.optim.AdamW(
        groups,
        lr=train_cfg["lr"],
        betas=(train_cfg["beta1"], train_cfg["beta2"]),
        eps=train_cfg["adam_eps"],
        fused=True,  # one kernel per step on CUDA and on the CPU: 4x faster than foreach on the CPU
    )


def build_optimizer(model, train_cfg, ns_dtype):
    """The optimizer of train.optimizer for `model`; ns_dtype (hardware.muon_ns_dtype) is the dtype of
    Muon's Newton-Schulz iteration."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if train_cfg["optimizer"] == "adamw":
        # Decay matrices (projections, embedding) only; norm weights are scales and stay undecayed.
        return adamw(
            [
                {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": train_cfg["weight_decay"]},
                {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
            ],
            train_cfg,
        )
    settings = train_cfg["muon"]
    hidden = [p for n, p in named if is_hidden_matrix(n, p)]
    embeddings = [p for n, p in named if p.dim() >= 2 and not is_hidden_matrix(n, p)]
    scalars = [p for _, p in named if p.dim() < 2]
    muon = Muon(
        [{"params": hidden}],
        ns_dtype,
        lr=settings["lr"],
        weight_decay=settings["weight_decay"],
        momentum=settings["momentum"],
        nesterov=settings["nesterov"],
        ns_steps=settings["ns_steps"],
        adjust_lr_fn=settings["adjust_lr"],
    )
    rest = [
        {"params": embeddings, "weight_decay": train_cfg["weight_decay"]},
        {"params": scalars, "weight_decay": 0.0},
    ]
    return MuonWithAdamW(muon, adamw([g for g in rest if g["params"]], train_cfg))


def lr_at(step, train):
    """Warmup-stable-decay learning rate of optimizer step `step` (0-based), from the step alone."""
    peak, total = train["lr"], train["max_steps"]
    decay_steps = int(train["decay_fraction"] * total)
    decay_start = total - decay_steps
    if step < train["warmup_steps"]:
        return peak * (step + 1) / train["warmup_steps"]
    if step < decay_start:
        return peak
    progress = min(1.0, (step - decay_start + 1) / decay_steps)
    remaining = 1.0 - progress if train["decay_shape"] == "linear" else 1.0 - math.sqrt(progress)
    return peak * (train["min_lr_ratio"] + (1.0 - train["min_lr_ratio"]) * remaining)


def set_lr(optimizer, lr, train_cfg):
    """The schedule's learning rate `lr` (lr_at: train.lr's warmup-stable-decay) on every group; Muon's
    groups follow the same schedule scaled to their own peak, train.muon.lr."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    if isinstance(optimizer, MuonWithAdamW):
        for group in optimizer.muon.param_groups:
            group["lr"] = lr * train_cfg["muon"]["lr"] / train_cfg["lr"]
