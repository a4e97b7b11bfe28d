"""
The tokenizer and encode steps of stage 1 (`python -m corpus tokenizer|encode CONFIG`): a sentencepiece BPE
trained on a sample of the train documents, and the documents encoded into data.py's uint16 shards (or the
byte files of the byte format), the train split following the mixture plan of the sources' weights/epochs.
"""

import collections
import functools
import hashlib
import io
import json
import multiprocessing
import multiprocessing.pool
import os
import sys

import numpy as np
import sentencepiece as spm
from tqdm import tqdm

from corpus.docs import (
    DOCUMENT_SEPARATOR,
    corpus_record,
    docs_path,
    iter_documents,
    outputs_intact,
    processes_of,
)
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
    load_tokenizer,
    manifest_path,
    read_manifest,
    shard_name,
    shard_paths,
    tokenizer_path,
    write_shard,
)
from fileio import fingerprint, sha256_of_file, write_atomic, write_json

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
        "split_digits": tokenizer_cfg["split_digits"],
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


def chars_per_token(model_path, paths, log=print):
    """Characters per token of a trained tokenizer on text files, line by line (FLORES-200's spa_Latn dev
    and devtest hold one sentence a line); line ends are not counted. Returns the ratio of all files."""
    tokenizer = SentencePieceTokenizer(model_path)
    chars = tokens = 0
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().split(NEWLINE)
        except OSError as e:
            raise DataError(f"{path}: cannot read ({e.strerror})") from None
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        file_chars = sum(len(line) for line in lines)
        file_tokens = sum(len(tokenizer.encode(line)) for line in lines if line)
        if not file_tokens:
            raise DataError(f"{path}: no text")
        log(
            f"{path}: {file_chars:,} chars, {file_tokens:,} tokens, {file_chars / file_tokens:.3f} chars/token"
        )
        chars, tokens = chars + file_chars, tokens + file_tokens
    log(
        f"chars/token: {chars / tokens:.3f} ({model_path}, {tokenizer.vocab_size} tokens, {len(paths)} file(s))"
    )
    return chars / tokens


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
            raise DataError(f"{info_path}: missing; run `python -m corpus tokenizer CONFIG` first")
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
