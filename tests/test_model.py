"""The decoder in model.py: attention, RoPE, tying, losses, parameter count."""

import json
import math
import os
import re

import jsonschema
import pytest
import torch
import torch.nn.functional as F
import yaml
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import profile
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import config
import hardware
from bench import model as bench_model
from model import Transformer, apply_rope, rope_tables

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


def kernel_standing_in_for(board_kernel, monkeypatch):
    """scaled_dot_product_attention as a CUDA-only kernel would take it on this CPU: each call's arguments
    checked against that kernel's documented limits (hardware.SDPA_KERNELS), then run by the math kernel.
    Returns the list of calls seen (q heads, k heads, enable_gqa)."""
    limits = hardware.SDPA_KERNELS[board_kernel]
    real, calls = F.scaled_dot_product_attention, []

    def sdpa(q, k, v, **kwargs):
        calls.append((q.shape[1], k.shape[1], kwargs.get("enable_gqa", False)))
        if not limits.gqa:
            assert not kwargs.get("enable_gqa") and k.shape[1] == v.shape[1] == q.shape[1], (
                f"{board_kernel[0]} takes no grouped-query attention: {calls[-1]}"
            )
        with sdpa_kernel(SDPBackend.MATH):
            return real(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    return calls


def test_a_kernel_without_grouped_query_attention_gets_each_kv_head_repeated_and_the_same_logits(monkeypatch):
    cfg = tiny(n_heads=4, n_kv_heads=2)
    idx = tokens(2, 16)
    with torch.no_grad():
        want = build(cfg, "math")(idx)[0]
    calls = kernel_standing_in_for(("mem_efficient", "cuda"), monkeypatch)
    with torch.no_grad():
        got = build(cfg, "mem_efficient")(idx)[0]  # the RTX 2060's kernel (turing-2060.yaml)
    assert calls and all(call == (4, 4, False) for call in calls)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_kernel_with_grouped_query_attention_gets_the_kv_heads_unrepeated(monkeypatch):
    calls = kernel_standing_in_for(("flash", "cuda"), monkeypatch)
    with torch.no_grad():
        build(tiny(n_heads=4, n_kv_heads=2), "flash")(tokens(1, 8))
    assert calls and all(call == (4, 2, True) for call in calls)  # the smaller k/v: no copy
