"""
The SFT mixture (data.chat.mixture): conversations from several sources (chat/sources.py), filtered with the
corpus step's tools (corpus/filters.py), split, decontaminated and mixed by share into DIR/train.jsonl and
DIR/val.jsonl, which data.chat.train and data.chat.val then name. `python -m chat prepare CONFIG` builds it
before packing (nothing is redone when the config and the files are unchanged), and checks the epochs the run
makes of each source.

The stages, in order, each counted per source in DIR/manifest.json and DIR/report.md (chat/report.py):
    read             rows that cannot be a conversation counted by reason (chat/sources.py)
    turns            every message: markup the template cannot render (a lone surrogate, a control character)
                     or text that imitates a control token or a tool tag; sources with filters: also
                     language ID per turn (py3langid) and length bounds. A conversation is cut before its first
                     bad turn, at its last answer; with no answer left it is dropped. PII is replaced (the
                     corpus's placeholders) in every source.
    exact_dedup      the same turns (case and spacing aside) as an earlier conversation, across sources
    near_dedup       datatrove's MinHash across sources: a conversation of a filtered source in a cluster with
                     an earlier one is dropped (sources without filters, such as generated templates, are never
                     dropped here: their near-duplicates are their variation)
    val              a val_fraction of a source's conversations, by a hash of the first user turn (the branches
                     of one tree stay together), is held out into val.jsonl: never trained on
    decontamination  train conversations sharing an n-gram with an evaluation file (or a whole turn with one
                     of its short texts), or too many n-grams with the val split, are dropped
    mixture          each source repeated or subsampled (seeded) to its share of mixture.conversations
"""

import collections
import glob
import hashlib
import json
import math
import os
import random
import re
import unicodedata

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import fileio
from chat import sources, template
from corpus import filters

MANIFEST = "manifest.json"
MIXTURE_VERSION = 1  # bump when a stage changes what the same input produces
CONTROL_TOKEN = re.compile(r"<\|[A-Za-z_0-9]+\|>")


def text_of(conversation):
    """The text of a conversation's turns (what dedup, decontamination and token counts look at)."""
    return "\n".join(message["content"] for message in conversation["messages"])


def spoken_text(conversation):
    """The text of its turns without the system message: a system prompt is the deployment's template (the
    family's name, the date), not what an evaluation asks or answers."""
    return "\n".join(m["content"] for m in conversation["messages"] if m["role"] != "system")


def turn_problem(message, checks):
    """The reason a message cannot be trained on, or None. checks: (language stage, cfg) or None for a
    source without filters (markup is checked for every source)."""
    text = message["content"]
    if fileio.text_problem(text):
        return "markup"
    if any(unicodedata.category(c) == "Cc" and c not in "\n\t\r" for c in text):
        return "markup"
    if CONTROL_TOKEN.search(text) or any(tag in text for tag in template.PROTOCOL_TAGS):
        return "control_token"
    if checks is None or message["role"] == "tool" or not text.strip():
        return None
    language, cfg = checks
    if len(text) < cfg["turn_chars"]["min"]:
        return "too_short"
    if len(text) > cfg["turn_chars"]["max"]:
        return "too_long"
    if len(text) >= cfg["language"]["min_chars"]:
        code, score = language.score(text)
        if code not in cfg["language"]["languages"]:
            return f"language_{code}"
        if score < cfg["language"]["min_score"]:
            return "language_low_score"
    return None


def cut_at_bad_turn(conversation, checks, dropped_turns):
    """The conversation up to its last answer before the first bad turn (None when none is left); counts
    the turns left out by the first one's reason."""
    messages = conversation["messages"]
    for index, message in enumerate(messages):
        reason = turn_problem(message, checks)
        if reason is None:
            continue
        end = index
        while end and (messages[end - 1]["role"] != "assistant" or messages[end - 1].get("tool_calls")):
            end -= 1
        dropped_turns[reason] += len(messages) - end
        return {**conversation, "messages": messages[:end]} if end else None
    return conversation


def scrub(conversation, scrubber, pii_counts):
    """The conversation with personal data replaced (the same object when there was none)."""
    messages, replaced = [], 0
    for message in conversation["messages"]:
        text, counts = scrubber(message["content"])
        pii_counts.update(counts)
        replaced += sum(counts.values())
        messages.append({**message, "content": text})
    return {**conversation, "messages": messages} if replaced else conversation


def dedup_key(conversation):
    normal = " ".join(text_of(conversation).lower().split())
    return hashlib.sha256(normal.encode("utf-8")).hexdigest()


def first_user_turn(conversation):
    return next((m["content"] for m in conversation["messages"] if m["role"] == "user"), "")


def held_out(conversation, fraction):
    digest = hashlib.sha256(first_user_turn(conversation).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


# -----------------------------------------------------------------------------
# Evaluation texts


def texts_in(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from texts_in(item)
    elif isinstance(value, list):
        for item in value:
            yield from texts_in(item)


def table_texts(path):
    """The strings of every text column of a parquet file or of an Arrow file (the Hugging Face datasets
    cache keeps lm-eval's task data as Arrow streams)."""
    if path.endswith(".parquet"):
        table = pq.read_table(path)
    else:
        with pa.memory_map(path) as source:
            try:
                table = pa.ipc.open_stream(source).read_all()
            except pa.ArrowInvalid:
                table = pa.ipc.open_file(source).read_all()
    return [
        value
        for column in table.columns
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type)
        for value in column.to_pylist()
        if value
    ]


def evaluation_texts(path):
    """The texts of an evaluation file: each turn of a JSONL conversation (its system message aside), every
    string of another JSONL record (a prompt), the text columns of a parquet or Arrow table, or the
    paragraphs of a text file."""
    if path.endswith((".parquet", ".arrow")):
        try:
            return table_texts(path)
        except (OSError, pa.ArrowException) as e:
            raise template.ChatError(f"{path}: not a readable parquet or Arrow table ({e})") from None
    try:
        with open(path, "rb") as f:
            text = template.decode_utf8(f.read(), path)
    except OSError as e:
        raise template.ChatError(f"{path}: cannot read ({e.strerror})") from None
    if not path.endswith(".jsonl"):
        return [part for part in text.split("\n\n") if part.strip()]
    found = []
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise template.ChatError(f"{path}:{number}: not JSON ({e})") from None
        messages = record.get("messages") if isinstance(record, dict) else None
        if isinstance(messages, list):
            found += [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") != "system"]
        else:
            found += texts_in(record)
    return [text for text in found if isinstance(text, str)]


def evaluation_files(decon_cfg):
    """The files to protect: eval_files must exist; eval_files_if_present are globs (~ is the home folder,
    ** any depth) that may match none, such as the Hugging Face datasets cache where lm-eval keeps its tasks."""
    paths = template.expand_paths(decon_cfg["eval_files"], "data.chat.mixture.decontamination.eval_files")
    for pattern in decon_cfg["eval_files_if_present"]:
        found = glob.glob(os.path.expanduser(pattern), recursive=True)
        paths += sorted(path for path in found if os.path.isfile(path))
    return paths


def normal_words(text):
    return " ".join(filters.NON_WORD.sub(" ", text.lower()).split())


def protector(decon_cfg, val_items):
    """(Decontaminator of the evaluation files and the val split, {normal words of a short evaluation text:
    its file}): a text shorter than an n-gram is matched as a whole turn."""
    guard = filters.Decontaminator(decon_cfg["ngram"], None, decon_cfg["val_max_overlap"])
    short = {}
    for path in evaluation_files(decon_cfg):
        for text in evaluation_texts(path):
            guard.protect(path, text)
            words = normal_words(text)
            if decon_cfg["min_words"] <= len(words.split()) < decon_cfg["ngram"]:
                short.setdefault(words, path)
    for item in val_items:
        guard.protect("val", spoken_text(item["conversation"]))
    return guard, short


def contamination(conversation, guard, short):
    """The name of what a train conversation overlaps (an evaluation file, "val"), or None."""
    hit = guard.hit(spoken_text(conversation))
    if hit is not None:
        return hit
    return next(
        (short[w] for m in conversation["messages"] if (w := normal_words(m["content"])) in short), None
    )


# -----------------------------------------------------------------------------
# The build


class Funnel:
    """Conversations and tokens of each source after each stage, and what each stage dropped."""

    def __init__(self, mix_cfg):
        self.sources = {
            s["name"]: {
                "kind": s["kind"],
                "licence": s["licence"],
                "share": s["share"],
                "stages": [],
                "bad_rows": {},
                "bad_examples": {},
                "dropped_turns": collections.Counter(),
                "pii": collections.Counter(),
                "decontamination": collections.Counter(),
            }
            for s in mix_cfg["sources"]
        }

    def count(self, stage, items):
        totals = {name: [0, 0] for name in self.sources}
        for item in items:
            totals[item["source"]][0] += 1
            totals[item["source"]][1] += item["tokens"]
        for name, (conversations, tokens) in totals.items():
            self.sources[name]["stages"].append(
                {"stage": stage, "conversations": conversations, "tokens": tokens}
            )


def read_all(mix_cfg, funnel, tokenizer):
    items = []
    for index, source in enumerate(mix_cfg["sources"]):
        found, rows = sources.read_source(index, source)
        funnel.sources[source["name"]]["bad_rows"] = rows.counts
        funnel.sources[source["name"]]["bad_examples"] = rows.examples
        for where, conversation in found:
            if template.text_problems(conversation):  # a lone surrogate ("\ud800"): no tokenizer encodes it
                rows.add("not_unicode", where)
                continue
            tokens = len(tokenizer.encode(text_of(conversation)))
            items.append(
                {"source": source["name"], "where": where, "conversation": conversation, "tokens": tokens}
            )
    return items


def filter_turns(mix_cfg, items, funnel, tokenizer):
    cfg = mix_cfg["filters"]
    language = filters.LanguageStage(cfg["language"])
    scrubber = filters.PiiScrubber(cfg["pii"]) if cfg["pii"]["enabled"] else None
    filtered = {s["name"]: s["filters"] for s in mix_cfg["sources"]}
    kept = []
    for item in items:
        stats = funnel.sources[item["source"]]
        checks = (language, cfg) if filtered[item["source"]] else None
        conversation = cut_at_bad_turn(item["conversation"], checks, stats["dropped_turns"])
        if conversation is None:
            continue
        if scrubber is not None:
            conversation = scrub(conversation, scrubber, stats["pii"])
        if conversation is not item["conversation"]:
            item = item | {
                "conversation": conversation,
                "tokens": len(tokenizer.encode(text_of(conversation))),
            }
        kept.append(item)
    return kept


def exact_dedup(items):
    seen, kept = set(), []
    for item in items:
        key = dedup_key(item["conversation"])
        if key not in seen:
            seen.add(key)
            kept.append(item)
    return kept


def near_dedup(mix_cfg, items):
    cfg = mix_cfg["filters"]["near_dedup"]
    if not cfg["enabled"] or not items:
        return items
    hasher = filters.MinHasher(cfg, filters.word_splitter("regex"))
    keys = np.zeros((len(items), cfg["buckets"]), dtype=np.uint64)
    for row, item in enumerate(items):
        signature = hasher.bucket_keys(text_of(item["conversation"]))
        if signature is not None:
            keys[row] = signature
    clusters = filters.near_duplicate_clusters(keys)
    filtered = {s["name"]: s["filters"] for s in mix_cfg["sources"]}
    return [item for row, item in enumerate(items) if clusters[row] == row or not filtered[item["source"]]]


def split(mix_cfg, items):
    fractions = {s["name"]: s.get("val_fraction", 0) for s in mix_cfg["sources"]}
    train, val = [], []
    for item in items:
        (val if held_out(item["conversation"], fractions[item["source"]]) else train).append(item)
    return train, val


def decontaminate(mix_cfg, train, val, funnel):
    guard, short = protector(mix_cfg["filters"]["decontamination"], val)
    kept = []
    for item in train:
        hit = contamination(item["conversation"], guard, short)
        if hit is None:
            kept.append(item)
        else:
            funnel.sources[item["source"]]["decontamination"][hit] += 1
    return kept


def mix(mix_cfg, train, funnel):
    """The train mixture: each source's conversations repeated (whole passes, then a seeded subset) to its
    share of mixture.conversations (null: as many as keep every source within one pass), shuffled."""
    by_source = {s["name"]: [] for s in mix_cfg["sources"]}
    for item in train:
        by_source[item["source"]].append(item)
    shares = {s["name"]: s["share"] for s in mix_cfg["sources"]}
    all_shares = sum(shares.values())
    for name, items in by_source.items():
        if not items:
            raise template.ChatError(
                f"data.chat.mixture.sources ({name}): no train conversation left after the filters "
                f"({funnel.sources[name]['stages']}); check its files and filters"
            )
    total = mix_cfg["conversations"]
    if total is None:
        total = math.floor(min(len(by_source[name]) * all_shares / share for name, share in shares.items()))
    mixed = []
    for name, share in shares.items():
        items = by_source[name]
        want = round(total * share / all_shares)
        passes, rest = divmod(want, len(items))
        mixed += items * passes + random.Random(f"{mix_cfg['seed']}:{name}").sample(items, rest)
        funnel.sources[name]["mixture"] = {
            "conversations": want,
            "unique": len(items),
            "epochs": want / len(items),
        }
    random.Random(mix_cfg["seed"]).shuffle(mixed)
    return mixed


def turns_per_conversation(items):
    """{source: {"1", "2", ..., "5+": conversations with that many user turns}}."""
    histogram = collections.defaultdict(collections.Counter)
    for item in items:
        turns = sum(m["role"] == "user" for m in item["conversation"]["messages"])
        histogram[item["source"]][str(turns) if turns < 5 else "5+"] += 1
    return {name: dict(sorted(counts.items())) for name, counts in histogram.items()}


def write_jsonl(path, items):
    lines = "".join(
        json.dumps(item["conversation"] | {"source": item["source"]}, ensure_ascii=False) + "\n"
        for item in items
    )
    fileio.write_atomic(path, lambda f: f.write(lines.encode("utf-8")))
    return fileio.sha256_of_file(path)


def inputs_fingerprint(mix_cfg, tokenizer_sha):
    files = [
        path
        for index, source in enumerate(mix_cfg["sources"])
        for path in sources.source_files(index, source)
    ]
    files += evaluation_files(mix_cfg["filters"]["decontamination"])
    return fileio.fingerprint(
        {
            "version": MIXTURE_VERSION,
            "mixture": mix_cfg,
            "tokenizer": tokenizer_sha,
            "files": [[path, fileio.sha256_of_file(path)] for path in files],
        }
    )


def up_to_date(directory, key):
    """The manifest of a finished build of these inputs whose outputs are unchanged, else None."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        manifest = json.load(f)
    if manifest.get("fingerprint") != key:
        return None
    for name, sha in manifest["outputs"].items():
        output = os.path.join(directory, name)
        if not os.path.exists(output) or fileio.sha256_of_file(output) != sha:
            return None
    return manifest


def build(data_cfg, tokenizer, tokenizer_sha, log=print):
    """Build the mixture into data.chat.mixture.dir (train.jsonl, val.jsonl, manifest.json, report.md and
    its plot); returns the manifest."""
    from chat import report  # matplotlib only when a mixture is built

    mix_cfg = data_cfg["chat"]["mixture"]
    names = [source["name"] for source in mix_cfg["sources"]]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise template.ChatError(
            f"data.chat.mixture.sources: the name {twice[0]!r} is used twice; names must differ"
        )
    directory = mix_cfg["dir"]
    key = inputs_fingerprint(mix_cfg, tokenizer_sha)
    manifest = up_to_date(directory, key)
    if manifest is not None:
        log(f"mixture: up to date ({directory}/)")
        return manifest
    funnel = Funnel(mix_cfg)
    items = read_all(mix_cfg, funnel, tokenizer)
    funnel.count("read", items)
    items = filter_turns(mix_cfg, items, funnel, tokenizer)
    funnel.count("turns", items)
    items = exact_dedup(items)
    funnel.count("exact_dedup", items)
    items = near_dedup(mix_cfg, items)
    funnel.count("near_dedup", items)
    train, val = split(mix_cfg, items)
    funnel.count("val", train)
    train = decontaminate(mix_cfg, train, val, funnel)
    funnel.count("decontamination", train)
    mixed = mix(mix_cfg, train, funnel)
    os.makedirs(directory, exist_ok=True)
    outputs = {"train.jsonl": write_jsonl(os.path.join(directory, "train.jsonl"), mixed)}
    outputs["val.jsonl"] = write_jsonl(os.path.join(directory, "val.jsonl"), val)
    turns = turns_per_conversation(train)
    held = collections.Counter(item["source"] for item in val)
    for name, stats in funnel.sources.items():
        stats |= {"turns": turns.get(name, {}), "val": held[name]}
    manifest = {"fingerprint": key, "outputs": outputs, "sources": funnel.sources}
    report.write_report(directory, manifest, mix_cfg["sources"])
    fileio.write_json(os.path.join(directory, MANIFEST), manifest)  # last: a kill before it builds again
    for name, stats in funnel.sources.items():
        read, last = stats["stages"][0], stats["stages"][-1]
        log(
            f"mixture: {name}: {read['conversations']:,} conversations read ({sum(stats['bad_rows'].values()):,} "
            f"rows left out), {last['conversations']:,} kept for training ({last['tokens']:,} tokens), "
            f"{stats['val']:,} held out; in the mixture {stats['mixture']['conversations']:,} "
            f"({stats['mixture']['epochs']:.2f} epochs)"
        )
    log(f"mixture: {len(mixed):,} train and {len(val):,} val conversations -> {directory}/ (report.md)")
    return manifest


def check_epochs(cfg, manifest, train_rows, log=print):
    """Print the epochs the run makes of each source (its passes over the packed train rows times the
    source's epochs in the mixture) and refuse past its max_epochs. Returns {source: epochs}."""
    mix_cfg, train_cfg = cfg["data"]["chat"]["mixture"], cfg["train"]
    rows_read = train_cfg["max_steps"] * train_cfg["micro_batch_size"] * train_cfg["grad_accum_steps"]
    passes = rows_read / train_rows
    epochs = {name: passes * stats["mixture"]["epochs"] for name, stats in manifest["sources"].items()}
    shown = ", ".join(f"{name} {value:.2f}" for name, value in epochs.items())
    log(
        f"data: the run reads {rows_read:,} rows (train.max_steps x micro_batch_size x grad_accum_steps); the "
        f"train split holds {train_rows:,} ({passes:.2f} passes); epochs per source: {shown}"
    )
    limits = {s["name"]: s.get("max_epochs") or mix_cfg["max_epochs"] for s in mix_cfg["sources"]}
    worst = max(epochs, key=lambda name: epochs[name] / limits[name])
    if epochs[worst] > limits[worst]:
        steps = math.floor(train_cfg["max_steps"] * limits[worst] / epochs[worst])
        raise template.ChatError(
            f"data.chat.mixture.max_epochs: the run would read {worst} {epochs[worst]:.1f} times, past "
            f"{limits[worst]}; lower train.max_steps to {steps:,} or below, or lower {worst}'s share"
        )
    return epochs
