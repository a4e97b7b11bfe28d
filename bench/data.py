"""
`make bench ARGS=data` and `ARGS=corpus`: the corpus pipeline's throughput against raw sentencepiece,
the tokenizer's quality, and the cost of each corpus stage.
"""

import collections
import gzip
import json
import os
import re
import shutil
import statistics
import tempfile
import time

import config
import data
import fileio
from bench.common import ROOT, timed
from corpus import docs, pipeline

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
        processes = docs.processes_of(data_cfg)

        # Three runs of the corpus and encode steps (and of raw sentencepiece), the median of each kept:
        # one run on a shared machine can be off by a third. The tokenizer is trained once.
        runs = []
        for attempt in range(3):
            if attempt:  # forget the finished steps (manifest entries, filter tasks): nothing is skipped
                shutil.rmtree(os.path.join(folder, "work"), ignore_errors=True)
                manifest = data.read_manifest(data_cfg)
                manifest.pop("corpus"), manifest.pop("encode")
                fileio.write_json(data.manifest_path(data_cfg), manifest)
            stats, corpus_wall, corpus_cpu = timed(pipeline.build_corpus, data_cfg, log=quiet)
            if not attempt:
                _, tokenizer_wall, _ = timed(pipeline.train_tokenizer, data_cfg, log=quiet)
                tokenizer = data.load_tokenizer(data_cfg)
                texts = [
                    t for split in data.SPLITS for t in docs.iter_documents(docs.docs_path(data_cfg, split))
                ]
                lines = [line for text in texts for line in text.split("\n")]
            _, encode_wall, encode_cpu = timed(pipeline.encode, data_cfg, log=quiet)
            _, raw_wall, raw_cpu = timed(tokenizer.processor.encode, lines, num_threads=1)
            runs.append((corpus_wall, corpus_cpu, encode_wall, encode_cpu, raw_wall, raw_cpu))
        corpus_wall, corpus_cpu, encode_wall, encode_cpu, raw_wall, raw_cpu = map(
            statistics.median, zip(*runs, strict=True)
        )
        megabytes = stats["bytes_out"] / 1e6  # UTF-8 text of the kept documents, both splits

        val = list(docs.iter_documents(docs.docs_path(data_cfg, "val")))
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
    from corpus import filters

    texts = {language: translated_texts(language) for language in LOCALE_LANGUAGES}
    if not texts["es"]:
        print("corpus: no Debian translations under /usr/share/locale; language-ID calibration skipped")
        return
    stage = filters.LanguageStage({"languages": ["es"], "min_score": 0, "max_chars": 10_000})
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


# -----------------------------------------------------------------------------
# FineWeb-2 fidelity: the corpus step's quality filters against FineWeb-2's own, on a mixed sample

FINEWEB2_REFERENCE = os.path.join(ROOT, "tests", "fixtures", "corpus", "fineweb2-spa_Latn.yml")
SHARED = os.path.join(ROOT, "..", "shared", "corpus")
# The mixed sample: [name, file, JSON text field or None for blank-line documents]; the shared sources are
# used when ../shared/corpus is there, the embedded ones (corpus/) always.
SAMPLE_SOURCES = [
    ["novelas-cligs", os.path.join(SHARED, "novelas-cligs.jsonl.gz"), "text"],
    ["parlamint-es", os.path.join(SHARED, "parlamint-es.jsonl.gz"), "text"],
    ["openstax-es", os.path.join(SHARED, "openstax-es.jsonl.gz"), "text"],
    ["rv1909", os.path.join(ROOT, "corpus", "rv1909.txt.gz"), None],
    ["fortunes-es", os.path.join(ROOT, "corpus", "fortunes-es.txt.gz"), None],
    ["técnico", os.path.join(ROOT, "corpus", "tecnico-dialogo.jsonl"), "text"],
    ["diálogo", os.path.join(ROOT, "corpus", "tecnico-dialogo.jsonl"), "text"],
]
PAGE_CHARS = (700, 1500, 3000, 6000)  # the lengths long documents are cut to, in turn: web pages vary so


def fineweb2_reference(path=FINEWEB2_REFERENCE):
    """FineWeb-2's three quality filters for Spanish, built as its pipeline builds them (the file says from
    where): datatrove's filters, spaCy's Spanish word split, FineWeb-2's thresholds and stop words."""
    import yaml
    from datatrove.pipeline.filters import FineWebQualityFilter, GopherQualityFilter, GopherRepetitionFilter

    from corpus import filters

    with open(path, encoding="utf-8") as f:
        reference = yaml.safe_load(f)
    language, c, fixed = reference["language"], reference["config"], reference["pipeline"]
    reference_filters = [
        GopherRepetitionFilter(language=language, dup_line_frac=c["dup_line_frac"], top_n_grams=c["top_n_grams"],
                               dup_n_grams=c["dup_n_grams"], **fixed["gopher_repetition"]),
        FineWebQualityFilter(language=language, line_punct_thr=c["line_punct_thr"],
                             new_line_ratio=c["new_line_ratio"], **fixed["fineweb_quality"]),
        GopherQualityFilter(language=language, max_avg_word_length=c["max_avg_word_length"],
                            min_avg_word_length=c["min_avg_word_length"], stop_words=c["stopwords"],
                            max_non_alpha_words_ratio=c["max_non_alpha_words_ratio"], **fixed["gopher_quality"]),
    ]  # fmt: skip
    return [filters.DatatroveStage(f"fineweb2:{f.name}", f) for f in reference_filters]


def keeps(stages, text):
    """Whether a document passes every stage (corpus/filters.py stages: (keep, reason) of a Document)."""
    from corpus import filters

    return all(stage(filters.document(text))[0] for stage in stages)


def pages(text, count, first=0):
    """Up to `count` pieces of a long text, evenly spread over it: cut at line ends (at sentence ends inside
    an overlong line) to the lengths of PAGE_CHARS in turn, starting with PAGE_CHARS[first]."""
    units = []
    for line in text.split("\n"):
        sentences = re.split(r"(?<=[.!?]) ", line) if len(line) > PAGE_CHARS[-1] else [line]
        units += [(sentence, " " if i else "\n") for i, sentence in enumerate(sentences)]
    pieces, piece = [], ""
    for unit, separator in units:
        piece = piece + separator + unit if piece else unit
        if len(piece) >= PAGE_CHARS[(first + len(pieces)) % len(PAGE_CHARS)]:
            pieces.append(piece)
            piece = ""
    pieces += [piece] if piece else []
    return pieces[:: max(1, len(pieces) // count)][:count]


def fidelity_sample(per_source, min_chars, sources=SAMPLE_SOURCES):
    """[(source name, text)]: documents of each source present, cleaned as the corpus step cleans them, at
    least min_chars long, long ones cut into web-page-sized pieces; at most per_source of each source,
    spread over it. The one-line proverbs are grouped into pages of proverbs; técnico and diálogo are the
    two kinds of corpus/tecnico-dialogo.jsonl."""
    sample = []
    for name, path, text_field in sources:
        if not os.path.exists(path):
            continue
        with (
            gzip.open(path, "rt", encoding="utf-8")
            if path.endswith(".gz")
            else open(path, encoding="utf-8") as f
        ):
            if text_field is None:
                documents = f.read().split("\n\n")
            else:
                records = [json.loads(line) for line in f]
                documents = [r[text_field] for r in records if r.get("kind", name) == name]
        if name == "fortunes-es":
            documents = ["\n".join(documents)]
        documents = [text for text in map(pipeline.clean_text, documents) if len(text) >= min_chars]
        chosen = documents[:: max(1, len(documents) // per_source)]
        each = max(1, per_source // len(chosen))
        texts = [
            piece
            for number, text in enumerate(chosen)
            for piece in (pages(text, each, number) if len(text) > PAGE_CHARS[-1] else [text])
        ]
        sample += [(name, text) for text in texts if len(text) >= min_chars][:per_source]
    return sample


def filter_agreement(sample, stages, reference):
    """(agreement per source {name: (same, documents)}, kept by stages, kept by the reference, CPU seconds
    of the stages): the keep/drop verdict of the three filters against the reference's, document by
    document. Each side starts with empty word-split caches; loading the word tokenizer is not timed."""
    import datatrove.utils.text

    keeps(stages, "Una frase para cargar el tokenizador antes de medir.")  # spaCy loads once, untimed
    datatrove.utils.text.split_into_parts.cache_clear()
    start = time.process_time()
    ours = [keeps(stages, text) for _, text in sample]
    seconds = time.process_time() - start
    datatrove.utils.text.split_into_parts.cache_clear()
    theirs = [keeps(reference, text) for _, text in sample]
    by_source = collections.defaultdict(lambda: [0, 0])
    for (name, _), a, b in zip(sample, ours, theirs, strict=True):
        by_source[name][0] += a == b
        by_source[name][1] += 1
    return dict(by_source), sum(ours), sum(theirs), seconds


def bench_fidelity(cfg):
    """The keep/drop agreement of the quality filters with each word split (data.corpus.filters.
    word_tokenizer) against FineWeb-2's own filters, per source of the mixed sample, and the CPU cost per
    MB of each split (the three filters, then MinHash)."""
    from corpus import filters

    per_source = int(os.environ.get("BENCH_FIDELITY_DOCS", "120"))
    sample = fidelity_sample(per_source, cfg["min_chars"])
    megabytes = sum(len(t.encode("utf-8")) for _, t in sample) / 1e6
    sources = collections.Counter(name for name, _ in sample)
    print(f"corpus: FineWeb-2 fidelity sample: {len(sample)} documents, {megabytes:.2f} MB: "
          + ", ".join(f"{n} {c}" for n, c in sources.items()))  # fmt: skip
    reference = fineweb2_reference()
    for name in ("spacy", "regex"):
        filters_cfg = cfg["filters"] | {"word_tokenizer": name}
        by_source, kept, kept_reference, seconds = filter_agreement(
            sample, filters.quality_stages(filters_cfg), reference
        )
        same = sum(a for a, _ in by_source.values())
        hasher = filters.MinHasher(cfg["near_dedup"], filters.word_splitter(name))
        hasher.bucket_keys(sample[0][1])  # builds the signer, untimed
        start = time.process_time()
        for _, text in sample:
            hasher.bucket_keys(text)
        minhash = time.process_time() - start
        print(
            f"corpus: word_tokenizer {name}: keep/drop agrees with FineWeb-2's filters on {100 * same / len(sample):.1f}% "
            f"of {len(sample)} documents (kept {kept} vs {kept_reference}); by source "
            + ", ".join(f"{n} {100 * a / t:.0f}%" for n, (a, t) in by_source.items())
        )
        print(
            f"corpus: word_tokenizer {name}: filters {seconds / megabytes:.2f} CPU-s per MB, MinHash "
            f"{minhash / megabytes:.2f} CPU-s per MB"
        )


def bench_corpus():
    """CPU seconds per stage on the same novelas text, single-threaded, as MB per CPU-second; the ratio of
    filters + near-dedup to encoding with a 32k BPE (trained here on the same text)."""
    from corpus import encode, filters, pipeline

    bench_language_id()
    cfg = data_layer("corpus")["corpus"]
    bench_fidelity(cfg)
    novelas = os.path.join(ROOT, "..", "shared", "corpus", "novelas-cligs.jsonl.gz")
    if not os.path.exists(novelas):
        print("corpus: ../shared/corpus/novelas-cligs.jsonl.gz not found; stage timings skipped")
        return
    limit = int(os.environ.get("BENCH_CORPUS_DOCS", "20"))  # novels timed (83 in all)
    with gzip.open(novelas, "rt", encoding="utf-8") as f:
        texts = [
            pipeline.clean_text(json.loads(line)["text"]) for _, line in zip(range(limit), f, strict=False)
        ]
    megabytes = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    documents = [filters.document(t) for t in texts]
    stages = {"language": filters.LanguageStage(cfg["filters"]["language"])}
    stages |= {stage.name: stage for stage in filters.quality_stages(cfg["filters"])}
    words = filters.word_splitter(cfg["filters"]["word_tokenizer"])
    hasher = filters.MinHasher(cfg["near_dedup"], words)
    scrub = filters.PiiScrubber(cfg["pii"])
    guard = filters.Decontaminator(
        cfg["decontamination"]["ngram"], None, cfg["decontamination"]["val_max_overlap"]
    )
    seconds = {}

    def timed_cpu(name, function):
        start = time.process_time()
        for item in documents:
            function(item)
        seconds[name] = time.process_time() - start

    timed_cpu("clean", lambda d: pipeline.clean_text(d.text))
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
        settings = encode.trainer_settings(data_cfg)
        model = os.path.join(folder, "bpe.model")
        lines = (line for text in texts for line in text.split("\n") if line.strip())
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines, model_prefix=model[:-6], minloglevel=2, input_sentence_size=0, **settings
        )
        tokenizer = data.SentencePieceTokenizer(model)
        timed_cpu("encode (32k BPE)", lambda d: tokenizer.encode(d.text))
    filters_s = sum(seconds[name] for name in ("clean", *stages, "pii", "minhash", "decontamination"))
    print(f"corpus: {len(texts)} novels of novelas-cligs, {megabytes:.1f} MB, one core (CPU time)")
    for name, spent in seconds.items():
        print(f"corpus:   {name:<20s} {megabytes / spent:7.2f} MB per CPU-s")
    encode_s = seconds["encode (32k BPE)"]
    print(
        f"corpus: clean + filters + PII + MinHash + decontamination {megabytes / filters_s:.2f} MB per CPU-s; "
        f"encode {megabytes / encode_s:.2f} MB per CPU-s: the stages cost {filters_s / encode_s:.1f}x the encode step"
    )
