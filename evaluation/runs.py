"""
How good is a run: SpanishBench through EleutherAI's lm-evaluation-harness, one score, and a report card.

    python -m evaluation runs/pretrain-2060                            # the enlace-es suite (configs/eval/)
    python -m evaluation runs/smoke-corpus-cpu --tasks fixtures        # the local test tasks, offline
    python -m evaluation runs/x --tasks copa_es,xstorycloze_es --limit 50 --num-fewshot 5 --batch-size 32
    python -m evaluation runs/x --tasks my_task --include-path my_tasks/ --log-samples
    python -m evaluation runs/sft-x --system "Eres ENLACE."            # SFT runs: prompts through chat.render
    python -m evaluation download enlace-es                            # the datasets, into the Hugging Face cache
    python -m evaluation report runs/smoke-corpus-cpu                  # -> runs/smoke-corpus-cpu/report.md

An evaluation writes RUN/eval/<step>-<suite>[-limitN][-Kshot][-chat].json (lm-eval's results JSON as its
CLI writes it, plus an "enlace" entry: checkpoint, step, sha256, the request) and a Markdown table beside
it (.md), printed too; --log-samples adds every request's scores, one JSONL per task. The same checkpoint
(by sha256) and request again reuse the stored result unless --force. Nothing is written before the
evaluation has finished. The model is harness.EnlaceLM: the checkpoint itself, no export.

The report card (RUN/report.md) puts on one page what a person needs to judge a run: config, hardware,
wall time, tokens seen, the tokenizer's characters per token, val loss and bits per byte, every stored
benchmark table and score (the base run's and the fine-tuned runs' too), tool-use rates when
make agent-eval (evaluation/tool_use.py) evaluated the run, three samples and the loss plot.
"""

import argparse
import glob
import json
import os
import re
import statistics
import sys

import torch
from lm_eval.utils import handle_non_serializable

import checkpoint
import config
import data
import fileio
from agent import call_bias
from chat import template
from checkpoint import CheckpointError
from decode import engine
from evaluation import harness, plot
from evaluation.harness import EvalError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -----------------------------------------------------------------------------
# Evaluating a run


def newest_checkpoint(run):
    """(checkpoint path, step) of a run directory's newest checkpoint or of a checkpoint file."""
    if os.path.isdir(run):
        found = checkpoint.list_checkpoints(run)
        if not found:
            raise CheckpointError(f"{run}/: no checkpoints (ckpt_<step>.pt); train it first")
        path = found[0]
    elif os.path.isfile(run):
        path = run
    else:
        raise CheckpointError(f"{run}: no such run directory or checkpoint file")
    match = re.fullmatch(r"ckpt_(\d+)\.pt", os.path.basename(path))
    return path, int(match.group(1)) if match else checkpoint.read_run(path)[1]["step"]


def run_dir_of(run):
    return run if os.path.isdir(run) else os.path.dirname(os.path.abspath(run))


def result_stem(step, plan, args, chat_mode):
    """<step>-<suite>[-limitN][-Kshot][-chat][-system<hash>]: one file per checkpoint and request."""
    parts = [f"{step:07d}", plan.label]
    parts += [f"limit{args.limit}"] if args.limit else []
    parts += [f"{args.num_fewshot}shot"] if args.num_fewshot is not None else []
    parts += ["chat"] if chat_mode else []
    parts += [f"system{fileio.fingerprint(args.system)[:8]}"] if args.system else []
    return "-".join(parts)


def request_of(plan, args, chat_mode):
    """What was asked, stored with the result: a second call reuses it only when this is equal."""
    tasks = [[s.name, s.num_fewshot, s.metric] for s in plan.tasks]
    return {"tasks": tasks, "include_path": args.include_path, "limit": args.limit, "chat": chat_mode,
            "system": args.system}  # fmt: skip


def stored_result(path, sha256, request):
    """The stored result at path when it is of this checkpoint and request, else None."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            stored = json.load(f)
    except (OSError, ValueError):
        return None
    enlace = stored.get("enlace", {})
    return stored if enlace.get("sha256") == sha256 and enlace.get("request") == request else None


def evaluate_run(args, out=None, log=lambda m: print(m, file=sys.stderr)):
    """The evaluation command; returns the results path."""
    out = out or sys.stdout
    settings = harness.load_settings(path=args.config)
    ckpt_path, step = newest_checkpoint(args.run)
    args.device = checkpoint.device_for(args.run, args.device, log)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise EvalError("--device cuda: no CUDA device found")
    backend = settings["attention_backend"][args.device]
    model, cfg, tokenizer, _ = checkpoint.load_run(ckpt_path, args.device, log=log, attention_backend=backend)
    chat_mode = args.chat if args.chat is not None else cfg["data"]["format"] == "chat"
    if chat_mode and "<|end|>" not in tokenizer.special_ids:
        raise EvalError(
            f"{ckpt_path}: a {tokenizer.name} run has no chat template; evaluate it without --chat"
        )
    plan = harness.plan_of(args.tasks, settings, chat_mode, args.include_path, args.num_fewshot)
    eval_dir = os.path.join(run_dir_of(args.run), "eval")
    stem = result_stem(step, plan, args, chat_mode)
    results_path = os.path.join(eval_dir, stem + ".json")
    sha256 = fileio.sha256_of_file(ckpt_path)
    request = request_of(plan, args, chat_mode)
    stored = None if args.force else stored_result(results_path, sha256, request)
    if stored is not None:
        with open(os.path.join(eval_dir, stem + ".md"), encoding="utf-8") as f:
            out.write(f.read())
        log(f"reused {results_path} (same checkpoint and request; --force evaluates again)")
        return results_path

    harness.prepare_hub_access(settings, args.offline, log)
    manager = harness.task_manager_for(plan)
    tasks = harness.load_tasks(manager, plan, settings["suites"])
    lm = harness.EnlaceLM.from_model(
        model, tokenizer, args.batch_size or settings["batch_size"],
        settings["max_gen_toks"], settings["seed"], ckpt_path,
    )  # fmt: skip
    log(f"evaluating {ckpt_path} (step {step}) on {', '.join(s.name for s in plan.tasks)}"
        + (" through chat.render" if chat_mode else ""))  # fmt: skip
    results = harness.run(lm, manager, tasks, settings, args.limit, chat_mode, args.system)
    if lm.truncated:
        log(f"{lm.truncated} requests did not fit the {model.seq_len}-token context: cut from the left")
    rows = harness.score_rows(results, plan)
    title = f"{os.path.basename(os.path.normpath(run_dir_of(args.run)))} · step {step} · {plan.label}"
    title += f" · limit {args.limit}" if args.limit else ""
    title += " · prompts through chat.render" if chat_mode else ""
    table = harness.markdown_table(rows, plan, title)
    samples = results.pop("samples", {})
    results["enlace"] = {
        "run": run_dir_of(args.run), "checkpoint": ckpt_path, "step": step, "sha256": sha256,
        "request": request, "suite": plan.suite, "score_name": harness.score_name(plan),
        "score": harness.score(rows), "rows": rows, "code_version": fileio.code_version(),
    }  # fmt: skip
    if args.log_samples:
        for task, task_samples in samples.items():
            lines = "".join(
                json.dumps(s, default=handle_non_serializable, ensure_ascii=False) + "\n"
                for s in task_samples
            )
            fileio.write_atomic(
                os.path.join(eval_dir, f"{stem}-samples-{task}.jsonl"), lambda f, t=lines: f.write(t.encode())
            )
    fileio.write_atomic(os.path.join(eval_dir, stem + ".md"), lambda f: f.write(table.encode()))
    text = json.dumps(results, default=handle_non_serializable, indent=2, ensure_ascii=False) + "\n"
    fileio.write_atomic(results_path, lambda f: f.write(text.encode()))  # last: the result exists once whole
    out.write(table)
    log(f"wrote {results_path}")
    return results_path


def download(args, log=lambda m: print(m, file=sys.stderr)):
    """Load every task of a suite or list once: lm-eval downloads their datasets into the cache."""
    settings = harness.load_settings(path=args.config)
    plan = harness.plan_of(args.tasks, settings, True, args.include_path)
    manager = harness.task_manager_for(plan)
    harness.load_tasks(manager, plan, settings["suites"])
    log(f"{len(plan.tasks)} tasks' datasets are in {harness.cache_folder()}; copy that folder to a "
        "machine without internet and set HF_DATASETS_OFFLINE=1 there")  # fmt: skip


# -----------------------------------------------------------------------------
# The report card


def wall_time(records):
    """Seconds of training: elapsed_s restarts at each resume, so the segments are summed."""
    total, last = 0.0, 0.0
    for r in records:
        if "elapsed_s" in r:
            if r["elapsed_s"] < last:
                total += last
            last = r["elapsed_s"]
    return total + last


def read_records(run):
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def duration(seconds):
    seconds = int(seconds)
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )


def characters_per_token(cfg, tokenizer, limit):
    """(characters, bytes) per token of the run's val split (its first `limit` tokens), or a reason."""
    try:
        tokens = data.load_split_tokens(cfg["data"], "val")[:limit].tolist()
    except (data.DataError, OSError) as e:
        return f"n/a ({str(e).splitlines()[0]})"
    if not tokens:
        return "n/a (empty val split)"
    text = tokenizer.decode(tokens)
    num_bytes = sum(tokenizer.token_bytes[t] for t in tokens)
    return f"{len(text) / len(tokens):.2f} characters ({num_bytes / len(tokens):.2f} bytes) per token over {len(tokens):,} val tokens"


def related_runs(run, cfg):
    """(the run this one was fine-tuned from, the runs beside it fine-tuned from this one)."""
    here = os.path.realpath(run)
    source = cfg["train"].get("init_from")
    base = None
    if source:
        source = source if os.path.isdir(source) else os.path.dirname(source)
        base = source if os.path.isdir(source) and os.path.realpath(source) != here else None
    children = []
    for other in sorted(glob.glob(os.path.join(os.path.dirname(here), "*", "config.yaml"))):
        try:
            other_cfg = config.compose(other)[0]
        except config.ConfigError:
            continue
        init = (other_cfg.get("train") or {}).get("init_from")
        if init and here in (os.path.realpath(init), os.path.realpath(os.path.dirname(init))):
            children.append(os.path.relpath(os.path.dirname(other)))
    return base, children


def stored_tables(run):
    """The Markdown tables of every stored evaluation of a run, oldest step first."""
    tables = []
    for path in sorted(glob.glob(os.path.join(run, "eval", "*.json"))):
        md = path[: -len(".json")] + ".md"
        if os.path.isfile(md):
            with open(md, encoding="utf-8") as f:
                tables.append(f.read().replace("### ", "#### ", 1))
    return tables


AGENT_COLUMNS = (("right", "all", "right tool"), ("valid", "called", "valid syntax"),
                 ("arguments", "needing", "key values"), ("uses", "answered", "result used"))  # fmt: skip


def agent_rates(run):
    """The Markdown table of RUN/agent_eval.json (evaluation/tool_use.py): per held-out set, the rates
    with their counts and calculadora's value right; a flat file of an older release as it was."""
    path = os.path.join(run, "agent_eval.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        report = json.load(f)
    if "sets" not in report:  # an older release's flat rates
        rates = {k: v for k, v in report.items() if k.endswith("_rate")}
        head = "| conversations | " + " | ".join(k[: -len("_rate")].replace("_", " ") for k in rates) + " |"
        values = " | ".join(harness.fmt(v, 3) for v in rates.values())
        rows = [head, "|---:|" + "---:|" * len(rates), f"| {report.get('conversations', '–')} | {values} |"]
        return "\n".join(rows) + f"\n\n(from `{os.path.basename(path)}`)\n"
    head = "| set | " + " | ".join(label for _, _, label in AGENT_COLUMNS) + " | calculadora value right |"
    rows = [head, "|---|" + "---:|" * (len(AGENT_COLUMNS) + 1)]
    for name, figures in report["sets"].items():
        counts, cells = figures["counts"], []
        for part, whole, _ in AGENT_COLUMNS:
            rate = figures.get(part + "_rate")
            cells.append("–" if rate is None else f"{100 * rate:.1f}% ({counts[part]}/{counts[whole]})")
        calc = figures["by_tool"].get("calculadora")
        cells.append("–" if calc is None else f"{calc['value']}/{calc['prompts']}")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    mode = report.get("grounding", "?")
    return (
        "\n".join(rows)
        + f"\n\n(from `{os.path.basename(path)}`, grounding {mode})\n"
        + bias_lines(run, report)
    )


def bias_lines(run, report):
    """The run's call bias (RUN/call_bias.json, agent/call_bias.py): the value served, the rule and the set it
    was chosen on, the sweep, and right tool / no tool per set without it and with it."""
    chosen = call_bias.chosen(run)
    if chosen is None:
        return ""
    sweep = ", ".join(f"{row['bias']:g}: {harness.fmt(row['right_tool'], 3)} / {harness.fmt(row['no_tool'], 3)}"
                      for row in chosen["sweep"])  # fmt: skip
    lines = ["", f"Call bias **{chosen['value']:g}** (`{call_bias.FILE}`, used when the run is served, sampled "
             f"and evaluated), chosen on `{chosen['chosen_on']}`: {chosen['rule']}. Sweep, bias: right tool / "
             f"no tool: {sweep}.", ""]  # fmt: skip
    for name, figures in report.get("sets", {}).items():
        bias = figures.get("call_bias")
        if bias:
            cells = [f"{label} {100 * (row['right_tool'] or 0):.1f}% right tool, {100 * (row['no_tool'] or 0):.1f}% no tool"
                     for label, row in (("without:", bias["without"]), (f"with {bias['value']:g}:", bias["with"]))]  # fmt: skip
            lines += [f"- {name}: " + "; ".join(cells)]
    return "\n".join(lines) + "\n"


def samples(model, tokenizer, chat_run, settings):
    """Three generations with the report's prompts and sampling settings: (prompt, text)."""
    report = settings["report"]
    generator = torch.Generator().manual_seed(report["seed"])
    device = model.embed_tokens.weight.device
    stops = {tokenizer.eos_id, tokenizer.special_ids.get("<|end|>")} - {None}
    out = []
    for prompt in (report["chat_prompts"] if chat_run else report["prompts"])[:3]:
        if chat_run:
            ids, _ = template.render(
                {"messages": [{"role": "user", "content": prompt}]}, tokenizer, for_generation=True
            )
        else:
            ids = ([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + tokenizer.encode(prompt)
        new = []
        for token in engine.generate(model, torch.tensor(ids, device=device), report["max_new_tokens"],
                                     report["temperature"], report["top_k"], generator=generator):  # fmt: skip
            if token in stops:
                break
            new.append(token)
        out.append((prompt, tokenizer.decode(new)))
    return out


def report_card(run, settings, log=lambda m: print(m, file=sys.stderr)):
    """The Markdown of RUN/report.md (and RUN/plot.png, which it shows)."""
    ckpt_path, state = checkpoint.read_run(run, log)
    model, cfg, tokenizer, _ = checkpoint.load_run(ckpt_path, log=log)
    m, t, hw, d = cfg["model"], cfg["train"], cfg["hardware"], cfg["data"]
    records = read_records(run)
    chat_run = d["format"] == "chat"
    world = state.get("world_size", 1)
    tokens_per_step = t["micro_batch_size"] * m["seq_len"] * t["grad_accum_steps"] * world
    name = os.path.basename(os.path.normpath(run))
    lines = [f"# Report card: {name}", "",
             f"Checkpoint `{ckpt_path}` (step {state['step']} of {t['max_steps']}), trained by code "
             f"{state.get('code_version', 'unknown')}; written by `python -m evaluation report`.", ""]  # fmt: skip

    vals = [r for r in records if "val_loss" in r]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    mfus = [r["mfu"] for r in records if "mfu" in r]
    tokenizer_name = (
        f"sentencepiece, {tokenizer.vocab_size:,} tokens" if tokenizer.name != "bytes" else "bytes (256)"
    )
    init = f"from `{t['init_from']}`" if t.get("init_from") else "random"
    rows = [
        ("model", f"{model.num_params() / 1e6:.2f}M parameters: {m['n_layers']} layers, d_model {m['d_model']}, "
                  f"{m['n_heads']} heads ({m['n_kv_heads']} key/value), FFN {m['ffn_hidden']}, context {m['seq_len']}"),
        ("data", f"{d['format']} in `{d['dir']}`; tokenizer: {tokenizer_name}"),
        ("training", f"{state['step']:,} steps × {tokens_per_step:,} tokens = {state['step'] * tokens_per_step:,} tokens "
                     f"seen; lr {t['lr']:g}, warmup {t['warmup_steps']}, {t['decay_shape']} decay over the last "
                     f"{t['decay_fraction']:.0%}; weights {init}"),
        ("hardware", f"profile `{hw['name']}`: {hw['device']}, {hw['dtype']}, attention {hw['attention_backend']}"
                     + (f", {world} processes" if world > 1 else "")),
        ("wall time", f"{duration(wall_time(records))}" + (f"; median {statistics.median(rates):,.0f} tokens/s, "
                      f"MFU {100 * statistics.median(mfus):.0f}%" if rates and mfus else "")),
        ("tokenizer", characters_per_token(cfg, tokenizer, settings["report"]["max_val_tokens"]) if not chat_run
                      else "n/a (conversation data: see the base run)"),
        ("val", f"loss {vals[-1]['val_loss']:.4f}, {vals[-1]['val_bpb']:.4f} bits per byte (step {vals[-1]['step']}, "
                f"{t['eval_batches']} batches)" if vals else "n/a (no val evaluation logged)"),
    ]  # fmt: skip
    lines += ["## Run", "", "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows] + [""]

    lines += ["## Benchmarks", ""]
    base, children = related_runs(run, cfg)
    sections = [(f"this run ({name})", run)] + ([(f"base run `{base}`", base)] if base else [])
    sections += [(f"fine-tuned from it: `{child}`", child) for child in children]
    for label, folder in sections:
        tables = stored_tables(folder)
        lines += [f"### {label}", ""] + (tables or ["No stored evaluation (`python -m evaluation RUN`).", ""])
    during = [r for r in records if "eval_score" in r]
    if during:
        lines += ["During training (train.eval): " + ", ".join(
            f"step {r['step']} {harness.fmt(r['eval_score'], 3)}" for r in during) + "", ""]  # fmt: skip

    rates_table = agent_rates(run)
    if rates_table:
        lines += ["## Tool use", "", rates_table]

    report = settings["report"]
    lines += ["## Samples", "", f"Temperature {report['temperature']}, top-k {report['top_k']}, seed {report['seed']}, "
              f"up to {report['max_new_tokens']} tokens" + (", answers to user messages" if chat_run else "") + ".", ""]  # fmt: skip
    for prompt, text in samples(model, tokenizer, chat_run, settings):
        shown = f"**{prompt}** → {text}" if chat_run else f"**{prompt}**{text}"
        lines += [f"> {shown.strip()}".replace("\n", " ⏎ "), ""]

    lines += ["## Loss", ""]
    try:
        plot.plot([run], os.path.join(run, "plot.png"))
        lines += ["![loss, val loss, bits per byte and learning rate](plot.png)", ""]
    except plot.PlotError as e:
        lines += [f"No plot: {e}", ""]
    return "\n".join(lines)


def write_report(run, config_path=None, out=None):
    out = out or sys.stdout
    if not os.path.isdir(run):
        raise CheckpointError(f"{run}: not a run directory")
    text = report_card(run, harness.load_settings(path=config_path))
    path = os.path.join(run, "report.md")
    fileio.write_atomic(path, lambda f: f.write(text.encode()))
    out.write(text)
    print(f"wrote {path}", file=sys.stderr)
    return path


# -----------------------------------------------------------------------------


def parse_args(argv):
    if argv[:1] == ["report"]:
        parser = argparse.ArgumentParser(prog="evaluation/runs.py report", description="Write RUN/report.md.")
        parser.add_argument("run", help="run directory")
        parser.add_argument("--config", default=harness.DEFAULT_SETTINGS, help="eval layer file")
        return "report", parser.parse_args(argv[1:])
    if argv[:1] == ["download"]:
        parser = argparse.ArgumentParser(
            prog="evaluation/runs.py download", description="Fetch task datasets into the cache."
        )
        parser.add_argument("tasks", help="a suite of the eval layer or task names separated by commas")
        parser.add_argument("--include-path", help="folder of local task YAMLs")
        parser.add_argument("--config", default=harness.DEFAULT_SETTINGS, help="eval layer file")
        return "download", parser.parse_args(argv[1:])
    parser = argparse.ArgumentParser(description="Evaluate an ENLACE run with lm-evaluation-harness.")
    parser.add_argument("run", help="run directory (newest checkpoint) or checkpoint file")
    parser.add_argument(
        "--tasks",
        default="enlace-es",
        help="a suite of the eval layer or lm-eval task names, comma-separated",
    )
    parser.add_argument("--include-path", help="folder of local task YAMLs (lm-eval's --include_path)")
    parser.add_argument("--limit", type=int, help="only the first N documents of each task (a quick look)")
    parser.add_argument(
        "--num-fewshot", type=int, help="few-shot examples for every task (default: the suite's)"
    )
    parser.add_argument(
        "--batch-size", type=int, help="requests per forward pass (default: the eval layer's)"
    )
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="default: the run's, where this machine has it",
    )
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                        help="prompts through chat.render (lm-eval's --apply_chat_template); default: on for "
                             "runs fine-tuned on conversations")  # fmt: skip
    parser.add_argument("--system", help="system instruction (lm-eval's --system_instruction)")
    parser.add_argument(
        "--log-samples", action="store_true", help="also write every request's scores (JSONL per task)"
    )
    parser.add_argument("--force", action="store_true", help="evaluate again even when a stored result fits")
    parser.add_argument("--offline", action="store_true", help="only cached datasets (HF_DATASETS_OFFLINE)")
    parser.add_argument("--config", default=harness.DEFAULT_SETTINGS, help="eval layer file")
    args = parser.parse_args(argv)
    for name in ("limit", "batch_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} {value}: expected a number >= 1")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        parser.error(f"--num-fewshot {args.num_fewshot}: expected a number >= 0")
    return "evaluate", args


@fileio.reports_storage_errors
def main(argv):
    command, args = parse_args(argv)
    try:
        if command == "report":
            write_report(args.run, args.config)
        elif command == "download":
            download(args)
        else:
            evaluate_run(args)
    except (EvalError, CheckpointError, config.ConfigError, data.DataError, template.ChatError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
