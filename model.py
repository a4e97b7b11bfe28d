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

The model knows nothing about devices, dtypes or files: the caller moves it and picks autocast.
"""

import collections
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import config

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
    def __init__(self, cfg, backend):
        super().__init__()
        self.n_heads = cfg["n_heads"]
        self.n_kv_heads = cfg["n_kv_heads"]
        self.head_dim = cfg["d_model"] // cfg["n_heads"]
        self.backend = backend
        d_model = cfg["d_model"]
        self.q_proj = nn.Linear(d_model, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d_model, bias=False)
        # QK-norm (with z-loss) is what keeps float16 training on the RTX 2060 stable: it bounds the
        # attention logits, which otherwise grow until softmax overflows in half precision.
        self.q_norm = RMSNorm(self.head_dim, cfg["norm_eps"])
        self.k_norm = RMSNorm(self.head_dim, cfg["norm_eps"])
        # A decode step's attention in one operator (q, keys, values, ends) -> y, and the three projections
        # in one x -> (q, k, v), where serve puts its CPU kernels (serve/weights.with_kernels); None: the
        # torch code below.
        self.decode_kernel = None
        self.qkv_kernel = None

    def project(self, x, cos, sin):
        """q, k, v of x (B, T, d_model), shaped (B, heads, T, head_dim), q and k normed and rotated."""
        B, T, _ = x.shape
        if self.qkv_kernel is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = self.qkv_kernel(x)
        q = self.q_norm(q.view(B, T, self.n_heads, self.head_dim))
        k = self.k_norm(k.view(B, T, self.n_kv_heads, self.head_dim))
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def attend(self, q, k, v, mask=None, is_causal=False, backends=None):
        with sdpa_kernel(self.backend if backends is None else backends):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=self.n_kv_heads != self.n_heads
            )

    def forward(self, x, cos, sin, cache=None, layer_index=None, slot=None):
        B, T, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        mask, is_causal, backends = None, True, self.backend
        if cache is not None:
            # Flash kernels take no explicit mask: decoding may fall back to the math kernel.
            backends = [self.backend, SDPBackend.MATH]
            start = cache.lengths[slot or 0]
            k, v = cache.store(layer_index, k, v, slot)
            if start > 0:
                # New queries sit at positions start..start+T-1 and see every cached key up to their own
                # position; is_causal would align the mask to the top-left corner instead.
                is_causal = False
                if T > 1:
                    key_pos = torch.arange(start + T, device=x.device)
                    query_pos = torch.arange(start, start + T, device=x.device)
                    mask = key_pos[None, :] <= query_pos[:, None]
        y = self.attend(q, k, v, mask, is_causal, backends)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))

    def decode(self, x, cos, sin, cache, layer_index, step):
        """One new token for each cache slot: x (slots, 1, d_model) at each slot's own position (cos, sin:
        (slots, 1, head_dim)); step (a DecodeStep) lists the slots in use, the others' outputs are zeros.
        The projections run over every slot at once; attention runs row by row over the row's own filled
        keys, so that it is exactly the computation of that row decoding alone. (One masked attention over
        the longest row would add the other rows' lengths to each row's softmax sums, which changes their
        float32 rounding.) A single query needs no mask; these three products cost about what the flash
        kernel does and a fifth to a twentieth of the math kernel with its grouped-query expansion."""
        slots = x.shape[0]
        q, k, v = self.project(x, cos, sin)
        keys, values = cache.store_step(layer_index, k[:, :, 0], v[:, :, 0], step)
        # Query heads grouped by the key/value head they read: head h reads kv head h // group.
        q = q.reshape(slots, self.n_kv_heads, -1, self.head_dim) * self.head_dim**-0.5
        if self.decode_kernel is not None:  # each row over its own filled keys; zeros for unused slots
            return self.o_proj(self.decode_kernel(q, keys, values, step.slot_ends).reshape(slots, 1, -1))
        outputs = []
        for row, end in zip(step.rows, step.ends, strict=True):
            scores = q[row] @ keys[row, :, :end].transpose(1, 2)  # (kv_heads, group, end)
            outputs.append(scores.softmax(-1) @ values[row, :, :end])  # (kv_heads, group, head_dim)
        y = torch.stack(outputs)
        if len(step.rows) < slots:
            y = q.new_zeros(q.shape).index_copy_(0, step.index, y)
        return self.o_proj(y.reshape(slots, 1, -1))

    def decode_all(self, x, cos, sin, keys, values, positions, visible):
        """Attention.decode with static shapes, for a compiled step: every slot writes its new key and
        value at its position and attends over the whole preallocated cache, the keys past its position
        masked (visible: (slots, max_len) bool). The shapes never depend on the lengths or on the slots in
        use, so one graph (or CUDA graph) serves every step; a row's result depends only on its own
        inputs, so it is the same whichever other slots are in use."""
        slots = x.shape[0]
        q, k, v = self.project(x, cos, sin)
        rows = torch.arange(slots, device=x.device)
        keys[rows, :, positions] = k[:, :, 0]
        values[rows, :, positions] = v[:, :, 0]
        q = q.reshape(slots, self.n_kv_heads, -1, self.head_dim) * self.head_dim**-0.5
        if self.decode_kernel is not None:  # the filled keys only, not the whole cache
            return self.o_proj(self.decode_kernel(q, keys, values, positions + 1).reshape(slots, 1, -1))
        scores = (q @ keys.transpose(2, 3)).masked_fill(~visible[:, None, None, :], float("-inf"))
        y = scores.softmax(-1) @ values  # (slots, kv_heads, group, head_dim)
        return self.o_proj(y.reshape(slots, 1, -1))

    def prefill_block(self, x, cos, sin, keys, values, slot, positions, visible):
        """A block of T tokens of one slot with static shapes, for a compiled prefill: x (1, T, d_model) at
        `positions` (T,) of slot `slot` (a 0-d tensor) writes its keys and values there and attends over the
        slot's whole preallocated cache, each query seeing the keys up to its own position (visible: (T,
        max_len) bool). Positions past the prompt (the block's padding) write keys nothing sees: the next
        step or prefill at that position writes again."""
        T = x.shape[1]
        q, k, v = self.project(x, cos, sin)  # (1, heads, T, head_dim)
        rows = slot.expand(T)
        keys[rows, :, positions] = k[0].transpose(0, 1)
        values[rows, :, positions] = v[0].transpose(0, 1)
        slot_keys, slot_values = keys.index_select(0, slot[None])[0], values.index_select(0, slot[None])[0]
        # Query heads grouped by the key/value head they read, as in decode: (kv_heads, group, T, head_dim).
        q = q.reshape(self.n_kv_heads, -1, T, self.head_dim) * self.head_dim**-0.5
        scores = (q @ slot_keys[:, None].transpose(2, 3)).masked_fill(~visible, float("-inf"))
        y = scores.softmax(-1) @ slot_values[:, None]  # (kv_heads, group, T, head_dim)
        return self.o_proj(y.reshape(1, -1, T, self.head_dim).transpose(1, 2).reshape(1, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg["d_model"], cfg["ffn_hidden"], bias=False)
        self.up_proj = nn.Linear(cfg["d_model"], cfg["ffn_hidden"], bias=False)
        self.down_proj = nn.Linear(cfg["ffn_hidden"], cfg["d_model"], bias=False)
        self.gate_up_kernel = None  # x -> (gate, up) in one operator: see Attention.qkv_kernel

    def forward(self, x):
        if self.gate_up_kernel is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up_kernel(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, backend):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["d_model"], cfg["norm_eps"])
        self.self_attn = Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg["d_model"], cfg["norm_eps"])
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache=None, layer_index=None, slot=None, step=None):
        """With a DecodeStep, x holds one new token per cache slot (Attention.decode), else a block of
        tokens."""
        h = self.input_layernorm(x)
        if step is None:
            x = x + self.self_attn(h, cos, sin, cache, layer_index, slot)
        else:
            x = x + self.self_attn.decode(h, cos, sin, cache, layer_index, step)
        return x + self.mlp(self.post_attention_layernorm(x))


class KVCache:
    """Keys and values of every layer for `slots` sequences, each at its own length: per layer a keys and a
    values tensor (slots, kv_heads, max_len, head_dim), preallocated by allocate() or on the first store
    (with the dtype and device of the first keys stored). lengths[s] positions of slot s are filled."""

    def __init__(self, n_layers, max_len, slots=1):
        self.max_len, self.slots = max_len, slots
        self.lengths = [0] * slots
        self.keys = [None] * n_layers
        self.values = [None] * n_layers

    @property
    def length(self):
        """The filled length of a cache whose slots are filled together (forward_with_cache without slot)."""
        return self.lengths[0]

    @length.setter
    def length(self, value):
        self.lengths = [value] * self.slots

    def allocate(self, kv_heads, head_dim, dtype, device):
        for layer_index in range(len(self.keys)):
            shape = (self.slots, kv_heads, self.max_len, head_dim)
            self.keys[layer_index] = torch.zeros(shape, dtype=dtype, device=device)
            self.values[layer_index] = torch.zeros(shape, dtype=dtype, device=device)

    def store(self, layer_index, k, v, slot=None):
        """Write k, v (B, kv_heads, T, head_dim) after the filled positions, into every slot (B = slots,
        filled together) or into slot `slot` alone (B = 1); return the keys and values of those slots'
        positions 0..length+T-1. The caller advances the lengths once every layer has stored."""
        B, H, T, D = k.shape
        if self.keys[layer_index] is None:
            self.allocate(H, D, k.dtype, k.device)
        rows = slice(None) if slot is None else slice(slot, slot + 1)
        start = self.lengths[slot or 0]
        end = start + T
        self.keys[layer_index][rows, :, start:end] = k
        self.values[layer_index][rows, :, start:end] = v
        return self.keys[layer_index][rows, :, :end], self.values[layer_index][rows, :, :end]

    def store_step(self, layer_index, k, v, step):
        """Write one position per slot in use (a DecodeStep), at that slot's length: k, v (slots, kv_heads,
        head_dim) hold every slot's new key and value. Returns the layer's whole keys and values."""
        if self.keys[layer_index] is None:
            self.allocate(k.shape[1], k.shape[2], k.dtype, k.device)
        self.keys[layer_index][step.index, :, step.positions] = k[step.index]
        self.values[layer_index][step.index, :, step.positions] = v[step.index]
        return self.keys[layer_index], self.values[layer_index]


class DecodeStep:
    """The slots in use in one decode_step: rows (ints, ascending) and as a tensor (index), their
    positions (a tensor: the slots' lengths before the step) and the lengths after it (ends; and as a
    tensor over every slot, 0 for a slot not in use: slot_ends, what a decode kernel reads)."""

    def __init__(self, rows, lengths, device):
        self.rows = sorted(rows)
        self.ends = [lengths[row] + 1 for row in self.rows]
        self.index = torch.tensor(self.rows, device=device)
        self.positions = torch.tensor([end - 1 for end in self.ends], device=device)
        ends = dict(zip(self.rows, self.ends, strict=True))
        self.slot_ends = torch.tensor([ends.get(slot, 0) for slot in range(len(lengths))], device=device)


PUBLIC = ("public",)  # the PrefixCache scope of the blocks every request may share


class PrefixCache:
    """Keys and values of prompt prefixes, in blocks of `block` positions cut at the fixed points 0, block,
    2 * block, ... (Decoder prefills every prompt in chunks at those points, so a block restored here holds
    the very numbers its prefill would compute, and an answer is the same with or without the cache).
    A block is keyed by its scope and every token id up to its end: a block within a prompt's first
    `shared` tokens (text the server wrote for everyone) has the scope PUBLIC; any later block the scope of
    the request's member, and only that member's requests find it. At most max_bytes, least recently used
    blocks evicted first (a prompt's later blocks before its earlier ones)."""

    def __init__(self, block, max_bytes):
        self.block, self.max_bytes, self.bytes = block, max_bytes, 0
        self.blocks = collections.OrderedDict()  # (scope, ids) -> [(keys, values) per layer]
        self.stats = {"reused_tokens": 0, "prefilled_tokens": 0, "evicted_blocks": 0}

    def key(self, ids, end, scope, shared):
        return (PUBLIC if end <= shared else ("member", scope), tuple(ids[:end]))

    def restore(self, cache, slot, ids, scope, shared):
        """Copy the cached blocks that start ids (leaving at least its last token to prefill) into the
        slot; returns how many positions they fill, and the keys of the blocks used."""
        used = []
        for end in range(self.block, len(ids), self.block):
            entry = self.blocks.get(self.key(ids, end, scope, shared))
            if entry is None:
                break
            for layer_index, (keys, values) in enumerate(entry):
                cache.keys[layer_index][slot, :, end - self.block : end] = keys
                cache.values[layer_index][slot, :, end - self.block : end] = values
            used.append(self.key(ids, end, scope, shared))
        filled = len(used) * self.block
        cache.lengths[slot] = filled
        self.stats["reused_tokens"] += filled
        return filled, used

    def store(self, cache, slot, ids, end, scope, shared):
        """Keep positions end - block .. end - 1 of the slot (just prefilled from ids)."""
        key = self.key(ids, end, scope, shared)
        if key in self.blocks:
            return key
        entry = [(keys[slot, :, end - self.block : end].clone(), values[slot, :, end - self.block : end].clone())
                 for keys, values in zip(cache.keys, cache.values, strict=True)]  # fmt: skip
        self.blocks[key] = entry
        self.bytes += sum(k.nbytes + v.nbytes for k, v in entry)
        while self.bytes > self.max_bytes and self.blocks:
            _, evicted = self.blocks.popitem(last=False)
            self.bytes -= sum(k.nbytes + v.nbytes for k, v in evicted)
            self.stats["evicted_blocks"] += 1
        return key

    def touch(self, keys):
        """Mark a prompt's blocks used, its first block last: eviction takes a prompt's later blocks
        first, which are useless without the earlier ones."""
        for key in reversed(keys):
            if key in self.blocks:
                self.blocks.move_to_end(key)


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
        self.embed_tokens = nn.Embedding(model_cfg["vocab_size"], model_cfg["d_model"])
        self.layers = nn.ModuleList(DecoderLayer(model_cfg, backend) for _ in range(model_cfg["n_layers"]))
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

    # ---- inference with a KV cache ----

    def new_kv_cache(self, slots=1):
        """An empty cache for forward_with_cache and decode_step: `slots` sequences of up to seq_len
        positions each."""
        return KVCache(len(self.layers), self.seq_len, slots)

    def kv_cache_bytes(self, slots, bytes_per_value=4):
        """Memory of a KVCache of `slots` slots: keys and values of every layer, seq_len positions each."""
        attn = self.layers[0].self_attn
        return 2 * len(self.layers) * slots * attn.n_kv_heads * self.seq_len * attn.head_dim * bytes_per_value

    def forward_with_cache(self, idx, cache, slot=None):
        """Run the new tokens idx (B, T) at positions cache.length..cache.length+T-1, attending to every
        cached position, and append their keys/values to the cache: to every slot (B = cache.slots, all
        filled together), or with `slot` to that slot alone (B = 1, from its own length). Returns logits
        (B, T, vocab_size): the same as the full forward pass over all the tokens seen so far, at the new
        positions."""
        start, T = cache.lengths[slot or 0], idx.shape[1]
        if start + T > cache.max_len:
            raise ValueError(
                f"{start} cached + {T} new tokens exceed model.seq_len={cache.max_len}; "
                "start a new cache from the most recent tokens"
            )
        x = self.embed_tokens(idx)
        cos, sin = self.rope_cos[start : start + T], self.rope_sin[start : start + T]
        for layer_index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, layer_index, slot)
        if slot is None:
            cache.length = start + T
        else:
            cache.lengths[slot] = start + T
        return self.lm_head(self.norm(x))

    def decode_step(self, tokens, cache, rows):
        """One generation step for several sequences at once, each at its own position: tokens (slots,)
        holds the next token of each cache slot, of which the slots listed in `rows` are in use (the
        others' tokens are ignored). Appends the rows' keys and values at their slots' lengths and returns
        logits (slots, vocab_size). The projections and the LM head always run over all cache.slots
        rows, so a row's logits are bit for bit the same whichever other slots are in use (a float32
        matrix product may round a row differently when the number of rows changes)."""
        full = [row for row in rows if cache.lengths[row] >= cache.max_len]
        if full:
            raise ValueError(
                f"slots {full} hold model.seq_len={cache.max_len} positions; restart their window"
            )
        step = DecodeStep(rows, cache.lengths, tokens.device)
        positions = torch.zeros(cache.slots, dtype=torch.long, device=tokens.device)
        positions[step.index] = step.positions
        x = self.embed_tokens(tokens[:, None])
        cos, sin = self.rope_cos[positions][:, None, :], self.rope_sin[positions][:, None, :]
        for layer_index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, layer_index, step=step)
        for row, end in zip(step.rows, step.ends, strict=True):
            cache.lengths[row] = end
        return self.lm_head(self.norm(x))[:, 0]

    def decode_all(self, tokens, positions, cache):
        """decode_step for every slot at once with static shapes (what Decoder compiles): tokens (slots,)
        and positions (slots,) each slot's next token and the position it takes; writes every slot's keys
        and values there (a slot not in use writes past its filled length, where its next step or prefill
        writes again) and returns logits (slots, vocab_size). The caller advances the lengths."""
        x = self.embed_tokens(tokens[:, None])
        cos, sin = self.rope_cos[positions][:, None, :], self.rope_sin[positions][:, None, :]
        visible = torch.arange(cache.max_len, device=tokens.device)[None, :] <= positions[:, None]
        for layer_index, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            x = x + attn.decode_all(h, cos, sin, cache.keys[layer_index], cache.values[layer_index], positions,
                                    visible)  # fmt: skip
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(self.norm(x))[:, 0]

    def prefill_block(self, tokens, slot, start, last, cache):
        """A block of one slot's prompt with static shapes (what a Decoder's compiled prefill runs): tokens
        (1, T) at positions start..start+T-1 of slot `slot` (0-d tensors, start + T <= max_len), the
        prompt's tokens first and any padding after; writes their keys and values and returns the logits
        (vocab_size,) of the block's position `last` (0-d), the prompt's last. The caller sets the slot's
        length. A token's keys, values and logits do not depend on the padding after it (causal)."""
        T = tokens.shape[1]
        positions = start + torch.arange(T, device=tokens.device)
        x = self.embed_tokens(tokens)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        visible = torch.arange(cache.max_len, device=tokens.device)[None, :] <= positions[:, None]
        for layer_index, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            x = x + attn.prefill_block(h, cos, sin, cache.keys[layer_index], cache.values[layer_index], slot,
                                       positions, visible)  # fmt: skip
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(self.norm(x[:, last]))[0]

    def decoder(self, slots, allocate=False, compile_mode=None, prefix_block=None, prefix_cache_bytes=0,
                compile_with=None):  # fmt: skip
        """A Decoder over this model with `slots` slots (allocate: its KV cache now, in the weights'
        dtype, rather than on the first prefill; compile_mode, compile_with and the prefix cache: see
        Decoder)."""
        return Decoder(self, slots, allocate, compile_mode, prefix_block, prefix_cache_bytes, compile_with)

    @torch.no_grad()
    def generate(
        self,
        idx,
        max_new_tokens,
        temperature=1.0,
        top_k=None,
        top_p=None,
        stop_token=None,
        generator=None,
        constraint=None,
    ):
        """Yield up to max_new_tokens new token ids (ints), one per step, continuing the prompt idx (a 1-D
        tensor or shape (1, T)). temperature 0 or top_k 1 is greedy argmax; otherwise sample from
        softmax(logits / temperature), restricted to the top_k tokens and/or the smallest set whose
        probability reaches top_p, drawing with `generator` (sampling runs on the generator's device, so a
        CPU generator gives the same draws whatever the model's device). A constraint (see Decoder.sample)
        masks each step's logits before sampling and is told the token chosen. The stop token is yielded,
        then generation ends. This is a Decoder with one slot: the server's batches run the same steps.

        Each step's logits are exactly those of a full forward pass over a window of the most recent
        tokens. The first window is the prompt's last seq_len tokens; each step adds the new token to it
        until it holds seq_len; the next step's window is then the last seq_len // 2 tokens (the cache
        restarts from them with one batched prefill) and it grows again. So past seq_len every token is
        predicted from at least seq_len // 2 tokens, and a long chat costs one prefill of seq_len // 2
        tokens every seq_len // 2 steps instead of a full window at every step. (A rolling cache would
        keep keys computed while older tokens were still in view: no forward pass computes those.)"""
        if idx.dim() == 2 and idx.shape[0] == 1:
            idx = idx[0]
        if idx.dim() != 1 or idx.numel() == 0:
            raise ValueError(
                f"generate needs a non-empty prompt of shape (T,) or (1, T), not {tuple(idx.shape)}"
            )
        decoder = Decoder(self, slots=1)
        row = decoder.add(idx.tolist(), temperature, top_k, top_p, generator, constraint)
        for step in range(max_new_tokens):
            token = decoder.sample(row)
            yield token
            if token == stop_token or step == max_new_tokens - 1:
                return
            decoder.advance({row: token})


class Row:
    """One sequence of a Decoder: its cache slot, the window of tokens its cache holds, its sampling
    settings, and the logits of its next token."""

    def __init__(self, slot, window, temperature, top_k, top_p, generator, constraint):
        self.slot, self.window, self.logits = slot, window, None
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.generator, self.constraint = generator, constraint


class Decoder:
    """Generation for up to `slots` sequences at once, each at its own position (continuous batching:
    rows join and leave between steps). add() prefills a prompt on its own into a free slot of the KV
    cache; sample() picks a row's next token with the row's own settings, generator and constraint;
    advance() feeds every continuing row its token in one batched decode_step; remove() frees the slot.
    A row's tokens are those it would get alone in a Decoder of as many slots (decode_step). Windows
    past seq_len restart as Transformer.generate describes, each row on its own.

    With a compile_mode ("default": inductor; "reduce-overhead": CUDA graphs too) the batched step is
    Transformer.decode_all under torch.compile: static shapes (every slot, the whole preallocated cache),
    so compile() builds the one graph before any row arrives and no later step compiles again. Its logits
    are the eager step's up to float32 rounding; a row's tokens still do not depend on the other rows.
    compile_with(model, cache, block=...) builds such a step elsewhere instead (serve/aot.py: ahead of
    time), given the prefix cache's block when there is one: a step that also has prefill_block (a block of
    a prompt at static shapes) prefills the prompts' chunks with it.

    With prefix_block (and prefix_cache_bytes > 0) prompts are prefilled in chunks of prefix_block tokens
    and their whole blocks kept in a PrefixCache of at most prefix_cache_bytes, which later prompts
    starting with the same blocks copy instead of computing (see PrefixCache for who may reuse what)."""

    def __init__(self, model, slots, allocate=False, compile_mode=None, prefix_block=None, prefix_cache_bytes=0,
                 compile_with=None):  # fmt: skip
        self.model, self.slots = model, slots
        self.cache = model.new_kv_cache(slots)
        weight = model.embed_tokens.weight
        self.device = weight.device
        if allocate or compile_mode or compile_with:
            attn = model.layers[0].self_attn
            self.cache.allocate(attn.n_kv_heads, attn.head_dim, weight.dtype, weight.device)
        self.prefix_cache = (
            PrefixCache(prefix_block, prefix_cache_bytes) if prefix_block and prefix_cache_bytes else None
        )
        self.compiled_step = None
        if compile_with is not None:  # built elsewhere (serve/aot.py), with decode_all's contract
            block = self.prefix_cache.block if self.prefix_cache else None
            self.compiled_step = compile_with(model, self.cache, block=block)
        elif compile_mode:
            for tensor in self.cache.keys + self.cache.values:  # CUDA graphs write into them in place
                torch._dynamo.mark_static_address(tensor)
            # On a CPU, inductor's default mode with the wrapper that calls each kernel in C++ rather than
            # Python: a decode step is ~100 small calls (make bench ARGS=llama: +16% for int8 at tiny-50m).
            on_cpu = compile_mode == "default" and self.device.type == "cpu"
            how = {"options": {"cpp_wrapper": True}} if on_cpu else {"mode": compile_mode}
            self.compiled_step = torch.compile(model.decode_all, fullgraph=True, dynamic=False, **how)
        self.free = list(range(slots))
        self.rows = {}  # slot -> Row

    @torch.no_grad()
    def compile(self):
        """Run the compiled step until it is built (CUDA graphs record on the third call), before any row
        is added: the garbage it writes at position 0 of every slot is overwritten by each prefill."""
        for width in self.step_widths():
            for _ in range(3):
                tokens, positions = (torch.zeros(width, dtype=torch.long, device=self.device) for _ in "tp")
                float(self.compiled_step(tokens, positions, self.cache)[0, 0])  # waits for the device
        if self.compiled_prefill():
            self.prefill_chunk(0, 0, [0])
            self.cache.lengths[0] = 0

    @torch.no_grad()
    def add(self, prompt, temperature=1.0, top_k=None, top_p=None, generator=None, constraint=None, scope=None,
            shared=0):  # fmt: skip
        """A new row continuing `prompt` (a list of token ids, its last seq_len read), prefilled into the
        lowest free slot; raises ValueError when every slot is taken. With a prefix cache, scope (who
        asks) and shared (how many first tokens are everyone's) say which cached blocks it may reuse."""
        check_sampling(temperature, top_k, top_p)
        if not prompt:
            raise ValueError("a row needs a non-empty prompt")
        if not self.free:
            raise ValueError(f"all {self.slots} slots are in use")
        row = Row(min(self.free), list(prompt)[-self.model.seq_len :], temperature, top_k, top_p, generator,
                  constraint)  # fmt: skip
        row.scope, row.shared = scope, shared if len(prompt) <= self.model.seq_len else 0
        self.prefill(row)
        self.free.remove(row.slot)
        self.rows[row.slot] = row
        return row

    def prefill(self, row):
        if self.prefix_cache is None:
            self.cache.lengths[row.slot] = 0
            ids = torch.tensor([row.window], device=self.device)
            row.logits = self.model.forward_with_cache(ids, self.cache, row.slot)[0, -1]
            return
        # In chunks cut at multiples of the block, from the first position the cache did not restore.
        cache, block, window = self.prefix_cache, self.prefix_cache.block, row.window
        start, used = cache.restore(self.cache, row.slot, window, row.scope, row.shared)
        for begin in range(start, len(window), block):
            logits = self.prefill_chunk(row.slot, begin, window[begin : begin + block])
            if begin + block <= len(window):
                used.append(cache.store(self.cache, row.slot, window, begin + block, row.scope, row.shared))
        cache.touch(used)
        cache.stats["prefilled_tokens"] += len(window) - start
        row.logits = logits

    def compiled_prefill(self):
        """Whether the compiled step prefills blocks too (serve/aot.py's AotStep given the prefix block)."""
        return getattr(self.compiled_step, "prefill", None) is not None

    def prefill_chunk(self, slot, start, chunk):
        """Write the chunk's keys and values at positions start.. of the slot and return its last token's
        logits: through the compiled prefill_block where there is one and a whole block fits the cache from
        start (the chunk padded to the block: a fixed shape, one program for every prompt), else eager. Every
        chunk at a given start takes the same path, so a block the prefix cache restores holds what its
        prefill would compute."""
        block = self.prefix_cache.block
        if not self.compiled_prefill() or start + block > self.cache.max_len:
            ids = torch.tensor([chunk], device=self.device)
            return self.model.forward_with_cache(ids, self.cache, slot)[0, -1]
        padded = torch.tensor([chunk + [0] * (block - len(chunk))], device=self.device)
        where = [torch.tensor(value, device=self.device) for value in (slot, start, len(chunk) - 1)]
        logits = self.compiled_step.prefill_block(padded, *where, self.cache).clone()
        self.cache.lengths[slot] = start + len(chunk)
        return logits

    def sample(self, row):
        """The row's next token (sample_rows of it alone)."""
        return self.sample_rows([row])[row]

    def sample_rows(self, rows):
        """{row: its next token} for `rows`: each row's logits, masked by its constraint (constraint.mask(
        logits) returns the logits with forbidden tokens at -inf; constraint.accept(token) is told the
        choice), drawn by sample_tokens with the row's settings and generator. Rows with the same settings
        are drawn in one call (one top-k over all of them: a pass over the vocabulary per row, on the
        machine's threads); each row's token is the one it gets alone."""
        groups = {}
        for row in rows:
            groups.setdefault((row.temperature, row.top_k, row.top_p), []).append(row)
        tokens = {}
        for (temperature, top_k, top_p), group in groups.items():
            logits = [
                row.logits if row.constraint is None else row.constraint.mask(row.logits) for row in group
            ]
            logits = logits[0][None] if len(group) == 1 else torch.stack(logits)
            drawn = sample_tokens(logits, temperature, top_k, top_p, [row.generator for row in group])
            for row, token in zip(group, drawn, strict=True):
                if row.constraint is not None:
                    row.constraint.accept(token)
                tokens[row] = token
        return tokens

    @torch.no_grad()
    def advance(self, tokens):
        """Feed each row of `tokens` ({row: token}) its token: one decode_step for the rows whose slot has
        room, a prefill of its last seq_len // 2 tokens for a row whose window is full."""
        batched = []
        for row, token in tokens.items():
            row.window.append(token)
            if self.cache.lengths[row.slot] < self.model.seq_len:
                batched.append(row)
            else:
                row.window = row.window[-(self.model.seq_len // 2) :]
                row.shared = 0  # the window no longer starts where the prompt did
                self.prefill(row)
        if batched:
            ids = torch.zeros(self.slots, dtype=torch.long)
            for row in batched:
                ids[row.slot] = row.window[-1]
            if self.compiled_step is None:
                logits = self.model.decode_step(
                    ids.to(self.device), self.cache, [row.slot for row in batched]
                )
            else:
                logits = self.step_compiled(ids, batched)
            for row in batched:
                row.logits = logits[row.slot]

    def step_widths(self):
        """The numbers of first slots the compiled step runs over (serve/aot.py's AotStep builds narrower
        steps where each row's logits do not depend on the width); every slot otherwise."""
        return getattr(self.compiled_step, "widths", [self.slots])

    def step_compiled(self, ids, batched):
        """The compiled decode_all for the rows in `batched`, over the narrowest width that holds their slots
        (add() takes the lowest free slot); the other slots of that width write at their length (at
        most max_len - 1), past what they have filled. The logits are copied out of the graph's buffer,
        which the next step overwrites."""
        highest = max(row.slot for row in batched) + 1
        width = next(width for width in self.step_widths() if width >= highest)
        last = self.cache.max_len - 1
        positions = torch.tensor([min(length, last) for length in self.cache.lengths[:width]])
        logits = self.compiled_step(
            ids[:width].to(self.device), positions.to(self.device), self.cache
        ).clone()
        for row in batched:
            self.cache.lengths[row.slot] += 1
        return logits

    def remove(self, row):
        """Free the row's slot (a later add() overwrites its cache)."""
        if self.rows.pop(row.slot, None) is row:
            self.free.append(row.slot)


def check_sampling(temperature, top_k, top_p):
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 means greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1 (or None for no limit)")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1] (or None for no limit)")


def sample_token(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """Pick one token id from logits (vocab_size,), see Transformer.generate: sample_tokens of one row."""
    return sample_tokens(logits[None], temperature, top_k, top_p, [generator])[0]


def sample_tokens(logits, temperature=1.0, top_k=None, top_p=None, generators=None):
    """One token id per row of logits (rows, vocab_size), each row drawn with its own generator
    (generators: one per row, or None for torch's default). With top_k or top_p the draw is among the
    candidates only, most likely first (the top_k, or the vocabulary sorted for top_p): the softmax over
    them is the full softmax with the others masked out. Dividing by the temperature keeps the order, so
    it is done on the candidates only. Each draw is one uniform number from the row's generator placed on
    the candidates' cumulative probabilities (torch.multinomial draws a number per entry: measured 1.27 ms
    per token at 32,768 tokens before candidates, then 9 us of a 31 us top-50 draw at 4,096 tokens,
    docs/rendimiento.md). Every step works row by row, so a row's token does not depend on the others."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0 or top_k == 1:
        return logits.max(dim=-1).indices.tolist()  # the first of equal maxima, as argmax; 2-3x faster
    generators = generators or [None] * logits.shape[0]
    device = generators[0].device if generators[0] is not None else logits.device
    logits = logits.to(device)
    if top_k is not None and top_k < logits.shape[-1]:
        logits, order = torch.topk(logits, top_k, dim=-1)  # sorted, most likely first
    elif top_p is not None and top_p < 1:
        logits, order = torch.sort(logits, dim=-1, descending=True)
    else:
        order = None
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    below = probs.cumsum(-1)  # below[:, i]: the probability of candidates 0..i
    draws = [torch.rand(1, generator=generator, device=device) for generator in generators]
    uniform = (draws[0] if len(draws) == 1 else torch.cat(draws))[:, None]
    if top_p is not None and top_p < 1:
        # Drop a token when the more likely ones already reach top_p; the most likely always stays.
        last = ((below - probs) < top_p).sum(-1, keepdim=True) - 1
        index = torch.minimum((below <= uniform * below.gather(-1, last)).sum(-1, keepdim=True), last)
    else:
        index = (below <= uniform * below[:, -1:]).sum(-1, keepdim=True).clamp_(max=below.shape[-1] - 1)
    return (index if order is None else order.gather(-1, index)).squeeze(-1).tolist()
