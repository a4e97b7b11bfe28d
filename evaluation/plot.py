"""
Plot training curves of one or more runs: training loss, val loss, val bits per byte, the learning rate and,
when the run has train.eval, its benchmark score, against the optimizer step, read from each run's
metrics.jsonl (what train.py logs).

    python -m evaluation.plot runs/smoke-cpu                           -> runs/smoke-cpu/plot.png
    python -m evaluation.plot runs/pretrain-2060 runs/sft-2060 --out comparison.png
    make plot RUN="runs/A runs/B"
"""

import argparse
import io
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402

import fileio


class PlotError(Exception):
    """A run without usable metrics; the message names the file."""


def read_metrics(run):
    """{"train": [(step, loss)], "val_loss": [...], "val_bpb": [...], "lr": [...], "eval_score": [...]} of a
    run directory."""
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.isfile(path):
        raise PlotError(f"{path}: not found; is {run} a run directory written by train.py?")
    series = {"train": [], "val_loss": [], "val_bpb": [], "lr": [], "eval_score": []}
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise PlotError(f"{path}:{number}: not JSON ({e})") from None
            step = record.get("step")
            if "loss" in record:
                series["train"].append((step, record["loss"]))
            if "lr" in record:
                series["lr"].append((step, record["lr"]))
            for key in ("val_loss", "val_bpb", "eval_score"):
                if record.get(key) is not None:
                    series[key].append((step, record[key]))
    if not series["train"]:
        raise PlotError(f"{path}: no training steps logged yet")
    return series


def plot(runs, out):
    all_series = [read_metrics(run) for run in runs]
    benchmarked = any(series["eval_score"] for series in all_series)
    rows = 4 if benchmarked else 3
    figure, axes = plt.subplots(rows, 1, figsize=(9, 10 + 3 * (rows - 3)), sharex=True)
    loss_axis, bpb_axis, lr_axis = axes[:3]
    for index, (run, series) in enumerate(zip(runs, all_series, strict=True)):
        name, color = os.path.basename(os.path.normpath(run)), f"C{index}"
        if series["eval_score"]:
            axes[3].plot(*zip(*series["eval_score"], strict=True), color=color, marker="o", label=name)
        loss_axis.plot(*zip(*series["train"], strict=True), color=color, label=f"{name} train")
        if series["val_loss"]:
            val = zip(*series["val_loss"], strict=True)
            loss_axis.plot(*val, color=color, linestyle="--", marker="o", label=f"{name} val")
        if series["val_bpb"]:
            bpb_axis.plot(*zip(*series["val_bpb"], strict=True), color=color, marker="o", label=name)
        lr_axis.plot(*zip(*series["lr"], strict=True), color=color, label=name)
    loss_axis.set_ylabel("loss (nats/token)")
    bpb_axis.set_ylabel("val bits per byte")
    lr_axis.set_ylabel("learning rate")
    if benchmarked:
        axes[3].set_ylabel("benchmark score\n(centred accuracy)")
        axes[3].axhline(0.0, color="grey", linewidth=0.8)  # chance level
    axes[-1].set_xlabel("optimizer step")
    for axis in axes:
        axis.grid(alpha=0.3)
        if axis.has_data():
            axis.legend(fontsize="small")
    loss_axis.set_title(", ".join(os.path.basename(os.path.normpath(r)) for r in runs))
    figure.tight_layout()
    png = io.BytesIO()
    figure.savefig(png, format="png", dpi=100)
    plt.close(figure)
    fileio.write_atomic(out, lambda f: f.write(png.getvalue()))
    return out


@fileio.reports_storage_errors
def main(argv):
    parser = argparse.ArgumentParser(description="Plot loss, val loss/bpb and lr of ENLACE runs.")
    parser.add_argument("runs", nargs="+", help="run directories (each with a metrics.jsonl)")
    parser.add_argument("--out", help="PNG to write (default: <first run>/plot.png)")
    args = parser.parse_args(argv)
    out = args.out or os.path.join(args.runs[0], "plot.png")
    try:
        print(f"plot: {plot(args.runs, out)}")
    except PlotError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
