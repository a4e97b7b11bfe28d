"""
The agent on a size ladder: each rung trained on the same tool data with several SFT seeds, evaluated on
both sets (evaluation/tool_use.py), and one table of the mean and the min–max over seeds.

    python -m evaluation.ladder --rung a configs/sft-agent-tiny-cpu.yaml \
                                --rung b configs/sft-agent-cpu.yaml configs/smoke-corpus-cpu.yaml \
                                [--seeds 1 2 3] [--table] [--grounding constrained|hint|off]

A rung is a name, its SFT run file and, optionally, the pretraining run file it starts from. The
pretraining runs once per rung (kept when it already has a checkpoint); each seed is an SFT run
<runs_dir>/ladder-<name>-s<seed> (train.seed=<seed>, init_from the pretraining) followed by the agent
evaluation into its agent_eval.json (which also chooses the run's call bias on the generated set:
RUN/call_bias.json, agent/call_bias.py). A seed whose agent_eval.json exists is not trained again, and one
with checkpoints but no evaluation resumes from its newest checkpoint (train.py --resume), so a ladder
stopped half-way goes on where it stopped; --table only prints the table of what is there. With
--grounding, each seed is evaluated (and tabled) with agent.grounding.mode set to it (and, for constrained
and off, agent.answers.grounding), into agent_eval-<mode>.json beside the run's own agent_eval.json: the
modes of one ladder side by side. The table has a column per seed, then the mean (min–max) and the worst
seed's value (the lowest rate; the highest share of answers stating an unsaid number).
The CPU time of every training run (user + system, of the child processes) goes to train_time.json
in its folder.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import config
import fileio

SETS = (("generated", "generated"), ("hand-written", "hand-written"))
RATES = (("right", "all", "right tool"), ("needed_right", "needing", "right tool, needing one"),
         ("no_tool", "none_needed", "no tool when none is needed"), ("valid", "called", "valid syntax"),
         ("arguments", "needing", "key values in the arguments"), ("uses", "answered", "result used"),
         ("unsaid", "answered", "answers stating an unsaid number"),
         ("spans", "texts", "text arguments that are spans"))  # fmt: skip
# rows where more is worse: the worst seed is the highest
WORSE_HIGH = ("unsaid number", "value unavailable", "CPU time")
TOOLS = ("calculadora", "fecha_hora", "buscar_web", "recordar", "buscar_recuerdos", "olvidar", "ninguna")


def run_dir(cfg):
    return os.path.join(cfg["train"]["runs_dir"], cfg["run_name"])


def tokens_of(cfg):
    """The tokens a run trains on: steps x rows x accumulation x sequence length."""
    train = cfg["train"]
    return (
        train["max_steps"] * train["micro_batch_size"] * train["grad_accum_steps"] * cfg["model"]["seq_len"]
    )


def timed(command, folder, resumed=False):
    """Run a command; its CPU and wall seconds go to <folder>/train_time.json (added to those there when
    it resumes a run)."""
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    print("+", " ".join(command), flush=True)
    code = subprocess.run(command, check=False).returncode
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        raise SystemExit(f"evaluation/ladder.py: {' '.join(command)} failed with exit status {code}")
    spent = {"user_s": round(after.ru_utime - before.ru_utime, 1), "system_s": round(after.ru_stime - before.ru_stime, 1),
             "wall_s": round(time.perf_counter() - started, 1)}  # fmt: skip
    earlier = read_json(os.path.join(folder, "train_time.json")) if resumed else None
    if earlier:
        spent = {key: round(value + earlier.get(key, 0.0), 1) for key, value in spent.items()}
    fileio.write_json(os.path.join(folder, "train_time.json"), spent)


def has_checkpoint(folder):
    return os.path.isdir(folder) and any(name.startswith("ckpt_") for name in os.listdir(folder))


def report_path(folder, grounding_mode=None):
    name = (
        f"agent_eval-{grounding_mode}.json" if grounding_mode else "agent_eval.json"
    )  # evaluation/tool_use.py's
    return os.path.join(folder, name)


def climb(rungs, seeds, generated, overrides=(), limit=0, grounding_mode=None):
    """Train and evaluate what is missing, one run at a time; overrides go to every SFT run, limit (the
    first N prompts of each set) to every evaluation: a quick check of the ladder itself."""
    python = sys.executable
    for name, sft_path, pretrain_path in rungs:
        start = []
        if pretrain_path:
            pretrain = run_dir(config.load(pretrain_path))
            if not has_checkpoint(pretrain):
                timed([python, "train.py", pretrain_path], pretrain)
            start.append(f"train.init_from={pretrain}")
        for seed in seeds:
            run_overrides = [f"run_name=ladder-{name}-s{seed}", f"train.seed={seed}", *start, *overrides]
            folder = run_dir(config.load(sft_path, run_overrides))
            if os.path.exists(report_path(folder, grounding_mode)):
                continue
            if not os.path.exists(os.path.join(folder, "agent_eval.json")):  # trained and evaluated once
                resume = ["--resume"] if has_checkpoint(folder) else []  # a run stopped half-way goes on
                timed([python, "train.py", sft_path, *run_overrides, *resume], folder, resumed=bool(resume))
            command = [
                python,
                "-m",
                "evaluation.tool_use",
                folder,
                "--generated",
                generated,
                "--limit",
                str(limit),
            ]
            if grounding_mode:
                command += ["--grounding", grounding_mode, "--report", report_path(folder, grounding_mode)]
            print("+", " ".join(command), flush=True)
            if subprocess.run(command, check=False).returncode != 0:
                raise SystemExit(f"evaluation/ladder.py: the agent evaluation of {folder} failed")


# -----------------------------------------------------------------------------
# The table


def read_json(path):
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def parameters(cfg):
    """The parameter count of the run's model, built without memory (the meta device)."""
    import torch

    import model

    with torch.device("meta"):
        return model.Transformer(cfg["model"]).num_params()


def cpu_minutes(folder):
    spent = read_json(os.path.join(folder, "train_time.json"))
    return None if spent is None else (spent["user_s"] + spent["system_s"]) / 60


def rung_figures(name, sft_path, pretrain_path, seeds, overrides=(), grounding_mode=None):
    """({row label: [value per evaluated seed, None where it has none]}, the evaluated seeds) for one rung."""
    rows, evaluated = {}, []
    for seed in seeds:
        cfg = config.load(sft_path, [f"run_name=ladder-{name}-s{seed}", f"train.seed={seed}", *overrides])
        report = read_json(report_path(run_dir(cfg), grounding_mode))
        if report is not None:
            evaluated.append((seed, cfg, report))
    if not evaluated:
        return rows, []
    pretrain = config.load(pretrain_path) if pretrain_path else None
    rows["parameters (M)"] = [parameters(evaluated[0][1]) / 1e6] * len(evaluated)
    rows["pretraining tokens (M)"] = [tokens_of(pretrain) / 1e6 if pretrain else 0.0] * len(evaluated)
    rows["SFT tokens (M)"] = [tokens_of(cfg) / 1e6 for _, cfg, _ in evaluated]
    if pretrain and cpu_minutes(run_dir(pretrain)) is not None:
        rows["pretraining CPU time (min)"] = [cpu_minutes(run_dir(pretrain))] * len(evaluated)
    rows["SFT CPU time (min)"] = [cpu_minutes(run_dir(cfg)) for _, cfg, _ in evaluated]
    bias = [report.get("call_bias", {}).get("value") for _, _, report in evaluated]
    if any(value is not None for value in bias):
        rows["call bias chosen on the generated set"] = bias
    for label, key in SETS:
        sets = [report["sets"][key] for _, _, report in evaluated]
        for part, whole, title in RATES:
            rows[f"{label}: {title} (%)"] = [
                100 * figures["counts"][part] / figures["counts"][whole]
                if figures["counts"].get(whole) and part in figures["counts"] else None
                for figures in sets
            ]  # fmt: skip
        for title, part in (
            ("right tool, needing one", "right_tool"),
            ("no tool when none is needed", "no_tool"),
        ):
            for when in ("without", "with"):
                rows[f"{label}: {title}, {when} the call bias (%)"] = [
                    None if "call_bias" not in figures or figures["call_bias"][when][part] is None
                    else 100 * figures["call_bias"][when][part] for figures in sets
                ]  # fmt: skip
        rows[f"{label}: value unavailable (%)"] = [
            100 * figures["counts"].get("unavailable", 0) / figures["counts"]["needing"]
            if figures["counts"]["needing"] else None for figures in sets
        ]  # fmt: skip
        for tool in TOOLS:
            tool_rows = [figures["by_tool"].get(tool) for figures in sets]
            counted = [row if row and row["prompts"] else None for row in tool_rows]
            rows[f"{label}: {tool} right tool (%)"] = [
                None if row is None else 100 * row["right"] / row["prompts"] for row in counted
            ]
            if tool != "ninguna":
                rows[f"{label}: {tool} key values (%)"] = [
                    None if row is None else 100 * row["arguments"] / row["prompts"] for row in counted
                ]
            if tool == "calculadora":
                rows[f"{label}: calculadora value right (%)"] = [
                    None if row is None or "value" not in row else 100 * row["value"] / row["prompts"]
                    for row in counted
                ]
    rows = {label: values for label, values in rows.items() if any(v is not None for v in values)}
    return rows, [seed for seed, _, _ in evaluated]


def cell(values, digits=1):
    """'mean (min–max)' of the values (None left out); a single value (or all alike) alone; '-' for none."""
    values = [value for value in values if value is not None]
    if not values:
        return "-"
    mean, low, high = (
        f"{value:.{digits}f}" for value in (statistics.fmean(values), min(values), max(values))
    )
    return mean if low == high else f"{mean} ({low}–{high})"


def worst(label, values, digits=1):
    """The worst seed's value of a row: the lowest rate, the highest where more is worse."""
    values = [value for value in values if value is not None]
    if not values or label.endswith("(M)"):
        return "-"
    return f"{(max if any(word in label for word in WORSE_HIGH) else min)(values):.{digits}f}"


def table(rungs, seeds, overrides=(), grounding_mode=None):
    """Per rung, a column per evaluated seed, then the mean (min–max) and the worst seed's value."""
    figures = {name: rung_figures(name, sft, pretrain, seeds, overrides, grounding_mode)
               for name, sft, pretrain in rungs}  # fmt: skip
    labels = list(dict.fromkeys(label for rows, _ in figures.values() for label in rows))
    columns = []  # (title, width): a seed's value and the worst are short, the mean and range less so
    for name, (_, evaluated) in figures.items():
        title = f"{name} ({len(evaluated)} seeds)"
        columns += [(f"s{seed}", 8) for seed in evaluated] + [(title, max(24, len(title) + 2)), ("worst", 8)]
    lines = [f"{'':56s}" + "".join(f"{title:>{width}s}" for title, width in columns)]
    for label in labels:
        digits = 2 if label.endswith("(M)") else 1  # a model's millions of parameters and tokens
        cells = []
        for rows, evaluated in figures.values():
            values = rows.get(label, [None] * len(evaluated))
            cells += [cell([value], digits) for value in values]
            cells += [cell(values, digits), worst(label, values, digits)]
        widths = [width for _, width in columns]
        lines.append(
            f"{label:56s}" + "".join(f"{text:>{width}s}" for text, width in zip(cells, widths, strict=True))
        )
    return "\n".join(lines)


@fileio.reports_storage_errors
def main(argv):
    parser = argparse.ArgumentParser(description="Train and evaluate the agent on a size ladder.")
    parser.add_argument("--rung", nargs="+", action="append", required=True,
                        metavar="NAME SFT_CONFIG [PRETRAIN_CONFIG]", help="a rung of the ladder")  # fmt: skip
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="the SFT seeds of every rung")
    parser.add_argument("--generated", default="data/agent/eval.jsonl", help="agent/dataset.py's eval.jsonl")
    parser.add_argument("--table", action="store_true", help="only print the table of the runs there are")
    parser.add_argument("--override", nargs="+", default=[], metavar="KEY=VALUE", help="for every SFT run")
    parser.add_argument("--limit", type=int, default=0, help="evaluate only the first N prompts of each set")
    parser.add_argument("--grounding", choices=["constrained", "hint", "off"],
                        help="evaluate with this agent.grounding.mode (agent_eval-<mode>.json)")  # fmt: skip
    args = parser.parse_args(argv)
    rungs = []
    for rung in args.rung:
        if len(rung) not in (2, 3):
            parser.error(f"--rung {' '.join(rung)}: give NAME SFT_CONFIG [PRETRAIN_CONFIG]")
        rungs.append((rung[0], rung[1], rung[2] if len(rung) == 3 else None))
    try:
        for _, sft_path, pretrain_path in rungs:
            config.load(sft_path, args.override)
            if pretrain_path:
                config.load(pretrain_path)
    except config.ConfigError as exc:
        print(f"evaluation/ladder.py: {exc}", file=sys.stderr)
        return 2
    if not args.table:
        climb(rungs, args.seeds, args.generated, args.override, args.limit, args.grounding)
    print(table(rungs, args.seeds, args.override, args.grounding))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
