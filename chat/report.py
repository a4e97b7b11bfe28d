"""
The report of the SFT mixture (chat/mixture.py), like the corpus report: DIR/report.md and DIR/report/funnel.png,
written from the mixture's manifest, so a person sees in two minutes what came in from each source under which
licence, what each stage left (conversations and tokens), why rows and turns were left out, the turns per
conversation and how many times each source is repeated in the mixture.
"""

import os

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

import fileio  # noqa: E402
from corpus import hub  # noqa: E402

PLOT = os.path.join("report", "funnel.png")


def plot_funnel(manifest, path):
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for axis, unit in zip(axes, ("conversations", "tokens"), strict=True):
        for name, stats in manifest["sources"].items():
            stages = stats["stages"]
            values = [max(stage[unit], 0.8) for stage in stages]  # a log axis has no zero
            axis.plot([stage["stage"] for stage in stages], values, marker="o", label=name)
        axis.set_title(f"{unit} left after each stage (train side)")
        axis.set_yscale("log")
        axis.tick_params(axis="x", rotation=30)
        axis.legend(fontsize=8)
    figure.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fileio.write_atomic(path, lambda f: figure.savefig(f, format="png", dpi=110))
    plt.close(figure)


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def counts_text(counts):
    return ", ".join(f"{reason} {count:,}" for reason, count in sorted(counts.items())) or "none"


def write_report(directory, manifest, sources_cfg):
    """DIR/report.md and DIR/report/funnel.png from the mixture's manifest."""
    plot_funnel(manifest, os.path.join(directory, PLOT))
    sources = manifest["sources"]
    stage_names = [stage["stage"] for stage in next(iter(sources.values()))["stages"]]
    out = [
        "# The SFT mixture",
        "",
        f"![conversations and tokens after each stage]({PLOT})",
        "",
        "## Sources",
        "",
    ]
    out += table(
        ["source", "kind", "licence", "share", "in the mixture", "epochs in the mixture"],
        [
            [
                name,
                s["kind"],
                s["licence"],
                s["share"],
                f"{s['mixture']['conversations']:,} of {s['mixture']['unique']:,}",
                f"{s['mixture']['epochs']:.2f}",
            ]
            for name, s in sources.items()
        ],
    )
    out += ["", "## Conversations (tokens) after each stage", ""]
    out += [
        "Tokens of the turns' text with data.chat.tokenizer. read: rows that became conversations; turns: after"
        " markup, control tokens, language and length cut turns (and PII was replaced); exact_dedup and"
        " near_dedup: across sources, earlier sources first; val: what is left for training once the held-out"
        " slice is taken; decontamination: after the evaluation sets and val are protected.",
        "",
    ]
    out += table(
        ["source", *stage_names, "val (held out)"],
        [
            [name, *(f"{st['conversations']:,} ({st['tokens']:,})" for st in s["stages"]), f"{s['val']:,}"]
            for name, s in sources.items()
        ],
    )
    out += ["", "## What was left out", ""]
    for name, s in sources.items():
        examples = "; ".join(
            f"{reason}: {', '.join(where)}" for reason, where in sorted(s["bad_examples"].items())
        )
        out += [
            f"- {name}: rows not read as conversations: {counts_text(s['bad_rows'])}"
            + (f" (e.g. {examples})" if examples else ""),
            f"  turns cut: {counts_text(s['dropped_turns'])}; personal data replaced: {counts_text(s['pii'])}; "
            f"decontamination hits: {counts_text(s['decontamination'])}",
        ]
    out += ["", "## User turns per train conversation", ""]
    buckets = ["1", "2", "3", "4", "5+"]
    out += table(
        ["source", *buckets],
        [[name, *(s["turns"].get(b, 0) for b in buckets)] for name, s in sources.items()],
    )
    out += ["", *hub.report_lines(sources_cfg)]
    text = "\n".join(out) + "\n"
    fileio.write_atomic(os.path.join(directory, "report.md"), lambda f: f.write(text.encode("utf-8")))
