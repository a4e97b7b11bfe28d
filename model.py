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

    def forward(self, x, cos, sin, cache=None, layer_index=None):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim))
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, head_dim)
        mask, is_causal, backends = None, True, self.backend
        if cache is not None:
            # Flash kernels take no explicit mask: decoding may fall back to the math kernel.
            backends = [self.backend, SDPBackend.MATH]
            start = cache.length
            k, v = cache.store(layer_index, k, v)
            if start > 0:
                # New queries sit at positions start..start+T-1 and see every cached key up to their own
                # position; is_causal would align the mask to the top-left corner instead.
                is_causal = False
                if T > 1:
                    key_pos = torch.arange(start + T, device=x.device)
                    query_pos = torch.arange(start, start + T, device=x.device)
                    mask = key_pos[None, :] <= query_pos[:, None]
        with sdpa_kernel(backends):
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=self.n_kv_heads != self.n_heads
            )
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg["d_model"], cfg["ffn_hidden"], bias=False)
        self.up_proj = nn.Linear(cfg["d_model"], cfg["ffn_hidden"], bias=False)
        self.down_proj = nn.Linear(cfg["ffn_hidden"], cfg["d_model"], bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, backend):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["d_model"], cfg["norm_eps"])
        self.self_attn = Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg["d_model"], cfg["norm_eps"])
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, cache=None, layer_index=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer_index)
        return x + self.mlp(self.post_attention_layernorm(x))


class KVCache:
    """Keys and values of every layer for positions 0..length-1, preallocated to the context length on the
    first store (with the dtype and device of the first keys stored)."""

    def __init__(self, n_layers, max_len):
        self.max_len = max_len
        self.length = 0
        self.keys = [None] * n_layers
        self.values = [None] * n_layers

    def store(self, layer_index, k, v):
        """Write k, v (B, kv_heads, T, head_dim) at positions length..length+T-1 and return the keys and
        values of positions 0..length+T-1. The caller advances `length` once every layer has stored."""
        B, H, T, D = k.shape
        if self.keys[layer_index] is None:
            self.keys[layer_index] = k.new_empty(B, H, self.max_len, D)
            self.values[layer_index] = v.new_empty(B, H, self.max_len, D)
        end = self.length + T
        self.keys[layer_index][:, :, self.length : end] = k
        self.values[layer_index][:, :, self.length : end] = v
        return self.keys[layer_index][:, :, :end], self.values[layer_index][:, :, :end]


class Transformer(nn.Module):
    def __init__(self, model_cfg, attention_backend="math"):
        super().__init__()
        config.check_section("model", model_cfg)  # the schema and config.py's rules, nowhere else
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend={attention_backend!r} is not one of {sorted(ATTENTION_BACKENDS)}"
            )
        self.cfg = dict(model_cfg)
        self.seq_len = model_cfg["seq_len"]
        self.z_loss_coef = model_cfg["z_loss_coef"]
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
        RMSNorm weight 1."""
        std = self.cfg["init_std"]
        residual_std = std / math.sqrt(2 * self.cfg["n_layers"])
        for name, param in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
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
        """idx (B, T) token ids, T <= seq_len -> (logits (B, T, vocab_size), losses). losses is None without
        targets, else {"loss": ce + z_loss, "ce": ..., "z_loss": ...} as 0-dim float32 tensors; targets
        equal to -1 are ignored."""
        T = idx.shape[1]
        if T > self.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than model.seq_len={self.seq_len}")
        x = self.embed_tokens(idx)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits, None
        return logits, self.losses(logits, targets)

    def losses(self, logits, targets):
        """Cross-entropy on float32 logits plus the PaLM z-loss z_loss_coef * mean(logsumexp(logits)^2),
        which keeps the softmax normalizer near 1 so float16 logits cannot drift out of range. Both are
        means over the positions whose target is not -1."""
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
        z_loss = self.z_loss_coef * torch.where(keep, log_normalizer.square(), 0.0).sum() / count
        return {"loss": ce + z_loss, "ce": ce, "z_loss": z_loss}

    # ---- inference with a KV cache ----

    def new_kv_cache(self):
        """An empty cache for forward_with_cache, holding up to seq_len positions."""
        return KVCache(len(self.layers), self.seq_len)

    def forward_with_cache(self, idx, cache):
        """Run the new tokens idx (B, T) at positions cache.length..cache.length+T-1, attending to every
        cached position, and append their keys/values to the cache. Returns logits (B, T, vocab_size):
        the same as the full forward pass over all the tokens seen so far, at the new positions."""
        start, T = cache.length, idx.shape[1]
        if start + T > cache.max_len:
            raise ValueError(
                f"{start} cached + {T} new tokens exceed model.seq_len={cache.max_len}; "
                "start a new cache from the most recent tokens"
            )
        x = self.embed_tokens(idx)
        cos, sin = self.rope_cos[start : start + T], self.rope_sin[start : start + T]
        for layer_index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, layer_index)
        cache.length = start + T
        return self.lm_head(self.norm(x))

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
        CPU generator gives the same draws whatever the model's device). The stop token is yielded, then
        generation ends. A constraint (agent_grammar.ToolCallConstraint, say) sees each step's logits
        before sampling, constraint.mask(logits) -> logits with forbidden tokens at -inf, and is told the
        token chosen, constraint.accept(token).

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
        check_sampling(temperature, top_k, top_p)
        device = self.embed_tokens.weight.device
        window = idx.tolist()[-self.seq_len :]
        cache = self.new_kv_cache()
        logits = self.forward_with_cache(torch.tensor([window], device=device), cache)
        for step in range(max_new_tokens):
            last = logits[0, -1] if constraint is None else constraint.mask(logits[0, -1])
            token = sample_token(last, temperature, top_k, top_p, generator)
            if constraint is not None:
                constraint.accept(token)
            yield token
            if token == stop_token or step == max_new_tokens - 1:
                return
            window.append(token)
            if cache.length < self.seq_len:
                logits = self.forward_with_cache(torch.tensor([[token]], device=device), cache)
            else:
                window = window[-(self.seq_len // 2) :]
                cache = self.new_kv_cache()
                logits = self.forward_with_cache(torch.tensor([window], device=device), cache)


def check_sampling(temperature, top_k, top_p):
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 means greedy)")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1 (or None for no limit)")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1] (or None for no limit)")


def sample_token(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """Pick one token id from logits (vocab_size,), see Transformer.generate."""
    check_sampling(temperature, top_k, top_p)
    if temperature == 0 or top_k == 1:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if generator is not None:
        logits = logits.to(generator.device)
    if top_k is not None and top_k < logits.numel():
        kth_largest = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Drop a token when the more likely ones already reach top_p; the most likely always stays.
        drop = (sorted_probs.cumsum(0) - sorted_probs) >= top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs, 1, generator=generator))
