"""
`make bench ARGS=data` and `ARGS=corpus`: the corpus pipeline's throughput against raw sentencepiece,
the tokenizer's quality, and the cost of each corpus stage.
"""

import collections
import gzip
import json
import os
import shutil
import statistics
import tempfile
import time

import config
import corpus
import corpus_docs
import data
import fileio
from bench_common import ROOT, timed

# -----------------------------------------------------------------------------
# data: corpus pipeline throughput against raw sentencepiece, tokenizer quality


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
