"""The decoder in model.py: attention, RoPE, tying, losses, parameter count, KV cache, generation."""

import copy
import json
import math
import os
import re

import jsonschema
import pytest
import torch
import torch.nn.functional as F
import yaml
from torch.profiler import profile
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import config
from bench import model as bench_model
from model import Transformer, apply_rope, rope_tables, sample_token

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shipped(name):
    with open(os.path.join(ROOT, "configs", "model", f"{name}.yaml"), encoding="utf-8") as f:
        return yaml.safe_load(f)["model"]


def tiny(**changes):
    """The smoke model shrunk to milliseconds: 2 layers, d_model 64, 4 query heads sharing 2 kv heads."""
    cfg = shipped("smoke")
    cfg.update(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96, seq_len=32, init_std=0.02)
    cfg.update(changes)
    return cfg


def build(cfg, backend="math", seed=0, loss_chunk_size=0):
    torch.manual_seed(seed)
    return Transformer(cfg, backend, loss_chunk_size).eval()


def tokens(batch, length, vocab_size=256, seed=1):
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def closed_form_num_params(cfg):
    d, head_dim = cfg["d_model"], cfg["d_model"] // cfg["n_heads"]
    q_width, kv_width = cfg["n_heads"] * head_dim, cfg["n_kv_heads"] * head_dim
    attention = d * q_width + 2 * d * kv_width + q_width * d + 2 * head_dim  # q,k,v,o + q_norm,k_norm
    mlp = 3 * d * cfg["ffn_hidden"]
    per_layer = attention + mlp + 2 * d  # + input_layernorm, post_attention_layernorm
    return cfg["vocab_size"] * d + cfg["n_layers"] * per_layer + d  # tied embedding once + final norm


def written_out_attention(attn, x, rope_base, eps):
    """Multi-head attention spelled out from the module's weights, independently of model.py's code path:
    per-head RMSNorm on q and k, RoPE pairing dimension i with i + head_dim/2, causal softmax."""
    B, T, C = x.shape
    H, KV, D = attn.n_heads, attn.n_kv_heads, attn.head_dim

    def heads(weight):
        return (x @ weight.T).view(B, T, -1, D)

    def norm(t, weight):
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps) * weight

    angle = torch.arange(T)[:, None] * rope_base ** (-2 * torch.arange(D // 2) / D)  # (T, D/2)
    cos, sin = torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]

    def rotate(t):
        first, second = t[..., : D // 2], t[..., D // 2 :]
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)

    q = rotate(norm(heads(attn.q_proj.weight), attn.q_norm.weight))
    k = rotate(norm(heads(attn.k_proj.weight), attn.k_norm.weight))
    v = heads(attn.v_proj.weight)
    kv_head_of = torch.arange(H) // (H // KV)  # query head h reads key/value head h // group
    k, v = k[:, :, kv_head_of], v[:, :, kv_head_of]
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(D)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v)
    return y.reshape(B, T, C) @ attn.o_proj.weight.T


# ---- architecture ----


def test_changing_a_token_changes_no_logit_before_it():
    net = build(tiny())
    idx = tokens(2, 20)
    changed = idx.clone()
    changed[:, 12] = (changed[:, 12] + 1) % 256
    with torch.no_grad():
        before, _ = net(idx)
        after, _ = net(changed)
    torch.testing.assert_close(after[:, :12], before[:, :12], rtol=0, atol=0)
    assert not torch.allclose(after[:, 12], before[:, 12])


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_attention_equals_written_out_multi_head_attention_with_kv_heads_shared_by_groups(n_kv_heads):
    cfg = tiny(n_heads=4, n_kv_heads=n_kv_heads)
    net = build(cfg)
    attn = net.layers[0].self_attn
    for norm in (attn.q_norm, attn.k_norm):  # non-trivial norm weights, so a skipped norm would show
        norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(2, 10, cfg["d_model"])
    with torch.no_grad():
        got = attn(x, net.rope_cos[:10], net.rope_sin[:10])
        want = written_out_attention(attn, x, cfg["rope_base"], cfg["norm_eps"])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_grouped_query_attention_equals_multi_head_attention_with_each_kv_head_copied_to_its_group():
    gqa = build(tiny(n_heads=4, n_kv_heads=2))
    mha = build(tiny(n_heads=4, n_kv_heads=4))
    head_dim = 16
    state = gqa.state_dict()
    for name, tensor in list(state.items()):
        # (kv_heads * head_dim, d) -> (heads * head_dim, d), kv head j copied to query heads 2j and 2j+1
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            state[name] = tensor.view(2, head_dim, -1).repeat_interleave(2, dim=0).reshape(4 * head_dim, -1)
    mha.load_state_dict(state)
    idx = tokens(2, 16)
    with torch.no_grad():
        torch.testing.assert_close(mha(idx)[0], gqa(idx)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["math", "flash"])
def test_logits_equal_transformers_qwen3_with_the_same_weights(backend):
    # The model.py docstring's mapping: every name but lm_head gains `model.`; the weights load one to one.
    cfg = tiny(n_layers=2, n_heads=4, n_kv_heads=2)
    net = build(cfg, backend)
    for param in net.parameters():  # norm weights away from 1, so a skipped norm would show
        if param.dim() == 1:
            param.data.uniform_(0.5, 1.5)
    twin = bench_model.qwen3_twin(cfg).eval()
    state = {(n if n == "lm_head.weight" else f"model.{n}"): t for n, t in net.state_dict().items()}
    twin.load_state_dict(state)
    idx = tokens(2, cfg["seq_len"])
    with torch.no_grad():
        torch.testing.assert_close(net(idx)[0], twin(input_ids=idx).logits, rtol=0, atol=2e-5)


def test_rope_makes_query_key_products_depend_only_on_their_relative_offset():
    head_dim = 16
    cos, sin = rope_tables(64, head_dim, 10000.0)
    q, k = torch.randn(head_dim), torch.randn(head_dim)

    def at(vector, pos):
        return apply_rope(vector.view(1, 1, 1, -1), cos[pos : pos + 1], sin[pos : pos + 1])

    def score(query_pos, key_pos):
        return float((at(q, query_pos) * at(k, key_pos)).sum())

    for offset in (0, 1, 7):
        same_offset = [score(key_pos + offset, key_pos) for key_pos in (0, 5, 30, 50)]
        assert max(same_offset) - min(same_offset) < 1e-4, (offset, same_offset)
    assert abs(score(8, 1) - score(3, 1)) > 1e-3  # a different offset gives a different product


def test_rope_rotates_dimension_i_with_dimension_i_plus_half_head_dim():
    head_dim, base, position = 8, 10000.0, 3
    cos, sin = rope_tables(position + 1, head_dim, base)
    for i in range(head_dim // 2):
        x = torch.zeros(1, 1, 1, head_dim)
        x[..., i] = 1.0
        rotated = apply_rope(x, cos[position : position + 1], sin[position : position + 1]).flatten()
        angle = position * base ** (-2 * i / head_dim)
        want = torch.zeros(head_dim)
        want[i], want[i + head_dim // 2] = math.cos(angle), math.sin(angle)
        torch.testing.assert_close(rotated, want, rtol=0, atol=1e-6)


def test_lm_head_and_embedding_are_one_tensor():
    net = Transformer(tiny())
    assert net.lm_head.weight is net.embed_tokens.weight
    names = [name for name, _ in net.named_parameters()]
    assert "embed_tokens.weight" in names and "lm_head.weight" not in names  # one parameter, listed once
    _, losses = net(tokens(2, 8), tokens(2, 8, seed=2))
    losses["loss"].backward()
    assert net.embed_tokens.weight.grad is net.lm_head.weight.grad


def test_parameter_names_follow_the_hugging_face_qwen3_decoder():
    net = Transformer(tiny(n_layers=1))
    layer = [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ]
    want = {"embed_tokens.weight", "norm.weight", "lm_head.weight"} | {f"layers.0.{n}" for n in layer}
    assert set(net.state_dict()) == want  # RoPE tables are not persistent: checkpoints hold weights only
    assert all(name.endswith("weight") for name, _ in net.named_parameters())  # no biases


# ---- losses and initialization ----


@pytest.mark.parametrize("loss_chunk_size", [0, 5])
def test_loss_is_cross_entropy_plus_z_loss_matching_its_formula(loss_chunk_size):
    cfg = tiny(z_loss_coef=0.01)
    net = build(cfg, loss_chunk_size=loss_chunk_size)
    idx, targets = tokens(2, 12), tokens(2, 12, seed=2)
    no_logits, losses = net(idx, targets)
    assert no_logits is None  # with targets the full logits are not returned (nor, chunked, computed)
    flat = net(idx)[0].float().view(-1, cfg["vocab_size"])
    ce = F.cross_entropy(flat, targets.view(-1))
    z_loss = 0.01 * torch.logsumexp(flat, dim=-1).pow(2).mean()
    torch.testing.assert_close(losses["ce"], ce)
    torch.testing.assert_close(losses["z_loss"], z_loss)
    torch.testing.assert_close(losses["loss"], ce + z_loss)
    assert all(value.dim() == 0 and value.dtype == torch.float32 for value in losses.values())


@pytest.mark.parametrize("loss_chunk_size", [0, 3])
def test_targets_equal_to_minus_one_are_left_out_of_both_losses(loss_chunk_size):
    net = build(tiny(z_loss_coef=0.01), loss_chunk_size=loss_chunk_size)
    idx, targets = tokens(1, 12), tokens(1, 12, seed=2)
    masked = targets.clone()
    masked[0, 5:] = -1
    _, losses = net(idx, masked)
    logits, _ = net(idx)
    _, kept = net(idx[:, :5], targets[:, :5])  # causal: the first 5 logits do not see the rest
    torch.testing.assert_close(losses["ce"], kept["ce"])
    torch.testing.assert_close(losses["z_loss"], kept["z_loss"])
    reference = F.cross_entropy(logits.view(-1, 256), masked.view(-1), ignore_index=-1)
    torch.testing.assert_close(losses["ce"], reference)


@pytest.mark.parametrize("name", ["smoke", "tiny-50m"])
def test_loss_at_init_is_within_a_tenth_of_ln_vocab_size_for_shipped_models(name):
    cfg = shipped(name)
    net = build(cfg)
    idx = tokens(2, 64, cfg["vocab_size"])
    targets = tokens(2, 64, cfg["vocab_size"], seed=2)
    with torch.no_grad():
        _, losses = net(idx, targets)
    assert abs(losses["ce"].item() - math.log(cfg["vocab_size"])) < 0.1, losses["ce"].item()


def test_residual_output_projections_start_smaller_by_sqrt_of_twice_the_depth():
    cfg = tiny(d_model=256, n_heads=4, n_kv_heads=4, ffn_hidden=512, n_layers=8, init_std=0.02)
    net = build(cfg)
    layer = net.layers[3]
    assert abs(layer.self_attn.q_proj.weight.std().item() - 0.02) < 0.001
    assert abs(layer.mlp.down_proj.weight.std().item() - 0.02 / 4) < 0.0003
    assert abs(layer.self_attn.o_proj.weight.std().item() - 0.02 / 4) < 0.0003
    assert torch.equal(layer.input_layernorm.weight, torch.ones(256))


def test_zero_init_out_proj_starts_every_block_as_the_identity_and_the_projections_still_learn():
    net = build(tiny(zero_init_out_proj=True))
    for layer in net.layers:
        assert not layer.self_attn.o_proj.weight.any() and not layer.mlp.down_proj.weight.any()
        assert layer.self_attn.q_proj.weight.std() > 0
    x = torch.randint(0, net.cfg["vocab_size"], (2, 16))
    hidden = net.embed_tokens(x)
    assert torch.equal(net.layers[0](hidden, net.rope_cos[:16], net.rope_sin[:16]), hidden)
    _, losses = net(x, torch.roll(x, -1, 1))
    losses["loss"].backward()
    assert all(layer.self_attn.o_proj.weight.grad.abs().sum() > 0 for layer in net.layers)
    assert all(layer.mlp.down_proj.weight.grad.abs().sum() > 0 for layer in net.layers)


@pytest.mark.parametrize("loss_chunk_size", [0, 24])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_forward_is_finite_at_init(dtype, loss_chunk_size):
    net = build(tiny(), loss_chunk_size=loss_chunk_size)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        logits, _ = net(tokens(2, 32))
        _, losses = net(tokens(2, 32), tokens(2, 32, seed=2))
    assert logits.dtype == dtype  # autocast really ran the matmuls in half precision
    assert torch.isfinite(logits).all()
    assert all(torch.isfinite(value) and value.dtype == torch.float32 for value in losses.values())


# ---- the chunked LM head + loss ----


def loss_and_gradients(net, idx, targets, dtype=None, loss_scale=1.0):
    """(losses, {parameter name: gradient}) of one forward + backward, under autocast to `dtype` if given,
    the loss multiplied by `loss_scale` before backward as a GradScaler does."""
    net.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
        _, losses = net(idx, targets)
    (losses["loss"] * loss_scale).backward()
    return losses, {name: param.grad.clone() for name, param in net.named_parameters()}


def largest_relative_difference(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def with_ignored_targets(targets):
    """Targets with prompt-like runs of -1 at the start of the first row and the end of the last."""
    targets = targets.clone()
    targets[0, : targets.shape[1] // 3] = -1
    targets[-1, -2:] = -1
    return targets


@pytest.mark.parametrize(
    "batch, length, vocab_size, loss_chunk_size, z_loss_coef",
    [
        (2, 32, 256, 7, 1e-4),  # 64 positions: nine chunks of 7 and a last one of 1
        (3, 17, 300, 64, 0.01),  # one chunk larger than the 51 positions
        (1, 32, 97, 1, 0.0),  # a chunk per position, no z-loss
        (4, 24, 1000, 32, 1e-4),  # three chunks, vocabulary larger than the positions
    ],
)
def test_the_chunked_loss_gives_the_unchunked_losses_and_every_parameters_gradient(
    batch, length, vocab_size, loss_chunk_size, z_loss_coef
):
    cfg = tiny(vocab_size=vocab_size, z_loss_coef=z_loss_coef)
    unchunked, chunked = build(cfg), build(cfg, loss_chunk_size=loss_chunk_size)  # the same weights
    idx = tokens(batch, length, vocab_size)
    targets = with_ignored_targets(tokens(batch, length, vocab_size, seed=2))
    want_losses, want = loss_and_gradients(unchunked, idx, targets)
    got_losses, got = loss_and_gradients(chunked, idx, targets)
    for key in ("loss", "ce", "z_loss"):  # float32 rounding: a few units in the last place
        torch.testing.assert_close(got_losses[key], want_losses[key], rtol=2e-6, atol=1e-9)
    assert set(got) == set(want) and "embed_tokens.weight" in got  # the tied LM head's gradient is in it
    for name in want:
        assert largest_relative_difference(got[name], want[name]) <= 1e-5, name


@pytest.mark.parametrize("dtype, loss_scale", [(torch.float16, 2.0**16), (torch.bfloat16, 1.0)])
def test_under_autocast_the_chunked_loss_is_as_close_to_float32_as_the_unchunked_one(dtype, loss_scale):
    # The RTX 2060 trains in float16 with a GradScaler: the scaled gradients of the chunked path must
    # neither overflow nor underflow, and stray from the float32 gradients no more than today's path does.
    cfg = tiny(vocab_size=1000)
    unchunked, chunked = build(cfg), build(cfg, loss_chunk_size=16)
    idx = tokens(2, 32, 1000)
    targets = with_ignored_targets(tokens(2, 32, 1000, seed=2))
    exact_losses, exact = loss_and_gradients(unchunked, idx, targets, None, loss_scale)
    want_losses, want = loss_and_gradients(unchunked, idx, targets, dtype, loss_scale)
    got_losses, got = loss_and_gradients(chunked, idx, targets, dtype, loss_scale)
    torch.testing.assert_close(got_losses["loss"], want_losses["loss"], rtol=1e-5, atol=0)
    assert all(value.dtype == torch.float32 for value in got_losses.values())
    for name in exact:
        assert torch.isfinite(got[name]).all() and got[name].dtype == torch.float32, name
        today = largest_relative_difference(want[name], exact[name])  # ~1e-3 in float16, ~1e-2 in bf16
        assert largest_relative_difference(got[name], exact[name]) <= 2 * today, name


class LargestTensor(TorchDispatchMode):
    """The most elements any operation run inside it returned, backward included."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.elements = max(self.elements, tensor.numel())
        return out


def test_the_chunked_loss_never_holds_the_full_logits():
    cfg = tiny(vocab_size=1000)
    idx, targets = tokens(4, 32, 1000), tokens(4, 32, 1000, seed=2)
    full_logits = 4 * 32 * 1000
    largest = {}
    for loss_chunk_size in (0, 8):
        net = build(cfg, loss_chunk_size=loss_chunk_size)
        with LargestTensor() as mode:
            net(idx, targets)[1]["loss"].backward()
        largest[loss_chunk_size] = mode.elements
    assert largest[0] >= full_logits  # the unchunked path does hold them: the check can see them
    # Chunked, the largest tensor is the embedding's gradient (1000 x 64); a chunk's logits are 8 x 1000.
    assert largest[8] == cfg["vocab_size"] * cfg["d_model"] < full_logits


def test_the_chunked_loss_costs_the_unchunked_flops_in_training_and_no_gradient_work_without_grad():
    cfg = tiny(vocab_size=1000)
    idx, targets = tokens(4, 32, 1000), tokens(4, 32, 1000, seed=2)

    def flops(net, step):
        with FlopCounterMode(display=False) as counter:
            step(net)
        return counter.get_total_flops()

    def train_step(net):
        net(idx, targets)[1]["loss"].backward()

    def evaluation(net):
        with torch.no_grad():
            net(idx, targets)

    unchunked, chunked = build(cfg), build(cfg, loss_chunk_size=8)
    # Three matmuls per chunk, the gradients' made in the forward pass: no recomputed logits.
    assert flops(chunked, train_step) == flops(unchunked, train_step)
    assert flops(chunked, evaluation) == flops(unchunked, evaluation) == flops(unchunked, lambda n: n(idx))


def test_only_the_total_loss_carries_a_gradient_in_the_chunked_path():
    net = build(tiny(), loss_chunk_size=4)
    _, losses = net(tokens(2, 8), tokens(2, 8, seed=2))
    assert losses["loss"].requires_grad
    assert not losses["ce"].requires_grad and not losses["z_loss"].requires_grad  # reported parts


def test_a_batch_with_every_target_ignored_has_zero_loss_and_zero_gradients():
    net = build(tiny(), loss_chunk_size=5)
    _, losses = net(tokens(2, 16), torch.full((2, 16), -1))
    losses["loss"].backward()
    assert losses["loss"].item() == 0.0
    assert all(not param.grad.any() for param in net.parameters())


def test_a_bad_loss_chunk_size_is_named():
    with pytest.raises(ValueError, match="loss_chunk_size=-1 must be an int >= 0"):
        Transformer(tiny(), "math", -1)


# ---- sizes ----


@pytest.mark.parametrize("name", ["smoke", "tiny-50m"])
def test_num_params_matches_the_closed_form_count_and_the_config_comment(name):
    cfg = shipped(name)
    with torch.device("meta"):  # shapes only: no memory, no init
        net = Transformer(cfg)
    assert net.num_params() == closed_form_num_params(cfg)
    with open(os.path.join(ROOT, "configs", "model", f"{name}.yaml"), encoding="utf-8") as f:
        written = re.search(r"([\d,]+) parameters", f.read()).group(1)
    assert int(written.replace(",", "")) == net.num_params()


def test_num_params_counts_grouped_query_heads_and_the_tied_embedding_once():
    for n_kv_heads in (1, 2, 4):
        cfg = tiny(n_kv_heads=n_kv_heads)
        assert Transformer(cfg).num_params() == closed_form_num_params(cfg)


def test_flops_per_token_adds_the_attention_term_to_six_per_parameter():
    cfg = tiny()
    net = Transformer(cfg)
    assert net.flops_per_token(0) == 6 * net.num_params()
    assert net.flops_per_token(32) - net.flops_per_token(16) == 12 * cfg["n_layers"] * cfg["d_model"] * 16


# ---- configuration ----


def test_shipped_model_configs_validate_against_the_model_schema():
    with open(os.path.join(ROOT, "schema", "model.schema.json"), encoding="utf-8") as f:
        schema = json.load(f)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert set(schema["required"]) == set(schema["properties"]), "every model key is required"
    for name in ("smoke", "tiny-50m"):
        jsonschema.validate(shipped(name), schema)


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"d_model": 62}, "model.d_model: 62 must be divisible by model.n_heads=4"),
        ({"d_model": 12, "n_heads": 4, "n_kv_heads": 4}, "head_dim = d_model/n_heads = 3 must be even"),
        ({"n_kv_heads": 3}, "model.n_kv_heads: 3 must divide model.n_heads=4"),
        ({"n_kv_heads": 8}, "model.n_kv_heads: 8 must divide model.n_heads=4"),
        ({"dropout": 0.1}, "model.dropout: unknown key"),
    ],
)
def test_a_model_config_that_cannot_be_built_is_rejected_naming_the_key(changes, named):
    # The model checks its dict with the config layer's own schema and rules: one place says what is valid.
    with pytest.raises(config.ConfigError, match=re.escape(named)):
        Transformer(tiny(**changes))


def test_a_missing_key_and_an_unknown_backend_are_named():
    cfg = tiny()
    del cfg["rope_base"]
    with pytest.raises(config.ConfigError, match=re.escape("model.rope_base: required key missing")):
        Transformer(cfg)
    with pytest.raises(ValueError, match="attention_backend='fast'"):
        Transformer(tiny(), "fast")


def test_forward_refuses_a_sequence_longer_than_seq_len():
    with pytest.raises(ValueError, match="longer than model.seq_len=32"):
        Transformer(tiny())(tokens(1, 33))


# ---- attention backends ----


def test_attention_backend_argument_selects_the_kernel():
    idx = tokens(2, 24)
    outputs = {}
    for backend, kernel in (
        ("math", "aten::_scaled_dot_product_attention_math"),
        ("flash", "aten::_scaled_dot_product_flash_attention_for_cpu"),
    ):
        net = build(tiny(), backend)
        with torch.no_grad(), profile() as prof:
            outputs[backend], _ = net(idx)
        ran = {event.key for event in prof.key_averages()}
        assert kernel in ran, (backend, sorted(k for k in ran if "attention" in k))
    torch.testing.assert_close(outputs["flash"], outputs["math"], rtol=1e-4, atol=1e-4)
    # The CPU build has no memory-efficient kernel: restricting SDPA to it must fail rather than fall back.
    with pytest.raises(RuntimeError, match="No viable backend"):
        build(tiny(), "mem_efficient")(idx)


# ---- KV cache and generation ----


@pytest.mark.parametrize("backend", ["math", "flash"])
def test_incremental_decoding_with_the_kv_cache_gives_the_full_forward_logits(backend):
    net = build(tiny(), backend)
    idx = tokens(2, 24)
    with torch.no_grad():
        full, _ = net(idx)
        cache = net.new_kv_cache(slots=2)
        pieces = [net.forward_with_cache(idx[:, :10], cache)]  # prefill
        pieces += [net.forward_with_cache(idx[:, t : t + 1], cache) for t in range(10, 16)]  # one at a time
        pieces.append(net.forward_with_cache(idx[:, 16:], cache))  # a chunk after cached positions
    assert cache.length == 24
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-5)


def test_the_cache_refuses_to_grow_past_seq_len():
    net = build(tiny())
    cache = net.new_kv_cache()
    with torch.no_grad():
        net.forward_with_cache(tokens(1, 30), cache)
        with pytest.raises(ValueError, match="30 cached \\+ 3 new tokens exceed model.seq_len=32"):
            net.forward_with_cache(tokens(1, 3), cache)


def greedy_by_full_forward(net, prompt, steps):
    """Decoding without a cache, by generate's documented window rule: a full forward pass over the most
    recent `length` tokens, where length starts at the prompt's (at most seq_len), grows by one per step
    up to seq_len and then drops to seq_len // 2."""
    sequence, length = prompt.tolist(), min(len(prompt), net.seq_len)
    for _ in range(steps):
        with torch.no_grad():
            logits, _ = net(torch.tensor([sequence[-length:]]))
        sequence.append(int(logits[0, -1].argmax()))
        length = length + 1 if length < net.seq_len else net.seq_len // 2
    return sequence[len(prompt) :]


def test_greedy_generation_with_the_cache_equals_full_forward_decoding_also_past_seq_len():
    net = build(tiny(seq_len=16))
    prompt = tokens(1, 10)[0]
    want = greedy_by_full_forward(net, prompt, 40)  # 10 + 40 tokens: the window restarts three times
    assert list(net.generate(prompt, 40, temperature=0)) == want
    assert list(net.generate(prompt[None], 40, top_k=1)) == want  # top_k 1 is greedy too; (1, T) accepted
    long_prompt = tokens(1, 21)[0]  # longer than seq_len: only its last 16 tokens are read
    assert list(net.generate(long_prompt, 12, temperature=0)) == greedy_by_full_forward(net, long_prompt, 12)


def test_past_seq_len_generation_prefills_once_every_half_window_not_at_every_step(monkeypatch):
    net = build(tiny(seq_len=16))
    prefill_lengths = []
    forward_with_cache = net.forward_with_cache

    def counting(idx, cache, slot=None):
        if idx.shape[1] > 1:
            prefill_lengths.append(idx.shape[1])
        return forward_with_cache(idx, cache, slot)

    monkeypatch.setattr(net, "forward_with_cache", counting)
    assert len(list(net.generate(tokens(1, 10)[0], 6 + 8 * 3 + 1, temperature=0))) == 31
    # The prompt; then at 16 tokens the window restarts from the last 8, three times in 24 steps.
    assert prefill_lengths == [10, 8, 8, 8]


def test_generate_streams_one_int_per_step_and_stops_after_the_stop_token():
    net = build(tiny())
    prompt = tokens(1, 5)[0]
    stream = net.generate(prompt, 10, temperature=0)
    first = next(stream)
    assert isinstance(first, int)
    greedy = [first, *stream]
    assert len(greedy) == 10
    stop = greedy[3]
    stopped = list(net.generate(prompt, 10, temperature=0, stop_token=stop))
    assert stopped == greedy[: greedy.index(stop) + 1]


def test_sampling_with_the_same_seed_repeats_and_another_seed_differs():
    net = build(tiny())
    prompt = tokens(1, 5)[0]

    def draw(seed):
        return list(net.generate(prompt, 24, temperature=1.5, generator=torch.Generator().manual_seed(seed)))

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_top_k_and_top_p_only_draw_from_the_kept_tokens():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])  # probabilities ~ .64 .23 .09 .03 .01
    generator = torch.Generator().manual_seed(0)
    top_k = {sample_token(logits, 1.0, top_k=2, generator=generator) for _ in range(300)}
    assert top_k == {0, 1}
    top_p = {sample_token(logits, 1.0, top_p=0.8, generator=generator) for _ in range(300)}
    assert top_p == {0, 1}  # .64 < .8, so the second token is needed, the third is not
    assert {sample_token(logits, 1.0, top_p=0.5, generator=generator) for _ in range(50)} == {0}
    with pytest.raises(ValueError, match="top_p=1.5"):
        sample_token(logits, 1.0, top_p=1.5)


def test_draws_follow_the_softmax_of_the_logits_over_temperature():
    logits = torch.tensor([2.0, 1.0, 0.0, -30.0])
    generator = torch.Generator().manual_seed(0)
    for temperature, top_k in ((1.0, None), (0.5, 3)):
        expected = torch.softmax(logits / temperature, dim=0)
        counts = torch.zeros(4)
        for _ in range(4000):
            counts[sample_token(logits, temperature, top_k=top_k, generator=generator)] += 1
        # 4,000 draws: a share's standard error is at most 0.008, so 0.03 is ~4 of them
        assert (counts / 4000 - expected).abs().max() < 0.03, (temperature, counts)
        assert counts[3] == 0  # e^-30 of the mass is never drawn in 4,000 tries


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [
        (0, None, None),
        (1.0, None, None),
        (0.8, 50, None),
        (0.8, 50, 0.95),
        (1.3, None, 0.9),
        (0.7, 1000, 0.5),
    ],
)
def test_rows_drawn_together_get_the_tokens_each_draws_alone(temperature, top_k, top_p):
    from model import sample_tokens

    logits = torch.randn(6, 700, generator=torch.Generator().manual_seed(1)) * 4
    logits[2, 10] = logits[2, 20] = logits[2].max() + 1  # a tie: both ways keep the first
    together = [torch.Generator().manual_seed(row) for row in range(6)]
    alone = [torch.Generator().manual_seed(row) for row in range(6)]
    for _ in range(20):  # each generator goes on from where its last draw left it
        drawn = sample_tokens(logits, temperature, top_k, top_p, together)
        assert drawn == [sample_token(logits[row], temperature, top_k, top_p, alone[row]) for row in range(6)]
    if temperature == 0:
        assert drawn == logits.argmax(dim=-1).tolist()


def test_a_decoder_draws_rows_of_different_settings_each_with_its_own():
    net = build(tiny(seq_len=32))
    settings = [seeded(0.9, 1), seeded(0, 2), {**seeded(0.9, 3), "top_k": 5}, seeded(0.9, 4)]
    decoder = net.decoder(len(settings))
    rows = [decoder.add(forced_tokens(4, seed=i), **sampling) for i, sampling in enumerate(settings)]
    for _ in range(10):
        expected = {row: sample_token(row.logits, row.temperature, row.top_k, row.top_p,
                                      copy.deepcopy(row.generator)) for row in rows}  # fmt: skip
        drawn = decoder.sample_rows(rows)
        assert drawn == expected
        decoder.advance(drawn)


# ---- batched decoding (model.Decoder): rows at their own positions, joining and leaving between steps


def forced_tokens(count, seed):
    return tokens(1, count, seed=seed)[0].tolist()


def test_a_decode_step_over_several_rows_gives_each_row_its_single_row_logits():
    net = build(tiny(seq_len=32))
    prompts = [forced_tokens(length, seed=length) for length in (3, 9, 20, 31)]
    fed = [forced_tokens(24, seed=100 + i) for i in range(len(prompts))]  # the same inputs in both runs
    batch = net.decoder(len(prompts))
    rows = [batch.add(prompt, temperature=0) for prompt in prompts]
    alone = [net.decoder(1) for _ in prompts]
    solo_rows = [decoder.add(prompt, temperature=0) for decoder, prompt in zip(alone, prompts, strict=True)]
    for step in range(24):  # the rows of 20 and 31 tokens pass seq_len: their windows restart on their own
        for row, solo in zip(rows, solo_rows, strict=True):
            torch.testing.assert_close(row.logits, solo.logits, rtol=0, atol=1e-5)
        batch.advance({row: fed[i][step] for i, row in enumerate(rows)})
        for i, decoder in enumerate(alone):
            decoder.advance({solo_rows[i]: fed[i][step]})


def run_rows(net, slots, plans, steps, compile_mode=None, compile_with=None, **options):
    """Decode with `slots` slots (options: more of net.decoder's). plans: (prompt, first step, last step,
    sampling kwargs) per row; a row joins at its first step and leaves after its last. Returns each row's
    (tokens, logits per step)."""
    decoder = net.decoder(slots, compile_mode=compile_mode, compile_with=compile_with, **options)
    if decoder.compiled_step is not None:
        decoder.compile()
    rows, results = {}, [([], []) for _ in plans]
    for step in range(steps):
        for i, (prompt, first, _, sampling) in enumerate(plans):
            if step == first:
                rows[i] = decoder.add(prompt, **sampling)
        chosen, drawn = {}, decoder.sample_rows(list(rows.values()))  # drawn together, as the server does
        for i, row in list(rows.items()):
            token = drawn[row]
            results[i][0].append(token)
            results[i][1].append(row.logits.clone())
            if step == plans[i][2]:
                decoder.remove(rows.pop(i))
            else:
                chosen[row] = token
        decoder.advance(chosen)
    return results


def seeded(temperature, seed):
    return {"temperature": temperature, "generator": torch.Generator().manual_seed(seed)}


@pytest.mark.parametrize(
    "compile_mode, products",
    [
        (None, "torch"),
        ("default", "torch"),
        (None, "split"),
        (None, "kernel float32"),
        ("default", "kernel int8"),
    ],
    ids=["eager", "compiled", "split products", "kernel", "kernel int8 compiled"],
)
def test_a_rows_tokens_and_logits_are_bit_for_bit_its_own_whatever_the_other_rows_do(compile_mode, products):
    from serve import kernel
    from serve.weights import split_matvec, with_kernels

    net = build(tiny(seq_len=32))
    if products == "split":
        net = split_matvec(net, 2, max_rows=4)
    elif products.startswith("kernel"):
        if torch.backends.cpu.get_cpu_capability() not in kernel.CAPABILITIES:
            pytest.skip("the kernel needs AVX2 (make test-other-cpu runs torch as a CPU without it)")
        net = with_kernels(net, products.split()[1], max_rows=4)
    target = (forced_tokens(7, seed=1), 3, 40, {"temperature": 0})
    others = [(forced_tokens(n, seed=n), first, last, seeded(0.8, n))
              for n, first, last in [(12, 0, 9), (2, 1, 30), (25, 5, 12), (4, 20, 45)]]  # fmt: skip
    for target_sampling in ({"temperature": 0}, "seeded"):
        sampling = seeded(0.8, 5) if target_sampling == "seeded" else target_sampling
        alone = run_rows(net, 4, [(target[0], 0, 37, sampling)], 38, compile_mode)[0]
        sampling = seeded(0.8, 5) if target_sampling == "seeded" else target_sampling
        plans = [*others[:2], (target[0], 3, 40, sampling), *others[2:]]
        together = run_rows(net, 4, plans, 41, compile_mode)[2]
        assert together[0] == alone[0]  # the row joined at step 3, in slot 2, among rows coming and going
        assert all(torch.equal(a, b) for a, b in zip(together[1], alone[1], strict=True))


def compiled_graphs():
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_the_compiled_step_gives_the_eager_logits_and_greedy_tokens_and_compiles_only_at_start():
    # CPU inductor: the first compile of this tiny shape takes ~20-90 s on a shared 2-core CPU (cached after).
    net = build(tiny(seq_len=32))
    decoder = net.decoder(4, compile_mode="default")
    decoder.compile()
    graphs = compiled_graphs()
    plans = [(forced_tokens(n, seed=n), first, last, {"temperature": 0})
             for n, first, last in [(7, 0, 37), (12, 0, 9), (2, 1, 30), (25, 5, 12), (4, 20, 45)]]  # fmt: skip
    eager = run_rows(net, 4, plans, 46)
    compiled = run_rows(net, 4, plans, 46, "default")
    assert [tokens for tokens, _ in compiled] == [tokens for tokens, _ in eager]
    for (_, got), (_, want) in zip(compiled, eager, strict=True):
        torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=0, atol=1e-5)
    # Rows joining and leaving, windows restarting past seq_len and new decoders compiled nothing more.
    assert compiled_graphs() == graphs


def greedy_run(decoder, prompt, steps, **scoping):
    """(tokens, logits per step) of a greedy row of `decoder`, removed at the end."""
    row, tokens, logits = decoder.add(prompt, temperature=0, **scoping), [], []
    for _ in range(steps):
        logits.append(row.logits.clone())
        tokens.append(decoder.sample(row))
        decoder.advance({row: tokens[-1]})
    decoder.remove(row)
    return tokens, logits


def test_a_prompt_restored_from_the_prefix_cache_gets_bit_for_bit_the_answer_it_gets_without_it():
    net = build(tiny(seq_len=32))
    first = forced_tokens(19, seed=3)
    second = first[:10] + forced_tokens(6, seed=4)  # shares two blocks of 4 with the first
    decoder = net.decoder(2, prefix_block=4, prefix_cache_bytes=2**20)
    answers = [greedy_run(decoder, prompt, 10) for prompt in (first, second, first)]
    assert decoder.prefix_cache.stats["reused_tokens"] == 8 + 16  # the second reused 8, the third 16
    for prompt, answer in zip((first, second, first), answers, strict=True):
        fresh = greedy_run(net.decoder(2, prefix_block=4, prefix_cache_bytes=2**20), prompt, 10)
        assert answer[0] == fresh[0] and all(map(torch.equal, answer[1], fresh[1]))
    assert answers[0][0] == answers[2][0] and all(map(torch.equal, answers[0][1], answers[2][1]))


def test_the_prefix_cache_shares_only_the_public_blocks_between_members():
    net = build(tiny(seq_len=32))
    prompt = forced_tokens(17, seed=5)  # its first 9 tokens are the server's (public), the rest ana's
    decoder = net.decoder(1, prefix_block=4, prefix_cache_bytes=2**20)
    reused = lambda: decoder.prefix_cache.stats["reused_tokens"]  # noqa: E731
    ana = greedy_run(decoder, prompt, 3, scope="ana", shared=9)
    assert reused() == 0
    ben = greedy_run(decoder, prompt, 3, scope="ben", shared=9)  # the same text, another member
    assert reused() == 8  # blocks 0-3 and 4-7 only: 8-11 holds one of ana's tokens
    greedy_run(decoder, prompt, 3, scope="ana", shared=9)
    assert reused() == 8 + 16  # ana's own blocks, all four
    assert ana[0] == ben[0] and all(map(torch.equal, ana[1], ben[1]))
    scopes = {key[0] for key in decoder.prefix_cache.blocks}
    assert scopes == {("public",), ("member", "ana"), ("member", "ben")}
    ends_of = {
        scope: sorted(len(ids) for s, ids in decoder.prefix_cache.blocks if s == scope) for scope in scopes
    }
    assert ends_of[("public",)] == [4, 8] and ends_of[("member", "ana")] == ends_of[("member", "ben")] == [
        12,
        16,
    ]


def test_the_prefix_cache_stays_within_its_bytes_and_evicts_the_least_recently_used_blocks_last_first():
    net = build(tiny(seq_len=32))
    attn = net.layers[0].self_attn
    block_bytes = 2 * len(net.layers) * attn.n_kv_heads * 4 * attn.head_dim * 4  # keys + values, float32
    decoder = net.decoder(1, prefix_block=4, prefix_cache_bytes=5 * block_bytes)
    old, new = forced_tokens(13, seed=6), forced_tokens(9, seed=7)  # three blocks, then two
    greedy_run(decoder, old, 1)
    greedy_run(decoder, new, 1)
    assert decoder.prefix_cache.bytes == 5 * block_bytes
    greedy_run(decoder, new + [1, 2, 3, 4], 1)  # one more block: the old prompt's last one goes
    ends = [len(ids) for _, ids in decoder.prefix_cache.blocks]
    assert sorted(ends) == [4, 4, 8, 8, 12] and decoder.prefix_cache.bytes <= 5 * block_bytes
    assert tuple(old[:8]) in {ids for _, ids in decoder.prefix_cache.blocks}
    assert tuple(old[:12]) not in {ids for _, ids in decoder.prefix_cache.blocks}


def test_int8_weights_hold_every_linear_layer_in_int8_and_move_the_logits_by_about_a_percent():
    from serve.weights import int8_weights

    for seed in range(3):
        net = build(tiny(), seed=seed)
        quantized = int8_weights(net)
        linears = [m for m in quantized.modules() if isinstance(m, torch.ao.nn.quantized.dynamic.Linear)]
        assert len(linears) == 7 * net.cfg["n_layers"] + 1  # q, k, v, o, gate, up, down; the LM head
        assert all(linear.weight().dtype == torch.qint8 for linear in linears)
        assert all(type(m) is torch.nn.Linear for name, m in net.named_modules() if name.endswith("proj"))
        x = tokens(2, 16, seed=seed)
        with torch.no_grad():
            want, got = net(x)[0], quantized(x)[0]
        # Over 5 seeds the largest change was 0.9-1.2% of the largest logit; 3% leaves a margin.
        assert float((got - want).abs().max() / want.abs().max()) < 0.03
        # The Decoder runs on them as on float weights: its first token is the int8 forward's argmax.
        assert quantized.decoder(1).add(x[0].tolist(), temperature=0).logits.argmax() == got[0, -1].argmax()


def test_split_matvec_shares_the_weights_and_decodes_the_plain_models_tokens_with_logits_within_1e_5():
    from bench.decoding import step_bytes
    from serve.weights import SplitLinear, split_matvec

    net = build(tiny(seq_len=32))
    split = split_matvec(net, parts=2, max_rows=4)
    layers = [m for m in split.modules() if isinstance(m, SplitLinear)]
    assert len(layers) == 7 * net.cfg["n_layers"] + 1  # every projection and the LM head
    assert split.lm_head.weight is split.embed_tokens.weight is net.embed_tokens.weight  # shared, still tied
    same = {name: tensor.data_ptr() for name, tensor in net.state_dict().items()}
    assert {name: tensor.data_ptr() for name, tensor in split.state_dict().items()} == same
    assert step_bytes(split, 4, 16) == step_bytes(net, 4, 16)  # the bench's bytes per step: the same weights
    odd = split_matvec(net, parts=5, max_rows=4)  # 5 divides none of the widths 32, 64, 96, 256
    assert not any(isinstance(m, SplitLinear) for m in odd.modules())
    x = tokens(1, 12)
    with torch.no_grad():  # 12 rows > max_rows: a prefill goes through F.linear, bit for bit
        assert torch.equal(split(x)[0], net(x)[0])
    assert_decodes_the_plain_models_tokens(net, split)


def assert_decodes_the_plain_models_tokens(net, served):
    """served (net with its products done another way) decodes net's greedy tokens, eager and compiled,
    with logits within 1e-5, among rows coming and going."""
    plans = [(forced_tokens(n, seed=n), first, last, {"temperature": 0})
             for n, first, last in [(7, 0, 20), (12, 0, 9), (2, 1, 16), (25, 5, 12)]]  # fmt: skip
    plain, eager = run_rows(net, 4, plans, 21), run_rows(served, 4, plans, 21)
    compiled = run_rows(served, 4, plans, 21, "default")
    for got in (eager, compiled):
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in plain]
        for (_, logits), (_, want) in zip(got, plain, strict=True):
            torch.testing.assert_close(torch.stack(logits), torch.stack(want), rtol=0, atol=1e-5)


class Forced:
    """A constraint that allows only the next token of `sequence` (then anything), recording its calls."""

    def __init__(self, sequence):
        self.sequence, self.accepted = list(sequence), []

    def mask(self, logits):
        if len(self.accepted) >= len(self.sequence):
            return logits
        allowed = torch.full_like(logits, float("-inf"))
        allowed[self.sequence[len(self.accepted)]] = 0.0
        return logits + allowed

    def accept(self, token):
        self.accepted.append(token)


class Forbidden:
    def __init__(self, token):
        self.token = token

    def mask(self, logits):
        logits[self.token] = float("-inf")  # in place: the contract allows returning the same tensor
        return logits

    def accept(self, token):
        pass


def test_a_constraint_masks_each_steps_logits_before_sampling_and_hears_each_token():
    net = build(tiny())
    prompt = tokens(1, 5)[0]
    forced = Forced([7, 7, 3, 250, 0])
    drawn = list(net.generate(prompt, 8, temperature=1.5, generator=torch.Generator().manual_seed(0),
                              constraint=forced))  # fmt: skip
    assert drawn[:5] == [7, 7, 3, 250, 0] and forced.accepted == drawn
    greedy = list(net.generate(prompt, 1, temperature=0))[0]
    runner_up = int(net.decoder(1).add(prompt.tolist()).logits.topk(2).indices[1])
    assert list(net.generate(prompt, 1, temperature=0, constraint=Forbidden(greedy))) == [runner_up]
    # In a batch the constraint steers its own row only.
    plans = [
        (prompt.tolist(), 0, 9, {"temperature": 0}),
        (forced_tokens(9, seed=3), 0, 9, {"temperature": 0}),
    ]
    free = run_rows(net, 2, plans, 10)
    plans[1] = (*plans[1][:3], {"temperature": 0, "constraint": Forced([1, 2, 3])})
    steered = run_rows(net, 2, plans, 10)
    assert steered[1][0][:3] == [1, 2, 3] != free[1][0][:3] and steered[0][0] == free[0][0]


def test_a_decoder_refuses_a_row_when_every_slot_is_taken_and_reuses_a_freed_slot():
    net = build(tiny())
    decoder = net.decoder(2)
    first, second = decoder.add([1, 2, 3]), decoder.add([4])
    with pytest.raises(ValueError, match="all 2 slots are in use"):
        decoder.add([5])
    decoder.remove(first)
    assert decoder.add([5, 6]).slot == first.slot and second.slot == 1
