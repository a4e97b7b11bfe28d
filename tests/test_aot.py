"""The decode step compiled ahead of time (decode/aot.py, serve.compile.cpu: aot): the eager step's tokens
with logits within float32 rounding, rows coming and going; built once per shape and then loaded from the
disk cache; the KV cache and the weights bound in place, not copied."""

import os

import pytest
import torch

from decode import aot, engine, kernel
from tests.test_engine import forced_tokens, run_rows
from tests.test_model import build, tiny

PLANS = [(forced_tokens(n, seed=n), first, last, {"temperature": 0})
         for n, first, last in [(7, 0, 20), (12, 0, 9), (2, 1, 16), (25, 5, 12)]]  # fmt: skip


def served_models():
    """The plain model, and through ENLACE's kernels (float32 and int8) where this CPU runs them."""
    models = {"plain": build(tiny(seq_len=32))}
    if torch.backends.cpu.get_cpu_capability() in kernel.CAPABILITIES:
        from decode.weights import with_kernels

        models |= {dtype: with_kernels(build(tiny(seq_len=32)), dtype, 4) for dtype in ("float32", "int8")}
    return models


def served_model(name, tmp_path, monkeypatch):
    """served_models()[name] with the package cache in tmp_path; skipped where the kernel cannot run."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    models = served_models()
    if name not in models:
        pytest.skip("the kernel needs AVX2")
    return models[name]


def recording(steps):
    """A Decoder's compile_with that keeps each AotStep it builds in `steps` (to count their builds)."""

    def built(model, cache, **options):
        steps.append(aot.AotStep(model, cache, **options))
        return steps[-1]

    return built


@pytest.mark.parametrize("name", ["plain", "float32", "int8"])
def test_the_step_built_ahead_of_time_decodes_the_eager_tokens_with_logits_within_float32_rounding(
    name, tmp_path, monkeypatch
):
    net, steps = served_model(name, tmp_path, monkeypatch), []
    built = recording(steps)
    with torch.no_grad():
        eager = run_rows(net, 4, PLANS, 21)
        ahead = run_rows(net, 4, PLANS, 21, compile_with=built)
    assert [tokens for tokens, _ in ahead] == [tokens for tokens, _ in eager]
    tolerance = 1e-4 if name == "int8" else 1e-5  # as torch.compile's int8 step (test_matvec_kernel.py)
    for (_, got), (_, want) in zip(ahead, eager, strict=True):
        torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=0, atol=tolerance)
    assert [step.builds for step in steps] == [len(steps[0].widths)]  # built at compile(), never again
    assert steps[0].widths == ([4] if name == "plain" else [1, 2, 4])


@pytest.mark.parametrize("name", ["float32", "int8"])
def test_through_the_kernels_a_narrower_step_gives_each_row_the_full_steps_logits_bit_for_bit(
    name, tmp_path, monkeypatch
):
    net = served_model(name, tmp_path, monkeypatch)
    # These float32 products take up to 4 rows through the kernel (8 go through torch); int8 any number.
    assert aot.step_widths(net, 8) == ([8] if name == "float32" else [1, 2, 4, 8])
    decoder = engine.Decoder(net, 4, compile_with=aot.AotStep)
    decoder.compile()
    assert decoder.step_widths() == [1, 2, 4]
    generator = torch.Generator().manual_seed(0)
    for keys in decoder.cache.keys + decoder.cache.values:
        keys.normal_(generator=generator)
    tokens = torch.randint(0, net.cfg["vocab_size"], (4,), generator=generator)
    positions = torch.tensor([5, 17, 30, 2])
    with torch.no_grad():
        logits = {width: decoder.compiled_step(tokens[:width], positions[:width], decoder.cache).clone()
                  for width in (4, 2, 1)}  # fmt: skip
    for width in (2, 1):
        assert torch.equal(logits[width], logits[4][:width])
    # Each step runs at the narrowest width that holds the slots of the rows it feeds (the lowest free first).
    calls, steps = [], decoder.compiled_step.steps
    for width, program in list(steps.items()):
        steps[width] = lambda *inputs, width=width, program=program: calls.append(width) or program(*inputs)
    with torch.no_grad():
        first, second, third = (decoder.add(forced_tokens(3, seed=i), temperature=0) for i in range(3))
        decoder.advance({first: 1, second: 1, third: 1})  # slots 0-2
        decoder.remove(second)
        decoder.advance({first: 1, third: 1})  # slots 0 and 2
        decoder.remove(third)
        decoder.advance({first: 1})  # slot 0
        fourth = decoder.add(forced_tokens(4, seed=4), temperature=0)
        decoder.advance({first: 1, fourth: 1})  # slots 0 and 1
    assert calls == [4, 4, 1, 2] and fourth.slot == 1


@pytest.mark.parametrize("name", ["plain", "float32"])
def test_prompts_prefilled_ahead_of_time_in_blocks_give_the_eager_tokens_with_the_prefix_cache_on(
    name, tmp_path, monkeypatch
):
    net, steps = served_model(name, tmp_path, monkeypatch), []
    built = recording(steps)
    # Blocks of 12 in a 32-token cache: blocks from 0 and 12 run the compiled prefill (whole or padded),
    # one from 24 does not fit and runs eager; the last two prompts share their first two blocks, which
    # the second restores from the prefix cache; windows past 32 tokens restart and prefill again.
    shared = forced_tokens(24, seed=24)
    plans = PLANS + [(shared + forced_tokens(3, seed=3), 2, 14, {"temperature": 0}),
                     (shared + forced_tokens(5, seed=4), 6, 20, {"temperature": 0})]  # fmt: skip
    cached = {"prefix_block": 12, "prefix_cache_bytes": 2**20}
    with torch.no_grad():
        eager = run_rows(net, 6, plans, 21, **cached)
        ahead = run_rows(net, 6, plans, 21, compile_with=built, **cached)
    assert [tokens for tokens, _ in ahead] == [tokens for tokens, _ in eager]
    for (_, got), (_, want) in zip(ahead, eager, strict=True):
        torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=0, atol=1e-5)
    assert steps[0].block == 12 and steps[0].prefill.builds == 1  # at start, with the steps
    assert steps[0].builds == len(steps[0].widths) + 1


def test_a_second_decoder_of_the_same_shapes_loads_the_cached_package_and_writes_its_own_cache(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    net = build(tiny(seq_len=32))
    with torch.no_grad():
        first = engine.Decoder(net, 2, compile_with=aot.AotStep)
        first.compile()
        second = engine.Decoder(net, 2, compile_with=aot.AotStep)
        second.compile()
        assert (first.compiled_step.loaded_from_cache, second.compiled_step.loaded_from_cache) == (
            False,
            True,
        )
        assert len(os.listdir(tmp_path / "enlace" / "aot")) == 1  # no temp file left
        other = engine.Decoder(net, 1, compile_with=aot.AotStep)  # another shape: another package
        other.compile()
        assert not other.compiled_step.loaded_from_cache
        row = second.add(
            forced_tokens(5, seed=5), temperature=0
        )  # in place: the step writes `second`'s cache
        before = second.cache.keys[0][row.slot, :, 5].clone()
        second.advance({row: second.sample(row)})
        assert not torch.equal(second.cache.keys[0][row.slot, :, 5], before)
        assert first.cache.keys[0].data_ptr() != second.cache.keys[0].data_ptr()
        with pytest.raises(ValueError, match="bound to another decoder's KV cache"):
            second.compiled_step(
                torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), first.cache
            )


def test_a_package_cached_for_one_model_decodes_another_of_the_same_shapes_with_that_models_weights(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    # head_dim 8: inductor writes a weight of up to 8 values (q_norm's, k_norm's) into the code it generates,
    # where a package cached for another model of the same shapes would keep that model's values.
    cfg = tiny(seq_len=32, n_heads=8)
    first, second = build(cfg, seed=0), build(cfg, seed=1)
    with torch.no_grad():
        for layer in second.layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight.uniform_(0.5, 1.5)
        run_rows(first, 2, PLANS[:2], 12, compile_with=aot.AotStep)  # builds the package, cached
        eager = run_rows(second, 2, PLANS[:2], 12)
        ahead = run_rows(second, 2, PLANS[:2], 12, compile_with=aot.AotStep)
    assert [tokens for tokens, _ in ahead] == [tokens for tokens, _ in eager]
    for (_, got), (_, want) in zip(ahead, eager, strict=True):
        torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=0, atol=1e-5)
