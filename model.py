"""
The ENLACE decoder: a Qwen3-style transformer in one file.

token embedding -> n_layers pre-norm blocks -> final RMSNorm -> LM head tied to the embedding.
Block: x + attention(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)). No biases anywhere.
Attention: q/k/v/o projections, grouped-query attention (n_kv_heads key/value heads shared by groups of
query heads), QK-norm (RMSNorm over head_dim on q and k, before RoPE), RoPE in the rotate-half convention,
scale 1/sqrt(head_dim), causal scaled_dot_product_attention.

Parameter names follow the Hugging Face Qwen3 decoder without its `model.` prefix: embed_tokens,
layers.{i}.self_attn.{q,k,v,o}_proj, layers.{i}.self_attn.{q,k}_norm, layers.{i}.mlp.{gate,up,down}_proj,
layers.{i}.input_layernorm, layers.{i}.post_attention_layernorm, norm, and lm_head (the same Parameter as
embed_tokens.weight). An export to Qwen3ForCausalLM prefixes every name except lm_head with `model.` and
sets head_dim = d_model / n_heads, tie_word_embeddings = true, rms_norm_eps = norm_eps,
rope_theta = rope_base; the weights then map one to one and give the same logits.

The model knows nothing about devices, dtypes, files or serving: the caller moves it and picks autocast;
decode/engine.py decodes with it (KV cache, batched steps, sampling).
"""

import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import config
import hardware

ATTENTION_BACKENDS = {
    "math": SDPBackend.MATH,
    "mem_efficient": SDPBackend.EFFICIENT_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
}


def rms_norm(x, weight, eps):
    # Computed in float32 whatever the autocast dtype, cast back after: the mean of squares overflows or
    # loses precision in float16.
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rope_tables(seq_len, head_dim, base):
    """cos and sin of shape (seq_len, head_dim): position p rotates the pair (i, i + head_dim/2) by the
    angle p * base^(-2i/head_dim), for i < head_dim/2 (Hugging Face's rotate-half layout)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x, cos, sin):
    """Rotate x of shape (B, T, heads, head_dim) by the angles of its T positions (cos/sin: (T, head_dim))."""
    cos = cos[:, None, :].to(x.dtype)
    sin = sin[:, None, :].to(x.dtype)
    half = x.shape[-1] // 2
    rotated_half = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated_half * sin


class Attention(nn.Module):
    def __init__(self, cfg, backend, repeat_kv=False):
        super().__init__()
        self.n_heads = cfg["n_heads"]
        self.n_kv_heads = cfg["n_kv_heads"]
        self.head_dim = cfg["d_model"] // cfg["n_heads"]
        self.backend = backend
        # A kernel that takes no grouped-query attention (mem_efficient, hardware.SDPA_KERNELS) gets each
        # key/value head repeated for its group of query heads; the others get enable_gqa.
        self.repeat_kv = repeat_kv and self.n_kv_heads != self.n_heads
        self.grouped_in_kernel = not repeat_kv and self.n_kv_heads != self.n_heads
        d_model = cfg["d_model"]
        self.q_proj = nn.Linear(d_model, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d_model, bias=False)
        # QK-norm (with z-loss) is what keeps float16 training on the RTX 2060 stable: it bounds the
        # attention logits, which otherwise grow until softmax overflows in half precision.
        self.q_norm = RMSNorm(self.head_dim, cfg["norm_eps"])
        self.k_norm = RMSNorm(self.head_dim, cfg["norm_eps"])

    def project(self, x, cos, sin):
        """q, k, v of x (B, T, d_model), shaped (B, heads, T, head_dim), q and k normed and rotated."""
        return self.heads(self.q_proj(x), self.k_proj(x), self.v_proj(x), cos, sin)

    def heads(self, q, k, v, cos, sin):
        """The projections q, k, v (B, T, width) split into heads (B, heads, T, head_dim), q and k normed
        and rotated."""
        B, T, _ = q.shape
        q = self.q_norm(q.view(B, T, self.n_heads, self.head_dim))
        k = self.k_norm(k.view(B, T, self.n_kv_heads, self.head_dim))
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def attend(self, q, k, v, mask=None, is_causal=False, backends=None):
        if self.repeat_kv:
            groups = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        with sdpa_kernel(self.backend if backends is None else backends):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=self.grouped_in_kernel
            )

    def out(self, y):
        """The output projection of the heads' values y (B, T, heads * head_dim)."""
        return self.o_proj(y)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        y = self.attend(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg["d_model"], cfg["ffn_hidden"], bias=False)
        self.up_proj = nn.Linear(cfg["d_model"], cfg["ffn_hidden"], bias=False)
        self.down_proj = nn.Linear(cfg["ffn_hidden"], cfg["d_model"], bias=False)

    def forward(self, x):
        return self.swiglu(self.gate_proj(x), self.up_proj(x))

    def swiglu(self, gate, up):
        """The output of the gate and up projections of x."""
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, backend, repeat_kv=False):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["d_model"], cfg["norm_eps"])
        self.self_attn = Attention(cfg, backend, repeat_kv)
        self.post_attention_layernorm = RMSNorm(cfg["d_model"], cfg["norm_eps"])
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


def logits_losses(logits, targets, z_loss_coef):
    """Cross-entropy on float32 logits plus the PaLM z-loss z_loss_coef * mean(logsumexp(logits)^2),
    which keeps the softmax normalizer near 1 so float16 logits cannot drift out of range. Both are
    means over the positions whose target is not -1. The unchunked path (loss_chunk_size 0): the full
    logits and autograd's backward; ChunkedLMHeadLoss computes the same without them."""
    logits = logits.float().flatten(0, -2)
    targets = targets.flatten()
    keep = targets != -1
    rows = targets.clamp(min=0)[:, None]  # ignored rows pick column 0, then count for nothing
    log_probs = F.log_softmax(logits, dim=-1)
    target_log_prob = log_probs.gather(1, rows).squeeze(1)
    # log_softmax = logits - logsumexp(logits): the normalizer comes from the same column for free,
    # one pass over the logits fewer than calling logsumexp.
    log_normalizer = logits.gather(1, rows).squeeze(1) - target_log_prob
    count = keep.sum().clamp(min=1)
    ce = -torch.where(keep, target_log_prob, 0.0).sum() / count
    z_loss = z_loss_coef * torch.where(keep, log_normalizer.square(), 0.0).sum() / count
    return {"loss": ce + z_loss, "ce": ce, "z_loss": z_loss}


class ChunkedLMHeadLoss(torch.autograd.Function):
    """The LM head and both losses of logits_losses over chunks of `chunk_size` positions: the
    (positions x vocab_size) logits never exist whole, only one chunk's at a time. Each chunk's gradient
    is computed in the forward pass, while its logits are at hand (Liger Kernel's fused linear
    cross-entropy): three matmuls per chunk like the unchunked path, where a backward that recomputed the
    logits would need four. backward() then only scales the stored gradients by the incoming one.

    Dtypes follow the unchunked path under autocast: the matmuls run in `compute_dtype` (the autocast
    dtype, else the weight's), softmax and losses in float32. The stored gradients are those of the summed
    loss, not yet divided by the count of positions nor multiplied by a GradScaler's scale, so in float16
    they sit near 1 whatever the batch or the scale; backward applies both in float32."""

    @staticmethod
    def forward(ctx, h, weight, targets, z_loss_coef, chunk_size, compute_dtype, needs_grad):
        ctx.h_shape, ctx.h_dtype = h.shape, h.dtype
        h = h.reshape(-1, h.shape[-1])
        targets = targets.reshape(-1)
        keep = targets != -1
        rows = targets.clamp(min=0)  # ignored rows pick column 0, then count for nothing
        count = keep.sum().clamp(min=1)
        weight_c = weight.to(compute_dtype)
        ce_sum = torch.zeros((), dtype=torch.float32, device=h.device)
        z_sum = torch.zeros((), dtype=torch.float32, device=h.device)
        if needs_grad:
            grad_h = torch.empty(h.shape, dtype=compute_dtype, device=h.device)
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
        # One chunk's logits, reused by every chunk (and a compute-dtype twin for the half-precision
        # matmuls): the largest tensors here, allocated once.
        logits_buffer = h.new_empty((min(chunk_size, h.shape[0]), weight.shape[0]), dtype=torch.float32)
        half_buffer = None if compute_dtype == torch.float32 else logits_buffer.to(compute_dtype)
        with torch.autocast(h.device.type, enabled=False):  # every dtype below is explicit
            for start in range(0, h.shape[0], chunk_size):
                chunk = slice(start, start + chunk_size)
                h_c, keep_c, rows_c = h[chunk].to(compute_dtype), keep[chunk], rows[chunk]
                logits = logits_buffer[: h_c.shape[0]]
                if half_buffer is None:
                    torch.mm(h_c, weight_c.T, out=logits)
                else:
                    logits.copy_(torch.mm(h_c, weight_c.T, out=half_buffer[: h_c.shape[0]]))
                target_logit = logits.gather(1, rows_c[:, None]).squeeze(1)
                # logsumexp by hand, leaving exp(logits - max) in the buffer for the gradient
                row_max = logits.amax(dim=1, keepdim=True)
                probs = logits.sub_(row_max).exp_()
                row_sum = probs.sum(dim=1, keepdim=True)
                log_normalizer = (row_max + row_sum.log()).squeeze(1)
                ce_sum += torch.where(keep_c, log_normalizer - target_logit, 0.0).sum()
                z_sum += torch.where(keep_c, log_normalizer.square(), 0.0).sum()
                if needs_grad:
                    # d(sum of kept ce + z_loss_coef * lse^2)/d logits = softmax * (1 + 2 z lse) - one_hot
                    coef = torch.where(keep_c, 1.0 + 2.0 * z_loss_coef * log_normalizer, 0.0)[:, None]
                    grad_logits = probs.mul_(coef / row_sum)
                    grad_logits.scatter_add_(1, rows_c[:, None], -keep_c[:, None].float())
                    if half_buffer is None:
                        torch.mm(grad_logits, weight_c, out=grad_h[chunk])
                        # in place (FLOP counters do not see addmm_)
                        torch.addmm(grad_weight, grad_logits.T, h_c, out=grad_weight)
                    else:
                        grad_logits = half_buffer[: h_c.shape[0]].copy_(grad_logits)
                        torch.mm(grad_logits, weight_c, out=grad_h[chunk])
                        grad_weight += grad_logits.T @ h_c
        ce, z_loss = ce_sum / count, z_loss_coef * z_sum / count
        loss = ce + z_loss
        ctx.mark_non_differentiable(ce, z_loss)
        if needs_grad:
            ctx.save_for_backward(grad_h, grad_weight, count)
        return loss, ce, z_loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss, _grad_ce, _grad_z_loss):
        grad_h, grad_weight, count = ctx.saved_tensors
        scale = grad_loss.float() / count
        grad_h = (grad_h.float() * scale).to(ctx.h_dtype).view(ctx.h_shape)
        grad_weight = grad_weight * scale
        return grad_h, grad_weight, None, None, None, None, None


def chunked_losses(h, weight, targets, z_loss_coef, chunk_size):
    """logits_losses(h @ weight.T, targets, z_loss_coef) computed over chunks of positions: h (..., d_model)
    the final norm's output, weight (vocab_size, d_model) the LM head's."""
    device = h.device.type
    compute_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    needs_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    if targets.shape != h.shape[:-1]:
        raise ValueError(f"targets of shape {tuple(targets.shape)} for positions of {tuple(h.shape[:-1])}")
    loss, ce, z_loss = ChunkedLMHeadLoss.apply(
        h, weight, targets, z_loss_coef, chunk_size, compute_dtype, needs_grad
    )
    return {"loss": loss, "ce": ce, "z_loss": z_loss}


class Transformer(nn.Module):
    def __init__(self, model_cfg, attention_backend="math", loss_chunk_size=0):
        super().__init__()
        config.check_section("model", model_cfg)  # the schema and config.py's rules, nowhere else
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend={attention_backend!r} is not one of {sorted(ATTENTION_BACKENDS)}"
            )
        self.cfg = dict(model_cfg)
        self.seq_len = model_cfg["seq_len"]
        self.z_loss_coef = model_cfg["z_loss_coef"]
        if not isinstance(loss_chunk_size, int) or loss_chunk_size < 0:
            raise ValueError(f"loss_chunk_size={loss_chunk_size!r} must be an int >= 0 (0: the full logits)")
        self.loss_chunk_size = loss_chunk_size  # positions per chunk of the LM head + loss; 0 = unchunked
        backend = ATTENTION_BACKENDS[attention_backend]
        repeat_kv = not hardware.kernel_takes_gqa(attention_backend)
        self.embed_tokens = nn.Embedding(model_cfg["vocab_size"], model_cfg["d_model"])
        self.layers = nn.ModuleList(
            DecoderLayer(model_cfg, backend, repeat_kv) for _ in range(model_cfg["n_layers"])
        )
        self.norm = RMSNorm(model_cfg["d_model"], model_cfg["norm_eps"])
        self.lm_head = nn.Linear(model_cfg["d_model"], model_cfg["vocab_size"], bias=False)
        self.lm_head.weight = self.embed_tokens.weight  # tied: one tensor, counted once
        head_dim = model_cfg["d_model"] // model_cfg["n_heads"]
        cos, sin = rope_tables(self.seq_len, head_dim, model_cfg["rope_base"])
        # Not persistent: derived from the config, so checkpoints carry only learned weights.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    def init_weights(self):
        """The one place that says how weights start: every matrix (the tied embedding included) normal
        with std init_std; the projections that write into the residual stream (o_proj, down_proj) with
        init_std / sqrt(2 * n_layers), so the stream's variance does not grow with depth (GPT-2); every
        RMSNorm weight 1. With zero_init_out_proj those two start at zero instead: every block starts as the
        identity of the residual stream (modded-nanogpt); their gradients are not zero, so they still learn."""
        std = self.cfg["init_std"]
        residual_std = std / math.sqrt(2 * self.cfg["n_layers"])
        for name, param in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")) and self.cfg["zero_init_out_proj"]:
                nn.init.zeros_(param)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(param, mean=0.0, std=residual_std)
            elif param.dim() == 2:
                nn.init.normal_(param, mean=0.0, std=std)
            else:
                nn.init.ones_(param)

    def num_params(self):
        """Every parameter once: the tied embedding/LM head matrix counts one time."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len):
        """Training FLOPs per token (forward + backward), PaLM / nanoGPT accounting: 6 * N, N = num_params()
        (the tied embedding counts once: it costs nothing as a lookup and 2 * vocab_size * d_model per token
        as the LM head matmul), plus 12 * n_layers * d_model * seq_len for the attention scores and the
        weighted sum of values (full, not causal-halved, T x T)."""
        return 6 * self.num_params() + 12 * self.cfg["n_layers"] * self.cfg["d_model"] * seq_len

    def layout(self):
        """This model as the decoding engine reads it (layout() below)."""
        return layout(self)

    def forward(self, idx, targets=None):
        """idx (B, T) token ids, T <= seq_len. Without targets -> (logits (B, T, vocab_size), None). With
        targets (B, T) -> (None, losses): {"loss": ce + z_loss, "ce": ..., "z_loss": ...} as 0-dim float32
        tensors, means over the positions whose target is not -1 (targets equal to -1 are ignored). The
        full logits are not materialized then (loss_chunk_size > 0: chunk by chunk, see ChunkedLMHeadLoss);
        `loss` is the one to differentiate, ce and z_loss are its two parts, reported."""
        T = idx.shape[1]
        if T > self.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than model.seq_len={self.seq_len}")
        x = self.embed_tokens(idx)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        for layer in self.layers:
            x = layer(x, cos, sin)
        h = self.norm(x)
        if targets is None:
            return self.lm_head(h), None
        if self.loss_chunk_size:
            return None, chunked_losses(
                h, self.lm_head.weight, targets, self.z_loss_coef, self.loss_chunk_size
            )
        return None, logits_losses(self.lm_head(h), targets, self.z_loss_coef)


# -----------------------------------------------------------------------------
# The layout the decoding engine reads (decode/): every part of a Transformer it touches, named by role.
# The engine reads a model only through layout(), so renaming a part is a change in this file alone, and
# tests/test_engine.py decodes a model whose parts were all renamed to prove it. The engine calls
# model.layout(), so a model's own class says where its parts are.


class BlockParts(NamedTuple):
    """One block as the engine runs it: x + attention.out(attend(project(attn_norm(x)))), then
    x + ffn(ffn_norm(x))."""

    attn_norm: nn.Module  # RMSNorm of the block's input, before attention
    attention: Attention  # project / heads -> (q, k, v); attend(q, k, v, ...); out(y)
    qkv: tuple  # the q, k and v products, which read the same input (the engine's kernels fuse them)
    ffn_norm: nn.Module  # RMSNorm before the feed-forward
    ffn: MLP  # ffn(x); swiglu(gate, up) from the gate and up products
    gate_up: tuple  # the gate and up products, which read the same input


class Layout(NamedTuple):
    """A Transformer as the engine reads it: embed -> blocks -> final_norm -> head, rotary tables by
    position, and the shapes a KV cache needs."""

    embed: nn.Embedding  # token ids (...) -> (..., d_model)
    blocks: tuple  # BlockParts, first to last
    final_norm: nn.Module
    head: nn.Linear  # (..., d_model) -> logits (..., vocab_size), tied to embed's weight
    cos: torch.Tensor  # (seq_len, head_dim): the rotary cosines of each position
    sin: torch.Tensor
    seq_len: int
    kv_heads: int
    head_dim: int
    norm_eps: float
    backend: SDPBackend  # the attention kernel the model trained with


def layout(model):
    """The Layout of a Transformer (or of a copy whose products decode/weights.py replaced): its current
    modules and buffers, read here and nowhere else. The engine calls it as model.layout()."""
    blocks = tuple(
        BlockParts(
            layer.input_layernorm,
            layer.self_attn,
            (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
            layer.post_attention_layernorm,
            layer.mlp,
            (layer.mlp.gate_proj, layer.mlp.up_proj),
        )
        for layer in model.layers
    )
    first = model.layers[0].self_attn
    return Layout(
        model.embed_tokens,
        blocks,
        model.norm,
        model.lm_head,
        model.rope_cos,
        model.rope_sin,
        model.seq_len,
        first.n_kv_heads,
        first.head_dim,
        model.norm.eps,
        first.backend,
    )
