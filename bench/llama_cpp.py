"""
`make bench ARGS=llama` (also part of ARGS=serve): ENLACE's decoding against llama.cpp on the same weights,
at 1 and 8 streams, each configuration in a fresh process. ENLACE float32 (eager; with its products split
over the threads; through ENLACE's own kernel, eager and compiled ahead of time as the server runs it on a
CPU, decode/aot.py) and int8 weights (the kernel, eager and ahead of time); llama.cpp (llama-cpp-python, its
own batched llama_decode, as many threads) on the same weights exported to GGUF f32 and q8_0. (torch.compile
on a CPU and torch's int8 were retired from the server: docs/rendimiento.md keeps their figures.) Rounds
take turns, so that no configuration always runs first on a cool machine; ratios are taken round by round.
(The aot rows build their package in round 1 and load it from the disk cache after, as a server's later
starts do.)

    python -m bench.llama_cpp table --rounds 3            # the table
    python -m bench.llama_cpp table --only "ENLACE int8 kernel aot" --only "llama.cpp q8_0"   # some rows
    python -m bench.llama_cpp rate FOLDER smoke "llama.cpp q8_0"   # one configuration: a JSON line
"""

import json
import os
import statistics
import sys
import tempfile
import time

import torch

import config
import data
import export
import model
from bench.common import ROOT, in_turns, layer, run_fresh, spread
from bench.decoding import greedy_answers, memory_bandwidth, random_prompts, step_bytes
from corpus import pipeline
from decode import engine
from decode.aot import AotStep
from decode.weights import split_matvec, with_kernels

CONFIGURATIONS = (
    "ENLACE float32",
    "ENLACE float32 split",
    "ENLACE float32 kernel",
    "ENLACE float32 kernel aot",
    "ENLACE int8 kernel",
    "ENLACE int8 kernel aot",
    "llama.cpp f32",
    "llama.cpp q8_0",
)
PEER = {
    name: "llama.cpp f32" if "float32" in name else "llama.cpp q8_0"
    for name in CONFIGURATIONS
    if "ENLACE" in name
}
SHAPES = ("smoke", "tiny-50m")
STREAMS = (1, 8)
PROMPT_TOKENS, NEW_TOKENS, REPEATS = 32, 64, 3
LLAMA_KV_BYTES = 2  # llama.cpp caches keys and values in f16 (ENLACE in float32: step_bytes counts them)


def prompts(vocab, streams):
    """The same `streams` prompts of PROMPT_TOKENS random ids on both sides."""
    return random_prompts(vocab, streams, PROMPT_TOKENS)


# -----------------------------------------------------------------------------
# The weights both sides load: random, seeded, at the smoke and tiny-50m shapes with the vocabulary of
# the smoke corpus's tokenizer (GGUF carries the tokenizer, so its size is the model's)


def smoke_corpus_tokenizer(folder):
    """The smoke corpus's tokenizer (make corpus-smoke) when it exists, else the same configuration's
    tokenizer trained on the embedded corpus in `folder` (a few minutes)."""
    path = os.path.join(ROOT, "configs", "smoke-corpus-cpu.yaml")
    shipped = config.load(path, [])["data"]
    if os.path.exists(data.tokenizer_path(shipped)):
        return data.load_tokenizer(shipped)
    cfg = config.load(path, [f"data.dir={folder}/data"])
    quiet = lambda *args, **kwargs: None  # noqa: E731
    pipeline.build_corpus(cfg["data"], log=quiet)
    pipeline.train_tokenizer(cfg["data"], log=quiet)
    return data.load_tokenizer(cfg["data"])


def write_weights(folder, tokenizer):
    """For each shape: FOLDER/SHAPE.pt (model config and float32 weights, seed 0) and the same weights as
    FOLDER/SHAPE-f32.gguf and FOLDER/SHAPE-q8_0.gguf."""
    for shape in SHAPES:
        cfg = {"run_name": shape, "model": dict(layer("model", shape), vocab_size=tokenizer.vocab_size)}
        torch.manual_seed(0)
        net = model.Transformer(cfg["model"]).eval()
        torch.save({"model": cfg["model"], "weights": net.state_dict()}, os.path.join(folder, f"{shape}.pt"))
        for dtype in ("f32", "q8_0"):
            export.write_gguf(os.path.join(folder, f"{shape}-{dtype}.gguf"), net, cfg, tokenizer, dtype)


def gguf_step_bytes(path, streams, length, kv_layers, kv_width):
    """Bytes a llama.cpp decode step reads: every tensor of the file (the tied embedding once, as the
    output layer reads it whole) and `streams` rows of f16 keys and values of `length` positions."""
    import gguf

    weights = sum(int(tensor.n_bytes) for tensor in gguf.GGUFReader(path).tensors)
    return weights + 2 * kv_layers * kv_width * LLAMA_KV_BYTES * streams * length


# -----------------------------------------------------------------------------
# One configuration in its own process: tokens/s of NEW_TOKENS greedy steps after the prompts' prefill,
# the median of REPEATS, at each number of streams


def enlace_answers(decoder, vocab, streams):
    """(tokens/s of NEW_TOKENS decoding steps of `streams` greedy rows, each row's tokens)."""
    return greedy_answers(decoder, prompts(vocab, streams), NEW_TOKENS)


def enlace_rates(folder, shape, configuration, profile=False):
    saved = torch.load(os.path.join(folder, f"{shape}.pt"), weights_only=True)
    net = model.Transformer(saved["model"]).eval()
    net.load_state_dict(saved["weights"])
    words = configuration.split()
    if "kernel" in words:  # serve.matvec_kernel
        net = with_kernels(net, words[1], max(STREAMS))
    if "split" in words:  # serve.matvec_parts: one block per thread
        net = split_matvec(net, torch.get_num_threads(), max(STREAMS))
    compile_with = AotStep if configuration.endswith("aot") else None  # the package cached after round 1
    result = {"compile_s": 0.0}
    with torch.no_grad():
        for streams in STREAMS:
            decoder = engine.Decoder(net, streams, allocate=True, compile_with=compile_with)
            if decoder.compiled_step is not None:
                start = time.perf_counter()
                decoder.compile()
                result["compile_s"] += time.perf_counter() - start
            answers = timed_answers(enlace_answers, decoder, saved["model"]["vocab_size"], streams)
            result[str(streams)] = answers
            result[f"bytes{streams}"] = step_bytes(net, streams, PROMPT_TOKENS + NEW_TOKENS // 2)
        if profile and decoder.compiled_step is None:
            result["profile"] = decode_profile(net, saved["model"]["vocab_size"])
    return result


MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "quantized::linear_dynamic")


def decode_profile(net, vocab):
    """Where one eager decoding step of one stream spends its wall time: matrix products, the other torch
    operators (the top 3 named), and what is left outside operators (Python, the dispatcher)."""
    from torch.profiler import profile

    decoder = engine.Decoder(net, 1, allocate=True)
    enlace_answers(decoder, vocab, 1)  # warm-up
    with profile() as prof:
        start = time.perf_counter()
        enlace_answers(decoder, vocab, 1)
        wall = time.perf_counter() - start
    totals = {}
    for event in prof.key_averages():
        totals[event.key] = totals.get(event.key, 0.0) + event.self_cpu_time_total / 1e6
    matmul = sum(seconds for key, seconds in totals.items() if key in MATMULS)
    ops = sum(totals.values())
    top = sorted(((s, k) for k, s in totals.items() if k not in MATMULS), reverse=True)[:3]
    others = ", ".join(f"{key} {100 * seconds / wall:.0f}%" for seconds, key in top)
    return (f"{1e3 * wall / NEW_TOKENS:.2f} ms per step under the profiler: matrix products "
            f"{100 * matmul / wall:.0f}%, other operators {100 * (ops - matmul) / wall:.0f}% ({others}), outside "
            f"operators (Python, dispatch) {100 * max(wall - ops, 0) / wall:.0f}%")  # fmt: skip


def llama_answers(context, batch, vocab, streams):
    """llama.cpp's own batched decoding (what its server does with parallel slots): the prompts prefilled
    in one llama_decode, then one llama_decode per step with a token of each stream, each stream its own
    sequence; greedy argmax of its logits. Same return as enlace_answers."""
    import numpy as np

    def logits_row(index):
        return np.ctypeslib.as_array(context.get_logits_ith(index), shape=(vocab,))

    context.kv_cache_clear()
    batch.reset()
    for stream, ids in enumerate(prompts(vocab, streams)):
        batch.add_sequence(ids, stream, logits_all=False)
    context.decode(batch)
    chosen = [int(logits_row((stream + 1) * PROMPT_TOKENS - 1).argmax()) for stream in range(streams)]
    tokens = [[token] for token in chosen]
    start = time.perf_counter()
    for step in range(NEW_TOKENS):
        batch.reset()
        batch.batch.n_tokens = streams
        for stream, token in enumerate(chosen):
            batch.batch.token[stream], batch.batch.pos[stream] = token, PROMPT_TOKENS + step
            batch.batch.seq_id[stream][0], batch.batch.n_seq_id[stream] = stream, 1
            batch.batch.logits[stream] = True
        context.decode(batch)
        chosen = [int(logits_row(stream).argmax()) for stream in range(streams)]
        for stream, token in enumerate(chosen):
            tokens[stream].append(token)
    seconds = time.perf_counter() - start
    return streams * NEW_TOKENS / seconds, [stream[:NEW_TOKENS] for stream in tokens]


def llama_weights(path):
    """llama.cpp's model of a GGUF file (its backend initialised)."""
    import llama_cpp
    from llama_cpp import _internals

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    return _internals.LlamaModel(path_model=path, params=params, verbose=False)


def llama_context(weights, streams, seq_len, threads):
    """(context, batch) for `streams` sequences of up to seq_len positions each, the prompts of all of
    them prefilled in one llama_decode; llama.cpp's other settings are its defaults."""
    import llama_cpp
    from llama_cpp import _internals

    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_seq_max = streams * seq_len, streams
    params.n_batch = params.n_ubatch = streams * PROMPT_TOKENS
    params.n_threads = params.n_threads_batch = threads
    context = _internals.LlamaContext(model=weights, params=params, verbose=False)
    batch = _internals.LlamaBatch(n_tokens=streams * PROMPT_TOKENS, embd=0, n_seq_max=streams, verbose=False)
    return context, batch


def llama_rates(folder, shape, configuration, profile=False):
    dtype = configuration.split()[-1]
    path = os.path.join(folder, f"{shape}-{dtype}.gguf")
    cfg = torch.load(os.path.join(folder, f"{shape}.pt"), weights_only=True)["model"]
    weights = llama_weights(path)
    result = {"compile_s": 0.0}
    for streams in STREAMS:
        context, batch = llama_context(weights, streams, cfg["seq_len"], torch.get_num_threads())
        answers = timed_answers(llama_answers, context, batch, weights.n_vocab(), streams)
        result[str(streams)] = answers
        kv_width = cfg["n_kv_heads"] * (cfg["d_model"] // cfg["n_heads"])
        length = PROMPT_TOKENS + NEW_TOKENS // 2
        result[f"bytes{streams}"] = gguf_step_bytes(path, streams, length, cfg["n_layers"], kv_width)
        context.close()
        batch.close()
    weights.close()
    return result


def timed_answers(answers, *args):
    """Median tokens/s of REPEATS calls of answers(*args) after one warm-up call."""
    answers(*args)
    return statistics.median(answers(*args)[0] for _ in range(REPEATS))


# -----------------------------------------------------------------------------
# The table: rounds of fresh processes, each configuration's median and min-max over the rounds


def run_child(folder, shape, configuration, profile=False):
    return run_fresh(
        "bench.llama_cpp", "rate", folder, shape, configuration, *(["--profile"] if profile else [])
    )


def rounds_of(folder, shape, rounds, names=CONFIGURATIONS):
    """{configuration: [one fresh process's rates per round]}, the configurations taking turns."""
    rows = {name: [] for name in names}
    for index in range(rounds):
        for name in in_turns(names, index):
            rows[name].append(run_child(folder, shape, name, profile=index == 0))  # one op profile is enough
            print(f"llama: {shape} round {index + 1}: {name} done", file=sys.stderr, flush=True)
    return rows


def print_table(shape, rows, bandwidth):
    """One line per configuration and number of streams: tokens/s, MB read per step, the share of the
    bandwidth limit (bandwidth x streams / bytes per step) and the ratio to its llama.cpp peer round by
    round. (Both sides decode the same greedy tokens: tests/test_export.py checks it on trained weights;
    these random weights repeat one token.)"""
    cfg = layer("model", shape)
    rounds = len(next(iter(rows.values())))
    print(f"llama: {shape} shape (L{cfg['n_layers']} d{cfg['d_model']}, random weights), {NEW_TOKENS} greedy tokens "
          f"per stream after {PROMPT_TOKENS}-token prompts; tok/s: median (min-max) of {rounds} rounds, each a "
          f"fresh process taking the median of {REPEATS} answers")  # fmt: skip
    print(
        "llama:   configuration                 | streams | MB/step | tok/s               | limit share | x llama.cpp peer"
    )
    for name, runs in rows.items():
        for streams in STREAMS:
            rates = [run[str(streams)] for run in runs]
            per_step = runs[0][f"bytes{streams}"]
            share = 100 * statistics.median(rates) * per_step / (bandwidth * streams)
            peer, versus = PEER.get(name), ""
            if peer in rows:
                ratios = [mine / theirs[str(streams)] for mine, theirs in zip(rates, rows[peer], strict=True)]
                versus = spread(ratios, ".2f") + "x"
            print(f"llama:   {name:29s} | {streams:7d} | {per_step / 1e6:7.1f} | {spread(rates):19s} | "
                  f"{share:10.0f}% | {versus}")  # fmt: skip
    for name, runs in rows.items():
        if "profile" in runs[0]:
            print(f"llama:   where a step of {name} goes, 1 stream: {runs[0]['profile']}")
    for name in (name for name in rows if name.endswith("aot")):
        compiles = [run["compile_s"] for run in rows[name]]
        print(
            f"llama:   compiling the step of {name} for 1 and 8 slots took {spread(compiles)} s per process"
        )


def bench_llama(rounds=3, shapes=SHAPES, names=CONFIGURATIONS):
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llama: llama-cpp-python is not installed (make gguf-check installs it); no comparison")
        return
    with open("/proc/loadavg", encoding="utf-8") as f:
        load = f.read().split()[0]
    print(f"llama: load average {load} on {os.cpu_count()} CPUs, {torch.get_num_threads()} threads each side",
          flush=True)  # fmt: skip
    bandwidth = memory_bandwidth()
    print(f"llama: memory bandwidth (512 MiB copy, read + write, best of 5): {bandwidth / 1e9:.1f} GB/s")
    with tempfile.TemporaryDirectory(prefix="bench-llama-") as folder:
        tokenizer = smoke_corpus_tokenizer(folder)
        write_weights(folder, tokenizer)
        print(
            f"llama: vocabulary {tokenizer.vocab_size} (the smoke corpus's tokenizer) at both shapes",
            flush=True,
        )
        for shape in shapes:
            print_table(shape, rounds_of(folder, shape, rounds, names), bandwidth)


def main(argv):
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.llama_cpp", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    table = commands.add_parser("table", help="the whole comparison, in rounds of fresh processes")
    table.add_argument("--rounds", type=int, default=3, help="fresh processes per configuration (>= 2)")
    table.add_argument("--shape", action="append", choices=SHAPES, help="repeatable; default both")
    table.add_argument("--only", action="append", choices=CONFIGURATIONS, help="repeatable; default all")
    rate = commands.add_parser("rate", help="one configuration in this process: a JSON line")
    rate.add_argument("folder", help="where `table` wrote SHAPE.pt and the GGUF files")
    rate.add_argument("shape", choices=SHAPES)
    rate.add_argument("configuration", choices=CONFIGURATIONS)
    rate.add_argument("--profile", action="store_true", help="add where an eager step's time goes")
    args = parser.parse_args(argv)
    if args.command == "rate":
        rates = llama_rates if args.configuration.startswith("llama.cpp") else enlace_rates
        print(json.dumps(rates(args.folder, args.shape, args.configuration, args.profile)))
        return 0
    if args.rounds < 2:
        table.error(f"--rounds {args.rounds}: a spread needs at least 2 rounds")
    bench_llama(args.rounds, tuple(args.shape or SHAPES), tuple(args.only or CONFIGURATIONS))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
