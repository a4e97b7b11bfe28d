"""
Stage 1: the corpus pipeline that turns text files into the shards data.py's loaders read.

    python corpus.py corpus CONFIG [section.key=value ...]     clean, dedup, split  -> DIR/docs_*.jsonl
    python corpus.py tokenizer CONFIG [...]                     sentencepiece BPE    -> DIR/tokenizer.model
    python corpus.py encode CONFIG [...]                        tokens               -> DIR/{train,val}*.bin
    python corpus.py all CONFIG [...]                           the three in order

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

import collections
import functools
import glob
import gzip
import hashlib
import io
import json
import multiprocessing
import multiprocessing.pool
import os
import re
import sys
import unicodedata
import zlib

import numpy as np
import sentencepiece as spm
from tqdm import tqdm

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
# Corpus pipeline: read inputs, clean, dedup, split


SURROGATES = re.compile("[\ud800-\udfff]")
ODD_CHARACTERS = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\ufeff\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]"
)
REPLACEMENTS = {chr(c): " " for c in (0xA0, 0x1680, 0x202F, 0x205F, 0x3000, *range(0x2000, 0x200B))}
REPLACEMENTS |= {"\u2028": NEWLINE, "\u2029": NEWLINE}  # other odd characters (controls, BOM) go
# Spelled with a literal prefix, not as "\n{3,}": the regex engine then scans for the prefix at memory speed,
# several times faster than "\n{3,}" or a loop of str.replace("\n\n\n", "\n\n").
BLANK_LINE_RUNS = re.compile("\n\n\n+")


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


def expand_inputs(corpus_cfg):
    """[(input index, file path)] in config order, sorted within each glob; errors name the input."""
    files = []
    for index, item in enumerate(corpus_cfg["inputs"]):
        pattern, where = item["path"], f"data.corpus.inputs[{index}].path"
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
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def read_documents(path, item, stats):
    """Yield the raw documents (str) of one input file. Undecodable bytes arrive as lone surrogates
    (surrogateescape); clean_batch replaces and counts them. Bad JSON lines are counted in `stats`."""
    mode = item["documents"]
    with open_input(path) as f:
        if mode == "file":
            content = f.read()
            stats["bytes_in"] += len(content)
            yield content.decode("utf-8", "surrogateescape")
            return
        lines = []
        for raw_line in f:
            stats["bytes_in"] += len(raw_line)
            line = raw_line.decode("utf-8", "surrogateescape")
            if mode == "jsonl":
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    stats["rejects"]["bad_json"] += 1
                    continue
                text = record.get(item["text_field"]) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    stats["rejects"]["missing_text_field"] += 1
                    continue
                yield text
            elif line.strip():
                lines.append(line)
            elif lines:
                yield "".join(lines)
                lines = []
        if lines:
            yield "".join(lines)


def raw_documents(corpus_cfg, stats):
    """All raw documents of the corpus in config order, at most max_documents_per_file per file."""
    limit = corpus_cfg["max_documents_per_file"]
    for index, path in expand_inputs(corpus_cfg):
        documents = read_documents(path, corpus_cfg["inputs"][index], stats)
        try:
            for count, text in enumerate(documents):
                if limit is not None and count >= limit:
                    break
                yield text
        except (OSError, EOFError, zlib.error) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
            raise DataError(f"{path}: cannot read ({reason}) [data.corpus.inputs[{index}]]") from None
        finally:
            documents.close()


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


def clean_batch(batch, min_chars, val_fraction):
    """Worker: clean a batch of raw documents -> [(split | reject reason, digest, json line, text bytes,
    undecodable bytes replaced)]."""
    results = []
    for raw in batch:
        text = clean_text(raw)
        try:
            encoded, undecodable = text.encode("utf-8"), 0
        except UnicodeEncodeError:  # lone surrogates: undecodable input bytes or bad JSON escapes
            text, undecodable = replace_undecodable(text)
            encoded = text.encode("utf-8")
        if not text:
            results.append(("empty", None, None, 0, undecodable))
        elif len(text) < min_chars:
            results.append(("too_short", None, None, 0, undecodable))
        else:
            digest = hashlib.blake2b(encoded, digest_size=16).digest()
            split = "val" if int.from_bytes(digest[:8], "little") < val_fraction * 2**64 else "train"
            line = json.dumps({"text": text}, ensure_ascii=False).encode("utf-8") + b"\n"
            results.append((split, digest, line, len(encoded), undecodable))
    return results


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


def corpus_fingerprint(data_cfg):
    corpus_cfg = data_cfg["corpus"]
    files = [
        [path, os.path.getsize(path), os.stat(path).st_mtime_ns] for _, path in expand_inputs(corpus_cfg)
    ]
    return fingerprint({"pipeline": PIPELINE_VERSION, "corpus": corpus_cfg, "files": files})


def outputs_intact(records):
    """True when every recorded output file exists with its recorded size."""
    return all(os.path.exists(r["path"]) and os.path.getsize(r["path"]) == r["size"] for r in records)


def build_corpus(data_cfg, log=print):
    """Clean, dedup and split the inputs into DIR/docs_{train,val}.jsonl; returns the statistics."""
    corpus_cfg = data_cfg["corpus"]
    key = corpus_fingerprint(data_cfg)
    done = read_manifest(data_cfg).get("corpus")
    if done and done["fingerprint"] == key and outputs_intact(done["outputs"].values()):
        log(f"corpus: up to date ({data_cfg['dir']}/docs_*.jsonl)")
        return done["stats"]

    stats = {"bytes_in": 0, "undecodable": 0}
    stats["rejects"] = {"bad_json": 0, "missing_text_field": 0, "empty": 0, "too_short": 0}
    documents_in, duplicates, seen = 0, 0, set()
    outputs = {
        split: {"path": docs_path(data_cfg, split), "documents": 0, "text_bytes": 0} for split in SPLITS
    }
    hashes = {split: hashlib.sha256() for split in SPLITS}
    os.makedirs(data_cfg["dir"], exist_ok=True)
    temps = {split: f"{outputs[split]['path']}.{os.getpid()}.tmp" for split in SPLITS}
    files = {}
    progress = tqdm(desc="corpus", unit="B", unit_scale=True, mininterval=1.0, file=sys.stderr)
    settings = (corpus_cfg["min_chars"], corpus_cfg["val_fraction"])
    jobs = ((batch, *settings) for batch in batched(raw_documents(corpus_cfg, stats), 1 << 20))
    try:
        files = {split: open(temps[split], "wb") for split in SPLITS}
        for results in ordered_map(clean_job, jobs, processes_of(data_cfg)):
            for verdict, digest, line, text_bytes, undecodable in results:  # verdict: a split or a reject
                documents_in += 1
                stats["undecodable"] += undecodable
                if digest is None:
                    stats["rejects"][verdict] += 1
                elif digest in seen:
                    duplicates += 1
                else:
                    seen.add(digest)
                    files[verdict].write(line)
                    hashes[verdict].update(line)
                    outputs[verdict]["documents"] += 1
                    outputs[verdict]["text_bytes"] += text_bytes
            progress.update(stats["bytes_in"] - progress.n)
            progress.set_postfix(docs=documents_in, refresh=False)
        progress.close()
        documents_out = sum(o["documents"] for o in outputs.values())
        if documents_out == 0:
            raise DataError(
                f"data.corpus.inputs: no document survived ({documents_in} read, rejects {stats['rejects']}, "
                f"{duplicates} duplicates); check the inputs and data.corpus.min_chars"
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
        progress.close()
        for split in SPLITS:
            if split in files:
                files[split].close()
            if os.path.exists(temps[split]):
                os.remove(temps[split])

    for split in SPLITS:
        outputs[split].update(size=os.path.getsize(outputs[split]["path"]), sha256=hashes[split].hexdigest())
    documents_in += stats["rejects"]["bad_json"] + stats["rejects"]["missing_text_field"]
    stats.update(documents_in=documents_in, documents_out=documents_out, duplicates=duplicates)
    stats["bytes_out"] = sum(o["text_bytes"] for o in outputs.values())
    manifest = read_manifest(data_cfg)
    manifest["corpus"] = {"fingerprint": key, "stats": stats, "outputs": outputs}
    write_json(manifest_path(data_cfg), manifest)
    rejected = ", ".join(f"{reason} {count:,}" for reason, count in stats["rejects"].items() if count)
    log(
        f"corpus: {documents_in:,} documents in -> {documents_out:,} out (train {outputs['train']['documents']:,}, "
        f"val {outputs['val']['documents']:,}); {duplicates:,} duplicates; rejected: {rejected or 'none'}; "
        f"{stats['undecodable']:,} undecodable bytes replaced; {stats['bytes_in'] / 1e6:.2f} MB in, "
        f"{stats['bytes_out'] / 1e6:.2f} MB out -> {data_cfg['dir']}/docs_*.jsonl"
    )
    return stats


def clean_job(args):
    return clean_batch(*args)


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
        }
    )


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
    starts (document, token within it), so a rerun continues after the last finished shard."""
    directory = data_cfg["dir"]
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
            "documents": docs_record["documents"],
            "tokens": sum(s["tokens"] for s in shards),
            "shards": shards,
        }
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
        total=docs_record["size"],
        unit="B",
        unit_scale=True,
        mininterval=1.0,
        file=sys.stderr,
    )

    def unread_lines():
        with open(docs_record["path"], "rb") as f:
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
    log(f"encode: {split} {docs_record['documents']:,} documents, {total:,} tokens in {len(shards)} shard(s)")


# -----------------------------------------------------------------------------
# Command line


STEPS = {
    "corpus": [build_corpus],
    "tokenizer": [train_tokenizer],
    "encode": [encode],
    "all": [build_corpus, train_tokenizer, encode],
}
USAGE = "usage: python corpus.py {corpus,tokenizer,encode,all} CONFIG [section.key=value ...]"


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
