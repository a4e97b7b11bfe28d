"""
`make bench ARGS=bandwidth` (also part of ARGS=serve): the machine's memory bandwidth, each decoding
configuration against the limit it sets, the time to first token with the prefix cache, the held-out bits
per byte of int8 weights; and the run the serve benches load.
"""

import contextlib
import os
import statistics
import tempfile
import time

import torch

import config
import data
import model
import train
from bench.common import ROOT, layer, timed
from corpus import pipeline
from decode import engine, kvcache
from decode.kernel import KernelUnavailable
from decode.weights import KernelLinear, SplitLinear, split_matvec, with_kernels


def serve_bench_run(folder, shipped=True):
    """runs/smoke-corpus-cpu when it exists (make smoke-corpus) and `shipped`, else a 2-step run of the
    smoke model shape on a small 512-token BPE of the embedded corpus, built in `folder` (about a minute;
    its near-uniform next-token choices rarely end an answer before max_tokens)."""
    path = os.path.join(ROOT, "runs", "smoke-corpus-cpu")
    if shipped and os.path.isdir(path):
        return path
    if os.path.isdir(os.path.join(folder, "runs", "smoke-corpus-cpu")):
        return os.path.join(folder, "runs", "smoke-corpus-cpu")
    if shipped:
        print(
            "serve: runs/smoke-corpus-cpu not found (make smoke-corpus); training a 2-step stand-in",
            flush=True,
        )
    overrides = [f"data.dir={folder}/data", "data.corpus.max_documents_per_file=400",
                 "data.tokenizer.vocab_size=512", "model.vocab_size=512", "data.encode.tokens_per_shard=8000",
                 f"train.runs_dir={folder}/runs", "train.max_steps=2", "train.warmup_steps=0",
                 "train.eval_interval=0", "train.sample_tokens=0"]  # fmt: skip
    cfg = config.load(os.path.join(ROOT, "configs", "smoke-corpus-cpu.yaml"), overrides)
    quiet = lambda *args, **kwargs: None  # noqa: E731
    pipeline.build_corpus(cfg["data"], log=quiet)
    pipeline.train_tokenizer(cfg["data"], log=quiet)
    pipeline.encode(cfg["data"], log=quiet)
    train.train(cfg, log=quiet)
    return os.path.join(folder, "runs", cfg["run_name"])


def memory_bandwidth(size_mib=512, repeats=5):
    """Bytes per second of a large copy (read + write), the best of `repeats`: the rate no decoding step,
    which reads every weight once per token, can beat."""
    source = torch.ones(size_mib * 2**20 // 4)
    target = torch.empty_like(source)
    target.copy_(source)
    best = min(timed(target.copy_, source)[1] for _ in range(repeats))
    return 2 * source.nbytes / best


def step_bytes(net, slots, length):
    """Bytes one decode step reads: every weight but the embedding (looked up, one row per slot) and the
    keys and values of `slots` rows of `length` positions."""
    weights = 0
    for module in net.modules():
        if isinstance(module, (torch.nn.Linear, SplitLinear)):
            weights += module.weight.nbytes
        elif isinstance(module, KernelLinear):  # float32, or int8 with a float32 scale per row
            weights += module.weight.nbytes + (0 if module.scale is None else module.scale.nbytes)
    return weights + kvcache.kv_cache_bytes(net, slots) * length // net.seq_len


def random_prompts(vocab, streams, length=32):
    """`streams` prompts of `length` random ids, the same in every process (rates do not depend on text)."""
    return [torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(i)).tolist()
            for i in range(streams)]  # fmt: skip


def greedy_answers(decoder, prompts, new_tokens):
    """(tokens/s, each row's tokens) of new_tokens greedy decoding steps of one row per prompt, decoded
    together by `decoder` (prefills excluded); the rows are removed afterwards."""
    rows = [decoder.add(ids, temperature=0) for ids in prompts]
    tokens = [[] for _ in rows]
    start = time.perf_counter()
    for _ in range(new_tokens):
        chosen = decoder.sample_rows(rows)
        for index, row in enumerate(rows):
            tokens[index].append(chosen[row])
        decoder.advance(chosen)
    seconds = time.perf_counter() - start
    for row in rows:
        decoder.remove(row)
    return len(rows) * new_tokens / seconds, tokens


def decode_rate(net, streams, new_tokens):
    """Tokens/s of `streams` greedy answers of new_tokens after 32-token prompts, decoded together by an
    eager engine.Decoder of `streams` slots, prefills excluded."""
    decoder = engine.Decoder(net, streams, allocate=True)
    return greedy_answers(decoder, random_prompts(net.cfg["vocab_size"], streams), new_tokens)[0]


def bandwidth_table(label, net, bandwidth, new_tokens, repeats):
    """Each decoding configuration's tokens/s at 1 and 8 streams, and as a share of the memory-bandwidth
    limit (bandwidth x streams / bytes per step); configurations interleave, medians and ranges of repeats."""
    split = split_matvec(net, torch.get_num_threads(), 8)
    configurations = {"float32 eager": net, "float32 split products": split}
    try:  # serve.matvec_kernel, as the server runs a CPU by default (the step ahead of time: ARGS=llama)
        for dtype in ("float32", "int8"):
            configurations[f"{dtype} kernel"] = with_kernels(net, dtype, 8)
    except KernelUnavailable as e:
        print(f"serve: no kernel rows: {e}", flush=True)
    started = time.perf_counter()
    for weights in configurations.values():
        decode_rate(weights, 1, 2)  # warm-up
        decode_rate(weights, 8, 2)
    print(f"serve: {label}: warm-up {time.perf_counter() - started:.0f} s", flush=True)
    rates = {(name, streams): [] for name in configurations for streams in (1, 8)}
    for _ in range(repeats):
        for name, streams in rates:
            rates[(name, streams)].append(decode_rate(configurations[name], streams, new_tokens))
    print(f"serve: decoding against the memory-bandwidth limit, {label}, answers of {new_tokens} tokens after "
          f"32-token prompts, median [min-max] of {repeats}:")  # fmt: skip
    print(
        "serve:   configuration               | streams | MB per step | tokens/s            | limit tok/s | share"
    )
    for (name, streams), values in rates.items():
        per_step = step_bytes(configurations[name], streams, 32 + new_tokens // 2)
        limit = bandwidth * streams / per_step
        rate = statistics.median(values)
        print(f"serve:   {name:27s} | {streams:7d} | {per_step / 1e6:11.1f} | {rate:7.1f} [{min(values):.0f}-"
              f"{max(values):.0f}] | {limit:11.0f} | {100 * rate / limit:4.1f}%")  # fmt: skip


def first_token_seconds(net, tokenizer, repeats):
    """Time to the first token of a chat prompt whose system turn is the server's (system prompt, date and
    agent tools), with and without the prefix cache (its blocks cached by an earlier request of another
    member), medians of `repeats` different user messages; `net` needs a context that holds the prompt
    (a longer one restarts its window and shares nothing). Returns (prompt tokens, without, with)."""
    from agent import tools
    from chat import template

    settings = config.load_layer("serve", os.path.join(ROOT, "configs", "serve", "default.yaml"))
    helper = tools.Agent(tools.load_settings())
    head = [{"role": "system", "content": settings["system_prompt"]}]
    public = template.render(helper.conversation(head), tokenizer)[0]
    cache = settings["prefix_cache"]
    options = {"prefix_block": cache["block_tokens"], "prefix_cache_bytes": cache["mib"] * 2**20}

    def prompt(index):
        turn = [{"role": "user", "content": f"Pregunta número {index}: ¿qué tiempo hará mañana en Sevilla?"}]
        return template.render(helper.conversation(head + turn), tokenizer, for_generation=True)[0]

    def first_token(decoder, ids, **scoping):
        start = time.perf_counter()
        row = decoder.add(ids, temperature=0, **scoping)
        decoder.sample(row)
        seconds = time.perf_counter() - start
        decoder.remove(row)
        return seconds

    plain, cached = engine.Decoder(net, 1, allocate=True), engine.Decoder(net, 1, allocate=True, **options)
    first_token(cached, prompt(-1), scope="other", shared=len(public))  # fills the public blocks
    without = statistics.median(first_token(plain, prompt(i)) for i in range(repeats))
    with_cache = statistics.median(
        first_token(cached, prompt(i), scope="me", shared=len(public)) for i in range(repeats)
    )
    return len(prompt(0)), without, with_cache


def held_out_bpb(net, cfg, tokenizer, max_tokens):
    """Bits per byte of the first max_tokens tokens of the run's val split (evaluation.bpb.evaluate_tokens)."""
    from evaluation import bpb

    tokens = torch.as_tensor(data.load_split_tokens(cfg["data"], "val").astype("int64"))[:max_tokens]
    nats, _, num_bytes = bpb.evaluate_tokens(net, tokens, tokenizer.token_bytes, max(1, net.seq_len // 2))
    return nats / (0.6931471805599453 * max(num_bytes, 1))


def bench_decoding(new_tokens=64, repeats=3):
    """`make bench ARGS=bandwidth`'s table (also part of ARGS=serve): the machine's memory bandwidth, each
    decoding configuration against the limit it sets, the time to first token with the prefix cache, and
    the held-out bits per byte of int8 weights against float32."""
    import checkpoint

    print(f"serve: load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs, torch with "
          f"{torch.get_num_threads()} threads", flush=True)  # fmt: skip
    bandwidth = memory_bandwidth()
    print(
        f"serve: memory bandwidth (512 MiB copy, read + write, best of 5): {bandwidth / 1e9:.1f} GB/s",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="bench-decode-") as folder:
        run = serve_bench_run(folder)
        smoke, cfg, tokenizer, _ = checkpoint.load_run(run, log=lambda message: None)
        torch.manual_seed(0)
        tiny = model.Transformer(
            layer("model", "tiny-50m")
        ).eval()  # random weights: rates do not depend on them
        with torch.no_grad():
            for label, net in ((os.path.basename(run), smoke), ("tiny-50m (random weights)", tiny)):
                bandwidth_table(label, net, bandwidth, new_tokens, repeats)
            length, without, with_cache = first_token_seconds(tiny, tokenizer, 5)  # the smoke context is 256
            print(f"serve: time to first token, {length}-token prompt (system prompt + date + tools + question, "
                  f"{os.path.basename(run)}'s tokenizer), tiny-50m: {1e3 * without:.0f} ms without the prefix cache, "
                  f"{1e3 * with_cache:.0f} ms with it -> {with_cache / without:.2f} (target <= 0.3)")  # fmt: skip
            f32 = held_out_bpb(smoke, cfg, tokenizer, 20_000)
            with contextlib.suppress(KernelUnavailable):
                bpb = held_out_bpb(with_kernels(smoke, "int8", 8), cfg, tokenizer, 20_000)
                print(f"serve: held-out bpb (val, first 20,000 tokens), {os.path.basename(run)}: float32 {f32:.4f}, "
                      f"int8 weights (the kernel's) {bpb:.4f} -> {100 * (bpb / f32 - 1):+.2f}% (target within 1%)")  # fmt: skip
    print("serve: llama.cpp f32/q8_0 side by side on the same weights: make bench ARGS=llama (needs "
          "llama-cpp-python: make gguf-check)")  # fmt: skip
    print(f"serve: load average {os.getloadavg()[0]:.1f} at the end", flush=True)
