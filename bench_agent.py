"""
`make bench ARGS=agent`: what constraining a tool call costs per token (agent_grammar.py), with xgrammar
(used) and llguidance (the other engine vLLM offers) side by side, against a decode step of the tiny-50m
model on the CPU. The vocabulary is a 32,000-token BPE trained with the stage-1 trainer settings
(configs/data/corpus.yaml) on the embedded corpus, so it holds the control tokens and tool tags of
data.py's table; the grammar is the server's six tools for a member.
"""

import gzip
import json
import os
import platform
import statistics
import tempfile
import time

import numpy as np
import sentencepiece as spm
import torch

import agent
import agent_data
import agent_eval
import agent_grammar
import config
import corpus_encode
import data
import model
from bench_common import ROOT, layer

REPEATS = 5  # passes over the calls; the median pass is kept


def train_32k_tokenizer(folder):
    data_cfg = config.load_layer("data", os.path.join(ROOT, "configs", "data", "corpus.yaml"))
    settings = corpus_encode.trainer_settings(data_cfg)
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
    for entry in agent_data.read_jsonl(agent_eval.HANDWRITTEN):
        if entry["tool"]:
            body = json.dumps({"name": entry["tool"], "arguments": entry["call"]}, ensure_ascii=False)
            sequences.append(tokenizer.encode("\n" + body + "\n") + [close])
    return sequences


def median_pass(run_pass):
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        run_pass()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def xgrammar_per_token(tokenizer, tools, settings, sequences, vocab_size):
    """(compile s, mask s per call token, mask s per free-text token) of agent_grammar's constraint."""
    start = time.perf_counter()
    agent_grammar.vocabulary.cache_clear()
    agent_grammar.tool_grammar(tokenizer, tools, settings)
    compile_s = time.perf_counter() - start
    logits = torch.randn(vocab_size)
    tokens = sum(len(sequence) for sequence in sequences)

    def calls():
        for sequence in sequences:
            constraint = agent_grammar.constraint_for(tokenizer, tools, settings)
            constraint.accept(data.TOKEN_TABLE["<tool_call>"])
            for token in sequence:
                constraint.mask(logits.clone())
                constraint.accept(token)

    free_text = tokenizer.encode(
        "Claro, te lo miro ahora mismo: son unos minutos y enseguida te digo qué sale."
    )

    def text():
        constraint = agent_grammar.constraint_for(tokenizer, tools, settings)
        for token in free_text * 4:
            constraint.mask(logits.clone())
            constraint.accept(token)

    clone = median_pass(lambda: [logits.clone() for _ in range(tokens)]) / tokens  # not the engine's cost
    return compile_s, median_pass(calls) / tokens - clone, median_pass(text) / (4 * len(free_text)) - clone


def llguidance_per_token(tokenizer, tools, settings, sequences, vocab_size):
    """(compile s, mask s per call token) of the same grammar with llguidance, the bitmask applied the
    way agent_grammar applies xgrammar's."""
    import llguidance
    import llguidance.torch

    vocab = agent_grammar.vocabulary(tokenizer)
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
    schema = agent_grammar.call_schema(tools, settings)
    schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    grammar = llguidance.LLMatcher.grammar_from_lark(
        'start: "\\n" body "\\n"\nbody: %json ' + json.dumps(schema)
    )
    first = llguidance.LLMatcher(lltokenizer, grammar, log_level=0)
    if first.is_error():
        raise RuntimeError(f"llguidance: {first.get_error()}")
    compile_s = time.perf_counter() - start
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
    logits = torch.randn(vocab_size)
    tokens = sum(len(sequence) for sequence in sequences)

    def calls():
        for sequence in sequences:
            matcher = first.deep_copy()
            for token in sequence:
                llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
                bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:vocab_size]
                logits.clone().masked_fill(~torch.from_numpy(bits.view(bool)), float("-inf"))
                if not matcher.consume_token(token):
                    raise RuntimeError(f"llguidance refused a reference call: {matcher.get_error()}")

    clone = median_pass(lambda: [logits.clone() for _ in range(tokens)]) / tokens
    return compile_s, median_pass(calls) / tokens - clone


def decode_step_seconds(context=512, steps=24):
    """Seconds per token of greedy generation with the KV cache, tiny-50m shape, random weights."""
    backend = layer("hardware", "cpu")["attention_backend"]
    torch.manual_seed(0)
    net = model.Transformer(layer("model", "tiny-50m"), backend).eval()
    prompt = torch.randint(0, net.cfg["vocab_size"], (context,))
    stream = net.generate(prompt, steps + 1, temperature=0)
    next(stream)  # the prefill
    start = time.perf_counter()
    count = sum(1 for _ in stream)
    return (time.perf_counter() - start) / count


def bench_agent():
    import importlib.metadata

    settings = agent.load_settings()
    tools = agent.tool_specs(settings, agent.default_tools(member="bench"))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as folder:
        tokenizer = train_32k_tokenizer(folder)
        sequences = call_sequences(tokenizer)
        vocab_size = layer("model", "tiny-50m")["vocab_size"]
        step = decode_step_seconds()
        xgr_compile, xgr_call, xgr_text = xgrammar_per_token(
            tokenizer, tools, settings, sequences, vocab_size
        )
        llg_compile, llg_call = llguidance_per_token(tokenizer, tools, settings, sequences, vocab_size)
    versions = {name: importlib.metadata.version(name) for name in ("xgrammar", "llguidance")}
    print(
        f"agent: {tokenizer.vocab_size:,}-token BPE, the server's {len(tools)} tools, {len(sequences)} reference "
        f"calls ({sum(map(len, sequences))} tokens); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} "
        f"CPUs ({platform.processor() or platform.machine()}), torch {torch.get_num_threads()} threads"
    )
    print(f"agent: tiny-50m decode step (KV cache, 512-token context) {1e3 * step:.2f} ms")
    for name, compile_s, call_s in (
        ("xgrammar", xgr_compile, xgr_call),
        ("llguidance", llg_compile, llg_call),
    ):
        print(
            f"agent: {name} {versions[name]:<7s} grammar {compile_s:.2f} s | per token inside a call: mask "
            f"{1e6 * call_s:6.1f} µs = {100 * call_s / step:.2f}% of a decode step"
        )
    print(
        f"agent: xgrammar in free text {1e6 * xgr_text:.1f} µs per token ({100 * xgr_text / step:.2f}% of a step); "
        f"llguidance / xgrammar inside a call: {llg_call / xgr_call:.1f}x"
    )
