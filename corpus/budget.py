"""
The token budget of a pretraining run against its train data, checked when the run starts: the tokens the
run will read, the tokens in its train shards, and the epochs of each source that follow (the epochs the
mixture already put in the shards times the passes over the shards). Past data.warn_epochs it warns; past
data.max_epochs it refuses, saying how many more train tokens would bring every source within the limit and
which commands fetch and build them. Repeating data past ~4 epochs buys little (Muennighoff et al., 2023,
"Scaling Data-Constrained Language Models").
"""

import os

from data import DataError, byte_path, manifest_path, read_manifest


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
