"""
`python -m corpus report CONFIG` (`make corpus-report`): DIR/report.md and DIR/report/*.png from what the
corpus, tokenizer and encode steps recorded in DIR/manifest.json, so a person understands the corpus in two
minutes: what came in from each source under which licence, what each stage dropped and why (with
examples), document lengths, duplicate clusters, personal data replaced, decontamination hits, language-ID
scores, the mixture's tokens per source and the tokenizer's characters per token per source on val
(documents the tokenizer never saw).
"""

import json
import os

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from corpus import (
    docs,  # noqa: E402
    hub,  # noqa: E402
)
from data import DataError, load_tokenizer, read_manifest  # noqa: E402
from fileio import write_atomic  # noqa: E402

STAGES = (
    "min_chars",
    "language",
    "gopher_repetition",
    "fineweb_quality",
    "gopher_quality",
    "exact_dedup",
    "near_dedup",
    "decontamination",
)


def save(figure, path):
    figure.tight_layout()
    write_atomic(path, lambda f: figure.savefig(f, format="png", dpi=110))
    plt.close(figure)


def plot_funnel(sources, path):
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for axis, unit in zip(axes, ("documents", "chars"), strict=True):
        labels = ["read", *STAGES]
        for name, s in sources.items():
            values = [s["documents_in"] if unit == "documents" else None]
            last = values[0]
            for stage in STAGES:
                entry = s["stages"].get(stage)
                last = entry[f"{unit}_out"] if entry else last
                values.append(last)
            if values[0] is None:  # characters are first counted after cleaning (min_chars)
                values[0] = s["stages"]["min_chars"]["chars_in"] if "min_chars" in s["stages"] else 0
            axis.plot(labels, values, marker="o", label=name)
        axis.set_title(f"{unit} left after each stage")
        axis.set_yscale("log")
        axis.tick_params(axis="x", rotation=45)
        axis.legend(fontsize=8)
    save(figure, path)


def plot_drops(sources, path):
    reasons = sorted({r for s in sources.values() for r, n in s["drops"].items() if n})
    figure, axis = plt.subplots(figsize=(10, max(2.5, 0.35 * len(reasons) + 1)))
    left = np.zeros(len(reasons))
    for name, s in sources.items():
        counts = np.array([s["drops"].get(r, 0) for r in reasons], dtype=float)
        axis.barh(reasons, counts, left=left, label=name)
        left += counts
    axis.set_xlabel("documents dropped")
    axis.set_title("drop reasons by source")
    axis.legend(fontsize=8)
    save(figure, path)


def plot_lengths(sources, path):
    edges = docs.LENGTH_BINS
    centers = np.concatenate([[edges[0] / 1.5], np.sqrt(edges[:-1] * edges[1:]), [edges[-1] * 1.5]])
    figure, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for axis, key, title in zip(
        axes, ("length_in", "length_out"), ("read (after cleaning)", "kept"), strict=True
    ):
        for name, s in sources.items():
            axis.plot(centers, s[key], marker=".", label=name)
        axis.set_xscale("log")
        axis.set_xlabel("characters per document")
        axis.set_title(f"document lengths, {title}")
        axis.legend(fontsize=8)
    axes[0].set_ylabel("documents")
    save(figure, path)


def plot_clusters(cluster_sizes, path):
    figure, axis = plt.subplots(figsize=(6, 3.5))
    sizes = sorted(int(k) for k in cluster_sizes)
    axis.bar([str(k) for k in sizes], [cluster_sizes[str(k)] for k in sizes])
    axis.set_yscale("log")
    axis.set_xlabel("documents in the MinHash cluster (1 = unique)")
    axis.set_ylabel("clusters")
    axis.set_title("near-duplicate cluster sizes")
    save(figure, path)


def plot_language(sources, path):
    figure, axis = plt.subplots(figsize=(7, 3.5))
    bins = docs.SCORE_BINS
    for name, s in sources.items():
        if sum(s["language_score"]):
            axis.step(bins, s["language_score"], where="post", label=name)
    axis.set_yscale("log")
    axis.set_xlabel("py3langid probability of the detected language")
    axis.set_ylabel("documents")
    axis.set_title("language-ID scores (sources with filters on)")
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=8)
    save(figure, path)


def plot_mixture(mixture, path):
    figure, axis = plt.subplots(figsize=(7, 3.5))
    names = list(mixture)
    once = [mixture[n]["tokens_once"] / 1e6 for n in names]
    used = [mixture[n]["tokens"] / 1e6 for n in names]
    x = np.arange(len(names))
    axis.bar(x - 0.2, once, 0.4, label="train tokens, once")
    axis.bar(x + 0.2, used, 0.4, label="tokens in the mixture")
    for i, n in enumerate(names):
        axis.text(x[i] + 0.2, used[i], f"{mixture[n]['epochs']:.2f} ep", ha="center", va="bottom", fontsize=8)
    axis.set_xticks(x, names)
    axis.set_ylabel("million tokens")
    axis.set_title("mixture")
    axis.legend(fontsize=8)
    save(figure, path)


def chars_per_token(data_cfg):
    """{source: (characters, tokens)} of the val split (held out from tokenizer training), and 'all'."""
    tokenizer = load_tokenizer(data_cfg)
    counts = {}
    with open(docs.docs_path(data_cfg, "val"), "rb") as f:
        for line in f:
            record = json.loads(line)
            chars, tokens = counts.get(record["source"], (0, 0))
            counts[record["source"]] = (
                chars + len(record["text"]),
                tokens + len(tokenizer.encode(record["text"])),
            )
    counts["all"] = tuple(map(sum, zip(*counts.values(), strict=True))) if counts else (0, 0)
    return counts


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def quote(text):
    return text.replace("\n", " ⏎ ").replace("|", "\\|")[:240]


def write_report(data_cfg, log=print):
    manifest = read_manifest(data_cfg)
    done = manifest.get("corpus")
    if not done:
        raise DataError(
            f"{data_cfg['dir']}/manifest.json: no corpus step recorded; run `python -m corpus corpus CONFIG`"
        )
    stats = done["stats"]
    sources = stats["sources"]
    folder = os.path.join(data_cfg["dir"], "report")
    os.makedirs(folder, exist_ok=True)
    plot_funnel(sources, os.path.join(folder, "funnel.png"))
    plot_drops(sources, os.path.join(folder, "drops.png"))
    plot_lengths(sources, os.path.join(folder, "lengths.png"))
    plot_clusters(stats["cluster_sizes"] or {"1": 0}, os.path.join(folder, "clusters.png"))
    plot_language(sources, os.path.join(folder, "language.png"))

    out = [f"# Corpus report: {data_cfg['dir']}", ""]
    out += [
        f"{stats['documents_in']:,} documents in, {stats['documents_out']:,} kept "
        f"(train {done['outputs']['train']['documents']:,}, val {done['outputs']['val']['documents']:,}); "
        f"{stats['bytes_in'] / 1e6:,.1f} MB read, {stats['bytes_out'] / 1e6:,.1f} MB of text kept; "
        f"{stats['undecodable']:,} undecodable bytes replaced.",
        "",
        "## Sources",
        "",
    ]
    rows = []
    for name, s in sources.items():
        chars_in = s["stages"].get("min_chars", {}).get("chars_in", 0)
        kept = f"{100 * s['chars_out'] / chars_in:.1f}%" if chars_in else "-"
        rows.append(
            [name, s["kind"], s["licence"], f"{s['documents_in']:,}", f"{s['documents_out']:,}",
             f"{chars_in / 1e6:,.2f}M", f"{s['chars_out'] / 1e6:,.2f}M", kept]
        )  # fmt: skip
    out += [
        table(["source", "kind", "licence", "docs in", "docs kept", "chars in", "chars kept", "kept"], rows)
    ]
    out += ["", *hub.report_lines(data_cfg["corpus"]["sources"])]
    out += ["## What each stage kept", "", "![funnel](report/funnel.png)", ""]
    rows = []
    for name, s in sources.items():
        for stage in STAGES:
            e = s["stages"].get(stage)
            if e:
                rows.append(
                    [name, stage, f"{e['documents_in']:,}", f"{e['documents_out']:,}",
                     f"{100 * (1 - e['chars_out'] / e['chars_in']):.1f}%" if e["chars_in"] else "-"]
                )  # fmt: skip
    out += [table(["source", "stage", "docs in", "docs out", "chars dropped"], rows)]
    out += ["", "## Drop reasons", "", "![drops](report/drops.png)", ""]
    reasons = sorted({r for s in sources.values() for r, n in s["drops"].items() if n})
    for reason in reasons:
        by_source = ", ".join(
            f"{name} {s['drops'][reason]:,}" for name, s in sources.items() if s["drops"].get(reason)
        )
        out.append(f"- **{reason}**: {by_source}")
        for example in stats["examples"].get(reason, []):
            out.append(f"  - _{example['source']}_: {quote(example['text'])}")
    out += ["", "## Document lengths", "", "![lengths](report/lengths.png)", ""]
    out += ["## Near-duplicates", "", "![clusters](report/clusters.png)", ""]
    sizes = stats["cluster_sizes"]
    multi = {k: v for k, v in sizes.items() if int(k) > 1}
    out.append(
        f"{sum(multi.values()):,} clusters of 2+ documents (one kept each); sizes: "
        + (", ".join(f"{k}: {v:,}" for k, v in sorted(multi.items(), key=lambda kv: int(kv[0]))) or "none")
    )
    out += ["", "## Personal data replaced", ""]
    rows = [
        [name, *(s["pii"].get(kind, 0) for kind in ("email", "ip", "phone", "dni", "nie", "iban"))]
        for name, s in sources.items()
    ]
    out += [table(["source", "email", "ip", "phone", "dni", "nie", "iban"], rows)]
    out += ["", "## Decontamination", ""]
    hits = stats["decontamination"]
    out.append(
        "Train documents dropped for sharing a "
        f"{data_cfg['corpus']['decontamination']['ngram']}-gram with: "
        + (", ".join(f"{name} {count:,}" for name, count in hits.items()) or "nothing (no hits)")
        + f"; {stats.get('common_ngrams_ignored', 0):,} common n-grams ignored as boilerplate."
    )
    out += ["", "## Language ID", "", "![language](report/language.png)", ""]
    encoded = manifest.get("encode", {}).get("train", {})
    if encoded.get("mixture"):
        mixture = encoded["mixture"]
        plot_mixture(mixture, os.path.join(folder, "mixture.png"))
        total = sum(m["tokens"] for m in mixture.values())
        out += ["## Mixture (train shards)", "", "![mixture](report/mixture.png)", ""]
        rows = [
            [name, f"{m['tokens_once']:,}", f"{m['epochs']:.2f}", f"{m['tokens']:,}", f"{100 * m['tokens'] / total:.1f}%",
             ", ".join(f"{t:,}" for t in m["tokens_per_epoch"])]
            for name, m in mixture.items()
        ]  # fmt: skip
        out += [
            table(["source", "train tokens once", "epochs", "tokens", "share", "tokens per epoch"], rows),
            "",
        ]
    if data_cfg["format"] == "shards" and os.path.exists(os.path.join(data_cfg["dir"], "tokenizer.model")):
        counts = chars_per_token(data_cfg)
        out += [f"## Tokenizer ({data_cfg['tokenizer']['vocab_size']:,} tokens) on val (held out)", ""]
        rows = [[name, f"{c:,}", f"{t:,}", f"{c / t:.2f}" if t else "-"] for name, (c, t) in counts.items()]
        out += [table(["source", "characters", "tokens", "characters/token"], rows), ""]
    text = "\n".join(out) + "\n"
    path = os.path.join(data_cfg["dir"], "report.md")
    write_atomic(path, lambda f: f.write(text.encode("utf-8")))
    log(f"report: {path} and {folder}/*.png")
    return path
