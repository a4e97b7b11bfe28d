"""
The micro-batch that fits: the peak memory of one training step, estimated from the model's shapes.

    python microbatch.py configs/pretrain-2060.yaml [section.key=value ...]
    python microbatch.py --table            # tiny-50m on every GPU profile (the docs' table)

The estimate counts the tensors eager PyTorch holds at the step's highest point: the float32 weights and
AdamW's two moments, the activations the forward pass saves for the backward pass (counted from what
model.py's operations save, with the flash / memory-efficient attention kernels), the half-precision
copies of the weights under autocast, and the LM head + loss at their largest (model.ChunkedLMHeadLoss,
or the full logits when hardware.loss_chunk_size is 0). tests/test_train_memory.py measures the same
peak on the CPU and holds the estimate to it. Not counted: the CUDA context, the caching allocator's
fragmentation and cuBLAS workspaces, which is why a profile's memory_gib is what a run may fill, below
the board's memory. torch.compile saves fewer activations: the estimate is for eager mode.
"""

import os
import sys

import config

GIB = 1024**3


def bytes_per_element(dtype):
    return 4 if dtype == "float32" else 2  # float16 and bfloat16


def parameter_counts(model_cfg):
    """(all parameters, those of the decoder layers' matrices): the tied embedding counts once."""
    d, f, heads, kv_heads = (model_cfg[k] for k in ("d_model", "ffn_hidden", "n_heads", "n_kv_heads"))
    head_dim = d // heads
    kv_width = kv_heads * head_dim
    matrices = 2 * d * d + 2 * d * kv_width + 3 * d * f  # q, o; k, v; gate, up, down
    per_layer = matrices + 2 * head_dim + 2 * d  # + q_norm, k_norm, the two RMSNorms
    total = model_cfg["vocab_size"] * d + model_cfg["n_layers"] * per_layer + d
    return total, model_cfg["n_layers"] * matrices


def layer_activation_bytes_per_token(model_cfg, dtype):
    """Bytes one decoder layer saves for the backward pass per token. Counted from the tensors autograd
    keeps (tests/test_train_memory.py checks the sum): in float32, four ffn_hidden-wide tensors (gate,
    up, SiLU, product), ten d_model-wide ones (the layer's input, the norms' inputs and outputs, q, the
    attention output, o_proj's input, ...), four key/value-wide ones and a few per-head scalars (the
    norms' reciprocal RMS, the attention's log-sum-exp). Under autocast the matmul inputs are
    half-precision copies while the RMSNorms still save float32."""
    d, f = model_cfg["d_model"], model_cfg["ffn_hidden"]
    heads, kv_heads = model_cfg["n_heads"], model_cfg["n_kv_heads"]
    kv_width = kv_heads * (d // heads)
    scalars = 4 * (2 * heads + kv_heads + 2)
    if dtype == "float32":
        return 4 * (4 * f + 10 * d + 4 * kv_width) + scalars
    return 4 * (6 * d + 2 * kv_width) + 2 * (4 * f + 7 * d + 2 * kv_width) + scalars


def loss_peak_bytes(model_cfg, positions, dtype, loss_chunk_size):
    """The LM head + loss at their largest, beyond the activations. Unchunked: four float32 copies of
    positions x vocab at once (the logits, log-softmax, two gradients), or the LM head's weight gradient
    and its copies when the vocabulary outweighs the positions. Chunked: one chunk's logits plus the
    gradients ChunkedLMHeadLoss keeps for the embedding matrix and the final norm's output."""
    vocab, d = model_cfg["vocab_size"], model_cfg["d_model"]
    logits, weight, hidden = positions * vocab, vocab * d, positions * d
    half = dtype != "float32"
    if not loss_chunk_size:
        if not half:
            return max(16 * logits, 4 * logits + 4 * weight + 4 * hidden)
        # + the weight's half copy; then its half gradient, cast to float32 for the parameter
        return max(16 * logits + 2 * weight + 2 * hidden, 4 * weight + 2 * logits + 4 * hidden, 6 * weight)
    chunk = min(loss_chunk_size, positions) * vocab
    if not half:  # the loop (grad_weight, grad_h, one chunk) or backward (both gradients twice)
        return max(4 * weight + 4 * hidden + 4 * chunk, 8 * weight + 8 * hidden)
    # grad_weight, its half product and float32 sum per chunk, the weight's half copy; grad_h; the
    # chunk's float32 and half buffers
    return max(12 * weight + 2 * hidden + 6 * chunk, 8 * weight + 6 * hidden)


def step_peak_bytes(model_cfg, micro_batch, dtype, loss_chunk_size):
    """Estimated peak bytes of one training step (forward, backward, AdamW) at `micro_batch` sequences
    of model.seq_len tokens."""
    params, layer_matrices = parameter_counts(model_cfg)
    positions = micro_batch * model_cfg["seq_len"]
    d = model_cfg["d_model"]
    state = 12 * params  # float32 weights, AdamW's exp_avg and exp_avg_sq
    activations = positions * (model_cfg["n_layers"] * layer_activation_bytes_per_token(model_cfg, dtype))
    activations += positions * 4 * (2 * d + 1)  # the final RMSNorm
    if dtype != "float32":
        activations += 2 * layer_matrices  # autocast's half copies, kept for the backward pass
    # The highest of: the end of the forward pass with the loss at its largest; the end of the backward
    # pass, where every gradient exists and the embedding's (dense) is added to the LM head's: in place,
    # but for the float32 LM head's gradient that the unchunked matmul's backward leaves, which takes a
    # new sum.
    tied_sum = 8 if dtype == "float32" and not loss_chunk_size else 4
    end_of_backward = 4 * params + tied_sum * model_cfg["vocab_size"] * d
    return state + max(
        activations + loss_peak_bytes(model_cfg, positions, dtype, loss_chunk_size), end_of_backward
    )


def largest_micro_batch(model_cfg, dtype, loss_chunk_size, memory_bytes):
    """The most sequences per micro-batch whose estimated step fits in memory_bytes (0 if none)."""
    fits = 0
    while step_peak_bytes(model_cfg, fits + 1, dtype, loss_chunk_size) <= memory_bytes:
        fits += 1
    return fits


# -----------------------------------------------------------------------------

ROOT = os.path.dirname(os.path.abspath(__file__))
TABLE_PROFILES = ["turing-2060", "blackwell-5090", "hopper-h200"]
TABLE_MICRO_BATCH = 16  # configs/train/pretrain.yaml's


def report(cfg):
    """Lines for one resolved run config: the estimate at its micro-batch, and the largest that fits."""
    model_cfg, hardware, micro_batch = cfg["model"], cfg["hardware"], cfg["train"]["micro_batch_size"]
    memory_gib = hardware["memory_gib"]
    lines = [
        f"{cfg['run_name']}: {hardware['name']} ({hardware['dtype']}, "
        f"{'no memory_gib' if memory_gib is None else f'{memory_gib} GiB for the step'}), "
        f"seq_len {model_cfg['seq_len']}, vocab {model_cfg['vocab_size']}"
    ]
    for chunk in sorted({hardware["loss_chunk_size"], 0}, reverse=True):
        peak = step_peak_bytes(model_cfg, micro_batch, hardware["dtype"], chunk)
        what = f"loss in chunks of {chunk}" if chunk else "full logits"
        line = f"  {what:26s} micro-batch {micro_batch}: ~{peak / GIB:.1f} GiB"
        if memory_gib is not None:
            fits = largest_micro_batch(model_cfg, hardware["dtype"], chunk, memory_gib * GIB)
            line += f" | largest micro-batch that fits: {fits}"
        lines.append(line)
    return lines


def table():
    """tiny-50m (seq_len 1024) on each GPU profile: the Markdown table of docs/entrenamiento.md, in
    Spanish (decimal commas)."""
    model_cfg = config.load_layer("model", os.path.join(ROOT, "configs", "model", "tiny-50m.yaml"))

    def gib(value):
        return f"{value:.1f}".replace(".", ",") + " GiB"

    rows = [
        f"| perfil | dtype | memoria para el paso | micro-batch {TABLE_MICRO_BATCH}: logits completos | "
        f"micro-batch {TABLE_MICRO_BATCH}: por trozos | cabe: logits completos | cabe: por trozos |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in TABLE_PROFILES:
        hardware = config.load_layer("hardware", os.path.join(ROOT, "configs", "hardware", f"{name}.yaml"))
        dtype, chunk, memory = hardware["dtype"], hardware["loss_chunk_size"], hardware["memory_gib"] * GIB
        peak = {c: step_peak_bytes(model_cfg, TABLE_MICRO_BATCH, dtype, c) / GIB for c in (0, chunk)}
        fits = {c: largest_micro_batch(model_cfg, dtype, c, memory) for c in (0, chunk)}
        rows.append(
            f"| `{name}` | {dtype} | {gib(hardware['memory_gib'])} | {gib(peak[0])} | {gib(peak[chunk])} "
            f"(trozos de {chunk}) | {fits[0]} | {fits[chunk]} |"
        )
    return rows


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python microbatch.py CONFIG [section.key=value ...] | --table", file=sys.stderr)
        return 2
    try:
        print("\n".join(table() if argv[0] == "--table" else report(config.load(argv[0], argv[1:]))))
    except config.ConfigError as e:
        print("config problems:\n  " + "\n  ".join(e.problems), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
