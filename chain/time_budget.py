"""
A chain scaled to a time budget (make run BOARD=h200 BUDGET_MIN=20): a short loan of a large board still ends
in a report card and a served model. The stages whose time grows with the data (the Hub download, the corpus,
every training stage) are scaled by one factor, so that with the other stages' time they fit the budget on
the plan's throughput: fewer Hub bytes, a smaller mixture total, fewer steps. Everything is said with the one
override syntax, added to each stage's words, so the plan printed afterwards is the scaled one.
"""

import yaml

from chain import plan as chain_plan
from chain import runfile

# Not chat-download: its sources are tens of MB (minutes at most) and the mixture needs each whole.
SCALED = ("corpus-download", "corpus", "train")


def scale_factor(chain, plan, minutes):
    """The share of the scalable stages' planned time that fits `minutes`, at most 1; None when even the
    other stages do not fit."""
    pairs = list(zip(chain["stages"], plan["stages"], strict=True))
    scalable = sum(p["hours"] for s, p in pairs if s["command"] in SCALED)
    fixed = sum(p["hours"] for s, p in pairs if s["command"] not in SCALED)
    left = minutes / 60 - fixed
    if left <= 0 or scalable <= 0:
        return None
    return min(1.0, left / scalable)


def corpus_words(data_cfg, factor):
    """The data overrides that download and read `factor` of the Hub bytes and of the mixture's tokens."""
    corpus = data_cfg["corpus"]
    sources = []
    for source in corpus["sources"]:
        hub = source.get("hub")
        if hub and hub.get("max_bytes"):
            source = dict(source, hub=dict(hub, max_bytes=int(hub["max_bytes"] * factor)))
        sources.append(source)
    flow = yaml.safe_dump(sources, default_flow_style=True, width=float("inf"), allow_unicode=True).strip()
    words = [f"data.corpus.sources={flow}"]
    total = (corpus.get("mixture") or {}).get("total_tokens")
    if total:
        words.append(f"data.corpus.mixture.total_tokens={int(total * factor)}")
    return words


def train_words(train_cfg, factor):
    steps = max(4, int(train_cfg["max_steps"] * factor))
    words = [f"train.max_steps={steps}", f"train.warmup_steps={min(train_cfg['warmup_steps'], steps // 10)}"]
    words.append(f"train.ckpt_interval={max(1, min(train_cfg['ckpt_interval'], steps // 2))}")
    words.append(f"train.eval_interval={min(train_cfg['eval_interval'], steps)}")
    return words


def scale(chain, plan, minutes):
    """Add the scaled settings to the stages' words; returns the factor, or None when the budget is too
    small for the stages that do not scale. The corpus's tokenizer trains on a sample of fixed size, so
    its time does not shrink with the data: the factor is corrected on the scaled plan a few times."""
    factor = scale_factor(chain, plan, minutes)
    if factor is None or factor >= 1:
        return factor
    own_words = {stage["name"]: list(stage.get("args", [])) for stage in chain["stages"]}
    for _ in range(4):
        apply_factor(chain, factor, own_words)
        correction = scale_factor(chain, chain_plan.make_plan(chain), minutes)
        if correction is None or correction > 0.999:
            break
        factor *= correction
    return factor


def apply_factor(chain, factor, own_words):
    """Each scaled stage's words: its own, then the overrides of `factor`."""
    for stage in chain["stages"]:
        if stage["command"] not in SCALED:
            continue
        stage["args"] = list(own_words[stage["name"]])
        cfg = runfile.load_stage_config(chain, stage)
        words = train_words(cfg["train"], factor) if stage["command"] == "train" else []
        if cfg["data"]["format"] == "shards" and "corpus" in cfg["data"]:
            words = corpus_words(cfg["data"], factor) + words
        stage["args"] = own_words[stage["name"]] + words
