"""
Stage 1: the corpus pipeline that turns text files into the shards data.py's loaders read.

    python corpus.py corpus CONFIG [section.key=value ...]     clean, dedup, split  -> DIR/docs_*.jsonl
    python corpus.py tokenizer CONFIG [...]                     sentencepiece BPE    -> DIR/tokenizer.model
    python corpus.py encode CONFIG [...]                        tokens               -> DIR/{train,val}*.bin
    python corpus.py all CONFIG [...]                           the three in order
    python corpus.py report CONFIG [...]                        DIR/report.md + DIR/report/*.png

CONFIG is a run file (config.py composes it); only its `data:` section is used. DIR is `data.dir`. Every
step records what it did in DIR/manifest.json and does nothing when its inputs have not changed.

Files in DIR
    docs_train.jsonl, docs_val.jsonl   cleaned documents, one {"text": ...} per line, in input order
    manifest.json                      corpus statistics, fingerprints, shards with token counts + sha256
    format bytes:  train.bin, val.bin  the UTF-8 bytes of the documents, separated by a blank line
    format shards: tokenizer.model, tokenizer_info.json (its settings and the hash of the corpus it saw),
                   train_000000.bin ..., val_000000.bin ...
The shard format, the tokenizers and the loaders live in data.py.
"""

import bz2
import collections
import functools
import glob
import gzip
import hashlib
import heapq
import io
import json
import multiprocessing
import multiprocessing.pool
import os
import re
import shutil
import sys
import unicodedata
import zlib

import numpy as np
import sentencepiece as spm
from tqdm import tqdm

import corpus_filters
from data import (
    CONTROL_TOKENS,
    NEWLINE,
    PIPELINE_VERSION,
    SPLITS,
    UNK_PIECE,
    USER_DEFINED_PIECES,
    DataError,
    SentencePieceTokenizer,
    byte_path,
    fingerprint,
    load_tokenizer,
    manifest_path,
    read_manifest,
    sha256_of_file,
    shard_name,
    shard_paths,
    tokenizer_path,
    write_atomic,
    write_json,
    write_shard,
)

DOCUMENT_SEPARATOR = "\n\n"  # between documents in the byte format


def cpu_count():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def processes_of(data_cfg):
    return data_cfg["processes"] or cpu_count()


def docs_path(data_cfg, split):
    return os.path.join(data_cfg["dir"], f"docs_{split}.jsonl")


# -----------------------------------------------------------------------------
# Sources: text, jsonl, parquet and MediaWiki dumps, each document tagged with its source's name


SURROGATES = re.compile("[\ud800-\udfff]")
ODD_CHARACTERS = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\ufeff\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
)
REPLACEMENTS = {chr(c): " " for c in (0xA0, 0x1680, 0x202F, 0x205F, 0x3000, *range(0x2000, 0x200B))}
REPLACEMENTS |= {"\u2028": NEWLINE, "\u2029": NEWLINE}  # other odd characters (controls, BOM) go
# Spelled with a literal prefix, not as "\n{3,}": the regex engine then scans for the prefix at memory speed,
# several times faster than "\n{3,}" or a loop of str.replace("\n\n\n", "\n\n").
BLANK_LINE_RUNS = re.compile("\n\n\n+")
PARQUET_METADATA = ("id", "url", "language_score", "minhash_cluster_size")  # kept when present (FineWeb-2)


def clean_text(text):
    """NFC; controls (but \\t, \\n) and BOMs dropped; unicode spaces -> ' '; \\r\\n -> \\n; trailing spaces
    of lines and runs of blank lines tidied; leading blank lines and trailing whitespace removed."""
    if "\r" in text:
        text = text.replace("\r\n", NEWLINE).replace("\r", NEWLINE)
    if not unicodedata.is_normalized("NFC", text):
        text = unicodedata.normalize("NFC", text)
    if ODD_CHARACTERS.search(text):
        text = ODD_CHARACTERS.sub(lambda m: REPLACEMENTS.get(m.group(), ""), text)
    text = NEWLINE.join([line.rstrip(" \t") for line in text.split(NEWLINE)])
    text = BLANK_LINE_RUNS.sub("\n\n", text)
    return text.lstrip(NEWLINE).rstrip()


def replace_undecodable(text):
    """Lone surrogates (from undecodable bytes or bad JSON escapes) -> U+FFFD; returns (text, count)."""
    count = len(SURROGATES.findall(text))
    return (SURROGATES.sub("\ufffd", text), count) if count else (text, 0)


def expand_sources(corpus_cfg):
    """[(source index, file path)] in config order, sorted within each glob; errors name the source."""
    files = []
    for index, source in enumerate(corpus_cfg["sources"]):
        pattern, where = source["path"], f"data.corpus.sources[{index}] ({source['name']}).path"
        if glob.has_magic(pattern):
            matches = [path for path in sorted(glob.glob(pattern, recursive=True)) if os.path.isfile(path)]
            if not matches:
                raise DataError(f"{where}: no file matches {pattern!r}")
        elif not os.path.exists(pattern):
            raise DataError(f"{where}: {pattern}: file not found")
        elif os.path.isdir(pattern):
            raise DataError(
                f"{where}: {pattern} is a directory; name files or a glob such as {pattern}/*.txt"
            )
        else:
            matches = [pattern]
        files.extend((index, path) for path in matches)
    return files


def open_input(path):
    """A binary stream of the file, decompressed by its extension (.gz, .bz2, .zst)."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".bz2"):
        return bz2.open(path, "rb")
    if path.endswith(".zst"):
        return io.BufferedReader(ZstdReader(path))
    return open(path, "rb")


class ZstdReader(io.RawIOBase):
    """A .zst file's decompressed bytes, frame after frame; a file that ends inside a frame is an error
    (zstandard's stream reader would end quietly there)."""

    def __init__(self, path):
        import zstandard

        self.zstandard = zstandard
        self.file, self.path = open(path, "rb"), path
        self.decompressor, self.pending = zstandard.ZstdDecompressor().decompressobj(), b""

    def readable(self):
        return True

    def readinto(self, buffer):
        while not self.pending:
            compressed = self.file.read(1 << 16)
            if not compressed:
                if not self.decompressor.eof:
                    raise EOFError("the file ends inside a zstd frame (truncated)")
                return 0
            if self.decompressor.eof:  # a new frame follows
                self.decompressor = self.zstandard.ZstdDecompressor().decompressobj()
            self.pending = self.decompressor.decompress(compressed)
        size = min(len(buffer), len(self.pending))
        buffer[:size], self.pending = self.pending[:size], self.pending[size:]
        return size

    def close(self):
        self.file.close()
        super().close()


def read_text_like(path, source, stats):
    """Documents of a text (blank_line / file) or jsonl file. Undecodable bytes arrive as lone surrogates
    (surrogateescape); the worker replaces and counts them. Bad JSON lines are counted in `stats`."""
    kind, mode = source["kind"], source.get("documents", "blank_line")
    with open_input(path) as f:
        if kind == "text" and mode == "file":
            content = f.read()
            stats["bytes_in"] += len(content)
            yield content.decode("utf-8", "surrogateescape"), {}
            return
        lines = []
        for raw_line in f:
            stats["bytes_in"] += len(raw_line)
            line = raw_line.decode("utf-8", "surrogateescape")
            if kind == "jsonl":
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    stats["drops"]["bad_json"] += 1
                    continue
                text = record.get(source["text_field"]) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    stats["drops"]["missing_text_field"] += 1
                    continue
                yield text, {key: record[key] for key in ("id", "url") if key in record}
            elif line.strip():
                lines.append(line)
            elif lines:
                yield "".join(lines), {}
                lines = []
        if lines:
            yield "".join(lines), {}


def read_parquet(path, source, stats):
    """Row group by row group: the text column and FineWeb-2's metadata columns when present."""
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError for files that are not parquet
        raise DataError(f"{path}: not a readable parquet file ({e})") from None
    names = parquet.schema_arrow.names
    if source["text_field"] not in names:
        raise DataError(
            f"{path}: no column {source['text_field']!r} (text_field of source {source['name']}); "
            f"the file has {', '.join(names)}"
        )
    columns = [source["text_field"], *(c for c in PARQUET_METADATA if c in names)]
    for group in range(parquet.num_row_groups):
        try:
            rows = parquet.read_row_group(group, columns=columns).to_pylist()
        except Exception as e:
            raise DataError(f"{path}: row group {group} is unreadable ({e})") from None
        stats["bytes_in"] += parquet.metadata.row_group(group).total_byte_size
        for row in rows:
            text = row.pop(source["text_field"])
            if not isinstance(text, str):
                stats["drops"]["missing_text_field"] += 1
                continue
            yield text, {key: value for key, value in row.items() if value is not None}


def read_mediawiki(path, source, stats):
    """A Wikipedia/Wikisource XML dump, streamed: main-namespace pages that are not redirects, their
    wikitext as plain text (templates, tables, references, files and categories dropped; headings kept)."""
    import xml.etree.ElementTree as ElementTree

    counted = CountingReader(open_input(path), stats)
    try:
        events = ElementTree.iterparse(counted, events=("start", "end"))
        _, root = next(events)
        if not root.tag.endswith("mediawiki"):
            raise DataError(f"{path}: not a MediaWiki XML dump (root element <{root.tag}>)")
        namespace = root.tag[: -len("mediawiki")]
        for event, element in events:
            if event != "end" or element.tag != namespace + "page":
                continue
            title = element.findtext(namespace + "title") or ""
            page_ns = element.findtext(namespace + "ns")
            redirect = element.find(namespace + "redirect") is not None
            text = element.findtext(f"{namespace}revision/{namespace}text") or ""
            root.clear()  # pages already read are not kept: memory stays flat over the dump
            if page_ns != "0" or redirect or text.lstrip().lower().startswith("#redir"):
                stats["drops"]["wiki_not_article"] += 1
                continue
            yield wikitext_to_text(title, text), {"id": title}
    except ElementTree.ParseError as e:
        raise DataError(f"{path}: not well-formed MediaWiki XML ({e})") from None
    finally:
        counted.close()


class CountingReader(io.RawIOBase):
    """A read-only stream that adds the bytes it hands out to stats['bytes_in']."""

    def __init__(self, stream, stats):
        self.stream, self.stats = stream, stats

    def readable(self):
        return True

    def readinto(self, buffer):
        data = self.stream.read(len(buffer))
        buffer[: len(data)] = data
        self.stats["bytes_in"] += len(data)
        return len(data)

    def close(self):
        self.stream.close()
        super().close()


def wikitext_to_text(title, wikitext):
    import mwparserfromhell

    code = mwparserfromhell.parse(wikitext)
    for node in code.filter_wikilinks(recursive=False):
        if ":" in str(node.title):  # Archivo:, Categoría:, interwiki links: not text
            code.remove(node)
    for node in code.filter_tags(recursive=False):
        if str(node.tag).lower() in ("ref", "table", "gallery", "math"):
            code.remove(node)
    lines = [title, ""]
    for line in code.strip_code(normalize=True, collapse=True).split(NEWLINE):
        lines.append(line.strip())  # heading titles come back as " Historia "
    return NEWLINE.join(lines)


READERS = {
    "text": read_text_like,
    "jsonl": read_text_like,
    "parquet": read_parquet,
    "mediawiki": read_mediawiki,
}


def raw_documents(corpus_cfg, stats_of):
    """(source index, raw text, metadata) of every document in config order, at most
    max_documents_per_file per file; stats_of(source index) is that source's counters."""
    limit = corpus_cfg["max_documents_per_file"]
    taken = collections.Counter()  # documents per source, for a source's max_documents
    for index, path in expand_sources(corpus_cfg):
        source = corpus_cfg["sources"][index]
        source_limit = source.get("max_documents")
        documents = READERS[source["kind"]](path, source, stats_of(index))
        try:
            for count, (text, meta) in enumerate(documents):
                if (limit is not None and count >= limit) or (
                    source_limit is not None and taken[index] >= source_limit
                ):
                    break
                taken[index] += 1
                yield index, text, meta
        except (OSError, EOFError, zlib.error, ValueError) as e:
            import zstandard

            if isinstance(e, ValueError) and not isinstance(e, zstandard.ZstdError):
                raise
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
            raise DataError(f"{path}: cannot read ({reason}) [data.corpus.sources[{index}]]") from None
        finally:
            documents.close()


# -----------------------------------------------------------------------------
# The corpus step, part 1: every document through the stages, as tasks of a datatrove executor
#
# Task r of T takes documents r, r + T, r + 2T, ... (all tasks read every file, only the stages are split)
# and writes, each file atomically, in the step's work folder (named by the fingerprint of config + inputs):
#   kept_0000r.jsonl   the documents it kept: {"i", "source", "split", "digest", "text", "meta"}
#   keys_0000r.npy     their MinHash bucket keys (uint64 [documents, buckets]; zeros: too short to sign)
#   stats_0000r.json   counts per source and stage, drop reasons with examples, histograms (written last:
#                      a task whose stats exist is finished and is skipped when the step runs again)

LENGTH_BINS = np.logspace(1, 7, 25)  # document characters, 10 .. 10M, for the report's histograms
SCORE_BINS = np.linspace(0, 1, 21)
EXAMPLES = 3  # dropped documents kept per reason for the report
EXAMPLE_CHARS = 300


def new_source_stats():
    return {
        "documents_in": 0,
        "bytes_in": 0,
        "documents_out": 0,
        "chars_out": 0,
        "undecodable": 0,
        "drops": collections.Counter(),
        "stages": {},
        "pii": collections.Counter(),
        "length_in": [0] * (len(LENGTH_BINS) + 1),
        "length_out": [0] * (len(LENGTH_BINS) + 1),
        "language_score": [0] * len(SCORE_BINS),
    }


def runs(source, stage_name):
    """Whether a filter stage runs on a source (its `filters`: true, false or a list of stage names)."""
    chosen = source["filters"]
    return chosen if isinstance(chosen, bool) else stage_name in chosen


def split_of_digest(digest, val_fraction):
    return "val" if int.from_bytes(digest[:8], "little") < val_fraction * 2**64 else "train"


def split_of(text, val_fraction):
    """The split a cleaned document goes to: a hash of its text, so the same text always lands alike."""
    return split_of_digest(hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest(), val_fraction)


def count_stage(stats, stage, chars, kept):
    entry = stats["stages"].setdefault(
        stage, {"documents_in": 0, "chars_in": 0, "documents_out": 0, "chars_out": 0}
    )
    entry["documents_in"] += 1
    entry["chars_in"] += chars
    if kept:
        entry["documents_out"] += 1
        entry["chars_out"] += chars


def length_bin(chars):
    return int(np.searchsorted(LENGTH_BINS, chars))


class FilterTask:
    """A datatrove pipeline callable (data, rank, world_size): the stages of corpus_filters on this task's
    share of the documents. Models are built in the task, so the object pickles small."""

    def __init__(self, data_cfg, workdir):
        self.corpus_cfg, self.workdir = data_cfg["corpus"], workdir

    def paths(self, rank):
        return {
            name: os.path.join(self.workdir, f"{name}_{rank:05d}.{ext}")
            for name, ext in (("kept", "jsonl"), ("keys", "npy"), ("stats", "json"))
        }

    def __call__(self, data, rank=0, world_size=1):
        paths = self.paths(rank)
        if os.path.exists(paths["stats"]):  # finished by an earlier run of the same config
            return
        cfg = self.corpus_cfg
        filters_cfg = cfg["filters"]
        language = (
            corpus_filters.LanguageStage(filters_cfg["language"])
            if filters_cfg["language"]["enabled"]
            else None
        )
        quality = corpus_filters.quality_stages(filters_cfg)
        scrub = corpus_filters.PiiScrubber(cfg["pii"]) if cfg["pii"]["enabled"] else None
        dedup_cfg = cfg["near_dedup"]
        hasher = None
        if dedup_cfg["enabled"]:
            words = corpus_filters.word_splitter(filters_cfg["word_tokenizer"])
            hasher = corpus_filters.MinHasher(dedup_cfg, words)
        width = dedup_cfg["buckets"] if hasher else 0
        names = [source["name"] for source in cfg["sources"]]
        stats = {name: new_source_stats() for name in names}
        examples = collections.defaultdict(list)
        keys = []

        def drop(source_stats, name, reason, text):
            source_stats["drops"][reason] += 1
            if len(examples[reason]) < EXAMPLES:
                examples[reason].append({"source": name, "text": text[:EXAMPLE_CHARS]})

        progress = tqdm(desc=f"filter task {rank}", unit=" docs", mininterval=2.0, file=sys.stderr)

        def kept_lines():
            # Reader counts (bytes in, bad lines) come from task 0 only: every task reads every file.
            scratch = new_source_stats()
            reader_stats = (lambda k: stats[names[k]]) if rank == 0 else (lambda k: scratch)
            for i, (index, raw, meta) in enumerate(raw_documents(cfg, reader_stats)):
                if i % world_size != rank:
                    continue
                name, source = names[index], cfg["sources"][index]
                s = stats[name]
                s["documents_in"] += 1
                progress.update()
                text = clean_text(raw)
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:  # lone surrogates: undecodable input bytes or bad JSON escapes
                    text, undecodable = replace_undecodable(text)
                    s["undecodable"] += undecodable
                s["length_in"][length_bin(len(text))] += 1
                ok = len(text) >= cfg["min_chars"]
                count_stage(s, "min_chars", len(text), ok)
                if not ok:
                    drop(s, name, "empty" if not text else "too_short", text)
                    continue
                doc = corpus_filters.document(text, name)
                stages = [
                    stage for stage in ([language] if language else []) + quality if runs(source, stage.name)
                ]
                for stage in stages:
                    ok, reason = stage(doc)
                    count_stage(s, stage.name, len(text), ok)
                    if stage is language:
                        s["language_score"][int(doc.metadata["language_score"] * (len(SCORE_BINS) - 1))] += 1
                    if not ok:
                        drop(s, name, reason, text)
                        break
                if not ok:
                    continue
                if scrub:
                    text, found = scrub(text)
                    s["pii"].update(found)
                encoded = text.encode("utf-8")
                digest = hashlib.blake2b(encoded, digest_size=16).digest()
                split = split_of_digest(digest, cfg["val_fraction"])
                signature = hasher.bucket_keys(text) if hasher else None
                keys.append(signature if signature is not None else np.zeros(width, np.uint64))
                if "language_score" in doc.metadata:
                    meta = meta | {"language_score": round(doc.metadata["language_score"], 4)}
                record = {
                    "i": i,
                    "source": name,
                    "split": split,
                    "digest": digest.hex(),
                    "text": text,
                    "meta": meta,
                }
                yield json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n"

        def write_kept(f):
            for line in kept_lines():
                f.write(line)

        write_atomic(paths["kept"], write_kept)
        progress.close()
        array = np.array(keys, dtype=np.uint64).reshape(len(keys), width)
        write_atomic(paths["keys"], lambda f: np.save(f, array))
        write_json(paths["stats"], {"sources": stats, "examples": examples})


def executor_for(task, data_cfg, workdir):
    """(datatrove executor of the filter tasks as data.corpus.executor says, number of tasks)."""
    executor_cfg = data_cfg["corpus"]["executor"]
    tasks = executor_cfg["tasks"] or processes_of(data_cfg)
    logging_dir = os.path.join(workdir, "logs")
    if executor_cfg["kind"] == "local":
        from datatrove.executor import LocalPipelineExecutor

        workers = min(tasks, processes_of(data_cfg))
        executor = LocalPipelineExecutor(
            pipeline=[task], tasks=tasks, workers=workers, logging_dir=logging_dir, skip_completed=False
        )
    elif executor_cfg["kind"] == "slurm":
        from datatrove.executor import SlurmPipelineExecutor

        slurm = executor_cfg["slurm"]
        executor = SlurmPipelineExecutor(
            pipeline=[task],
            tasks=tasks,
            logging_dir=logging_dir,
            skip_completed=False,
            job_name=slurm["job_name"],
            partition=slurm["partition"],
            time=slurm["time"],
            cpus_per_task=slurm["cpus_per_task"],
            mem_per_cpu_gb=slurm["mem_per_cpu_gb"],
            venv_path=slurm["venv_path"],
        )
    else:
        from datatrove.executor import RayPipelineExecutor  # needs `pip install ray`

        executor = RayPipelineExecutor(
            pipeline=[task], tasks=tasks, logging_dir=logging_dir, skip_completed=False
        )
    return executor, tasks


def run_tasks(task, data_cfg, workdir, log):
    """Run the filter tasks on the configured datatrove executor; the number of tasks when every one has
    finished here, None when they were only submitted (Slurm: run the step again once the jobs are done)."""
    executor, tasks = executor_for(task, data_cfg, workdir)
    executor_cfg = data_cfg["corpus"]["executor"]
    logging_dir = os.path.join(workdir, "logs")
    finished = sum(os.path.exists(task.paths(rank)["stats"]) for rank in range(tasks))
    log(
        f"corpus: {tasks} filter task(s) on the {executor_cfg['kind']} executor, {finished} already finished "
        f"(logs in {logging_dir})"
    )
    try:
        executor.run()
    except DataError:
        raise
    except Exception as e:  # a task's DataError may come back wrapped by the executor's pool
        cause = e
        while cause is not None and not isinstance(cause, DataError):
            cause = cause.__cause__ or cause.__context__
        raise (cause or e) from None
    done = [os.path.exists(task.paths(rank)["stats"]) for rank in range(tasks)]
    return tasks if all(done) else None


# -----------------------------------------------------------------------------
# The corpus step, part 2: exact and near dedup across all tasks, decontamination, the two splits


def merged_records(workdir, tasks):
    """The kept documents of every task, in input order."""
    files = [open(os.path.join(workdir, f"kept_{rank:05d}.jsonl"), "rb") for rank in range(tasks)]
    try:

        def tagged(f, rank):
            for line in f:
                yield json.loads(line), rank

        streams = [tagged(f, rank) for rank, f in enumerate(files)]
        yield from heapq.merge(*streams, key=lambda item: item[0]["i"])
    finally:
        for f in files:
            f.close()


def add_stats(total, part):
    """Sum nested counters (dicts of numbers and lists of bin counts)."""
    for key, value in part.items():
        if isinstance(value, dict):
            add_stats(total.setdefault(key, {}), value)
        elif isinstance(value, list):
            old = total.setdefault(key, [0] * len(value))
            total[key] = [a + b for a, b in zip(old, value, strict=True)]
        else:
            total[key] = total.get(key, 0) + value


def corpus_fingerprint(data_cfg):
    corpus_cfg = data_cfg["corpus"]
    files = [
        [path, os.path.getsize(path), os.stat(path).st_mtime_ns] for _, path in expand_sources(corpus_cfg)
    ]
    evals = [[p, os.path.getsize(p), os.stat(p).st_mtime_ns] for p in eval_files(corpus_cfg)]
    return fingerprint({"pipeline": PIPELINE_VERSION, "corpus": corpus_cfg, "files": files, "evals": evals})


def filter_fingerprint(data_cfg):
    """What the filter tasks' outputs depend on: the sources' files and the settings of the stages."""
    corpus_cfg = data_cfg["corpus"]
    keys = ("sources", "min_chars", "val_fraction", "max_documents_per_file", "filters", "pii", "near_dedup")
    files = [
        [path, os.path.getsize(path), os.stat(path).st_mtime_ns] for _, path in expand_sources(corpus_cfg)
    ]
    return fingerprint(
        {"pipeline": PIPELINE_VERSION, "corpus": {k: corpus_cfg[k] for k in keys}, "files": files}
    )


def eval_files(corpus_cfg):
    paths = corpus_cfg["decontamination"]["eval_files"]
    for index, path in enumerate(paths):
        if not os.path.isfile(path):
            raise DataError(f"data.corpus.decontamination.eval_files[{index}]: {path}: file not found")
    return paths


def outputs_intact(records):
    """True when every recorded output file exists with its recorded size."""
    return all(os.path.exists(r["path"]) and os.path.getsize(r["path"]) == r["size"] for r in records)


def build_corpus(data_cfg, log=print):
    """Sources -> filters -> PII -> dedup -> decontamination -> DIR/docs_{train,val}.jsonl; returns the
    statistics (also in the manifest, where `python corpus.py report` reads them)."""
    corpus_cfg = data_cfg["corpus"]
    key = corpus_fingerprint(data_cfg)
    done = read_manifest(data_cfg).get("corpus")
    if done and done["fingerprint"] == key and outputs_intact(done["outputs"].values()):
        log(f"corpus: up to date ({data_cfg['dir']}/docs_*.jsonl)")
        return done["stats"]
    # The filter tasks' outputs are kept, named by what they depend on: changing decontamination, the
    # mixture or the executor merges again without filtering again.
    work = os.path.join(data_cfg["dir"], "work")
    workdir = os.path.join(work, filter_fingerprint(data_cfg)[:16])
    if os.path.isdir(work):
        for stale in set(os.listdir(work)) - {os.path.basename(workdir)}:
            shutil.rmtree(os.path.join(work, stale), ignore_errors=True)
    os.makedirs(workdir, exist_ok=True)
    task = FilterTask(data_cfg, workdir)
    tasks = run_tasks(task, data_cfg, workdir, log)
    if tasks is None:
        log(f"corpus: filter tasks submitted; run this step again when they have finished ({workdir})")
        return None

    stats = {"sources": {}, "examples": {}}
    for rank in range(tasks):
        with open(task.paths(rank)["stats"], encoding="utf-8") as f:
            part = json.load(f)
        add_stats(stats["sources"], part["sources"])
        for reason, items in part["examples"].items():
            stats["examples"][reason] = (stats["examples"].get(reason, []) + items)[:EXAMPLES]
    per_source = stats["sources"]
    for source in corpus_cfg["sources"]:
        per_source[source["name"]]["licence"] = source["licence"]
        per_source[source["name"]]["kind"] = source["kind"]

    # Pass 1: exact duplicates (same text after cleaning and PII) and MinHash clusters over what is left.
    keys = [np.load(task.paths(rank)["keys"]) for rank in range(tasks)]
    rows, order, seen = [], [], set()  # order: (rank, row within the task's keys) of unique documents
    row_of_rank = [0] * tasks
    for record, rank in merged_records(workdir, tasks):
        row = row_of_rank[rank]
        row_of_rank[rank] += 1
        s = per_source[record["source"]]
        unique = record["digest"] not in seen
        count_stage(s, "exact_dedup", len(record["text"]), unique)
        if not unique:
            s["drops"]["exact_duplicate"] = s["drops"].get("exact_duplicate", 0) + 1
            rows.append(None)
            continue
        seen.add(record["digest"])
        rows.append(len(order))
        order.append((rank, row))
    del seen
    dedup_cfg = corpus_cfg["near_dedup"]
    if dedup_cfg["enabled"] and order:
        matrix = np.stack([keys[rank][row] for rank, row in order])
        clusters = corpus_filters.near_duplicate_clusters(matrix)
    else:
        clusters = np.arange(len(order))
    sizes = np.bincount(clusters, minlength=len(order))
    stats["cluster_sizes"] = {
        str(size): int(count)
        for size, count in zip(*np.unique(sizes[sizes > 0], return_counts=True), strict=True)
    }

    # Pass 2: the val documents (one per cluster) are protected n-grams, with the evaluation files.
    decon_cfg = corpus_cfg["decontamination"]
    guard = corpus_filters.Decontaminator(
        decon_cfg["ngram"], decon_cfg["common_in"], decon_cfg["val_max_overlap"]
    )
    for path in eval_files(corpus_cfg):
        with open(path, encoding="utf-8", errors="replace") as f:
            guard.protect(path, f.read())
    for (record, _), row in zip(merged_records(workdir, tasks), rows, strict=True):
        if row is not None and clusters[row] == row and record["split"] == "val":
            guard.protect("val", record["text"])
    stats["common_ngrams_ignored"] = guard.drop_common()

    # Pass 3: write the survivors.
    outputs = {
        split: {"path": docs_path(data_cfg, split), "documents": 0, "text_bytes": 0} for split in SPLITS
    }
    hashes = {split: hashlib.sha256() for split in SPLITS}
    temps = {split: f"{outputs[split]['path']}.{os.getpid()}.tmp" for split in SPLITS}
    hits = collections.Counter()
    examples = stats["examples"]
    files = {}
    try:
        files = {split: open(temps[split], "wb") for split in SPLITS}
        for (record, _), row in zip(merged_records(workdir, tasks), rows, strict=True):
            if row is None:
                continue
            s, text = per_source[record["source"]], record["text"]
            first = clusters[row] == row
            count_stage(s, "near_dedup", len(text), first)
            if not first:
                s["drops"]["near_duplicate"] = s["drops"].get("near_duplicate", 0) + 1
                if len(examples.setdefault("near_duplicate", [])) < EXAMPLES:
                    examples["near_duplicate"].append(
                        {"source": record["source"], "text": text[:EXAMPLE_CHARS]}
                    )
                continue
            split = record["split"]
            hit = guard.hit(text) if split == "train" else None
            count_stage(s, "decontamination", len(text), hit is None)
            if hit is not None:
                hits[hit] += 1
                s["drops"]["contaminated"] = s["drops"].get("contaminated", 0) + 1
                if len(examples.setdefault("contaminated", [])) < EXAMPLES:
                    examples["contaminated"].append(
                        {"source": record["source"], "text": f"[{hit}] {text[:EXAMPLE_CHARS]}"}
                    )
                continue
            entry = {
                "text": text,
                "source": record["source"],
                "cluster_size": int(sizes[row]),
                **record["meta"],
            }
            line = json.dumps(entry, ensure_ascii=False).encode("utf-8") + b"\n"
            files[split].write(line)
            hashes[split].update(line)
            outputs[split]["documents"] += 1
            outputs[split]["text_bytes"] += len(text.encode("utf-8"))
            s["documents_out"] += 1
            s["chars_out"] += len(text)
            s["length_out"][length_bin(len(text))] += 1
        documents_out = sum(o["documents"] for o in outputs.values())
        documents_in = sum(s["documents_in"] for s in per_source.values())
        if documents_out == 0:
            drops = {name: s["drops"] for name, s in per_source.items()}
            raise DataError(
                f"data.corpus.sources: no document survived ({documents_in} read; drops {drops}); "
                "check the sources and the filter thresholds (data.corpus.min_chars, data.corpus.filters)"
            )
        for split in SPLITS:
            if outputs[split]["documents"] == 0:
                raise DataError(
                    f"data.corpus.val_fraction: the {split} split is empty ({documents_out} documents in all); "
                    "add documents or change val_fraction"
                )
        for split in SPLITS:
            files[split].flush()
            os.fsync(files[split].fileno())
            files[split].close()
            os.replace(temps[split], outputs[split]["path"])
    finally:
        for split in SPLITS:
            if split in files:
                files[split].close()
            if os.path.exists(temps[split]):
                os.remove(temps[split])

    for split in SPLITS:
        outputs[split].update(size=os.path.getsize(outputs[split]["path"]), sha256=hashes[split].hexdigest())
    stats["decontamination"] = dict(hits)
    stats["documents_in"] = documents_in
    stats["documents_out"] = documents_out
    stats["bytes_in"] = sum(s["bytes_in"] for s in per_source.values())
    stats["bytes_out"] = sum(o["text_bytes"] for o in outputs.values())
    stats["undecodable"] = sum(s["undecodable"] for s in per_source.values())
    manifest = read_manifest(data_cfg)
    manifest["corpus"] = {"fingerprint": key, "stats": stats, "outputs": outputs}
    write_json(manifest_path(data_cfg), manifest)
    dropped = collections.Counter()
    for s in per_source.values():
        dropped.update(s["drops"])
    log(
        f"corpus: {documents_in:,} documents in -> {documents_out:,} out (train {outputs['train']['documents']:,}, "
        f"val {outputs['val']['documents']:,}); dropped: "
        + (", ".join(f"{reason} {count:,}" for reason, count in dropped.most_common()) or "none")
        + f"; {stats['undecodable']:,} undecodable bytes replaced; {stats['bytes_in'] / 1e6:.2f} MB in, "
        f"{stats['bytes_out'] / 1e6:.2f} MB out -> {data_cfg['dir']}/docs_*.jsonl"
    )
    return stats


def corpus_record(data_cfg):
    """The manifest's record of a finished corpus step, or an error saying to run it."""
    done = read_manifest(data_cfg).get("corpus")
    if not done or not outputs_intact(done["outputs"].values()):
        raise DataError(
            f"{data_cfg['dir']}/docs_*.jsonl: missing; run `python corpus.py corpus CONFIG` first"
        )
    return done


def iter_documents(path):
    with open(path, "rb") as f:
        for line in f:
            yield json.loads(line)["text"]


# -----------------------------------------------------------------------------
# Tokenizer training


def sentences_for_training(path, sample_fraction, max_sentence_bytes):
    """Lines of the sampled documents, long ones cut at a space, each shorter than max_sentence_bytes."""
    for text in iter_documents(path):
        digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, person=b"tok-sample").digest()
        if int.from_bytes(digest, "little") >= sample_fraction * 2**64:
            continue
        for line in text.split(NEWLINE):
            while len(line.encode("utf-8")) > max_sentence_bytes:
                head = line.encode("utf-8")[:max_sentence_bytes].decode("utf-8", "ignore")
                cut = head.rfind(" ", 1)
                cut = cut if cut > 0 else len(head)
                yield line[:cut]
                line = line[cut:]
            if line.strip():
                yield line


def trainer_settings(data_cfg):
    """Every sentencepiece trainer option we set (recorded in tokenizer_info.json)."""
    tokenizer_cfg = data_cfg["tokenizer"]
    return {
        "model_type": "bpe",
        "vocab_size": tokenizer_cfg["vocab_size"],
        "character_coverage": tokenizer_cfg["character_coverage"],
        "max_sentence_length": tokenizer_cfg["max_sentence_bytes"],
        "byte_fallback": True,
        "split_digits": True,
        "normalization_rule_name": "identity",
        "remove_extra_whitespaces": False,
        "add_dummy_prefix": False,  # so a text encodes the same whole or line by line
        "allow_whitespace_only_pieces": True,
        "unk_id": 0,
        "unk_piece": UNK_PIECE,
        "bos_id": 1,
        "bos_piece": CONTROL_TOKENS[0],
        "eos_id": 2,
        "eos_piece": CONTROL_TOKENS[1],
        "pad_id": -1,
        "control_symbols": list(CONTROL_TOKENS[2:]),
        "user_defined_symbols": list(USER_DEFINED_PIECES),
        "hard_vocab_limit": True,
    }


def train_tokenizer(data_cfg, log=print):
    """Train the sentencepiece BPE on a sample of the train split -> DIR/tokenizer.model + tokenizer_info.json."""
    if data_cfg["format"] != "shards":
        log("tokenizer: data.format is bytes; the byte tokenizer needs no training")
        return None
    corpus = corpus_record(data_cfg)
    tokenizer_cfg = data_cfg["tokenizer"]
    settings = trainer_settings(data_cfg)
    train_docs = corpus["outputs"]["train"]
    key = fingerprint(
        {"settings": settings, "sample_bytes": tokenizer_cfg["sample_bytes"], "corpus": train_docs}
    )
    model_path = tokenizer_path(data_cfg)
    info_path = os.path.join(data_cfg["dir"], "tokenizer_info.json")
    if os.path.exists(info_path) and os.path.exists(model_path):
        with open(info_path, encoding="utf-8") as f:
            info = json.load(f)
        if info.get("fingerprint") == key and info.get("sha256") == sha256_of_file(model_path):
            log(f"tokenizer: up to date ({model_path})")
            return info

    sample_fraction = min(1.0, tokenizer_cfg["sample_bytes"] / train_docs["text_bytes"])
    sentences = sentences_for_training(
        train_docs["path"], sample_fraction, tokenizer_cfg["max_sentence_bytes"]
    )
    counted = {"sentences": 0, "bytes": 0}

    def counting(items):
        for sentence in items:
            counted["sentences"] += 1
            counted["bytes"] += len(sentence.encode("utf-8"))
            yield sentence

    model = io.BytesIO()
    threads = processes_of(data_cfg)
    log(f"tokenizer: training a {settings['vocab_size']}-token BPE on {threads} threads ...")
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=counting(sentences),
            model_writer=model,
            num_threads=threads,
            input_sentence_size=0,
            minloglevel=2,
            **settings,
        )
    except RuntimeError as e:
        raise DataError(f"data.tokenizer: sentencepiece training failed: {e}") from None
    write_atomic(model_path, lambda f: f.write(model.getvalue()))
    info = {
        "fingerprint": key,
        "sha256": hashlib.sha256(model.getvalue()).hexdigest(),
        "sentencepiece_version": spm.__version__,
        "corpus_sha256": train_docs["sha256"],
        "sample_fraction": sample_fraction,
        "sample_sentences": counted["sentences"],
        "sample_bytes": counted["bytes"],
        "num_threads": threads,
        "special_ids": SentencePieceTokenizer(model_path).special_ids,
        "settings": settings,
    }
    write_json(info_path, info)
    log(
        f"tokenizer: {settings['vocab_size']} tokens from {counted['bytes'] / 1e6:.1f} MB "
        f"({counted['sentences']:,} lines) -> {model_path}"
    )
    return info


# -----------------------------------------------------------------------------
# Encoding: documents -> shards (or the raw byte files of the byte format)


def ordered_map(function, items, workers, threads=False):
    """function(item) for every item, results in input order, on `workers` worker processes (threads for
    a function that spends its time outside the GIL) with a bounded number of items in flight (the input
    may be far larger than memory). Inline for 1 worker."""
    if workers == 1:
        yield from map(function, items)
        return
    pool_class = multiprocessing.pool.ThreadPool if threads else multiprocessing.Pool
    with pool_class(workers) as pool:
        pending = collections.deque()
        for item in items:
            pending.append(pool.apply_async(function, (item,)))
            if len(pending) > 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def batched(items, max_bytes):
    """Group strings (or bytes) into lists of about `max_bytes` characters."""
    batch, size = [], 0
    for item in items:
        batch.append(item)
        size += len(item)
        if size >= max_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def encode_batch(tokenizer, lines):
    """jsonl lines -> (tokens uint16, tokens per document, bytes of the lines)."""
    tokens, counts = [], []
    for line in lines:
        start = len(tokens)
        tokens.append(tokenizer.bos_id)
        tokens.extend(tokenizer.encode(json.loads(line)["text"]))
        tokens.append(tokenizer.eos_id)
        counts.append(len(tokens) - start)
    return np.array(tokens, dtype=np.uint16), np.array(counts, dtype=np.int64), sum(map(len, lines))


def encode_fingerprint(data_cfg, split, corpus):
    if data_cfg["format"] == "bytes":
        return fingerprint({"pipeline": PIPELINE_VERSION, "docs": corpus["outputs"][split]["sha256"]})
    return fingerprint(
        {
            "pipeline": PIPELINE_VERSION,
            "docs": corpus["outputs"][split]["sha256"],
            "tokenizer": sha256_of_file(tokenizer_path(data_cfg)),
            "encode": data_cfg["encode"],
            "mixture": mixture_settings(data_cfg) if split == "train" else None,
        }
    )


# -----------------------------------------------------------------------------
# Mixture: each source's share of the train tokens, realised by repeating or subsampling its documents


def mixture_settings(data_cfg):
    corpus_cfg = data_cfg["corpus"]
    keys = ("name", "weight", "epochs", "max_epochs")
    sources = [{k: s[k] for k in keys if k in s} for s in corpus_cfg["sources"]]
    dedup = corpus_cfg["near_dedup"]
    rehydrate = dedup["rehydrate_copies"] if dedup["rehydrate"] else None
    return {"sources": sources, "mixture": corpus_cfg["mixture"], "rehydrate": rehydrate}


def is_plain_mixture(data_cfg):
    """Every source read once, in file order: no plan needed."""
    settings = mixture_settings(data_cfg)
    return (
        settings["rehydrate"] is None
        and settings["mixture"]["total_tokens"] is None
        and all(s.get("epochs") == 1 for s in settings["sources"])
    )


def rehydrated_copies(cluster_size, table):
    copies = 1
    for min_size, count in table:
        if cluster_size >= min_size:
            copies = count
    return copies


def count_tokens(tokenizer, docs_record, workers):
    """Per train document: (byte offset of its line, tokens incl. <|bos|> <|eos|>, source, cluster size)."""
    offsets, sources, sizes = [], [], []

    def lines():
        position = 0
        with open(docs_record["path"], "rb") as f:
            for line in f:
                record = json.loads(line)
                offsets.append(position)
                sources.append(record["source"])
                # FineWeb-2 parquet carries the cluster size of its own global dedup; ours sees only our files
                sizes.append(max(record.get("cluster_size", 1), record.get("minhash_cluster_size", 1)))
                position += len(line)
                yield line

    counts = []
    encode_lines = functools.partial(encode_batch, tokenizer)
    for _, batch_counts, _ in ordered_map(encode_lines, batched(lines(), 1 << 18), workers, threads=True):
        counts.extend(batch_counts.tolist())
    return np.array(offsets, np.int64), np.array(counts, np.int64), sources, np.array(sizes, np.int64)


def plan_mixture(data_cfg, tokens, sources, cluster_sizes):
    """(document order as indices into docs_train.jsonl, per-source record for the manifest).

    Sources with `epochs` take epochs x their tokens; the rest of total_tokens (default: every source once)
    is shared by `weight`. A source's whole epochs repeat all its documents; the fraction of an epoch is
    a prefix of its documents in a seeded order, cut where its tokens come closest to the target. The plan is
    shuffled by the same seed, so sources interleave across shards."""
    corpus_cfg = data_cfg["corpus"]
    mixture = corpus_cfg["mixture"]
    rng = np.random.default_rng(mixture["seed"])
    sources = np.array(sources)
    table = corpus_cfg["near_dedup"]["rehydrate_copies"] if corpus_cfg["near_dedup"]["rehydrate"] else None
    copies = np.array([rehydrated_copies(int(s), table) for s in cluster_sizes]) if table else None
    base = {}
    for source in corpus_cfg["sources"]:
        docs = np.flatnonzero(sources == source["name"])
        if copies is not None:
            docs = np.repeat(docs, copies[docs])
        base[source["name"]] = docs
    once = {name: int(tokens[docs].sum()) for name, docs in base.items()}
    total = mixture["total_tokens"] or sum(once.values())
    fixed = {s["name"]: s["epochs"] * once[s["name"]] for s in corpus_cfg["sources"] if "epochs" in s}
    weighted = [s for s in corpus_cfg["sources"] if "weight" in s]
    left = total - sum(fixed.values())
    if weighted and left <= 0:
        raise DataError(
            f"data.corpus.mixture.total_tokens: {total:,} tokens leave nothing for the weighted sources after "
            f"the epochs sources take {sum(fixed.values()):,}; raise total_tokens or lower their epochs"
        )
    weight_sum = sum(s["weight"] for s in weighted)
    targets = fixed | {s["name"]: left * s["weight"] / weight_sum for s in weighted}
    plan, record = [], {}
    for index, source in enumerate(corpus_cfg["sources"]):
        name, docs = source["name"], base[source["name"]]
        if once[name] == 0:
            if targets[name] > 0:
                raise DataError(
                    f"data.corpus.sources[{index}] ({name}): no train document survived the filters"
                )
            continue
        epochs = targets[name] / once[name]
        cap = source.get("max_epochs", mixture["max_epochs"])
        if epochs > cap + 1e-9:
            raise DataError(
                f"data.corpus.sources[{index}] ({name}): the mixture needs {epochs:.2f} epochs of its "
                f"{once[name]:,} train tokens, past max_epochs {cap}; lower its weight, add data or set "
                f"data.corpus.sources[{index}].max_epochs"
            )
        whole, fraction = int(epochs), epochs - int(epochs)
        per_epoch = [once[name]] * whole
        plan.extend([docs] * whole)
        if fraction > 0:
            order = rng.permutation(docs)
            running = np.cumsum(tokens[order])
            want = fraction * once[name]
            cut = int(np.searchsorted(running, want))  # running[cut] >= want: take cut or cut + 1 documents
            if cut < len(order) and (cut == 0 or abs(running[cut] - want) < abs(running[cut - 1] - want)):
                cut += 1
            plan.append(order[:cut])
            per_epoch.append(int(running[cut - 1]) if cut else 0)
        record[name] = {
            "licence": source["licence"],
            "documents": int(len(docs)),
            "tokens_once": once[name],
            "target_tokens": int(round(targets[name])),
            "epochs": round(epochs, 4),
            "tokens_per_epoch": per_epoch,
            "tokens": int(sum(per_epoch)),
        }
    order = np.concatenate(plan) if plan else np.zeros(0, np.int64)
    return rng.permutation(order), record


def encode(data_cfg, log=print):
    """Encode both splits; a rerun keeps the shards the manifest lists as finished."""
    corpus = corpus_record(data_cfg)
    if data_cfg["format"] == "shards":
        tokenizer = load_tokenizer(data_cfg)
        info_path = os.path.join(data_cfg["dir"], "tokenizer_info.json")
        if not os.path.exists(info_path):
            raise DataError(f"{info_path}: missing; run `python corpus.py tokenizer CONFIG` first")
    for split in SPLITS:
        key = encode_fingerprint(data_cfg, split, corpus)
        if data_cfg["format"] == "bytes":
            encode_bytes(data_cfg, split, key, log)
        else:
            encode_shards(data_cfg, split, key, tokenizer, corpus["outputs"][split], log)


def encode_bytes(data_cfg, split, key, log):
    path = byte_path(data_cfg, split)
    manifest = read_manifest(data_cfg)
    done = manifest.get("encode", {}).get(split)
    if done and done["fingerprint"] == key and outputs_intact([done]):
        log(f"encode: {split} up to date ({path})")
        return
    digest, documents = hashlib.sha256(), 0

    def write(f):
        nonlocal documents
        for text in iter_documents(docs_path(data_cfg, split)):
            chunk = ((DOCUMENT_SEPARATOR if documents else "") + text).encode("utf-8")
            digest.update(chunk)
            f.write(chunk)
            documents += 1

    write_atomic(path, write)
    record = {"fingerprint": key, "path": path, "size": os.path.getsize(path), "sha256": digest.hexdigest()}
    record |= {"documents": documents, "tokens": os.path.getsize(path), "complete": True}
    manifest = read_manifest(data_cfg)
    manifest.setdefault("encode", {})[split] = record
    write_json(manifest_path(data_cfg), manifest)
    log(f"encode: {split} {documents:,} documents, {record['size']:,} bytes -> {path}")


def finished_shards(data_cfg, split, key, log):
    """Shards of an earlier run with the same inputs that are still intact (a prefix of the list)."""
    done = read_manifest(data_cfg).get("encode", {}).get(split)
    if not done or done.get("fingerprint") != key:
        return [], False
    kept = []
    for shard in done["shards"]:
        path = os.path.join(data_cfg["dir"], shard["name"])
        if not os.path.exists(path) or sha256_of_file(path) != shard["sha256"]:
            log(f"encode: {path} is missing or changed; re-encoding from there")
            return kept, False
        kept.append(shard)
    return kept, done["complete"]


def encode_shards(data_cfg, split, key, tokenizer, docs_record, log):
    """Documents -> shards of tokens_per_shard tokens. Each shard's manifest entry says where the next one
    starts (document of the plan, token within it), so a rerun continues after the last finished shard.
    The train split follows the mixture plan (plan_mixture) unless every source is read once."""
    directory = data_cfg["dir"]
    plan, offsets, mixture = None, None, None
    if split == "train" and not is_plain_mixture(data_cfg):
        plan_path = os.path.join(directory, "mixture_train.npz")
        if os.path.exists(plan_path):
            saved = np.load(plan_path)
            if str(saved["key"]) == key:
                plan, offsets = saved["plan"], saved["offsets"]
                mixture = read_manifest(data_cfg).get("mixture")
        if plan is None or mixture is None:
            log("encode: counting the tokens of every train document for the mixture ...")
            offsets, tokens, sources, sizes = count_tokens(tokenizer, docs_record, processes_of(data_cfg))
            plan, mixture = plan_mixture(data_cfg, tokens, sources, sizes)
            write_atomic(plan_path, lambda f: np.savez(f, key=np.array(key), plan=plan, offsets=offsets))
            manifest = read_manifest(data_cfg)
            manifest["mixture"] = mixture
            write_json(manifest_path(data_cfg), manifest)
        shares = ", ".join(f"{name} {m['epochs']:.2f} epochs" for name, m in mixture.items())
        log(f"encode: mixture of {len(plan):,} train documents: {shares}")
    shards, complete = finished_shards(data_cfg, split, key, log)
    keep = {shard["name"] for shard in shards}
    for path in shard_paths(data_cfg, split):  # stale shards of an older run must not be read
        if os.path.basename(path) not in keep:
            os.remove(path)
    if complete:
        log(f"encode: {split} up to date ({len(shards)} shard(s) in {directory}/)")
        return

    def save_manifest(complete):
        manifest = read_manifest(data_cfg)
        manifest.setdefault("encode", {})[split] = {
            "fingerprint": key,
            "complete": complete,
            "documents": docs_record["documents"] if plan is None else len(plan),
            "tokens": sum(s["tokens"] for s in shards),
            "shards": shards,
        }
        if mixture is not None:
            manifest["encode"][split]["mixture"] = mixture
        write_json(manifest_path(data_cfg), manifest)

    capacity = data_cfg["encode"]["tokens_per_shard"]
    buffer = np.empty(capacity, dtype=np.uint16)
    filled = 0

    def flush(next_document, next_token):
        name = shard_name(split, len(shards))
        sha256 = write_shard(os.path.join(directory, name), buffer[:filled], tokenizer.vocab_size)
        entry = {"name": name, "tokens": filled, "sha256": sha256}
        shards.append(entry | {"next_document": next_document, "next_token": next_token})
        save_manifest(complete=False)

    document, skip = (shards[-1]["next_document"], shards[-1]["next_token"]) if shards else (0, 0)
    if shards:
        log(f"encode: {split} resuming after {len(shards)} finished shards, at document {document:,}")
    progress = tqdm(
        desc=f"encode {split}",
        total=docs_record["size"] if plan is None else None,
        unit="B",
        unit_scale=True,
        mininterval=1.0,
        file=sys.stderr,
    )

    def unread_lines():
        with open(docs_record["path"], "rb") as f:
            if plan is not None:
                for line_index in plan[document:]:
                    f.seek(int(offsets[line_index]))
                    yield f.readline()
                return
            for index, line in enumerate(f):
                if index >= document:
                    yield line
                else:
                    progress.update(len(line))

    # Threads, not processes: sentencepiece releases the GIL while it encodes, the threads share one copy
    # of the model (less CPU time per byte than a process per core) and nothing is pickled between them.
    batches = batched(unread_lines(), 1 << 18)
    encode_lines = functools.partial(encode_batch, tokenizer)
    for tokens, counts, size in ordered_map(encode_lines, batches, processes_of(data_cfg), threads=True):
        # `document` is the batch's first document; its first `skip` tokens are in finished shards.
        ends = np.cumsum(counts)
        taken = skip
        while taken < len(tokens):
            take = min(len(tokens) - taken, capacity - filled)
            buffer[filled : filled + take] = tokens[taken : taken + take]
            filled += take
            taken += take
            if filled == capacity:
                within = int(np.searchsorted(ends, taken, side="right"))  # documents fully taken
                flush(document + within, taken - (int(ends[within - 1]) if within else 0))
                filled = 0
        document += len(counts)
        skip = 0
        progress.update(size)
        progress.set_postfix(docs=document, refresh=False)
    if filled:
        flush(document, 0)
    progress.close()
    save_manifest(complete=True)
    total = sum(s["tokens"] for s in shards)
    documents = docs_record["documents"] if plan is None else len(plan)
    log(f"encode: {split} {documents:,} documents, {total:,} tokens in {len(shards)} shard(s)")


# -----------------------------------------------------------------------------
# Command line


def report(data_cfg, log=print):
    import corpus_report  # matplotlib only when a report is asked for

    return corpus_report.write_report(data_cfg, log)


STEPS = {
    "corpus": [build_corpus],
    "tokenizer": [train_tokenizer],
    "encode": [encode],
    "all": [build_corpus, train_tokenizer, encode],
    "report": [report],
}
USAGE = "usage: python corpus.py {corpus,tokenizer,encode,all,report} CONFIG [section.key=value ...]"


def main(argv):
    if len(argv) < 2 or argv[0] not in STEPS:
        print(USAGE, file=sys.stderr)
        return 2
    import config

    try:
        data_cfg = config.load(argv[1], argv[2:])["data"]
        for step in STEPS[argv[0]]:
            step(data_cfg)
    except config.ConfigError as e:
        print(f"{argv[1]}: config problems:\n  " + str(e).replace("\n", "\n  "), file=sys.stderr)
        return 2
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
