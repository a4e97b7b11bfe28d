"""
`make bench ARGS=agent`: what constraining a tool call costs per token (agent/grammar.py), with xgrammar
(used) and llguidance (the other engine vLLM offers) side by side, against a decode step of the tiny-50m
model on the CPU. The vocabulary is a 32,000-token BPE trained with the stage-1 trainer settings
(configs/data/corpus.yaml) on the embedded corpus, so it holds the control tokens and tool tags of
data.py's table; the grammar is the server's six tools for a member. Then the grammar grounded in each
hand-written prompt (agent.grounding.mode constrained): its compile time when a call opens (uncached) and
its per-token mask time, per call against the decode time of the call at the smoke and tiny-50m shapes.
"""

import gzip
import json
import os
import platform
import statistics
import tempfile
import time

import sentencepiece as spm
import torch

import config
import data
import model
from agent import dataset, grammar, tools
from bench.common import ROOT, layer
from corpus import encode
from decode import engine, kvcache
from evaluation import tool_use

ROUNDS = 5  # alternate rounds over the calls; the median is kept


def train_32k_tokenizer(folder):
    data_cfg = config.load_layer("data", os.path.join(ROOT, "configs", "data", "corpus.yaml"))
    settings = encode.trainer_settings(data_cfg)
    lines = []
    for name in ("rv1909.txt.gz", "fortunes-es.txt.gz"):
        with gzip.open(os.path.join(ROOT, "corpus", name), "rt", encoding="utf-8") as f:
            lines += [line for line in f.read().split("\n") if line.strip()]
    prefix = os.path.join(folder, "bpe32k")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=prefix, minloglevel=2, input_sentence_size=0, **settings
    )
    return data.SentencePieceTokenizer(prefix + ".model")


def call_sequences(tokenizer):
    """The token ids after <tool_call> of the hand-written set's reference calls, </tool_call> included."""
    close = data.TOKEN_TABLE["</tool_call>"]
    sequences = []
    for entry in dataset.read_jsonl(tool_use.HANDWRITTEN):
        if entry["tool"]:
            body = json.dumps({"name": entry["tool"], "arguments": entry["call"]}, ensure_ascii=False)
            sequences.append(tokenizer.encode("\n" + body + "\n") + [close])
    return sequences


def xgrammar_passes(tokenizer, tools, settings, sequences, vocab_size):
    """(vocabulary s, grammar s, engine pass, constraint pass): a pass runs the calls once and returns its
    seconds. The engine pass is xgrammar's matcher alone (fill the bitmask, accept the token); the
    constraint pass is all agent/grammar.py does per token (the engine, the bitmask applied to the logits,
    the spelled-tag guard, the budget)."""
    start = time.perf_counter()
    grammar.vocabulary.cache_clear()
    grammar.vocabulary(tokenizer)
    vocabulary_s = time.perf_counter() - start
    compiled = grammar.tool_grammar(tokenizer, tools, settings)
    grammar_s = time.perf_counter() - start - vocabulary_s
    logits = torch.randn(vocab_size)
    bitmask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)

    def engine():
        start = time.perf_counter()
        for sequence in sequences:
            matcher = compiled.matcher()
            for token in sequence:
                matcher.fill_next_token_bitmask(bitmask)
                matcher.accept_token(token)
        return time.perf_counter() - start

    def constraint():
        start = time.perf_counter()
        for sequence in sequences:
            constraint = grammar.constraint_for(tokenizer, tools, settings, max_tokens=len(sequence) + 99)
            constraint.accept(data.TOKEN_TABLE["<tool_call>"])
            for token in sequence:
                constraint.mask(logits)
                constraint.accept(token)
        return time.perf_counter() - start

    return vocabulary_s, grammar_s, engine, constraint


def llguidance_passes(tokenizer, tools, settings, sequences, vocab_size):
    """(tokenizer + grammar s, engine pass) of the same grammar with llguidance."""
    import llguidance
    import llguidance.torch

    vocab = grammar.vocabulary(tokenizer)
    close = vocab.close_id
    protocol = set(data.TOKEN_TABLE.values()) - {vocab.newline_id}

    class Tokens:  # what llguidance.TokenizerWrapper reads; special tokens start with 0xff
        eos_token_id, bos_token_id = close, None
        special_token_ids = sorted(protocol)
        tokens = [
            b"\xff" + tokenizer.processor.id_to_piece(i).encode() if i in protocol else raw
            for i, raw in enumerate(vocab.bytes)
        ]

        def __call__(self, text):
            return tokenizer.encode(text.decode("utf-8") if isinstance(text, bytes) else text)

    start = time.perf_counter()
    lltokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Tokens()), eos_token=close)
    schema = grammar.call_schema(tools, settings)
    schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    compiled = llguidance.LLMatcher.grammar_from_lark(
        'start: "\\n" body "\\n"\nbody: %json ' + json.dumps(schema)
    )
    first = llguidance.LLMatcher(lltokenizer, compiled, log_level=0)
    if first.is_error():
        raise RuntimeError(f"llguidance: {first.get_error()}")
    setup = time.perf_counter() - start
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

    def engine():
        start = time.perf_counter()
        for sequence in sequences:
            matcher = first.deep_copy()
            for token in sequence:
                llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
                if not matcher.consume_token(token):
                    raise RuntimeError(f"llguidance refused a reference call: {matcher.get_error()}")
        return time.perf_counter() - start

    return setup, engine


def application_pass(tokenizer, tokens, vocab_size):
    """A pass that applies a bitmask to the logits `tokens` times, as agent/grammar.py does for either engine."""
    vocab = grammar.vocabulary(tokenizer)
    logits, bitmask = (
        torch.randn(vocab_size),
        torch.full((1, (vocab_size + 31) // 32), 0x0F0F0F0F, dtype=torch.int32),
    )

    def apply():
        start = time.perf_counter()
        for _ in range(tokens):
            logits.masked_fill(~vocab.allowed(bitmask, vocab_size), float("-inf"))
        return time.perf_counter() - start

    return apply


def free_text_seconds(tokenizer, tools, settings, vocab_size):
    """Seconds per token of the constraint in free text (no grammar: the </tool_call> ban and the guard)."""
    text = (
        tokenizer.encode("Claro, te lo miro ahora mismo: son unos minutos y enseguida te digo qué sale.") * 8
    )
    logits = torch.randn(vocab_size)
    constraint = grammar.constraint_for(tokenizer, tools, settings)
    start = time.perf_counter()
    for token in text:
        constraint.mask(logits)
        constraint.accept(token)
    return (time.perf_counter() - start) / len(text)


def grounded_calls(tokenizer, specs, settings, vocab_size):
    """Over the hand-written prompts that need a tool: (compile seconds of each prompt's grounded grammar,
    uncached; mask seconds per token of its reference call; reference calls inside the grounded grammar,
    prompts). A reference call outside it (a value the prompt does not say) is not timed."""
    close, logits = data.TOKEN_TABLE["</tool_call>"], torch.randn(vocab_size)
    compiles, masks, inside, prompts = [], [], 0, 0
    for entry in dataset.read_jsonl(tool_use.HANDWRITTEN):
        if not entry["tool"]:
            continue
        prompts += 1
        shown = [
            f"- [{n}] {m if isinstance(m, str) else m['text']}"
            for n, m in enumerate(entry.get("memories", []), 1)
        ]
        messages = [{"role": "system", "content": "\n".join(["Recuerdos:", *shown])},
                    *entry.get("before", []), {"role": "user", "content": entry["prompt"]}]  # fmt: skip
        grammar._grammars.clear()
        start = time.perf_counter()
        constraint = grammar.constraint_for(tokenizer, specs, settings, None, messages)
        constraint.accept(data.TOKEN_TABLE["<tool_call>"])
        constraint.mask(logits)  # the grammar compiles as the call opens
        compiles.append(time.perf_counter() - start)
        body = json.dumps({"name": entry["tool"], "arguments": entry["call"]}, ensure_ascii=False)
        sequence = tokenizer.encode("\n" + body + "\n") + [close]
        start = time.perf_counter()
        try:
            for token in sequence:
                constraint.mask(logits)
                constraint.accept(token)
        except ValueError:  # outside the grounded grammar
            continue
        masks.append((time.perf_counter() - start) / len(sequence))
        inside += 1
    return compiles, masks, inside, prompts


def decode_step_seconds(context=512, steps=24, shape="tiny-50m"):
    """Seconds per token of greedy generation with the KV cache, at a model shape, random weights."""
    backend = layer("hardware", "cpu")["attention_backend"]
    torch.manual_seed(0)
    net = model.Transformer(layer("model", shape), backend).eval()
    prompt = torch.randint(0, net.cfg["vocab_size"], (context,))
    stream = engine.generate(net, prompt, steps + 1, temperature=0)
    next(stream)  # the prefill
    start = time.perf_counter()
    count = sum(1 for _ in stream)
    return (time.perf_counter() - start) / count


def bench_agent():
    import importlib.metadata

    settings = tools.load_settings()
    specs = tools.tool_specs(settings, tools.default_tools(member="bench"))
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as folder:
        tokenizer = train_32k_tokenizer(folder)
        sequences = call_sequences(tokenizer)
        tokens = sum(map(len, sequences))
        vocab_size = layer("model", "tiny-50m")["vocab_size"]
        step = decode_step_seconds()
        vocabulary_s, grammar_s, xgr_engine, xgr_constraint = xgrammar_passes(
            tokenizer, specs, settings, sequences, vocab_size
        )
        llg_setup, llg_engine = llguidance_passes(tokenizer, specs, settings, sequences, vocab_size)
        passes = {"xgrammar": xgr_engine, "llguidance": llg_engine, "applying the bitmask": application_pass(
            tokenizer, tokens, vocab_size), "the grammar's constraint": xgr_constraint}  # fmt: skip
        times = {name: [] for name in passes}
        for _ in range(ROUNDS):  # alternate rounds: a busy moment of the machine hits every pass
            for name, run_pass in passes.items():
                times[name].append(run_pass() / tokens)
        per_token = {name: statistics.median(values) for name, values in times.items()}
        free = statistics.median(
            free_text_seconds(tokenizer, specs, settings, vocab_size) for _ in range(ROUNDS)
        )
        grounded = grounded_calls(tokenizer, specs, settings, vocab_size)
        smoke_step = decode_step_seconds(shape="smoke")
    versions = {name: importlib.metadata.version(name) for name in ("xgrammar", "llguidance")}
    print(
        f"agent: {tokenizer.vocab_size:,}-token BPE, the server's {len(specs)} tools, {len(sequences)} reference "
        f"calls ({tokens} tokens), median of {ROUNDS} alternate rounds; load average {os.getloadavg()[0]:.1f} "
        f"on {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads"
    )
    print(f"agent: tiny-50m decode step (KV cache, 512-token context) {1e3 * step:.2f} ms")
    print(
        f"agent: setup: xgrammar {versions['xgrammar']} vocabulary {vocabulary_s:.2f} s + grammar {grammar_s:.2f} s "
        f"| llguidance {versions['llguidance']} tokenizer + grammar {llg_setup:.2f} s"
    )
    applying = per_token["applying the bitmask"]
    for name in ("xgrammar", "llguidance"):
        total = per_token[name] + applying
        print(
            f"agent: {name:<10s} per token inside a call: engine {1e6 * per_token[name]:6.1f} µs + bitmask applied "
            f"{1e6 * applying:6.1f} µs = {100 * total / step:.3f}% of a decode step"
        )
    used = per_token["the grammar's constraint"]
    print(
        f"agent: the grammar's constraint (xgrammar) inside a call {1e6 * used:.1f} µs per token = "
        f"{100 * used / step:.3f}% of a decode step (target < 10%); in free text {1e6 * free:.1f} µs "
        f"({100 * free / step:.3f}%); llguidance's engine / xgrammar's: {per_token['llguidance'] / per_token['xgrammar']:.0f}x"
    )
    compiles, masks, inside, prompts = grounded
    compile_s, mask_s = statistics.median(compiles), statistics.median(masks)
    call_tokens = tokens / len(sequences)
    print(
        f"agent: grounded grammar per hand-written prompt ({prompts} needing a tool; {inside} reference calls "
        f"inside it): compile when the call opens {1e3 * compile_s:.1f} ms median (max {1e3 * max(compiles):.1f} ms), "
        f"mask {1e6 * mask_s:.1f} µs per token (cached per tool set: {1e3 * grammar_s:.0f} ms once, "
        f"{1e6 * used:.1f} µs per token)"
    )
    for shape, seconds in (("smoke", smoke_step), ("tiny-50m", step)):
        per_call = compile_s + call_tokens * mask_s
        print(
            f"agent: grounded call of {call_tokens:.0f} tokens at the {shape} shape (decode step {1e3 * seconds:.2f} ms): "
            f"{1e3 * per_call:.1f} ms of grammar = {100 * per_call / (call_tokens * seconds):.1f}% of the call's decode "
            "time (target <= 5% at smoke)"
        )


ANSWER = ("Son 69104 euros: 1234 por 56, es decir 69.104 en total; cada uno pone 26,57 de los 186 que "
          "costó la cena del 5 de diciembre de 2026, y sobran 2.")  # fmt: skip


def answer_pass(tokenizer, settings, messages, text, vocab_size):
    """Seconds per token of the free-text constraint along an answer after a tool result (mask + accept)."""
    logits = torch.randn(vocab_size)
    constraint = grammar.constraint_for(tokenizer, None, settings, None, messages)
    start = time.perf_counter()
    for token in text:
        constraint.mask(logits.clone())
        constraint.accept(token)
    return (time.perf_counter() - start) / len(text)


def decode_rates(shape, tokenizer, settings, off, messages, text, rounds=ROUNDS):
    """{"off": [tokens/s], "constrained": [tokens/s]}: greedy decoding teacher-forced along the answer (a KV
    cache step, the free-text constraint's mask, argmax, accept), the model at this shape with the 32,000-token
    vocabulary, random weights; the two in alternate rounds."""
    backend = layer("hardware", "cpu")["attention_backend"]
    torch.manual_seed(0)
    cfg = {**layer("model", shape), "vocab_size": tokenizer.vocab_size}
    net = model.Transformer(cfg, backend).eval()
    context = min(512, cfg["seq_len"] - len(text) - 1)
    prompt = torch.randint(0, cfg["vocab_size"], (1, context))
    cache = kvcache.new_kv_cache(net)

    def rate(chosen):
        cache.length = 0
        constraint = grammar.constraint_for(tokenizer, None, chosen, None, messages)
        with torch.no_grad():
            logits = engine.forward_with_cache(net, prompt, cache)
            start = time.perf_counter()
            for token in text:
                int(constraint.mask(logits[0, -1]).argmax())
                constraint.accept(token)
                logits = engine.forward_with_cache(net, torch.tensor([[token]]), cache)
            return len(text) / (time.perf_counter() - start)

    rates = {"off": [], "constrained": []}
    for _ in range(rounds):
        rates["off"].append(rate(off))
        rates["constrained"].append(rate(settings))
    return rates


def bench_answers():
    """`make bench ARGS=answers`: what grounding an answer's numbers costs per token (agent/answers.py,
    agent.answers.grounding constrained against off), against a decode step at the smoke and tiny-50m
    shapes, and decoding's tokens/s along the answer with and without the guard; the 32,000-token BPE of
    bench_agent, logits of 32,000 (an upper bound for smoke's 256)."""
    settings = tools.load_settings()
    off = {**settings, "answers": {**settings["answers"], "grounding": "off"}}
    messages = [
        {"role": "system", "content": "Hoy es sábado, 5 de diciembre de 2026."},
        {"role": "user", "content": "Somos 7 y la cena costó 186 euros; ¿y cuánto es 1234 por 56?"},
        {"role": "tool", "content": "69104", "name": "calculadora"},
        {"role": "tool", "content": "26,57", "name": "calculadora"},
    ]
    with tempfile.TemporaryDirectory(prefix="bench-answers-") as folder:
        tokenizer = train_32k_tokenizer(folder)
    vocab_size = layer("model", "tiny-50m")["vocab_size"]
    text = tokenizer.encode(ANSWER)
    grammar.vocabulary(tokenizer)  # built once per tokenizer, as in the server
    times = {"off": [], "constrained": []}
    for _ in range(ROUNDS):  # alternate rounds: a busy moment of the machine hits both
        times["off"].append(answer_pass(tokenizer, off, messages, text, vocab_size))
        times["constrained"].append(answer_pass(tokenizer, settings, messages, text, vocab_size))
    extra = [on - plain for on, plain in zip(times["constrained"], times["off"], strict=True)]
    steps = {shape: [decode_step_seconds(shape=shape) for _ in range(3)] for shape in ("smoke", "tiny-50m")}
    rates = {
        shape: decode_rates(shape, tokenizer, settings, off, messages, text)
        for shape in ("smoke", "tiny-50m")
    }
    print(
        f"answers: {tokenizer.vocab_size:,}-token BPE, an answer of {len(text)} tokens after two tool results, "
        f"{ROUNDS} alternate rounds; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs "
        f"({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads"
    )
    for name, values in times.items():
        print(f"answers: free-text constraint, grounding {name}: " + ", ".join(f"{1e6 * v:.1f}" for v in values)
              + " µs per token")  # fmt: skip
    for shape, seconds in steps.items():
        step = statistics.median(seconds)
        shares = ", ".join(f"{100 * e / step:.2f}%" for e in extra)
        print(
            f"answers: {shape} decode step {1e3 * step:.2f} ms (3 runs: "
            + ", ".join(f"{1e3 * s:.2f}" for s in seconds)
            + f"); grounding's extra per token {1e6 * statistics.median(extra):.1f} µs median = "
            f"{100 * statistics.median(extra) / step:.2f}% of a step (rounds: {shares}; target <= 5%)"
        )
    for shape, rate in rates.items():
        ratios = [on / plain for on, plain in zip(rate["constrained"], rate["off"], strict=True)]
        low, high = min(ratios), max(ratios)
        print(
            f"answers: {shape} decoding along the answer (vocabulary 32,000), tokens/s median [min–max]: without the "
            f"guard {statistics.median(rate['off']):.1f} [{min(rate['off']):.1f}–{max(rate['off']):.1f}], with it "
            f"{statistics.median(rate['constrained']):.1f} [{min(rate['constrained']):.1f}–{max(rate['constrained']):.1f}]; "
            f"with / without per round "
            + ", ".join(f"{r:.3f}" for r in ratios)
            + f", median {statistics.median(ratios):.3f} [{low:.3f}–{high:.3f}] (target >= 0.95)"
        )
