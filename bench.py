"""
Benchmarks: `python bench.py [SECTION ...]` (`make bench`) runs the named sections, or all of them.
Each section is a top-level bench_<name>() that prints its figures; timing lives here, never in tests.
"""

import collections
import gzip
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import yaml
from torch.profiler import profile

import corpus
import data
import model
import search
import train

ROOT = os.path.dirname(os.path.abspath(__file__))


# -----------------------------------------------------------------------------
# model: matmul peak and training-step throughput


def matmul_peak_flops():
    """The trainer's own MFU reference (train.measure_peak_tflops), measured longer for a steadier figure."""
    return train.measure_peak_tflops(torch.device("cpu"), size=2048, seconds=2.0) * 1e12


def training_step_times(model_cfg, batch_size, attention_backend="math", warmup=2, steps=5):
    """Seconds per optimizer step (forward + backward + AdamW) on random tokens, after warm-up steps."""
    torch.manual_seed(0)
    net = model.Transformer(model_cfg, attention_backend)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.1)
    idx = torch.randint(0, model_cfg["vocab_size"], (batch_size, model_cfg["seq_len"]))
    targets = torch.randint(0, model_cfg["vocab_size"], (batch_size, model_cfg["seq_len"]))

    def step():
        _, losses = net(idx, targets)
        losses["loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return net, step, times


def where_time_goes(step, top=6):
    """Share of one step's CPU time per aten op, largest first."""
    with profile() as prof:
        step()
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return ", ".join(f"{e.key[6:]} {100 * e.self_cpu_time_total / total:.0f}%" for e in events[:top])


def bench_model():
    def load(name):
        with open(os.path.join(ROOT, "configs", "model", f"{name}.yaml"), encoding="utf-8") as f:
            return yaml.safe_load(f)["model"]

    # Measured before and after the steps and the higher one kept: a neighbour process that slows one
    # measurement must not shrink the peak and so flatter the MFU.
    peak = matmul_peak_flops()
    results = []
    # The CPU profile's math kernel, and the CPU flash kernel (which skips the masked half of the scores).
    shapes = [
        ("smoke", 16, "math"),
        ("smoke", 16, "flash"),
        ("tiny-50m", 1, "math"),
        ("tiny-50m", 1, "flash"),
    ]
    print(
        f"model: timing {len(shapes)} training shapes between two matmul peaks (about a minute)", flush=True
    )
    for name, batch_size, backend in shapes:
        cfg = load(name)
        warmup, steps = (2, 5) if name == "smoke" else (1, 3)
        net, step, times = training_step_times(cfg, batch_size, backend, warmup, steps)
        seconds = statistics.median(times)
        tokens_per_second = batch_size * cfg["seq_len"] / seconds
        flops = net.flops_per_token(cfg["seq_len"]) * tokens_per_second
        label = f"{name} B={batch_size} T={cfg['seq_len']} {backend}"
        breakdown = where_time_goes(step) if backend == "math" else None
        results.append((label, net.num_params(), seconds, len(times), tokens_per_second, flops, breakdown))
    peak = max(peak, matmul_peak_flops())
    print(f"model: float32 matmul peak {peak / 1e9:.1f} GFLOP/s ({torch.get_num_threads()} threads)")
    for label, params, seconds, steps, tokens_per_second, flops, breakdown in results:
        print(
            f"model: {label:24s} | {params / 1e6:.1f}M params | step {seconds:.3f}s (median of {steps})"
            f" | {tokens_per_second:,.0f} tok/s | {flops / 1e9:.1f} GFLOP/s | MFU {100 * flops / peak:.0f}%"
        )
        if breakdown:
            print(f"model:   time per op: {breakdown}")


# -----------------------------------------------------------------------------
# data: corpus pipeline throughput against raw sentencepiece, tokenizer quality


def cpu_seconds():
    """CPU time of this process and of its finished children (the pool workers), user + system."""
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
        processes = corpus.processes_of(data_cfg)

        stats, corpus_wall, corpus_cpu = timed(corpus.build_corpus, data_cfg, log=quiet)
        _, tokenizer_wall, _ = timed(corpus.train_tokenizer, data_cfg, log=quiet)
        _, encode_wall, encode_cpu = timed(corpus.encode, data_cfg, log=quiet)

        megabytes = stats["bytes_out"] / 1e6  # UTF-8 text of the kept documents, both splits
        tokenizer = data.load_tokenizer(data_cfg)
        texts = [t for split in data.SPLITS for t in corpus.iter_documents(corpus.docs_path(data_cfg, split))]
        lines = [line for text in texts for line in text.split("\n")]
        _, raw_wall, raw_cpu = timed(tokenizer.processor.encode, lines, num_threads=1)

        val = list(corpus.iter_documents(corpus.docs_path(data_cfg, "val")))
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
        f"{tokenizer.vocab_size:,}-token BPE, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
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

    return config._load_layer("data", f"data/{name}.yaml", os.path.join(ROOT, "configs"), None, [])[0]


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

SECTIONS = {
    "model": bench_model,
    "data": bench_data,
    "corpus": bench_corpus,
    "search": bench_search,
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
