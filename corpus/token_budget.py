"""
The token budget of a run against its train data, checked when the run starts: the tokens the run will
read, the tokens in its train data, and the epochs that follow. Pretraining (shards, bytes): the epochs of
each source (the epochs the mixture already put in the shards times the passes over the shards). SFT
(chat) and DPO (preference): the passes over the packed rows or pairs, which is steps x rows x seq_len /
data tokens, every packed row being seq_len + 1 tokens. Past data.warn_epochs it warns; past
data.max_epochs it refuses, saying how much more data would bring it within the limit and how to make it.
Repeating data past ~4 epochs buys little (Muennighoff et al., 2023, "Scaling Data-Constrained Language
Models"). run_epochs(cfg) gives the same figures without checking anything, for a plan made before a run.
"""

import os

from data import DataError, byte_path, manifest_path, read_manifest

PACKED = {"chat": "packed conversation rows", "preference": "preference pairs"}  # what one epoch visits


def shard_tokens(data_cfg):
    """(train tokens, {source: (tokens in the shards, unique tokens)}) from the manifest; sources are
    {} when the manifest has no mixture (every source read once) or the data are raw bytes."""
    if data_cfg["format"] == "bytes":  # one token per byte; scripts/prepare_smoke_data.sh writes no manifest
        path = byte_path(data_cfg, "train")
        if not os.path.exists(path):
            raise DataError(f"{path}: missing; build the data first (make data-smoke)")
        return os.path.getsize(path), {}
    encoded = read_manifest(data_cfg).get("encode", {}).get("train")
    if not encoded or not encoded.get("complete"):
        raise DataError(
            f"{manifest_path(data_cfg)}: no finished train split; run `python -m corpus all CONFIG` first"
        )
    mixture = encoded.get("mixture") or {}
    sources = {name: (m["tokens"], m["tokens_once"]) for name, m in mixture.items() if m["tokens_once"]}
    return encoded["tokens"], sources


def epochs_of(run_tokens, total, sources):
    """{source or "train shards": epochs the run makes of its unique tokens}."""
    passes = run_tokens / total
    if not sources:
        return {"train shards": passes}
    return {name: passes * tokens / once for name, (tokens, once) in sources.items()}


def tokens_needed(run_tokens, total, sources, limit):
    """More unique train tokens that bring every source to at most `limit` epochs (the mixture kept)."""
    if not sources:
        return max(0, round(run_tokens / limit - total))
    return sum(max(0, round(run_tokens * tokens / total / limit - once)) for tokens, once in sources.values())


def check_token_budget(data_cfg, run_tokens, log=print):
    """Print the budget; warn past data.warn_epochs; raise DataError past data.max_epochs. Returns epochs."""
    if data_cfg["format"] not in ("shards", "bytes"):
        return {}
    total, sources = shard_tokens(data_cfg)
    epochs = epochs_of(run_tokens, total, sources)
    shares = ", ".join(f"{name} {value:.2f}" for name, value in epochs.items())
    log(
        f"data: the run reads {run_tokens:,} tokens; the train shards hold {total:,} "
        f"({run_tokens / total:.2f} passes); epochs per source: {shares}"
    )
    worst = max(epochs, key=epochs.get)
    limit, warn = data_cfg.get("max_epochs"), data_cfg.get("warn_epochs")
    if limit is not None and epochs[worst] > limit:
        more = tokens_needed(run_tokens, total, sources, limit)
        raise DataError(
            f"data.max_epochs: the run would read {worst} {epochs[worst]:.1f} times, past {limit}; "
            f"{more:,} more train tokens are needed: raise the hub sources' max_bytes (or add sources) in the "
            f"data layer, then `python -m corpus download CONFIG && python -m corpus all CONFIG`; or lower "
            "train.max_steps"
        )
    if warn is not None and epochs[worst] > warn:
        log(
            f"warning: the run reads {worst} {epochs[worst]:.1f} times, past data.warn_epochs {warn}: "
            "repeating data past ~4 epochs buys little (Muennighoff et al., 2023)"
        )
    return epochs


def sequences_per_run(cfg, world_size=1):
    """Sequences the run reads: max_steps x micro_batch_size x grad_accum_steps x ranks (pairs for DPO)."""
    train = cfg["train"]
    return train["max_steps"] * train["micro_batch_size"] * train["grad_accum_steps"] * world_size


def packed_count(data_cfg):
    """Rows (chat) or pairs (preference) in the packed train split, from the manifest `chat prepare` wrote."""
    prepared = read_manifest(data_cfg).get("prepare", {}).get("train")
    if not prepared or not prepared.get("complete"):
        raise DataError(
            f"{manifest_path(data_cfg)}: no finished packed train split; run `python -m chat prepare CONFIG` first"
        )
    rows = sum(shard["rows"] for shard in prepared["shards"])
    return rows // 2 if data_cfg["format"] == "preference" else rows


def run_epochs(cfg, world_size=1):
    """{source, or what one epoch visits: epochs the run makes of it} for any format, read from the data's
    manifest: what a plan shows before anything runs. DataError when the data are not built yet."""
    data_cfg = cfg["data"]
    if data_cfg["format"] in PACKED:
        count = packed_count(data_cfg)
        return {PACKED[data_cfg["format"]]: sequences_per_run(cfg, world_size) / count}
    total, sources = shard_tokens(data_cfg)
    return epochs_of(sequences_per_run(cfg, world_size) * cfg["model"]["seq_len"], total, sources)


def check_run_budget(cfg, world_size=1, log=print):
    """check_token_budget for every format: pretraining as there; SFT and DPO print the passes over their
    packed data, warn past data.warn_epochs and refuse past data.max_epochs. Returns the epochs."""
    data_cfg = cfg["data"]
    if data_cfg["format"] not in PACKED:
        run_tokens = sequences_per_run(cfg, world_size) * cfg["model"]["seq_len"]
        return check_token_budget(data_cfg, run_tokens, log)
    what, count = PACKED[data_cfg["format"]], packed_count(data_cfg)
    read = sequences_per_run(cfg, world_size)
    epochs = read / count
    log(f"data: the run reads {read:,} {what}; the train split holds {count:,} ({epochs:.2f} epochs)")
    limit, warn = data_cfg.get("max_epochs"), data_cfg.get("warn_epochs")
    if limit is not None and epochs > limit:
        raise DataError(
            f"data.max_epochs: the run would read its {what} {epochs:.1f} times, past {limit}; "
            f"{max(0, round(read / limit - count)):,} more are needed: add "
            f"{'pairs' if data_cfg['format'] == 'preference' else 'conversations'} to data.chat.train and run "
            "`python -m chat prepare CONFIG` again; or lower train.max_steps"
        )
    if warn is not None and epochs > warn:
        log(
            f"warning: the run reads its {what} {epochs:.1f} times, past data.warn_epochs {warn}: "
            "many passes over the same few conversations teach the model to recite them"
        )
    return {what: epochs}
