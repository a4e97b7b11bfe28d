"""The serving engine in decode/engine.py: the KV cache, generation, sampling, and the Decoder's batched rows
(each row bit for bit its own), compiled steps and prefix cache."""

import copy
import re
import types

import pytest
import torch

import model
from decode import engine, kvcache
from tests.test_model import build, tiny, tokens

# ---- KV cache and generation ----


@pytest.mark.parametrize("backend", ["math", "flash"])
def test_incremental_decoding_with_the_kv_cache_gives_the_full_forward_logits(backend):
    net = build(tiny(), backend)
    idx = tokens(2, 24)
    with torch.no_grad():
        full, _ = net(idx)
        cache = kvcache.new_kv_cache(net, slots=2)
        pieces = [engine.forward_with_cache(net, idx[:, :10], cache)]  # prefill
        pieces += [
            engine.forward_with_cache(net, idx[:, t : t + 1], cache) for t in range(10, 16)
        ]  # one at a time
        pieces.append(engine.forward_with_cache(net, idx[:, 16:], cache))  # a chunk after cached positions
    assert cache.length == 24
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-5)


def test_the_cache_refuses_to_grow_past_seq_len():
    net = build(tiny())
    cache = kvcache.new_kv_cache(net)
    with torch.no_grad():
        engine.forward_with_cache(net, tokens(1, 30), cache)
        with pytest.raises(ValueError, match="30 cached \\+ 3 new tokens exceed model.seq_len=32"):
            engine.forward_with_cache(net, tokens(1, 3), cache)


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
    assert list(engine.generate(net, prompt, 40, temperature=0)) == want
    assert (
        list(engine.generate(net, prompt[None], 40, top_k=1)) == want
    )  # top_k 1 is greedy too; (1, T) accepted
    long_prompt = tokens(1, 21)[0]  # longer than seq_len: only its last 16 tokens are read
    assert list(engine.generate(net, long_prompt, 12, temperature=0)) == greedy_by_full_forward(
        net, long_prompt, 12
    )


def test_past_seq_len_generation_prefills_once_every_half_window_not_at_every_step(monkeypatch):
    net = build(tiny(seq_len=16))
    prefill_lengths = []
    forward_with_cache = engine.forward_with_cache

    def counting(model, idx, cache, slot=None):
        if idx.shape[1] > 1:
            prefill_lengths.append(idx.shape[1])
        return forward_with_cache(model, idx, cache, slot)

    monkeypatch.setattr(engine, "forward_with_cache", counting)
    assert len(list(engine.generate(net, tokens(1, 10)[0], 6 + 8 * 3 + 1, temperature=0))) == 31
    # The prompt; then at 16 tokens the window restarts from the last 8, three times in 24 steps.
    assert prefill_lengths == [10, 8, 8, 8]


def test_generate_streams_one_int_per_step_and_stops_after_the_stop_token():
    net = build(tiny())
    prompt = tokens(1, 5)[0]
    stream = engine.generate(net, prompt, 10, temperature=0)
    first = next(stream)
    assert isinstance(first, int)
    greedy = [first, *stream]
    assert len(greedy) == 10
    stop = greedy[3]
    stopped = list(engine.generate(net, prompt, 10, temperature=0, stop_token=stop))
    assert stopped == greedy[: greedy.index(stop) + 1]


def test_sampling_with_the_same_seed_repeats_and_another_seed_differs():
    net = build(tiny())
    prompt = tokens(1, 5)[0]

    def draw(seed):
        return list(
            engine.generate(net, prompt, 24, temperature=1.5, generator=torch.Generator().manual_seed(seed))
        )

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_top_k_and_top_p_only_draw_from_the_kept_tokens():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])  # probabilities ~ .64 .23 .09 .03 .01
    generator = torch.Generator().manual_seed(0)
    top_k = {engine.sample_token(logits, 1.0, top_k=2, generator=generator) for _ in range(300)}
    assert top_k == {0, 1}
    top_p = {engine.sample_token(logits, 1.0, top_p=0.8, generator=generator) for _ in range(300)}
    assert top_p == {0, 1}  # .64 < .8, so the second token is needed, the third is not
    assert {engine.sample_token(logits, 1.0, top_p=0.5, generator=generator) for _ in range(50)} == {0}
    with pytest.raises(ValueError, match="top_p=1.5"):
        engine.sample_token(logits, 1.0, top_p=1.5)


def test_draws_follow_the_softmax_of_the_logits_over_temperature():
    logits = torch.tensor([2.0, 1.0, 0.0, -30.0])
    generator = torch.Generator().manual_seed(0)
    for temperature, top_k in ((1.0, None), (0.5, 3)):
        expected = torch.softmax(logits / temperature, dim=0)
        counts = torch.zeros(4)
        for _ in range(4000):
            counts[engine.sample_token(logits, temperature, top_k=top_k, generator=generator)] += 1
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
    logits = torch.randn(6, 700, generator=torch.Generator().manual_seed(1)) * 4
    logits[2, 10] = logits[2, 20] = logits[2].max() + 1  # a tie: both ways keep the first
    together = [torch.Generator().manual_seed(row) for row in range(6)]
    alone = [torch.Generator().manual_seed(row) for row in range(6)]
    for _ in range(20):  # each generator goes on from where its last draw left it
        drawn = engine.sample_tokens(logits, temperature, top_k, top_p, together)
        assert drawn == [
            engine.sample_token(logits[row], temperature, top_k, top_p, alone[row]) for row in range(6)
        ]
    if temperature == 0:
        assert drawn == logits.argmax(dim=-1).tolist()


def test_a_decoder_draws_rows_of_different_settings_each_with_its_own():
    net = build(tiny(seq_len=32))
    settings = [seeded(0.9, 1), seeded(0, 2), {**seeded(0.9, 3), "top_k": 5}, seeded(0.9, 4)]
    decoder = engine.Decoder(net, len(settings))
    rows = [decoder.add(forced_tokens(4, seed=i), **sampling) for i, sampling in enumerate(settings)]
    for _ in range(10):
        expected = {row: engine.sample_token(row.logits, row.temperature, row.top_k, row.top_p,
                                      copy.deepcopy(row.generator)) for row in rows}  # fmt: skip
        drawn = decoder.sample_rows(rows)
        assert drawn == expected
        decoder.advance(drawn)


# ---- batched decoding (engine.Decoder): rows at their own positions, joining and leaving between steps


def forced_tokens(count, seed):
    return tokens(1, count, seed=seed)[0].tolist()


def test_a_decode_step_over_several_rows_gives_each_row_its_single_row_logits():
    net = build(tiny(seq_len=32))
    prompts = [forced_tokens(length, seed=length) for length in (3, 9, 20, 31)]
    fed = [forced_tokens(24, seed=100 + i) for i in range(len(prompts))]  # the same inputs in both runs
    batch = engine.Decoder(net, len(prompts))
    rows = [batch.add(prompt, temperature=0) for prompt in prompts]
    alone = [engine.Decoder(net, 1) for _ in prompts]
    solo_rows = [decoder.add(prompt, temperature=0) for decoder, prompt in zip(alone, prompts, strict=True)]
    for step in range(24):  # the rows of 20 and 31 tokens pass seq_len: their windows restart on their own
        for row, solo in zip(rows, solo_rows, strict=True):
            torch.testing.assert_close(row.logits, solo.logits, rtol=0, atol=1e-5)
        batch.advance({row: fed[i][step] for i, row in enumerate(rows)})
        for i, decoder in enumerate(alone):
            decoder.advance({solo_rows[i]: fed[i][step]})


def run_rows(net, slots, plans, steps, compile_mode=None, compile_with=None, **options):
    """Decode with `slots` slots (options: more of engine.Decoder's). plans: (prompt, first step, last step,
    sampling kwargs) per row; a row joins at its first step and leaves after its last. Returns each row's
    (tokens, logits per step)."""
    decoder = engine.Decoder(net, slots, compile_mode=compile_mode, compile_with=compile_with, **options)
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
    from decode import kernel
    from decode.weights import split_matvec, with_kernels

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
    decoder = engine.Decoder(net, 4, compile_mode="default")
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
    decoder = engine.Decoder(net, 2, prefix_block=4, prefix_cache_bytes=2**20)
    answers = [greedy_run(decoder, prompt, 10) for prompt in (first, second, first)]
    assert decoder.prefix_cache.stats["reused_tokens"] == 8 + 16  # the second reused 8, the third 16
    for prompt, answer in zip((first, second, first), answers, strict=True):
        fresh = greedy_run(engine.Decoder(net, 2, prefix_block=4, prefix_cache_bytes=2**20), prompt, 10)
        assert answer[0] == fresh[0] and all(map(torch.equal, answer[1], fresh[1]))
    assert answers[0][0] == answers[2][0] and all(map(torch.equal, answers[0][1], answers[2][1]))


def test_the_prefix_cache_shares_only_the_public_blocks_between_members():
    net = build(tiny(seq_len=32))
    prompt = forced_tokens(17, seed=5)  # its first 9 tokens are the server's (public), the rest ana's
    decoder = engine.Decoder(net, 1, prefix_block=4, prefix_cache_bytes=2**20)
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
    decoder = engine.Decoder(net, 1, prefix_block=4, prefix_cache_bytes=5 * block_bytes)
    old, new = forced_tokens(13, seed=6), forced_tokens(9, seed=7)  # three blocks, then two
    greedy_run(decoder, old, 1)
    greedy_run(decoder, new, 1)
    assert decoder.prefix_cache.bytes == 5 * block_bytes
    greedy_run(decoder, new + [1, 2, 3, 4], 1)  # one more block: the old prompt's last one goes
    ends = [len(ids) for _, ids in decoder.prefix_cache.blocks]
    assert sorted(ends) == [4, 4, 8, 8, 12] and decoder.prefix_cache.bytes <= 5 * block_bytes
    assert tuple(old[:8]) in {ids for _, ids in decoder.prefix_cache.blocks}
    assert tuple(old[:12]) not in {ids for _, ids in decoder.prefix_cache.blocks}


def test_split_matvec_shares_the_weights_and_decodes_the_plain_models_tokens_with_logits_within_1e_5():
    from bench.decoding import step_bytes
    from decode.weights import SplitLinear, split_matvec

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
    drawn = list(engine.generate(net, prompt, 8, temperature=1.5, generator=torch.Generator().manual_seed(0),
                              constraint=forced))  # fmt: skip
    assert drawn[:5] == [7, 7, 3, 250, 0] and forced.accepted == drawn
    greedy = list(engine.generate(net, prompt, 1, temperature=0))[0]
    runner_up = int(engine.Decoder(net, 1).add(prompt.tolist()).logits.topk(2).indices[1])
    assert list(engine.generate(net, prompt, 1, temperature=0, constraint=Forbidden(greedy))) == [runner_up]
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
    decoder = engine.Decoder(net, 2)
    first, second = decoder.add([1, 2, 3]), decoder.add([4])
    with pytest.raises(ValueError, match="all 2 slots are in use"):
        decoder.add([5])
    decoder.remove(first)
    assert decoder.add([5, 6]).slot == first.slot and second.slot == 1


# ---- the engine reads a model only through model.layout() ----

# Every attribute of model.py's modules that a forward pass reads: the children, buffers and shapes.
MODEL_PARTS = (
    "embed_tokens", "layers", "norm", "lm_head", "rope_cos", "rope_sin", "seq_len", "input_layernorm",
    "self_attn", "post_attention_layernorm", "mlp", "q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm",
    "gate_proj", "up_proj", "down_proj", "n_heads", "n_kv_heads", "head_dim", "backend", "eps",
)  # fmt: skip


def model_with_renamed_parts():
    """model.py as a developer who renamed every part would leave it (each attribute and buffer name, in
    this file alone), loaded as a module of its own."""
    with open(model.__file__, encoding="utf-8") as f:
        source = f.read()
    for name in MODEL_PARTS:
        source = re.sub(rf"\.{name}\b", f".{name}_renamed", source)
    for buffer in ("rope_cos", "rope_sin"):  # register_buffer's names
        source = source.replace(f'"{buffer}"', f'"{buffer}_renamed"')
    renamed = types.ModuleType("renamed_model")
    exec(compile(source, "renamed_model.py", "exec"), renamed.__dict__)
    return renamed


def test_the_engine_decodes_a_model_whose_parts_were_all_renamed_as_it_decodes_the_original():
    net = build(tiny())
    renamed = model_with_renamed_parts().Transformer(tiny(), "math").eval()
    assert not hasattr(renamed, "embed_tokens") and not hasattr(renamed.layers_renamed[0], "self_attn")
    renamed.load_state_dict(dict(zip(renamed.state_dict(), net.state_dict().values(), strict=True)))
    prompt = tokens(1, 10)[0]
    assert list(engine.generate(renamed, prompt, 40, temperature=0)) == list(
        engine.generate(net, prompt, 40, temperature=0)
    )  # past seq_len: the cached prefill and the window's restart
    plans = [
        (forced_tokens(5, seed=3), 0, 6, {"temperature": 0}),
        (forced_tokens(9, seed=4), 2, 7, {"temperature": 0}),
    ]
    for (want, want_logits), (got, got_logits) in zip(
        run_rows(net, 2, plans, 8), run_rows(renamed, 2, plans, 8), strict=True
    ):  # the batched decode step over two slots
        assert got == want
        torch.testing.assert_close(torch.stack(got_logits), torch.stack(want_logits), rtol=0, atol=0)
    assert kvcache.kv_cache_bytes(renamed, 3) == kvcache.kv_cache_bytes(net, 3)


def test_a_part_the_layout_does_not_name_fails_at_once_not_in_a_served_answer():
    class Broken(model.Transformer):  # a rename of input_layernorm that forgot layout()
        def __init__(self, *args):
            super().__init__(*args)
            for layer in self.layers:
                layer.attn_norm = layer.input_layernorm
                del layer.input_layernorm

    with pytest.raises(AttributeError, match="input_layernorm"):
        list(engine.generate(Broken(tiny()).eval(), tokens(1, 4)[0], 2, temperature=0))


def test_a_decoder_reads_its_models_layout_once_not_at_every_step():
    net = build(tiny())
    reads, layout = [], net.layout
    net.layout = lambda: reads.append(1) or layout()  # walks every layer's modules: ~53 us a step
    generated = list(engine.generate(net, tokens(1, 4)[0], 3 * net.seq_len, temperature=0))
    assert len(generated) == 3 * net.seq_len  # past seq_len: the window's restarts prefill again
    assert len(reads) <= 2  # the Decoder's own and its KV cache's
