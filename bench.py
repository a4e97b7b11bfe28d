"""
Benchmarks: `python bench.py [SECTION ...]` (`make bench`) runs the named sections, or all of them.
Each section is a top-level bench_<name>() that prints its figures; timing lives here, never in tests.
"""

import collections
import gzip
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import yaml
from torch.profiler import profile

import config
import corpus
import corpus_docs
import data
import fileio
import model
import search
import train

ROOT = os.path.dirname(os.path.abspath(__file__))


# -----------------------------------------------------------------------------
# model: training throughput against transformers' Qwen3 at the same shapes, MFU, where the time goes


def layer(kind, name):
    with open(os.path.join(ROOT, "configs", kind, f"{name}.yaml"), encoding="utf-8") as f:
        return yaml.safe_load(f)[kind]


def qwen3_twin(model_cfg):
    """transformers' Qwen3ForCausalLM with our config (export.hf_config's mapping), random init."""
    from transformers import Qwen3Config, Qwen3ForCausalLM  # a development dependency: only this bench

    import export

    hf_cfg = Qwen3Config.from_dict(export.hf_config({"model": model_cfg}, "f32"), use_cache=False)
    return Qwen3ForCausalLM(hf_cfg)


def training_steps(model_cfg, batch_size, contenders, train_cfg, warmup, rounds):
    """Seconds per optimizer step (forward + backward + the trainer's AdamW) of each contender on the same
    random tokens, timed in interleaved rounds so a neighbour process slows all of them alike. contenders:
    {label: (module, loss_of(module, idx, targets))}. Returns {label: [seconds, ...]} and the step fns."""
    idx = torch.randint(0, model_cfg["vocab_size"], (batch_size, model_cfg["seq_len"]))
    targets = torch.randint(0, model_cfg["vocab_size"], (batch_size, model_cfg["seq_len"]))
    steps = {}
    for label, (net, loss_of) in contenders.items():
        optimizer = train.build_optimizer(net, train_cfg, torch.device("cpu"))

        def step(net=net, loss_of=loss_of, optimizer=optimizer):
            loss_of(net, idx, targets).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        steps[label] = step
    times = {label: [] for label in contenders}
    for round_index in range(warmup + rounds):
        for label, step in steps.items():
            start = time.perf_counter()
            step()
            if round_index >= warmup:
                times[label].append(time.perf_counter() - start)
    return times, steps


def compile_seconds(compiled, model_cfg, batch_size):
    """Seconds of the first two forward + backward passes of a torch.compile'd model: the compile (the
    second pass may still recompile for the training-mode guards), not yet steady training."""
    idx = torch.randint(0, model_cfg["vocab_size"], (batch_size, model_cfg["seq_len"]))
    start = time.perf_counter()
    for _ in range(2):
        enlace_loss(compiled, idx, idx).backward()
    compiled.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def where_time_goes(step, top=6):
    """Share of one step's CPU time per aten op, largest first."""
    with profile() as prof:
        step()
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return ", ".join(f"{e.key[6:]} {100 * e.self_cpu_time_total / total:.0f}%" for e in events[:top])


def bench_model():
    """ENLACE as the cpu profile trains it, the same model with the math kernel and torch.compile'd, and
    transformers' Qwen3 built from the same config, trained with the same AdamW on the same tokens. The
    MFU divides by train.measure_peak_tflops, the figure a run's log uses."""
    profile_cfg = layer("hardware", "cpu")
    shapes = [("smoke", layer("train", "smoke")["micro_batch_size"], 2, 5), ("tiny-50m", 1, 1, 3)]
    print(f"model: timing {len(shapes)} shapes x 4 contenders between two matmul peaks (minutes)", flush=True)
    # Measured before and after the steps and the higher one kept: a neighbour process that slows one
    # measurement must not shrink the peak and so flatter the MFU.
    peak = train.measure_peak_tflops(torch.device("cpu")) * 1e12
    backend = profile_cfg["attention_backend"]
    results = []
    for name, batch_size, warmup, rounds in shapes:
        cfg = layer("model", name)
        torch.manual_seed(0)
        contenders = {
            f"ENLACE ({backend}, cpu profile)": (model.Transformer(cfg, backend), enlace_loss),
            "ENLACE (math)": (model.Transformer(cfg, "math"), enlace_loss),
            "transformers Qwen3": (qwen3_twin(cfg), qwen3_loss),
        }
        # hardware.compile: true on the same model; its first two steps (the compile) timed apart, with an
        # empty inductor cache, as a first run sees it (a warm cache makes it look 5x cheaper).
        compiled = torch.compile(model.Transformer(cfg, backend))
        with tempfile.TemporaryDirectory(prefix="bench-inductor-") as cache:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
            try:
                compile_s = compile_seconds(compiled, cfg, batch_size)
            finally:
                del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        contenders[f"ENLACE ({backend}, compiled)"] = (compiled, enlace_loss)
        times, steps = training_steps(cfg, batch_size, contenders, layer("train", "smoke"), warmup, rounds)
        first = next(iter(contenders))
        flops_per_token = contenders[first][0].flops_per_token(cfg["seq_len"])
        params = contenders[first][0].num_params()
        rates = {label: batch_size * cfg["seq_len"] / statistics.median(t) for label, t in times.items()}
        breakdown = where_time_goes(steps[first])
        results.append((name, batch_size, cfg, params, flops_per_token, rates, rounds, breakdown, compile_s))
    peak = max(peak, train.measure_peak_tflops(torch.device("cpu")) * 1e12)
    print(f"model: float32 matmul peak {peak / 1e9:.1f} GFLOP/s ({torch.get_num_threads()} threads)")
    for name, batch_size, cfg, params, flops_per_token, rates, rounds, breakdown, compile_s in results:
        print(
            f"model: {name} B={batch_size} T={cfg['seq_len']} | {params / 1e6:.1f}M params | median of {rounds}"
        )
        reference = rates["transformers Qwen3"]
        for label, rate in rates.items():
            print(
                f"model:   {label:28s} {rate:8,.0f} tok/s | MFU {100 * flops_per_token * rate / peak:3.0f}% | "
                f"{rate / reference:.2f}x transformers"
            )
        print(f"model:   time per op (cpu profile): {breakdown}")
        eager_s, compiled_s = (
            batch_size * cfg["seq_len"] / rates[f"ENLACE ({backend}, {kind})"]
            for kind in ("cpu profile", "compiled")
        )
        overhead_s = compile_s - 2 * compiled_s  # the two compiling passes less two ordinary steps
        pays = (
            f"pays for itself after {overhead_s / (eager_s - compiled_s):,.0f} steps"
            if compiled_s < eager_s
            else "never pays"
        )
        print(f"model:   torch.compile: {overhead_s:.0f} s of compiling before the first step, {pays}")


def enlace_loss(net, idx, targets):
    return net(idx, targets)[1]["loss"]


def qwen3_loss(net, idx, targets):
    # shift_labels: position t predicts targets[t], as in ENLACE (labels alone would be shifted by one).
    return net(input_ids=idx, labels=targets, shift_labels=targets).loss


# -----------------------------------------------------------------------------
# decode: generation with the KV cache against a full forward pass per token, and past seq_len


def decode_rates(net, prompt, new_tokens):
    """(seconds to the first token, tokens/s after it) of greedy model.generate with the KV cache."""
    start = time.perf_counter()
    stream = net.generate(prompt, new_tokens, temperature=0)
    next(stream)
    first = time.perf_counter()
    rest = sum(1 for _ in stream)
    return first - start, rest / (time.perf_counter() - first)


def uncached_rate(net, prompt, new_tokens):
    """Tokens/s of greedy decoding without a cache: a full forward pass over the last seq_len tokens per
    token (nanoGPT's sample loop)."""
    sequence = prompt.tolist()
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(new_tokens):
            logits, _ = net(torch.tensor([sequence[-net.seq_len :]]))
            sequence.append(int(logits[0, -1].argmax()))
    return new_tokens / (time.perf_counter() - start)


def bench_decode():
    """tiny-50m (random weights, the cpu profile's kernel) at 128 and ~1024 tokens of context, and the
    smoke model generating 4 x seq_len tokens, which makes generate restart its cache every seq_len / 2."""
    backend = layer("hardware", "cpu")["attention_backend"]
    torch.manual_seed(0)
    tiny = model.Transformer(layer("model", "tiny-50m"), backend).eval()
    generated, uncached_tokens = 32, 4
    for context in (128, tiny.seq_len):
        prompt = torch.randint(0, tiny.cfg["vocab_size"], (context - generated,))
        first_s, cached = decode_rates(tiny, prompt, generated)
        uncached = uncached_rate(tiny, prompt, uncached_tokens)
        print(
            f"decode: tiny-50m, {context - generated}-token prompt + {generated} new | KV cache "
            f"{cached:,.1f} tok/s (prefill {first_s:.2f}s) | no cache {uncached:,.2f} tok/s | "
            f"cache {cached / uncached:,.0f}x faster"
        )
    smoke = model.Transformer(layer("model", "smoke"), backend).eval()
    long_run = 4 * smoke.seq_len
    prompt = torch.randint(0, 256, (16,))
    first_s, cached = decode_rates(smoke, prompt, long_run)
    uncached = uncached_rate(smoke, prompt[-1:].repeat(smoke.seq_len), 16)  # a full window per token
    print(
        f"decode: smoke model, {long_run} tokens from a 16-token prompt (seq_len {smoke.seq_len}) | "
        f"{cached:,.0f} tok/s | a full window per token (what each step past seq_len cost before) "
        f"{uncached:,.0f} tok/s"
    )


# -----------------------------------------------------------------------------
# data: corpus pipeline throughput against raw sentencepiece, tokenizer quality


def cpu_seconds():
    """CPU time of this process and of its finished, waited-for children, user + system."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def timed(function, *args, **kwargs):
    """(result, wall seconds, CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), cpu_seconds()
    result = function(*args, **kwargs)
    return result, time.perf_counter() - wall, cpu_seconds() - cpu


def bench_data():
    """The stage-1 pipeline on novelas-cligs (beside the repo) with a 32k BPE, or on the embedded corpus
    with a 4k BPE when it is absent. Rates are MB of UTF-8 text per second of wall time, and per CPU-second
    (this process and its workers), which other load on the machine disturbs far less."""
    novelas = os.path.join(ROOT, "..", "shared", "corpus", "novelas-cligs.jsonl.gz")
    quiet = lambda *args: None  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="bench-data-") as folder:
        if os.path.exists(novelas):
            data_cfg = data_layer("corpus")
            data_cfg["corpus"]["sources"] = [data_cfg["corpus"]["sources"][0] | {"path": novelas}]
            data_cfg["corpus"]["sources"][0].pop("weight")
            data_cfg["corpus"]["sources"][0]["epochs"] = 1
        else:
            print(
                "data: ../shared/corpus/novelas-cligs.jsonl.gz not found; using the embedded corpus (4k BPE)"
            )
            data_cfg = data_layer("corpus-smoke")
            data_cfg["corpus"]["sources"] = data_cfg["corpus"]["sources"][:2]
        data_cfg["dir"] = folder
        # One process: datatrove's pool workers are children of its forkserver, so getrusage never sees
        # their CPU time, and the per-CPU-second rates would flatter the corpus step.
        data_cfg["processes"] = 1
        processes = corpus_docs.processes_of(data_cfg)

        # Three runs of the corpus and encode steps (and of raw sentencepiece), the median of each kept:
        # one run on a shared machine can be off by a third. The tokenizer is trained once.
        runs = []
        for attempt in range(3):
            if attempt:  # forget the finished steps (manifest entries, filter tasks): nothing is skipped
                shutil.rmtree(os.path.join(folder, "work"), ignore_errors=True)
                manifest = data.read_manifest(data_cfg)
                manifest.pop("corpus"), manifest.pop("encode")
                fileio.write_json(data.manifest_path(data_cfg), manifest)
            stats, corpus_wall, corpus_cpu = timed(corpus.build_corpus, data_cfg, log=quiet)
            if not attempt:
                _, tokenizer_wall, _ = timed(corpus.train_tokenizer, data_cfg, log=quiet)
                tokenizer = data.load_tokenizer(data_cfg)
                texts = [
                    t
                    for split in data.SPLITS
                    for t in corpus_docs.iter_documents(corpus_docs.docs_path(data_cfg, split))
                ]
                lines = [line for text in texts for line in text.split("\n")]
            _, encode_wall, encode_cpu = timed(corpus.encode, data_cfg, log=quiet)
            _, raw_wall, raw_cpu = timed(tokenizer.processor.encode, lines, num_threads=1)
            runs.append((corpus_wall, corpus_cpu, encode_wall, encode_cpu, raw_wall, raw_cpu))
        corpus_wall, corpus_cpu, encode_wall, encode_cpu, raw_wall, raw_cpu = map(
            statistics.median, zip(*runs, strict=True)
        )
        megabytes = stats["bytes_out"] / 1e6  # UTF-8 text of the kept documents, both splits

        val = list(corpus_docs.iter_documents(corpus_docs.docs_path(data_cfg, "val")))
        val_tokens = [tokenizer.encode(text) for text in val]
        chars_per_token = sum(map(len, val)) / sum(map(len, val_tokens))
        bytes_per_token = sum(len(t.encode("utf-8")) for t in val) / sum(map(len, val_tokens))
        exact = sum(tokenizer.decode(ids) == text for ids, text in zip(val_tokens, val, strict=True))

    raw_rate, raw_rate_cpu = megabytes / raw_wall, megabytes / raw_cpu
    pipeline_rate = megabytes / (corpus_wall + encode_wall)
    pipeline_rate_cpu = megabytes / (corpus_cpu + encode_cpu)
    encode_rate_cpu = megabytes / encode_cpu
    print(
        f"data: {stats['documents_out']:,} documents, {megabytes:.1f} MB of text, {processes} processes, "
        f"{tokenizer.vocab_size:,}-token BPE, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
        f"medians of {len(runs)} runs"
    )
    print(
        f"data: corpus step {megabytes / corpus_wall:.1f} MB/s ({megabytes / corpus_cpu:.1f} MB per CPU-s) | "
        f"tokenizer training {tokenizer_wall:.1f}s | encode step {megabytes / encode_wall:.1f} MB/s "
        f"({encode_rate_cpu:.1f} MB per CPU-s)"
    )
    print(
        f"data: pipeline end to end (corpus + encode) {pipeline_rate:.1f} MB/s, {pipeline_rate / processes:.1f} "
        f"MB/s per process | raw sentencepiece encode on one core {raw_rate:.1f} MB/s ({raw_rate_cpu:.1f} MB per "
        f"CPU-s)"
    )
    print(
        f"data: per core the pipeline keeps {100 * pipeline_rate_cpu / raw_rate_cpu:.0f}% of raw sentencepiece "
        f"(CPU time; the encode step alone {100 * encode_rate_cpu / raw_rate_cpu:.0f}%), "
        f"{100 * pipeline_rate / processes / raw_rate:.0f}% by wall time per process"
    )
    print(
        f"data: val split {len(val):,} documents: {chars_per_token:.2f} characters/token, {bytes_per_token:.2f} "
        f"bytes/token; decode(encode(x)) == x for {exact}/{len(val)} documents"
    )


def data_layer(name):
    """A shipped configs/data/<name>.yaml with the base layer it includes."""
    import config

    return config.load_layer("data", os.path.join(ROOT, "configs", "data", f"{name}.yaml"))


# -----------------------------------------------------------------------------
# corpus: CPU cost of each stage-1 stage against encoding, and the language-ID calibration


LOCALE_LANGUAGES = {"es": ["es"], "pt": ["pt", "pt_BR"], "ca": ["ca"], "gl": ["gl"], "it": ["it"]}


def translated_texts(language, chars=400, limit=300):
    """Documents of about `chars` characters in one language from Debian's translations on this machine:
    the msgstr sentences of /usr/share/locale/*/LC_MESSAGES/*.mo (lists of names left out) and the text of
    /usr/share/man/*/ pages, at most `limit` of each kind."""
    import gettext
    import glob
    import gzip
    import re

    documents = []
    for folder in LOCALE_LANGUAGES[language]:
        pieces = []
        for path in sorted(glob.glob(f"/usr/share/locale/{folder}/LC_MESSAGES/*.mo")):
            if os.path.basename(path).startswith("iso_"):
                continue
            try:
                with open(path, "rb") as f:
                    catalog = gettext.GNUTranslations(f)._catalog
            except (OSError, ValueError):  # a catalog in another charset or a damaged one
                continue
            for value in catalog.values():
                text = re.sub(r"%[-+ #0-9.]*[a-zA-Z]|\{\w*\}|[_&]", "", str(value)).replace("\n", " ").strip()
                if len(text.split()) >= 5:
                    pieces.append(text)
        page_pieces = []
        for path in sorted(glob.glob(f"/usr/share/man/{folder}/man*/*.gz")):
            with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
                lines = [line for line in f if line.strip() and not line.startswith((".", "'"))]
            page_pieces.append(re.sub(r"\\f[BIRP]|\\[-e&(]\S?", "", " ".join(lines)))
        for source in (pieces, page_pieces):
            text, count = "", 0
            for piece in source:
                text += " " + piece
                if len(text) >= chars:
                    documents.append(text.strip()[: chars * 2])
                    text, count = "", count + 1
                    if count >= limit:
                        break
    return documents


def bench_language_id():
    """Precision and recall of 'Spanish at py3langid probability >= t' on Spanish against Portuguese,
    Catalan, Galician and Italian documents from the machine's translations."""
    import corpus_filters

    texts = {language: translated_texts(language) for language in LOCALE_LANGUAGES}
    if not texts["es"]:
        print("corpus: no Debian translations under /usr/share/locale; language-ID calibration skipped")
        return
    stage = corpus_filters.LanguageStage({"languages": ["es"], "min_score": 0, "max_chars": 10_000})
    scored = [(language, *stage.score(text)) for language, items in texts.items() for text in items]
    print(
        "corpus: language-ID calibration documents: " + ", ".join(f"{k} {len(v)}" for k, v in texts.items())
    )
    missed = collections.Counter(found for truth, found, _ in scored if truth == "es" and found != "es")
    print(f"corpus: Spanish documents identified as another language: {dict(missed) or 'none'}")
    for threshold in (0.0, 0.5, 0.8, 0.9, 0.95, 0.99, 0.999):
        predicted = [(truth, found == "es" and score >= threshold) for truth, found, score in scored]
        true_positive = sum(truth == "es" and yes for truth, yes in predicted)
        precision = true_positive / max(1, sum(yes for _, yes in predicted))
        recall = true_positive / len(texts["es"])
        wrong = collections.Counter(truth for truth, yes in predicted if yes and truth != "es")
        print(
            f"corpus: language-ID min_score {threshold:<5} precision {precision:.3f} recall {recall:.3f} "
            f"(accepted as Spanish: {dict(wrong) or 'no other language'})"
        )


def bench_word_split(texts, cfg):
    """The datatrove filters' verdicts and CPU time with corpus_filters.RegexWords against datatrove's spaCy
    tokenizer (FineWeb-2's word split for spa_Latn), on ~2,000-character slices of the texts."""
    import corpus_filters

    try:
        import spacy  # noqa: F401
    except ImportError:
        print("corpus: spaCy is not installed (pip install spacy==3.8.18); word-split comparison skipped")
        return
    import datatrove.utils.text

    slices = [text[i : i + 2000] for text in texts for i in range(0, min(len(text), 60_000), 2000)]
    verdicts, seconds = {}, {}
    for name in ("regex", "spacy"):
        stages = corpus_filters.quality_stages(cfg["filters"] | {"word_tokenizer": name})
        datatrove.utils.text.split_into_parts.cache_clear()
        start = time.process_time()
        verdicts[name] = [[stage(corpus_filters.document(s))[0] for stage in stages] for s in slices]
        seconds[name] = time.process_time() - start
    same = sum(a == b for a, b in zip(verdicts["regex"], verdicts["spacy"], strict=True))
    kept = {name: sum(all(v) for v in verdicts[name]) for name in verdicts}
    print(
        f"corpus: word split regex vs spaCy on {len(slices)} slices of 2,000 characters: the three filters agree "
        f"on {100 * same / len(slices):.1f}% (kept {kept['regex']} vs {kept['spacy']}); regex is "
        f"{seconds['spacy'] / seconds['regex']:.0f}x faster ({seconds['regex']:.1f} vs {seconds['spacy']:.1f} CPU-s)"
    )


def bench_corpus():
    """CPU seconds per stage on the same novelas text, single-threaded, as MB per CPU-second; the ratio of
    filters + near-dedup to encoding with a 32k BPE (trained here on the same text)."""
    import corpus
    import corpus_encode
    import corpus_filters

    bench_language_id()
    novelas = os.path.join(ROOT, "..", "shared", "corpus", "novelas-cligs.jsonl.gz")
    if not os.path.exists(novelas):
        print("corpus: ../shared/corpus/novelas-cligs.jsonl.gz not found; stage timings skipped")
        return
    cfg = data_layer("corpus")["corpus"]
    limit = int(os.environ.get("BENCH_CORPUS_DOCS", "20"))  # novels timed (83 in all)
    with gzip.open(novelas, "rt", encoding="utf-8") as f:
        texts = [
            corpus.clean_text(json.loads(line)["text"]) for _, line in zip(range(limit), f, strict=False)
        ]
    bench_word_split(texts, cfg)
    megabytes = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    documents = [corpus_filters.document(t) for t in texts]
    stages = {"language": corpus_filters.LanguageStage(cfg["filters"]["language"])}
    stages |= {stage.name: stage for stage in corpus_filters.quality_stages(cfg["filters"])}
    words = corpus_filters.word_splitter(cfg["filters"]["word_tokenizer"])
    hasher = corpus_filters.MinHasher(cfg["near_dedup"], words)
    scrub = corpus_filters.PiiScrubber(cfg["pii"])
    guard = corpus_filters.Decontaminator(
        cfg["decontamination"]["ngram"], None, cfg["decontamination"]["val_max_overlap"]
    )
    seconds = {}

    def timed_cpu(name, function):
        start = time.process_time()
        for item in documents:
            function(item)
        seconds[name] = time.process_time() - start

    timed_cpu("clean", lambda d: corpus.clean_text(d.text))
    for name, stage in stages.items():
        # each filter alone: datatrove caches the word split of the last texts, which would flatter
        # whichever filter runs second
        import datatrove.utils.text

        datatrove.utils.text.split_into_parts.cache_clear()
        timed_cpu(name, stage)
    timed_cpu("pii", lambda d: scrub(d.text))
    timed_cpu("minhash", lambda d: hasher.bucket_keys(d.text))
    timed_cpu("decontamination", lambda d: guard.hit(d.text))
    with tempfile.TemporaryDirectory(prefix="bench-corpus-") as folder:
        import sentencepiece as spm

        data_cfg = data_layer("corpus")
        settings = corpus_encode.trainer_settings(data_cfg)
        model = os.path.join(folder, "bpe.model")
        lines = (line for text in texts for line in text.split("\n") if line.strip())
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines, model_prefix=model[:-6], minloglevel=2, input_sentence_size=0, **settings
        )
        tokenizer = data.SentencePieceTokenizer(model)
        timed_cpu("encode (32k BPE)", lambda d: tokenizer.encode(d.text))
    filters = sum(seconds[name] for name in ("clean", *stages, "pii", "minhash", "decontamination"))
    print(f"corpus: {len(texts)} novels of novelas-cligs, {megabytes:.1f} MB, one core (CPU time)")
    for name, spent in seconds.items():
        print(f"corpus:   {name:<20s} {megabytes / spent:7.2f} MB per CPU-s")
    encode = seconds["encode (32k BPE)"]
    print(
        f"corpus: clean + filters + PII + MinHash + decontamination {megabytes / filters:.2f} MB per CPU-s; "
        f"encode {megabytes / encode:.2f} MB per CPU-s: the stages cost {filters / encode:.1f}x the encode step"
    )


# -----------------------------------------------------------------------------
# search: parse time per page, and what the provider chain costs when the primary answers


def serve_fixture(body, content_type):
    """A keep-alive HTTP server on 127.0.0.1 answering every GET and POST with one body; returns it."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the PoolManager would get from the real services
        disable_nagle_algorithm = True  # headers and body go out as two writes: no 40 ms delayed-ACK stall

        def answer(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = answer

        def log_message(self, format, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def per_call_seconds(function, repeats):
    """Median seconds of one call over `repeats` calls, after one warm-up call."""
    function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_search():
    fixtures = os.path.join(ROOT, "tests", "fixtures", "search")
    with open(os.path.join(fixtures, "ddg_lite_results.html"), "rb") as f:
        lite_page = f.read()
    with open(os.path.join(fixtures, "brave_web_results.json"), "rb") as f:
        brave_body = f.read()
    lite_text = lite_page.decode("utf-8")

    lite_s = per_call_seconds(lambda: search.parse_ddg_lite(lite_text), 300)
    brave_s = per_call_seconds(lambda: search.parse_brave(brave_body), 300)
    print(
        f"search: parse DuckDuckGo lite page ({len(lite_page) / 1024:.1f} KiB, 10 results) "
        f"{1e3 * lite_s:.2f} ms/page | Brave JSON ({len(brave_body) / 1024:.1f} KiB, 19 results) "
        f"{1e3 * brave_s:.2f} ms/answer (median of 300)"
    )

    # The chain is the auto chain (DuckDuckGo, then Brave); DuckDuckGo answers, so Brave is never asked.
    # Both paths share one pool and one server, and alternate, so drift on a busy machine hits both alike.
    server = serve_fixture(lite_page, "text/html; charset=UTF-8")
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/lite/"
        env = {"ENLACE_DDG_URL": url, "ENLACE_BRAVE_URL": url, "BRAVE_API_KEY": "bench-not-a-key"}
        chain = search.SearchChain.from_env("auto", env=env)
        ddg = chain.providers[0]
        region = search.parse_region("es-es")
        via_chain = lambda: chain.search("weather san francisco", 10, "es-es")  # noqa: E731
        direct = lambda: ddg.search("weather san francisco", 10, region)  # noqa: E731
        chain_times, direct_times = [], []
        for _ in range(5):
            chain_times.append(per_call_seconds(via_chain, 40))
            direct_times.append(per_call_seconds(direct, 40))
        chain_s, direct_s = statistics.median(chain_times), statistics.median(direct_times)
        answer = via_chain()
    finally:
        server.shutdown()
        server.server_close()
    print(
        f"search: query against a local server: via the chain {1e3 * chain_s:.2f} ms, DuckDuckGo provider "
        f"directly {1e3 * direct_s:.2f} ms -> chain/direct {chain_s / direct_s:.3f} "
        f"({1e6 * (chain_s - direct_s):+.0f} us; answered by {answer.provider}, {len(answer.results)} results, "
        f"{len(answer.attempts)} failed attempts)"
    )


# -----------------------------------------------------------------------------
# serve: the server under 20 concurrent clients, against the same generations done directly


def serve_bench_run(folder):
    """runs/smoke-corpus-cpu when it exists (make smoke-corpus), else a 2-step run of the smoke model shape
    on a small 512-token BPE of the embedded corpus, built in `folder` (about a minute)."""
    shipped = os.path.join(ROOT, "runs", "smoke-corpus-cpu")
    if os.path.isdir(shipped):
        return shipped
    print(
        "serve: runs/smoke-corpus-cpu not found (make smoke-corpus); training a 2-step stand-in", flush=True
    )
    overrides = [f"data.dir={folder}/data", "data.corpus.max_documents_per_file=400",
                 "data.tokenizer.vocab_size=512", "model.vocab_size=512", "data.encode.tokens_per_shard=8000",
                 f"train.runs_dir={folder}/runs", "train.max_steps=2", "train.warmup_steps=0",
                 "train.eval_interval=0", "train.sample_tokens=0"]  # fmt: skip
    cfg = config.load(os.path.join(ROOT, "configs", "smoke-corpus-cpu.yaml"), overrides)
    quiet = lambda *args, **kwargs: None  # noqa: E731
    corpus.build_corpus(cfg["data"], log=quiet)
    corpus.train_tokenizer(cfg["data"], log=quiet)
    corpus.encode(cfg["data"], log=quiet)
    train.train(cfg, log=quiet)
    return os.path.join(folder, "runs", cfg["run_name"])


def percentile(values, fraction):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def bench_serve(clients=20, requests_per_client=10, max_tokens=8):
    """requests/s and latency of serve.py (a real process on 127.0.0.1) with `clients` threads, one member
    each, sending `requests_per_client` greedy chat completions; and the server's wall seconds per answer
    over the seconds its worker spent generating them (the same answers without HTTP, queue or JSON),
    both from the same run."""
    import httpx

    import serve_accounts

    with tempfile.TemporaryDirectory(prefix="bench-serve-") as folder:
        run = serve_bench_run(folder)
        database = os.path.join(folder, "bench.sqlite")
        store = serve_accounts.Store(database)
        admin = store.add_member("admin", "admin")
        keys = [store.add_member(f"c{i}", "adult") for i in range(clients)]
        command = [sys.executable, "serve.py", run, "--port", "0", f"serve.database={database}",
                   f"serve.queue_size={clients}"]  # fmt: skip
        proc = subprocess.Popen(
            command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        try:
            url = proc.stdout.readline().split(" at ")[1].split()[0].rstrip("/")
            admin_headers = {"Authorization": f"Bearer {admin}"}
            model_id = httpx.get(url + "/v1/models", headers=admin_headers).json()["data"][0]["id"]
            messages = [{"role": "user", "content": "Hola, ¿me cuentas un cuento corto?"}]
            body = {"model": model_id, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
            latencies, statuses, lock = [], [], threading.Lock()

            def client(key, count):
                with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=300) as http:
                    for _ in range(count):
                        start = time.perf_counter()
                        status = http.post(url + "/v1/chat/completions", json=body).status_code
                        with lock:
                            latencies.append(time.perf_counter() - start)
                            statuses.append(status)

            client(admin, 3)  # warm-up, not counted
            latencies.clear()
            statuses.clear()
            before = httpx.get(url + "/api/server", headers=admin_headers).json()
            rss_before = serve_rss_kib(proc.pid)
            threads = [threading.Thread(target=client, args=(key, requests_per_client)) for key in keys]
            started = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            wall = time.perf_counter() - started
            after = httpx.get(url + "/api/server", headers=admin_headers).json()
            rss_after = serve_rss_kib(proc.pid)
        finally:
            proc.kill()
            proc.wait()
    answered = statuses.count(200)
    served_s = wall / max(answered, 1)
    generate_s = (after["generate_s"] - before["generate_s"]) / max(after["answered"] - before["answered"], 1)
    others = len(statuses) - answered - statuses.count(503)
    print(
        f"serve: {clients} clients x {requests_per_client} requests, {max_tokens} greedy tokens each, run "
        f"{os.path.basename(run)}, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print(
        f"serve: {answered}/{len(statuses)} answered ({statuses.count(503)} refused 503, {others} other) | "
        f"{answered / wall:.1f} requests/s | latency p50 {1e3 * percentile(latencies, 0.5):.0f} ms, p95 "
        f"{1e3 * percentile(latencies, 0.95):.0f} ms | server RSS {rss_before / 1024:.0f} -> {rss_after / 1024:.0f} MiB"
    )
    print(
        f"serve: {1e3 * served_s:.1f} ms of wall time per answer through the server vs {1e3 * generate_s:.1f} ms "
        f"generating it in the worker -> overhead ratio {served_s / generate_s:.2f}"
    )


def serve_rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


# memory: retrieval for a turn among 100k memories, against the time of the turn itself


def bench_memory(count=100_000, members=6, queries=300, new_tokens=64):
    """Retrieval latency (memory.context_for_turn: pinned + top-k bm25 within the token budget) over
    `count` memories of `members` members, queries being other sentences of the embedded corpus; and its
    share of a whole turn with the smoke model's shape (vocab 4096 as make smoke-corpus trains it): a
    prompt filling the window but `new_tokens`, then `new_tokens` generated with the KV cache."""
    import gzip
    import random

    import memory

    with gzip.open(os.path.join(ROOT, "corpus", "fortunes-es.txt.gz"), "rt", encoding="utf-8") as f:
        sentences = [s.strip() for s in f.read().replace("\n", " ").split(".") if 20 < len(s.strip()) < 300]
    rng = random.Random(0)
    names = [f"miembro{i}" for i in range(members)]
    cfg = memory.load_config()
    count_tokens = lambda text: len(data.ByteTokenizer().encode(text))  # noqa: E731 - >= a BPE's count
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as folder:
        conn = memory.connect(os.path.join(folder, "familia.db"), cfg)
        stamp = memory.now_text()
        rows = [
            (
                rng.choice(names),
                "family" if rng.random() < 0.2 else "private",
                rng.choice(sentences),
                int(rng.random() < 3e-4),
                "manual",
                stamp,
                stamp,
            )
            for _ in range(count)
        ]
        with conn:
            conn.executemany(
                "INSERT INTO memories (member, scope, text, pinned, source, created, updated) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
        times, lengths = [], []
        for _ in range(queries):
            question = rng.choice(sentences)
            start = time.perf_counter()
            context = memory.context_for_turn(conn, rng.choice(names), "adult", question, cfg, count_tokens)
            times.append(time.perf_counter() - start)
            lengths.append(context.count("\n- ["))
        conn.close()
    times.sort()
    p50, p95 = times[len(times) // 2], times[int(0.95 * len(times))]

    with open(os.path.join(ROOT, "configs", "model", "smoke.yaml"), encoding="utf-8") as f:
        model_cfg = dict(yaml.safe_load(f)["model"], vocab_size=4096)
    torch.manual_seed(0)
    net = model.Transformer(model_cfg).eval()
    prompt = torch.randint(0, model_cfg["vocab_size"], (model_cfg["seq_len"] - new_tokens,))

    def turn():
        with torch.no_grad():
            for _ in net.generate(prompt, new_tokens, temperature=1.0, top_k=50):
                pass

    # One thread, like the retrieval: a loaded machine stretches a multi-threaded turn far more, which
    # would flatter the share.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        turn_s = per_call_seconds(turn, repeats=5)
    finally:
        torch.set_num_threads(threads)
    print(
        f"memory: {count:,} memories of {members} members, {queries} queries: retrieval p50 "
        f"{1000 * p50:.1f} ms, p95 {1000 * p95:.1f} ms ({statistics.mean(lengths):.1f} memories per turn)"
    )
    print(
        f"memory: a smoke-model turn ({len(prompt)}-token prompt + {new_tokens} tokens, 1 thread) takes "
        f"{1000 * turn_s:.0f} ms; retrieval p95 is {100 * p95 / (p95 + turn_s):.1f}% of the turn (target < 5%)"
    )


# -----------------------------------------------------------------------------

SECTIONS = {
    "model": bench_model,
    "decode": bench_decode,
    "data": bench_data,
    "corpus": bench_corpus,
    "search": bench_search,
    "serve": bench_serve,
    "memory": bench_memory,
}


def main(argv):
    names = argv or list(SECTIONS)
    unknown = [name for name in names if name not in SECTIONS]
    if unknown:
        print(f"unknown bench section(s) {unknown}; sections: {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    for name in names:
        SECTIONS[name]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
