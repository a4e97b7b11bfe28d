"""
The preparation command of chat data: python -m chat prepare | import | preferences | seed-pairs | show.

prepare packs conversations (SFT) or preference pairs (DPO) into the shards data.ChatLoader and data.PairLoader
read; import converts public data (chat/convert.py's importers); preferences turns the family's consented
feedback (family/feedback.py's rules, read from the server's database) into pairs; seed-pairs makes pairs
with worse answers from conversations; show prints what training sees. Everything is rendered by the one
template, chat/template.py's render().
"""

import bisect
import collections
import contextlib
import glob
import hashlib
import json
import os
import sqlite3
import sys

import numpy as np

import config
import fileio
from chat import convert
from chat.template import (
    ChatError,
    decode_utf8,
    expand_paths,
    preference_problems,
    read_conversations,
    read_preferences,
    render,
    render_pair,
    segments,
    training_problems,
)
from family import feedback

# -----------------------------------------------------------------------------
# Packing conversations (SFT) and preference pairs (DPO): python -m chat prepare CONFIG

PREPARE_VERSION = 1  # bump when rendering or packing changes what the same input produces


def truncate_at_turn(conversation, tokenizer, row_len):
    """(ids, mask) of the longest prefix that ends after a final assistant answer (no pending tool call)
    and fits row_len tokens; None when even the first answer does not fit."""
    messages = conversation["messages"]
    for end in range(len(messages), 0, -1):
        last = messages[end - 1]
        if last["role"] != "assistant" or last.get("tool_calls"):
            continue
        ids, mask = render({**conversation, "messages": messages[:end]}, tokenizer)
        if len(ids) <= row_len:
            return ids, mask
    return None


def best_fit(lengths, capacity):
    """Best-fit decreasing bin packing: rows as lists of indices into lengths (each <= capacity). The
    longest sequence goes first, each into the fullest row it still fits, else into a new row."""
    rows, free = [], []  # free: sorted (space left, row index)
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        at = bisect.bisect_left(free, (lengths[index], -1))
        if at < len(free):
            space, row = free.pop(at)
        else:
            space, row = capacity, len(rows)
            rows.append([])
        rows[row].append(index)
        if space > lengths[index]:
            bisect.insort(free, (space - lengths[index], row))
    return [sorted(row) for row in rows]


def pack_split(conversations, tokenizer, row_len, too_long, log=print):
    """Render and pack conversations into (tokens, mask) arrays of shape (rows, row_len), plus stats.
    Every row starts with <|bos|> (every rendered conversation does) and holds whole conversations; the
    rest of a row is <|eos|> padding with mask 0."""
    rendered = []
    stats = {"conversations": len(conversations), "dropped_too_long": 0, "truncated": 0}
    for where, conversation in conversations:
        ids, mask = render(conversation, tokenizer)
        if len(ids) > row_len:
            cut = truncate_at_turn(conversation, tokenizer, row_len) if too_long == "truncate" else None
            if cut is None:
                stats["dropped_too_long"] += 1
                log(f"dropping {where}: {len(ids)} tokens, longer than a row of seq_len + 1 = {row_len}")
                continue
            stats["truncated"] += 1
            ids, mask = cut
        rendered.append((ids, mask))
    rows = best_fit([len(ids) for ids, _ in rendered], row_len)
    tokens = np.full((len(rows), row_len), tokenizer.eos_id, dtype=np.uint16)
    masks = np.zeros((len(rows), row_len), dtype=np.uint16)
    for r, members in enumerate(rows):
        at = 0
        for index in members:
            ids, mask = rendered[index]
            tokens[r, at : at + len(ids)] = ids
            masks[r, at : at + len(ids)] = mask
            at += len(ids)
    used = sum(len(ids) for ids, _ in rendered)
    stats |= {
        "packed": len(rendered),
        "rows": len(rows),
        "tokens": used,
        "trained_tokens": int(masks.sum()),
        "fill": used / max(1, len(rows) * row_len),
    }
    return tokens, masks, stats


def fit_pair(pair, tokenizer, row_len, too_long):
    """render_pair() of the pair when both sequences fit row_len tokens; with too_long 'truncate', of the
    pair with its prompt's oldest turns dropped (up to the next user message; the system message stays)
    until they fit. Returns (rendered or None, whether turns were dropped)."""
    prompt = pair["prompt"]
    system = prompt[:1] if prompt[0]["role"] == "system" else []
    turns, cut = prompt[len(system) :], False
    while True:
        rendered = render_pair({**pair, "prompt": system + turns}, tokenizer)
        if max(len(ids) for ids, _ in rendered) <= row_len:
            return rendered, cut
        later = [i for i, message in enumerate(turns) if message["role"] == "user" and i > 0]
        if too_long == "drop" or not later:
            return None, False
        turns, cut = turns[later[0] :], True


def pack_pairs(pairs, tokenizer, row_len, too_long, log=print):
    """Render preference pairs into (tokens, mask) arrays of shape (2 x pairs, row_len): pair p's chosen
    sequence in row 2p and its rejected one in row 2p + 1, each alone in its row (a pair's log-probabilities
    must not depend on what else shares the row), padded with <|eos|> under mask 0."""
    stats = {"pairs": len(pairs), "dropped_too_long": 0, "truncated": 0}
    kept = []
    for where, pair in pairs:
        rendered, cut = fit_pair(pair, tokenizer, row_len, too_long)
        if rendered is None:
            stats["dropped_too_long"] += 1
            log(f"dropping {where}: prompt + answer longer than a row of seq_len + 1 = {row_len} tokens")
            continue
        stats["truncated"] += int(cut)
        kept += rendered
    tokens = np.full((len(kept), row_len), tokenizer.eos_id, dtype=np.uint16)
    masks = np.zeros((len(kept), row_len), dtype=np.uint16)
    for row, (ids, mask) in enumerate(kept):
        tokens[row, : len(ids)] = ids
        masks[row, : len(ids)] = mask
    used = sum(len(ids) for ids, _ in kept)
    stats |= {
        "packed": len(kept) // 2,
        "rows": len(kept),
        "tokens": used,
        "trained_tokens": int(masks.sum()),
        "fill": used / max(1, len(kept) * row_len),
    }
    return tokens, masks, stats


def prepare(cfg, log=print):
    """Pack data.chat's train and val conversations (data.format chat) or preference pairs (data.format
    preference) into DIR (see data.ChatLoader and data.PairLoader for the layouts). The manifest records
    each finished shard, so an interrupted run continues after the last one, and a rerun with unchanged
    inputs does nothing."""
    import data  # not at the top: python -m chat import and preferences have no use for torch
    from chat import mixture  # datatrove and matplotlib, for a mixture only

    data_cfg, seq_len = cfg["data"], cfg["model"]["seq_len"]
    if data_cfg["format"] not in ("chat", "preference"):
        raise ChatError(
            f"data.format is {data_cfg['format']!r}; `python -m chat prepare` needs data.format: chat or preference"
        )
    chat_cfg, directory = data_cfg["chat"], data_cfg["dir"]
    try:
        tokenizer = data.SentencePieceTokenizer(chat_cfg["tokenizer"])
    except data.DataError as e:
        raise ChatError(f"data.chat.tokenizer: {e}") from None
    if tokenizer.vocab_size != cfg["model"]["vocab_size"]:
        raise ChatError(
            f"data.chat.tokenizer: {chat_cfg['tokenizer']} has {tokenizer.vocab_size} tokens but "
            f"model.vocab_size is {cfg['model']['vocab_size']}"
        )
    os.makedirs(directory, exist_ok=True)
    tokenizer_sha = fileio.sha256_of_file(chat_cfg["tokenizer"])
    copy = data.tokenizer_path(data_cfg)
    if not os.path.exists(copy) or fileio.sha256_of_file(copy) != tokenizer_sha:
        manifest = data.read_manifest(data_cfg)
        if manifest.pop("prepare", None) is not None:  # shards of another tokenizer are no longer valid
            fileio.write_json(data.manifest_path(data_cfg), manifest)
        info = os.path.join(os.path.dirname(chat_cfg["tokenizer"]), "tokenizer_info.json")
        for source, name in ((chat_cfg["tokenizer"], "tokenizer.model"), (info, "tokenizer_info.json")):
            if os.path.exists(source):
                with open(source, "rb") as f:
                    content = f.read()
                fileio.write_atomic(os.path.join(directory, name), lambda out, c=content: out.write(c))
        log(f"prepare: tokenizer {chat_cfg['tokenizer']} -> {copy}")

    built = None
    if "mixture" in chat_cfg:
        if data_cfg["format"] != "chat":
            raise ChatError(
                f"data.chat.mixture: builds conversations; data.format is {data_cfg['format']!r}, not chat"
            )
        check_mixture_named(chat_cfg)
        built = mixture.build(data_cfg, tokenizer, tokenizer_sha, log)
    row_len = seq_len + 1
    packed = {}
    for split in data.SPLITS:
        paths = expand_paths(chat_cfg[split], f"data.chat.{split}")
        key = fileio.fingerprint(
            {
                "version": PREPARE_VERSION,
                "format": data_cfg["format"],
                "files": [[path, fileio.sha256_of_file(path)] for path in paths],
                "tokenizer": tokenizer_sha,
                "seq_len": seq_len,
                "too_long": chat_cfg["too_long"],
                "bad_lines": chat_cfg["bad_lines"],
                "rows_per_shard": chat_cfg["rows_per_shard"],
            }
        )
        packed[split] = prepare_split(data_cfg, split, key, paths, tokenizer, row_len, log)
    if built is not None:
        mixture.check_epochs(cfg, built, packed["train"]["rows"], log)


def check_mixture_named(chat_cfg):
    """data.chat.train and val must read what the mixture writes, or the build would be for nothing."""
    directory = chat_cfg["mixture"]["dir"]
    for split in ("train", "val"):
        path = os.path.join(directory, f"{split}.jsonl")
        if not any(os.path.normpath(p) == os.path.normpath(path) for p in chat_cfg[split]):
            raise ChatError(
                f"data.chat.{split}: {chat_cfg[split]} does not name {path}, which data.chat.mixture writes"
            )


def intact_shards(data_cfg, record, log):
    """The prefix of a manifest record's shards whose two files are unchanged on disk."""

    kept = []
    for shard in record["shards"]:
        for name, sha in ((shard["name"], shard["sha256"]), (shard["mask"], shard["mask_sha256"])):
            path = os.path.join(data_cfg["dir"], name)
            if not os.path.exists(path) or fileio.sha256_of_file(path) != sha:
                log(f"prepare: {path} is missing or changed; packing again from there")
                return kept
        kept.append(shard)
    return kept


def prepare_split(data_cfg, split, key, paths, tokenizer, row_len, log):
    import data

    chat_cfg, directory = data_cfg["chat"], data_cfg["dir"]
    done = data.read_manifest(data_cfg).get("prepare", {}).get(split)
    shards = intact_shards(data_cfg, done, log) if done and done["fingerprint"] == key else []
    if done and done["fingerprint"] == key and done["complete"] and len(shards) == len(done["shards"]):
        log(f"prepare: {split} up to date ({len(shards)} shard(s) in {directory}/)")
        return done["stats"]
    keep = {name for shard in shards for name in (shard["name"], shard["mask"])}
    stale = glob.glob(os.path.join(glob.escape(directory), f"{split}_[0-9]*.bin"))
    stale += glob.glob(os.path.join(glob.escape(directory), f"mask_{split}_[0-9]*.bin"))
    for path in stale:  # files of an older packing must never be read with this manifest
        if os.path.basename(path) not in keep:
            os.remove(path)

    pairs = data_cfg["format"] == "preference"
    records, skipped = [], 0
    for path in paths:
        found, bad = (read_preferences if pairs else read_conversations)(path, chat_cfg["bad_lines"], log)
        records += found
        skipped += bad
    pack = pack_pairs if pairs else pack_split
    tokens, masks, stats = pack(records, tokenizer, row_len, chat_cfg["too_long"], log)
    stats["skipped_bad_lines"] = skipped
    what = "preference pair" if pairs else "conversation"
    if stats["rows"] == 0:
        raise ChatError(f"data.chat.{split}: no {what} left to pack ({stats})")

    def save_manifest(complete):
        manifest = data.read_manifest(data_cfg)
        record = {"fingerprint": key, "complete": complete, "seq_len": row_len - 1, "stats": stats}
        manifest.setdefault("prepare", {})[split] = record | {"shards": shards}
        fileio.write_json(data.manifest_path(data_cfg), manifest)

    per_shard = chat_cfg["rows_per_shard"]
    if shards:
        log(f"prepare: {split} resuming after {len(shards)} finished shard(s)")
    for first in range(len(shards) * per_shard, stats["rows"], per_shard):
        index = first // per_shard
        name, mask_name = data.shard_name(split, index), data.mask_shard_name(split, index)
        rows = slice(first, first + per_shard)
        sha = data.write_shard(os.path.join(directory, name), tokens[rows].ravel(), tokenizer.vocab_size)
        mask_sha = data.write_shard(os.path.join(directory, mask_name), masks[rows].ravel(), 2)
        count = len(tokens[rows])
        shards.append(
            {"name": name, "mask": mask_name, "rows": count, "sha256": sha, "mask_sha256": mask_sha}
        )
        save_manifest(complete=False)
    save_manifest(complete=True)
    log(
        f"prepare: {split} {stats['packed']:,}/{stats['pairs' if pairs else 'conversations']:,} {what}s "
        f"({stats['skipped_bad_lines']} bad lines skipped, {stats['dropped_too_long']} too long dropped, "
        f"{stats['truncated']} truncated) -> {stats['rows']:,} rows of {row_len} tokens, "
        f"{100 * stats['fill']:.1f}% filled, {stats['trained_tokens']:,} trained tokens, "
        f"{len(shards)} shard(s) in {directory}/"
    )
    return stats


def download(cfg, log=print):
    """Fetch the files of data.chat.mixture's Hub sources (corpus/hub.py's client: resumable, checksummed)."""
    from corpus import hub  # the Hub client, for this command only

    mix_cfg = cfg["data"].get("chat", {}).get("mixture")
    sources = hub.hub_sources(mix_cfg["sources"], "data.chat.mixture.sources") if mix_cfg else []
    if not sources:
        log("download: no source of data.chat.mixture names a Hub dataset; nothing to do")
        return {}
    return hub.download_sources(sources, mix_cfg["download"]["workers"], log)


# -----------------------------------------------------------------------------
# Importing public data (the converters are chat/convert.py's) -> our conversations JSONL


def read_records(path):
    """(where, record) of a JSON array file (where = 'FILE: item N') or a JSONL file ('FILE:LINE')."""
    try:
        with open(path, "rb") as f:
            text = decode_utf8(f.read(), path)
    except OSError as e:
        raise ChatError(f"{path}: cannot read ({e.strerror})") from None
    if text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except ValueError as e:
            raise ChatError(f"{path}:{e.lineno}: not JSON ({e.msg})") from None
        yield from ((f"{path}: item {i}", item) for i, item in enumerate(items))
        return
    for number, line in enumerate(text.split("\n"), start=1):
        if line.strip():
            try:
                yield f"{path}:{number}", json.loads(line)
            except ValueError as e:
                raise ChatError(f"{path}:{number}: not JSON ({e})") from None


def import_file(kind, path, out_path, skip_bad=False, lang=None, log=print):
    """Convert a public data file to our conversations JSONL, or (kind preference) preference JSONL, written
    atomically. Returns (written, skipped)."""

    source = f"{kind}:{os.path.basename(path)}"
    records = read_records(path)
    converter = convert.IMPORTERS[kind]
    converted = converter(records, source, lang) if kind == "oasst" else converter(records, source)
    problems_of = preference_problems if kind == "preference" else training_problems
    lines, skipped = [], 0
    for where, conversation in converted:
        problems = (
            [str(conversation)]
            if isinstance(conversation, convert.RecordError)
            else problems_of(conversation)
        )
        if problems:
            if not skip_bad:
                raise ChatError(f"{where}: " + "; ".join(problems) + " (--skip-bad leaves such records out)")
            log(f"skipping {where}: " + "; ".join(problems))
            skipped += 1
            continue
        lines.append(json.dumps(conversation, ensure_ascii=False) + "\n")
    fileio.write_atomic(out_path, lambda f: f.write("".join(lines).encode("utf-8")))
    what = "preference pairs" if kind == "preference" else "conversations"
    log(f"import: {len(lines):,} {what} from {path} ({kind}) -> {out_path}; {skipped} skipped")
    return len(lines), skipped


# -----------------------------------------------------------------------------
# Pairs from the family's feedback (python -m chat preferences) and from conversations (python -m chat seed-pairs)


def write_pairs(path, pairs):
    """Check every pair (a bad one is a bug of its maker: refused, naming it) and write them atomically."""
    for number, pair in enumerate(pairs, start=1):
        problems = preference_problems(pair)
        if problems:
            raise ChatError(f"pair {number} ({pair.get('source')}) for {path}: " + "; ".join(problems))
    lines = "".join(json.dumps(pair, ensure_ascii=False) + "\n" for pair in pairs)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fileio.write_atomic(path, lambda f: f.write(lines.encode("utf-8")))


def export_preferences(db_path, out_path, val_path=None, val_share=None, log=print):
    """The pairs of the family's consented feedback (family/feedback.py: whose consent is on now, by its rules)
    from the server's database, written as preference JSONL. With val_path, the pairs of a val_share of
    the prompts go there instead: a prompt's side is drawn from the hash of its text, so it stays on its
    side as feedback grows and a prompt is never in both. Returns the counts."""
    if (val_path is None) != (val_share is None):
        raise ChatError("--val and --val-share go together (e.g. --val VAL.jsonl --val-share 0.1)")
    if val_share is not None and not 0 < val_share < 1:
        raise ChatError(f"--val-share {val_share}: expected a share between 0 and 1, e.g. 0.1")
    if not os.path.isfile(db_path):
        raise ChatError(f"{db_path}: no such database (the server's serve.database, e.g. var/enlace.sqlite)")
    try:
        conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
        conn.row_factory = sqlite3.Row
        with contextlib.closing(conn):
            records, left_out = feedback.training_records(conn), feedback.unconsented_count(conn)
    except sqlite3.Error as e:
        raise ChatError(f"{db_path}: cannot read the feedback ({e}); is it the server's database?") from None
    pairs, counts = feedback.preference_pairs(records)
    sides = {out_path: []} | ({val_path: []} if val_path else {})
    for pair in pairs:
        digest = hashlib.sha256(json.dumps(pair["prompt"], sort_keys=True).encode("utf-8")).digest()
        held_out = val_path and int.from_bytes(digest[:8], "big") / 2**64 < val_share
        sides[val_path if held_out else out_path].append(pair)
    for path, chosen in sides.items():
        write_pairs(path, chosen)
    members = len({record["member_id"] for record in records})
    written = ", ".join(f"{len(chosen)} -> {path}" for path, chosen in sides.items())
    log(
        f"preferences: {len(pairs)} pairs from the feedback of {members} consenting member(s) ({written}): "
        f"{counts['improved']} improved answers, {counts['rated_pairs']} from a 👎 and a 👍 to the same prompt; "
        f"not pairs: {counts['lone_dislikes']} lone 👎, {counts['likes']} 👍; left out: {left_out} ratings of "
        "members whose consent is off"
    )
    return counts | {"pairs": len(pairs), "unconsented": left_out}


def write_seed_pairs(paths, out_path, seed, log=print):
    """The pairs convert.seed_pairs makes from the conversations of paths, as preference JSONL."""
    conversations = [found for path in paths for found in read_conversations(path)[0]]
    pairs = convert.seed_pairs(conversations, seed)
    write_pairs(out_path, pairs)
    kinds = collections.Counter(pair["source"].split(":")[1] for pair in pairs)
    log(
        f"seed-pairs: {len(pairs)} pairs from {len(conversations)} conversations -> {out_path} "
        f"({', '.join(f'{count} {kind}' for kind, count in sorted(kinds.items()))})"
    )
    return pairs


# -----------------------------------------------------------------------------
# Showing what training sees (python -m chat show FILE.jsonl)

STYLES = {"control": "\033[36m", "trained": "\033[1;32m", "reset": "\033[0m"}


def show(path, tokenizer_path=None, color=False, limit=None, out=sys.stdout):
    """Print conversations as rendered: trained tokens in green (or between {+ +} without colour), masked
    ones plain, control tokens in cyan. With a tokenizer, each conversation's token counts too."""
    tokenizer = None
    if tokenizer_path:
        import data

        tokenizer = data.SentencePieceTokenizer(tokenizer_path)
    conversations, _ = read_conversations(path)
    legend = (
        "green = trained (mask 1), plain = masked (mask 0)" if color else "{+ trained +}, the rest masked"
    )
    out.write(f"{path}: {len(conversations)} conversations; {legend}\n")
    for where, conversation in conversations[:limit]:
        counts = ""
        if tokenizer:
            ids, mask = render(conversation, tokenizer)
            counts = f" | {len(ids)} tokens, {sum(mask)} trained"
        out.write(f"\n== {where}{counts}\n")
        pieces, open_span = [], False
        for control, text, trained in segments(conversation):
            for part, is_control in ((control, True), (text, False)):
                if not part:
                    continue
                if color:
                    style = STYLES["trained"] if trained else STYLES["control"] if is_control else ""
                    pieces.append(style + part + (STYLES["reset"] if style else ""))
                else:
                    if trained and not open_span:
                        pieces.append("{+")
                        open_span = True
                    pieces.append(part)
                if part == "<|end|>":  # a trained span always ends with its turn
                    if open_span:
                        pieces.append("+}")
                        open_span = False
                    pieces.append("\n")
        out.write("".join(pieces) + "\n")


# -----------------------------------------------------------------------------

USAGE = """usage:
  python -m chat prepare CONFIG [section.key=value ...]      build data.chat.mixture, pack the conversations (or pairs)
  python -m chat download CONFIG [section.key=value ...]     fetch data.chat.mixture's Hub sources
  python -m chat import --from alpaca|sharegpt|oasst|preference FILE OUT.jsonl [--skip-bad] [--lang es]
  python -m chat preferences --db DB OUT.jsonl [--val VAL.jsonl --val-share 0.1]   the family's pairs
  python -m chat seed-pairs OUT.jsonl FILE.jsonl... --seed N     pairs with worse answers made up
  python -m chat show FILE.jsonl [--tokenizer MODEL] [--limit N] [--color auto|always|never]"""


@fileio.reports_storage_errors
def main(argv):
    import argparse

    import data  # imported here: only prepare and show need it, and it loads torch

    if not argv or argv[0] not in ("prepare", "download", "import", "preferences", "seed-pairs", "show"):
        print(USAGE, file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    try:
        if command in ("prepare", "download"):
            if not rest:
                print(USAGE, file=sys.stderr)
                return 2
            try:
                cfg = config.load(rest[0], rest[1:])
            except config.ConfigError as e:
                print(f"{rest[0]}: config problems:\n  " + "\n  ".join(e.problems), file=sys.stderr)
                return 2
            (prepare if command == "prepare" else download)(cfg)
        elif command == "import":
            parser = argparse.ArgumentParser(prog="python -m chat import")
            parser.add_argument("--from", dest="kind", required=True, choices=sorted(convert.IMPORTERS))
            parser.add_argument("file")
            parser.add_argument("out")
            parser.add_argument("--skip-bad", action="store_true", help="leave out bad records (counted)")
            parser.add_argument("--lang", help="oasst: keep only trees whose first message has this language")
            args = parser.parse_args(rest)
            import_file(args.kind, args.file, args.out, args.skip_bad, args.lang)
        elif command == "preferences":
            parser = argparse.ArgumentParser(prog="python -m chat preferences")
            parser.add_argument("--db", required=True, help="the server's database (serve.database)")
            parser.add_argument("out", help="preference JSONL to write (e.g. var/preferences/train.jsonl)")
            parser.add_argument("--val", help="also write held-out pairs here (a share of the prompts)")
            parser.add_argument("--val-share", type=float, help="share of the prompts held out in --val")
            args = parser.parse_args(rest)
            export_preferences(args.db, args.out, args.val, args.val_share)
        elif command == "seed-pairs":
            parser = argparse.ArgumentParser(prog="python -m chat seed-pairs")
            parser.add_argument("out", help="preference JSONL to write")
            parser.add_argument("files", nargs="+", help="conversation JSONL files; each answer is chosen")
            parser.add_argument(
                "--seed", type=int, required=True, help="draws the other conversation's answer"
            )
            args = parser.parse_args(rest)
            write_seed_pairs(args.files, args.out, args.seed)
        else:
            parser = argparse.ArgumentParser(prog="python -m chat show")
            parser.add_argument("file")
            parser.add_argument("--tokenizer", help="a tokenizer.model, to count tokens per conversation")
            parser.add_argument("--limit", type=int, default=None)
            parser.add_argument("--color", choices=("auto", "always", "never"), default="auto")
            args = parser.parse_args(rest)
            color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
            show(args.file, args.tokenizer, color, args.limit)
    except (ChatError, data.DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
