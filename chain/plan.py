"""
The plan of a chain before anything runs: per stage its data (documents, tokens), the hours on the board, the
disk it holds, the epochs of its data and whether its step fits the board's memory; then the checks that
refuse a run at start (disk, memory), before any download.

Hours of a training stage come from the hardware profile's measured throughput of the model
(hardware.measured: {<model layer name>: {tokens_per_s, date, machine}}) where the board has one; otherwise
they are an estimate, FLOPs per token x tokens / (peak TFLOP/s x the chain's assumed MFU), printed as such.
Figures a finished stage has written (its manifest) replace the estimates.
"""

import glob
import json
import os
import shutil

import config
import data
import microbatch
from chain import runfile
from corpus import token_budget

GB = 1e9


def read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def model_name(stage):
    """The model layer's file name (model/tiny-50m.yaml -> tiny-50m): what hardware.measured is keyed by."""
    run = read_json_yaml(os.path.join(runfile.CONFIGS, stage["config"]))
    path = (run.get("include") or {}).get("model", "")
    return os.path.splitext(os.path.basename(path))[0]


def read_json_yaml(path):
    import yaml

    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f) or {}


def flops_per_token(model_cfg):
    """6 x parameters (forward and backward) + the attention scores' 12 x layers x d_model x seq_len."""
    params, _ = microbatch.parameter_counts(model_cfg)
    return 6 * params + 12 * model_cfg["n_layers"] * model_cfg["d_model"] * model_cfg["seq_len"]


def train_tokens(cfg):
    t = cfg["train"]
    return t["max_steps"] * t["micro_batch_size"] * t["grad_accum_steps"] * cfg["model"]["seq_len"]


def train_rate(cfg, hardware, assume, name):
    """(tokens per second, how it was found) of a training step of cfg on the board."""
    measured = (hardware.get("measured") or {}).get(name)
    if measured:
        where = f"{measured.get('date', '?')} on {measured.get('machine', '?')}"
        return measured["tokens_per_s"], f"measured {where}"
    peak = hardware["peak_tflops"] or assume["peak_tflops"]
    flops = flops_per_token(cfg["model"])
    rate = peak * 1e12 * assume["mfu"] / flops
    return rate, f"estimate: {flops / 1e6:.0f} MFLOP/token, {peak} TFLOP/s x MFU {assume['mfu']}"


def attention_workspace_bytes(model_cfg, micro_batch, dtype, backend):
    """What the attention kernel adds to microbatch.py's step: in one layer's backward pass, dq, dk and dv of
    every head, a float32 dq accumulator and the per-row delta (the flash and memory-efficient kernels);
    with mem_efficient and fewer kv heads, the keys and values repeated to every head and kept for the
    backward pass in every layer (the kernel has no GQA); with the math kernel, every layer's
    (heads x seq x seq) attention weights and one float32 score matrix."""
    heads, kv_heads, width = model_cfg["n_heads"], model_cfg["n_kv_heads"], model_cfg["d_model"]
    seq, layers = model_cfg["seq_len"], model_cfg["n_layers"]
    element, positions = microbatch.bytes_per_element(dtype), micro_batch * seq
    if backend == "math":
        return micro_batch * heads * seq * seq * (layers * element + 4)
    workspace = positions * (3 * width * element + 4 * width + 4 * heads)
    if backend == "mem_efficient" and kv_heads < heads:
        workspace += layers * positions * 2 * (heads - kv_heads) * (width // heads) * element
    return workspace


def step_memory_bytes(cfg):
    """The training step's estimated peak: microbatch.py's tensors + the attention kernel's workspace."""
    hw, micro_batch = cfg["hardware"], cfg["train"]["micro_batch_size"]
    step = microbatch.step_peak_bytes(cfg["model"], micro_batch, hw["dtype"], hw["loss_chunk_size"])
    return step + attention_workspace_bytes(cfg["model"], micro_batch, hw["dtype"], hw["attention_backend"])


def eval_memory_bytes(cfg):
    """The evaluation's estimated peak during a run (no_grad, the same micro-batch): the weights and the
    optimizer's moments stay, the gradients are freed; one layer's forward tensors and one loss chunk's
    float32 logits (and their softmax) at a time."""
    model_cfg, hw = cfg["model"], cfg["hardware"]
    params, _ = microbatch.parameter_counts(model_cfg)
    positions = cfg["train"]["micro_batch_size"] * model_cfg["seq_len"]
    chunk = min(hw["loss_chunk_size"] or positions, positions)
    layer = positions * (4 * model_cfg["ffn_hidden"] + 6 * model_cfg["d_model"]) * 4
    return 12 * params + layer + 8 * chunk * model_cfg["vocab_size"]


def memory_fit(cfg, hardware):
    """(fits, line): the step's and the evaluation's estimated peaks against the board's memory_gib, or on
    the CPU against this machine's RAM."""
    gib = microbatch.GIB
    hw = cfg["hardware"]
    micro_batch = cfg["train"]["micro_batch_size"]
    step = microbatch.step_peak_bytes(cfg["model"], micro_batch, hw["dtype"], hw["loss_chunk_size"])
    attention = attention_workspace_bytes(cfg["model"], micro_batch, hw["dtype"], hw["attention_backend"])
    evaluation = eval_memory_bytes(cfg)
    need = max(step + attention, evaluation)
    have = hardware["memory_gib"] * gib if hardware["memory_gib"] else ram_bytes()
    where = f"{hardware['name']} memory_gib" if hardware["memory_gib"] else "this machine's RAM"
    line = (
        f"{need / gib:.1f} of {have / gib:.1f} GiB ({where}; estimate: step {step / gib:.1f} + attention "
        f"{hw['attention_backend']} {attention / gib:.2f}, evaluation {evaluation / gib:.1f})"
    )
    return need <= have, line


def ram_bytes():
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def file_bytes(pattern):
    return sum(os.path.getsize(p) for p in glob.glob(pattern) if os.path.isfile(p))


WORD_FILTERS = ("gopher_repetition", "fineweb_quality", "gopher_quality")  # the cost model's word_filters


def source_stages(source, corpus_cfg):
    """The corpus step's stages that read this source's text, as the cost model names them."""
    filters = corpus_cfg["filters"]
    chosen = source["filters"]
    if chosen is True:
        chosen = [name for name in ("language", *WORD_FILTERS) if filters[name]["enabled"]]
    stages = ["language"] if "language" in (chosen or []) else []
    stages += ["word_filters"] if any(name in WORD_FILTERS for name in chosen or []) else []
    stages += [name for name in ("pii", "near_dedup") if corpus_cfg[name]["enabled"]]
    return stages + ["decontamination"]


def this_machines_cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def corpus_hours(data_cfg, assume, source_bytes, tokens):
    """(hours, basis) of the corpus stage by docs/corpus.md's cost model: each source's text times the CPU
    seconds per MB of the stages that read it, on the filter tasks' cores; the encode over the text and the
    tokens it writes, on its workers; the tokenizer on its sample."""
    corpus_cfg = data_cfg["corpus"]
    words = corpus_cfg["filters"]["word_tokenizer"]
    costs = assume["corpus_cpu_s_per_mb"][words]
    cores = assume["cores"] or this_machines_cores()
    workers = min(cores, data_cfg["processes"] or cores)
    tasks = min(cores, corpus_cfg["executor"]["tasks"] or workers)
    filter_s = sum(
        size / 1e6 * sum(costs[stage] for stage in source_stages(source, corpus_cfg))
        for source, size in source_bytes
    )
    text = sum(size for _, size in source_bytes)
    encode_s = (text + tokens * assume["bytes_per_token"]) / 1e6 / assume["encode_mb_per_s"]
    tokenizer_s = min(text, data_cfg["tokenizer"]["sample_bytes"]) / 1e6 * assume["tokenizer_s_per_mb"]
    hours = (filter_s / tasks + encode_s / workers + tokenizer_s) / 3600
    basis = (
        f"estimate: {human_hours(filter_s / 3600)} of CPU ({words} words) on {tasks} of {cores} cores + "
        f"encode {human_hours(encode_s / 3600)} of CPU on {workers} (docs/corpus.md's cost per MB)"
    )
    return hours, basis


def corpus_plan(cfg, assume, manifest):
    data_cfg = cfg["data"]
    sources = data_cfg["corpus"]["sources"]
    source_bytes = [
        (s, ((s.get("hub") or {}).get("max_bytes") or 0 if "hub" in s else file_bytes(s["path"]))
         * assume["text_per_download_byte"])
        for s in sources
    ]  # fmt: skip
    text = sum(size for _, size in source_bytes)
    encoded = (manifest.get("encode") or {}).get("train") or {}
    if encoded.get("complete"):
        docs, tokens, how = f"{encoded['documents']:,}", encoded["tokens"], "measured"
    else:
        mixture = data_cfg["corpus"].get("mixture") or {}
        tokens = mixture.get("total_tokens") or text / assume["bytes_per_token"]
        how = (
            "the mixture's total"
            if mixture.get("total_tokens")
            else f"estimate at {assume['bytes_per_token']} bytes each"
        )
        docs = "?"
    hours, basis = corpus_hours(data_cfg, assume, source_bytes, tokens)
    disk = text + 2 * tokens * 1.05  # filtered text, then uint16 shards (val ~5% more)
    return {
        "licences": [(source["name"], source["licence"]) for source in sources],
        "data": f"{len(sources)} sources, {docs} documents, tokens {how}",
        "tokens": tokens,
        "hours": hours,
        "basis": basis,
        "peak": disk,
        "end": disk,
    }


def download_plan(cfg, assume):
    hub = [s["hub"] for s in cfg["data"]["corpus"]["sources"] if s.get("hub")]
    size = sum(h.get("max_bytes") or 0 for h in hub)
    have = sum(file_bytes(os.path.join(h["local_dir"], h["files"])) for h in hub)
    left = max(0, size - have)
    return {
        "data": f"{len(hub)} Hub sources, {size / GB:.1f} GB ({have / GB:.1f} GB here)",
        "hours": left / (assume["download_mb_per_s"] * 1e6) / 3600,
        "basis": f"estimate: {assume['download_mb_per_s']} MB/s",
        "peak": left,
        "end": left,
    }


def train_plan(chain, stage, cfg, hardware, assume):
    tokens = train_tokens(cfg)
    rate, basis = train_rate(cfg, hardware, assume, model_name(stage))
    if basis.startswith("measured"):  # the estimate beside it: how far the assumptions were off
        guess, _ = train_rate(cfg, dict(hardware, measured={}), assume, model_name(stage))
        basis += f" (the estimate: {human_hours(tokens / guess / 3600)})"
    params, _ = microbatch.parameter_counts(cfg["model"])
    checkpoint_bytes = 12 * params  # float32 weights and the optimizer's two moments
    keep = cfg["train"]["keep_last"]
    fits, memory = memory_fit(cfg, hardware)
    return {
        "data": f"{cfg['train']['max_steps']:,} steps x {tokens // cfg['train']['max_steps']:,} tokens",
        "tokens": tokens,
        "hours": tokens / rate / 3600,
        "basis": basis,
        "rate": rate,
        "peak": (keep + 1) * checkpoint_bytes,
        "end": keep * checkpoint_bytes,
        "epochs": epochs_of(chain, stage, cfg, tokens),
        "fits": fits,
        "memory": memory,
    }


def epochs_of(chain, stage, cfg, tokens):
    """The passes a training stage makes over its data: from the data stage's manifest when it has run,
    else from what its config says (the corpus mixture's tokens; the conversations' count). For an SFT
    mixture, each source's epochs (passes x its epochs in the mixture) once the mixture is built."""
    data_dir = runfile.folder_of(chain, stage["data"])
    manifest = read_json(os.path.join(data_dir, "manifest.json"))
    if cfg["data"]["format"] == "shards":
        encoded = (manifest.get("encode") or {}).get("train") or {}
        mixture = (cfg["data"].get("corpus") or {}).get("mixture") or {}
        held = encoded.get("tokens") or mixture.get("total_tokens")
        return f"{tokens / held:.2f} passes" if held else "known after the corpus stage"
    read = token_budget.sequences_per_run(cfg)
    data_stage = runfile.stage_by_name(chain, stage["data"])  # the mixture is what that stage built
    data_cfg = runfile.load_stage_config(chain, data_stage)["data"] if "config" in data_stage else {}
    mix_cfg = (data_cfg.get("chat") or {}).get("mixture")
    try:
        passes = token_budget.run_epochs(cfg)[token_budget.PACKED[cfg["data"]["format"]]]
    except data.DataError:
        text = f"{read:,} rows read; rows known after {stage['data']}"
        if mix_cfg:  # the epochs per source need the mixture's counts
            shares = ", ".join(f"{s['name']} {s['share']:g}" for s in mix_cfg["sources"])
            text += f", each source's epochs (max {mix_cfg['max_epochs']:g}) after it; shares {shares}"
        return text
    text = f"{passes:.1f} epochs of {round(read / passes):,} rows"
    if mix_cfg:
        built = read_json(os.path.join(mix_cfg["dir"], "manifest.json")).get("sources") or {}
        mixed = {name: stats["mixture"]["epochs"] for name, stats in built.items() if "mixture" in stats}
        per_source = [f"{name} {passes * epochs:.2f}" for name, epochs in mixed.items()]
        text += f"; per source: {', '.join(per_source)}" if per_source else ""
    return text


def chat_plan(cfg):
    """A chat-prepare stage: its conversations; with a mixture its sources, shares and licences, else the
    local files it packs (the rehearsal: no Hub conversation source)."""
    conversations, size, later = 0, 0, 0
    patterns = cfg["data"]["chat"]["train"]
    for pattern in patterns:
        later += not glob.glob(pattern)
        for path in glob.glob(pattern):
            size += os.path.getsize(path)
            with open(path, "rb") as f:
                conversations += sum(1 for _ in f)
    made = f" + {later} file(s) made by an earlier stage" if later else ""
    found = f"{conversations:,} conversations{made}"
    plan = {"data": found, "hours": 0.0, "basis": "estimate: minutes", "peak": 2 * size, "end": 2 * size}
    mix_cfg = cfg["data"]["chat"].get("mixture")
    if mix_cfg:
        total = f"{mix_cfg['conversations']:,}" if mix_cfg["conversations"] else "all"
        plan["data"] = f"mixture: {total} conversations of {len(mix_cfg['sources'])} sources"
        plan["licences"] = [(s["name"], s["licence"]) for s in mix_cfg["sources"]]
    else:
        plan["note"] = (
            f"local conversations only ({', '.join(patterns)}); the Hub conversation sources of the "
            "boards' SFT mixture are left out"
        )
    return plan


def chat_download_plan(cfg, assume):
    """The SFT mixture's Hub sources: their hub.max_bytes, else the chain's assume.chat_download_mb."""
    mix_cfg = cfg["data"].get("chat", {}).get("mixture") or {"sources": []}
    hub = [s for s in mix_cfg["sources"] if s.get("hub")]
    bounded = all(s["hub"].get("max_bytes") for s in hub)
    size = sum(s["hub"]["max_bytes"] for s in hub) if bounded else assume["chat_download_mb"] * 1e6
    have = sum(file_bytes(os.path.join(s["hub"]["local_dir"], s["hub"]["files"])) for s in hub)
    left = max(0, size - have)
    how = "hub.max_bytes" if bounded else "assumed"
    names = ", ".join(s["name"] for s in hub)
    return {
        "data": f"{names}: {size / 1e6:.0f} MB {how} ({have / 1e6:.0f} MB here)",
        "hours": left / (assume["download_mb_per_s"] * 1e6) / 3600,
        "basis": f"estimate: {assume['download_mb_per_s']} MB/s",
        "peak": left,
        "end": left,
        "licences": [(s["name"], s["licence"]) for s in hub],
    }


def stage_plan(chain, stage, hardware):
    assume, command = chain["assume"], stage["command"]
    cfg = runfile.load_stage_config(chain, stage) if "config" in stage else None
    if command == "corpus-download":
        return download_plan(cfg, assume)
    if command == "corpus":
        manifest = read_json(os.path.join(runfile.folder_of(chain, stage["name"]), "manifest.json"))
        return corpus_plan(cfg, assume, manifest)
    if command == "train":
        return train_plan(chain, stage, cfg, hardware, assume)
    if command == "chat-download":
        return chat_download_plan(cfg, assume)
    if command == "chat-prepare":
        return chat_plan(cfg)
    if command == "export":
        run = runfile.stage_by_name(chain, stage["from"])
        params, _ = microbatch.parameter_counts(runfile.load_stage_config(chain, run)["model"])
        size = 4 * params if stage["to"] == "hf" else 2 * params
        return {
            "data": f"{stage['to']}",
            "hours": 0.0,
            "basis": "estimate: minutes",
            "peak": 2 * size,
            "end": size,
        }
    if command == "ask":
        return {"data": "the served model asked (serve layer's ask)", "hours": 0.0, "basis": "estimate: minutes",
                "peak": 0, "end": 0}  # fmt: skip
    return {"data": stage.get("tasks", "-"), "hours": 0.0, "basis": "estimate: minutes", "peak": 0, "end": 0}


def make_plan(chain):
    hardware = config.load_layer("hardware", os.path.join(runfile.CONFIGS, chain["hardware"]))
    stages = [dict(stage_plan(chain, s, hardware), name=s["name"]) for s in chain["stages"]]
    return {"hardware": hardware, "stages": stages}


def disk_totals(stages):
    """(peak, end) bytes of the whole run: the stages' outputs add up; each stage's temporary excess
    (a checkpoint being written, an export's staging folder) comes on top of what is there before it."""
    held, peak = 0, 0
    for s in stages:
        peak = max(peak, held + s["peak"])
        held += s["end"]
    return peak, held


def human_count(n):
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


def human_hours(hours):
    if hours < 1 / 60:
        return "<1 min"
    if hours < 1:
        return f"{hours * 60:.0f} min"
    return f"{hours:.1f} h" if hours < 48 else f"{hours / 24:.1f} days"


def format_plan(chain, plan):
    hardware = plan["hardware"]
    lines = [f"plan of {chain['board']} ({hardware['name']}): run folder {chain['folder']}/"]
    lines.append(f"{'':3}{'stage':14}{'data':56}{'tokens':>7}  {'hours':>9}  basis")
    for n, s in enumerate(plan["stages"], 1):
        tokens = human_count(s["tokens"]) if s.get("tokens") else "-"
        lines.append(
            f"{n:>2} {s['name']:14}{s['data']:56}{tokens:>7}  {human_hours(s['hours']):>9}  {s['basis']}"
        )
    for s in plan["stages"]:
        if "epochs" in s:
            verdict = "fits" if s["fits"] else "DOES NOT FIT"
            lines.append(f"   {s['name']}: epochs {s['epochs']}; memory {verdict}: {s['memory']}")
    peak, end = disk_totals(plan["stages"])
    total = sum(s["hours"] for s in plan["stages"])
    measured = sum(s["basis"].startswith("measured") for s in plan["stages"])
    lines.append(
        f"total: {human_hours(total)} ({measured} stage(s) measured, the rest estimates); disk (estimate) "
        f"{peak / GB:.2f} GB at peak, {end / GB:.2f} GB at the end"
    )
    lines.extend(throughput_lines(hardware))
    lines.extend(needs_lines(hardware))
    lines.extend(licence_lines(plan["stages"]))
    if not any(stage["command"] == "chat-download" for stage in chain["stages"]):
        lines.extend(f"{s['name']}: {s['note']}" for s in plan["stages"] if "note" in s)
    return "\n".join(lines)


def licence_lines(stages):
    """Each corpus and conversation source once, with its licence (what the run's model was trained on)."""
    licences = dict(pair for s in stages for pair in s.get("licences", []))
    if not licences:
        return []
    return ["data sources and their licences:"] + [f"  {name}: {text}" for name, text in licences.items()]


def throughput_lines(hardware):
    measured = hardware.get("measured") or {}
    if not measured:
        peak = hardware["peak_tflops"]
        peak = f"peak {peak} TFLOP/s" if peak else "the profile has no peak: the chain's assume.peak_tflops"
        return [f"throughput of {hardware['name']}: none measured yet ({peak}; hours are estimates)"]
    lines = [f"throughput of {hardware['name']} (hardware.measured):"]
    for name, m in sorted(measured.items()):
        lines.append(
            f"  {name:16}{m['tokens_per_s']:>12,.0f} tokens/s  {m.get('date', '?')}  {m.get('machine', '?')}"
        )
    return lines


def needs_lines(hardware):
    """What the board's machine must have installed, from the profile (hardware.needs): the plan is read
    before a 29 h run, so a driver too old for the CUDA that torch was built with shows here, not at step 1."""
    needs = hardware.get("needs")
    if not needs:
        return []
    return [
        f"needs on the board: NVIDIA driver >= {needs['nvidia_driver']} and torch built for CUDA {needs['cuda']} "
        f"({hardware['name']} hardware.needs; check there: .venv/bin/python -c "
        "'import torch; print(torch.version.cuda, torch.cuda.is_available())')"
    ]


def refusal(chain, plan, done):
    """One line when the run cannot fit this machine's free disk or the board's memory; None when it can.
    `done` names the stages already finished (what they hold is on disk already)."""
    for s in plan["stages"]:
        if s.get("fits") is False and s["name"] not in done:
            return f"refused: stage {s['name']} needs {s['memory']}; lower train.micro_batch_size in its run file"
    left = [s for s in plan["stages"] if s["name"] not in done]
    peak, _ = disk_totals(left)
    need = peak + chain["assume"]["min_free_gib"] * microbatch.GIB
    where = existing_parent(chain["folder"])
    free = shutil.disk_usage(where).free
    if need > free:
        return (
            f"refused: the run needs {need / GB:.2f} GB of disk ({peak / GB:.2f} GB at peak + min_free_gib "
            f"{chain['assume']['min_free_gib']}), {free / GB:.2f} GB are free on {where}"
        )
    return None


def existing_parent(path):
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path
