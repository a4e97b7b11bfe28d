"""
`make bench ARGS=model` and `ARGS=decode`: training throughput and memory against nanoGPT and
transformers' Qwen3 at the same shapes, each model and shape in a fresh process; KV-cached decoding
against no cache.

    python -m bench model                          # the whole table, 3 rounds (~2 hours on an idle 2-core CPU)
    python -m bench.model table --rounds 5 --shape smoke   # more rounds, fewer shapes
    python -m bench.model step tiny-50m "ENLACE"   # one row of one round: a JSON line
    python -m bench.model loss tiny-50m chunked    # the LM head + loss alone: its peak memory
"""

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import config
import hardware
import model
import optim
from bench.common import ROOT, in_turns, layer, run_fresh, spread
from decode import engine

# -----------------------------------------------------------------------------
# model: training throughput and memory against nanoGPT and transformers' Qwen3, a fresh process each

# name: (model layer, changes to it, micro-batch, warm-up steps, timed steps). tiny-50m is 12 layers.
# Each row runs ROUNDS times, each time in a fresh process: one process's median of a few steps moved by
# up to 1.7x between rows that should agree (a 1024-token row faster per token than a 512-token one), so
# the table gives the median of the rounds and their min-max, and a row whose rounds disagree says so.
SHAPES = {
    "smoke": ("smoke", {}, layer("train", "smoke")["micro_batch_size"], 2, 8),
    "tiny-50m T512": ("tiny-50m", {"seq_len": 512}, 8, 2, 4),
    "tiny-50m T1024": ("tiny-50m", {}, 4, 2, 4),
}
ROUNDS = 3
CPU = layer("hardware", "cpu")  # the profile every row trains with, read once
CHUNK = CPU["loss_chunk_size"]
CONTENDERS = [
    "nanoGPT",
    "transformers Qwen3",
    "ENLACE, full logits",
    f"ENLACE, chunks of {CHUNK}",
    f"ENLACE, chunks of {CHUNK}, compiled",
]
# The LM head + loss alone, and the chunk sizes around the cpu profile's: what chose it.
CHUNK_SIZES = sorted({CHUNK // 4, CHUNK, CHUNK * 4})
LOSSES = ["nanoGPT cross_entropy", "ENLACE, full logits", *(f"ENLACE, chunks of {c}" for c in CHUNK_SIZES)]


def shape_config(shape):
    name, changes, micro_batch, warmup, rounds = SHAPES[shape]
    return layer("model", name) | changes, micro_batch, warmup, rounds


class NanoGPT(nn.Module):
    """nanoGPT's GPT (karpathy/nanoGPT, model.py with train.py's defaults: no biases, dropout 0) at our
    shape: learned position embeddings, LayerNorm, multi-head causal attention through
    scaled_dot_product_attention, a 4 x d_model GELU MLP, the LM head tied to the token embedding and
    F.cross_entropy on the full logits."""

    def __init__(self, cfg):
        super().__init__()
        d, self.n_heads = cfg["d_model"], cfg["n_heads"]
        self.wte = nn.Embedding(cfg["vocab_size"], d)
        self.wpe = nn.Embedding(cfg["seq_len"], d)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "ln_1": nn.LayerNorm(d, bias=False),
                    "c_attn": nn.Linear(d, 3 * d, bias=False),
                    "attn_proj": nn.Linear(d, d, bias=False),
                    "ln_2": nn.LayerNorm(d, bias=False),
                    "c_fc": nn.Linear(d, 4 * d, bias=False),
                    "mlp_proj": nn.Linear(4 * d, d, bias=False),
                }
            )
            for _ in range(cfg["n_layers"])
        )
        self.ln_f = nn.LayerNorm(d, bias=False)
        self.lm_head = nn.Linear(d, cfg["vocab_size"], bias=False)
        self.wte.weight = self.lm_head.weight
        for name, param in self.named_parameters():
            if param.dim() == 2:  # GPT-2's init, the residual projections scaled down with depth
                std = 0.02 / math.sqrt(2 * cfg["n_layers"]) if name.endswith("_proj.weight") else 0.02
                nn.init.normal_(param, mean=0.0, std=std)

    def forward(self, idx, targets):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            q, k, v = block["c_attn"](block["ln_1"](x)).split(x.shape[-1], dim=2)
            q, k, v = (t.view(B, T, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + block["attn_proj"](y.transpose(1, 2).contiguous().view(B, T, -1))
            x = x + block["mlp_proj"](F.gelu(block["c_fc"](block["ln_2"](x))))
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def qwen3_twin(model_cfg):
    """transformers' Qwen3ForCausalLM with our config (export.hf_config's mapping), random init."""
    from transformers import Qwen3Config, Qwen3ForCausalLM  # a development dependency: only this bench

    import export

    hf_cfg = Qwen3Config.from_dict(export.hf_config({"model": model_cfg}, "f32"), use_cache=False)
    return Qwen3ForCausalLM(hf_cfg)


def contender(label, cfg):
    """(module, loss_of(module, idx, targets)) of one row of the table, as the cpu profile trains it."""
    backend = CPU["attention_backend"]
    if label == "nanoGPT":
        return NanoGPT(cfg), lambda net, idx, targets: net(idx, targets)
    if label == "transformers Qwen3":
        # shift_labels: position t predicts targets[t], as in ENLACE (labels alone would be shifted by one)
        return qwen3_twin(
            cfg
        ), lambda net, idx, targets: net(input_ids=idx, labels=targets, shift_labels=targets).loss
    net = model.Transformer(cfg, backend, 0 if label == "ENLACE, full logits" else CHUNK)
    if label.endswith("compiled"):
        net = torch.compile(net)
    return net, lambda net, idx, targets: net(idx, targets)[1]["loss"]


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def where_time_goes(step, top=6):
    """Share of one step's CPU time per aten op, largest first."""
    with profile() as prof:
        step()
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return ", ".join(f"{e.key[6:]} {100 * e.self_cpu_time_total / total:.0f}%" for e in events[:top])


def step_row(shape, label, profile=False):
    """One row in this (fresh) process: seconds per optimizer step (forward + backward + the trainer's
    AdamW) after warm-up, the process's peak resident memory, and for compiled models the seconds of
    the first two steps (the compile, with the inductor cache the parent emptied); with profile, the share
    of one more step's CPU time per aten op."""
    cfg, micro_batch, warmup, rounds = shape_config(shape)
    torch.manual_seed(0)
    net, loss_of = contender(label, cfg)
    idx = torch.randint(0, cfg["vocab_size"], (micro_batch, cfg["seq_len"]))
    targets = torch.randint(0, cfg["vocab_size"], (micro_batch, cfg["seq_len"]))
    optimizer = optim.build_optimizer(net, layer("train", "smoke"), "float32")

    def step():
        loss_of(net, idx, targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    row = {
        "params": sum(p.numel() for p in net.parameters()),
        "tokens_per_step": micro_batch * cfg["seq_len"],
    }
    start = time.perf_counter()
    for _ in range(max(warmup, 2 if label.endswith("compiled") else 0)):
        step()
    row["warmup_s"] = time.perf_counter() - start
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    row |= {"step_s": times, "peak_rss_mib": peak_rss_mib()}
    if profile:
        row["time_per_op"] = where_time_goes(step)
    return row


def allocated_peak(function):
    """Peak bytes allocated and not yet freed while function() runs, counted from where it starts (the
    profiler's memory events: every tensor the allocator hands out, whatever the resident pages)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        function()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def loss_row(shape, label, rounds=3):
    """The LM head + loss alone, forward and backward, on a micro-batch's final norm output: the peak
    bytes it allocates and the median seconds of `rounds` passes after a warm-up one."""
    cfg, micro_batch, _, _ = shape_config(shape)
    positions, d, vocab = micro_batch * cfg["seq_len"], cfg["d_model"], cfg["vocab_size"]
    torch.manual_seed(0)
    weight = (torch.randn(vocab, d) * cfg["init_std"]).requires_grad_()
    targets = torch.randint(0, vocab, (positions,))
    h = torch.randn(positions, d)

    def forward_backward():
        hidden = h.clone().requires_grad_()
        if label == "nanoGPT cross_entropy":
            loss = F.cross_entropy(hidden @ weight.T, targets)
        elif label == "ENLACE, full logits":
            loss = model.logits_losses(hidden @ weight.T, targets, cfg["z_loss_coef"])["loss"]
        else:
            chunk = int(label.rsplit(" ", 1)[1])
            loss = model.chunked_losses(hidden, weight, targets, cfg["z_loss_coef"], chunk)["loss"]
        loss.backward()
        weight.grad = None

    forward_backward()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        forward_backward()
        times.append(time.perf_counter() - start)
    return {"peak_bytes": allocated_peak(forward_backward), "seconds": statistics.median(times)}


def run_child(kind, shape, label, *flags):
    """step_row / loss_row in a fresh process (common.run_fresh)."""
    return run_fresh("bench.model", kind, shape, label, *flags)


def load_average():
    with open("/proc/loadavg", encoding="utf-8") as f:
        return " ".join(f.read().split()[:3])


def step_rounds(shape, rounds):
    """{label: [one fresh process's row per round]}: the contenders in turn, each round starting one
    further down the list, so that no contender is always the one that runs first on a cool machine."""
    rows = {label: [] for label in CONTENDERS}
    for index in range(rounds):
        for label in in_turns(CONTENDERS, index):
            profiled = index == 0 and label == f"ENLACE, chunks of {CHUNK}"  # one op profile is enough
            rows[label].append(run_child("step", shape, label, *(["--profile"] if profiled else [])))
    return rows


def print_steps(shape, rows, peak):
    """One line per contender: tokens/s (median of the rounds' medians, and their min-max), peak RSS, MFU
    and the ratios to nanoGPT and Qwen3 taken round by round (both sides of a ratio ran in the same
    round, so a slower round moves both)."""
    cfg, micro_batch, _, steps = shape_config(shape)
    rounds = len(rows["nanoGPT"])
    print(
        f"model: {shape}: L{cfg['n_layers']} d{cfg['d_model']} T{cfg['seq_len']} vocab {cfg['vocab_size']}, "
        f"micro-batch {micro_batch} | tok/s: median of {rounds} rounds (min-max), each round a fresh process "
        f"timing {steps} steps after warm-up"
    )
    rates = {
        label: [row["tokens_per_step"] / statistics.median(row["step_s"]) for row in runs]
        for label, runs in rows.items()
    }
    for label, runs in rows.items():
        flops = 6 * runs[0]["params"] + 12 * cfg["n_layers"] * cfg["d_model"] * cfg["seq_len"]
        rate = statistics.median(rates[label])
        ratios = [
            spread([mine / theirs for mine, theirs in zip(rates[label], rates[peer], strict=True)], ".2f")
            + "x"
            for peer in ("nanoGPT", "transformers Qwen3")
        ]
        disagree = max(rates[label]) / min(rates[label]) - 1
        print(
            f"model:   {label:34s} {spread(rates[label])} tok/s (rounds {100 * disagree:.0f}% apart) | "
            f"peak RSS {statistics.median(r['peak_rss_mib'] for r in runs):6,.0f} MiB | "
            f"MFU {100 * flops * rate / peak:3.0f}% | {ratios[0]} nanoGPT | {ratios[1]} Qwen3"
        )
    return rates


def print_compile_and_loss(rows, losses):
    """Where the chunked model's time goes, what torch.compile costs and when it pays (the first round:
    an empty inductor cache), and the LM head + loss's own memory and time."""
    chunked, compiled = f"ENLACE, chunks of {CHUNK}", f"ENLACE, chunks of {CHUNK}, compiled"
    print(f"model:   time per op ({chunked}): {rows[chunked][0]['time_per_op']}")
    eager_s, compiled_s = (
        statistics.median(s for row in rows[label] for s in row["step_s"]) for label in (chunked, compiled)
    )
    overhead_s = rows[compiled][0]["warmup_s"] - 2 * compiled_s  # the two compiling steps less two ordinary
    pays = (
        f"pays for itself after {overhead_s / (eager_s - compiled_s):,.0f} steps"
        if compiled_s < eager_s
        else "never pays"
    )
    print(f"model:   torch.compile: {overhead_s:.0f} s of compiling before the first step, {pays}")
    full = losses["ENLACE, full logits"]
    print(
        "model:   LM head + loss alone (forward + backward): "
        + " | ".join(
            f"{label.replace('ENLACE, ', '')} {row['peak_bytes'] / 2**20:,.0f} MiB {row['seconds']:.2f} s"
            for label, row in losses.items()
        )
        + f" | chunks of {CHUNK}: {full['peak_bytes'] / losses[chunked]['peak_bytes']:.1f}x less memory, "
        f"{full['seconds'] / losses[chunked]['seconds']:.2f}x the speed of the full logits",
        flush=True,
    )


def bench_model(rounds=ROUNDS, shapes=tuple(SHAPES)):
    """Every contender at every shape, each round of each in its own process, trained with the same AdamW
    on the same random tokens: tokens/s with its spread over the rounds, the process's peak resident
    memory, ratios to nanoGPT and transformers' Qwen3; torch.compile's cost and when it pays; the LM head
    + loss's own peak memory. MFU divides each model's 6 x parameters + attention FLOPs by
    hardware.measure_peak_tflops, the figure a run's log uses."""
    runs = len(shapes) * (rounds * len(CONTENDERS) + len(LOSSES))
    print(f"model: {runs} fresh processes, {len(shapes)} shape(s), {rounds} rounds", flush=True)
    load_before = load_average()
    peak = hardware.measure_peak_tflops(torch.device("cpu")) * 1e12
    for shape in shapes:
        rows = step_rounds(shape, rounds)
        losses = {label: run_child("loss", shape, label) for label in LOSSES}
        print_steps(shape, rows, peak)
        print_compile_and_loss(rows, losses)
    print(f"model: load average {load_before} before, {load_average()} after (1, 5, 15 minutes)")


# -----------------------------------------------------------------------------
# decode: generation with the KV cache against a full forward pass per token, and past seq_len


def decode_rates(net, prompt, new_tokens):
    """(seconds to the first token, tokens/s after it) of greedy engine.generate with the KV cache."""
    start = time.perf_counter()
    stream = engine.generate(net, prompt, new_tokens, temperature=0)
    next(stream)
    first = time.perf_counter()
    rest = sum(1 for _ in stream)
    return first - start, rest / (time.perf_counter() - first)


def uncached_rate(net, prompt, new_tokens):
    """Tokens/s of greedy decoding without a cache: a full forward pass over the last seq_len tokens per
    token (nanoGPT's sample loop)."""
    sequence = prompt.tolist()
    start = time.perf_counter()
    with torch.no_grad():
        for _ in range(new_tokens):
            logits, _ = net(torch.tensor([sequence[-net.seq_len :]]))
            sequence.append(int(logits[0, -1].argmax()))
    return new_tokens / (time.perf_counter() - start)


def bench_decode():
    """tiny-50m (random weights, the cpu profile's kernel) at 128 and ~1024 tokens of context, and the
    smoke model generating 4 x seq_len tokens, which makes generate restart its cache every seq_len / 2."""
    backend = CPU["attention_backend"]
    torch.manual_seed(0)
    tiny = model.Transformer(layer("model", "tiny-50m"), backend).eval()
    generated, uncached_tokens = 32, 4
    for context in (128, tiny.seq_len):
        prompt = torch.randint(0, tiny.cfg["vocab_size"], (context - generated,))
        first_s, cached = decode_rates(tiny, prompt, generated)
        uncached = uncached_rate(tiny, prompt, uncached_tokens)
        print(
            f"decode: tiny-50m, {context - generated}-token prompt + {generated} new | KV cache "
            f"{cached:,.1f} tok/s (prefill {first_s:.2f}s) | no cache {uncached:,.2f} tok/s | "
            f"cache {cached / uncached:,.0f}x faster"
        )
    smoke = model.Transformer(layer("model", "smoke"), backend).eval()
    long_run = 4 * smoke.seq_len
    prompt = torch.randint(0, 256, (16,))
    first_s, cached = decode_rates(smoke, prompt, long_run)
    uncached = uncached_rate(smoke, prompt[-1:].repeat(smoke.seq_len), 16)  # a full window per token
    print(
        f"decode: smoke model, {long_run} tokens from a 16-token prompt (seq_len {smoke.seq_len}) | "
        f"{cached:,.0f} tok/s | a full window per token (what each step past seq_len cost before) "
        f"{uncached:,.0f} tok/s"
    )
    sampling_line(smoke.cfg["vocab_size"])


def sampling_line(vocab, rounds=7, draws=3000):
    """One token drawn from vocab logits with the server's settings (configs/serve/default.yaml) and
    without candidates: median and range of rounds of draws (engine.sample_token, one row)."""
    settings = config.load_layer("serve", os.path.join(ROOT, "configs", "serve", "default.yaml"))
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 3
    generator = torch.Generator().manual_seed(0)
    cases = {
        "server (temperature {temperature}, top_k {top_k}, top_p {top_p})".format(**settings): (
            settings["temperature"], settings["top_k"], settings["top_p"]),
        "temperature 1, every token": (1.0, None, None),
    }  # fmt: skip
    for label, (temperature, top_k, top_p) in cases.items():
        rates = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(draws):
                engine.sample_token(logits, temperature, top_k, top_p, generator)
            rates.append((time.perf_counter() - start) / draws * 1e6)
        print(f"decode: sampling one token of {vocab:,}, {label}: {statistics.median(rates):.1f} us "
              f"(range {min(rates):.1f}-{max(rates):.1f} over {rounds} rounds of {draws:,})")  # fmt: skip


def main(argv):
    """`table`: the model section with chosen rounds and shapes; `step` / `loss`: one row of one round, in
    this process, as a JSON line (bench_model runs each row this way)."""
    if argv[:1] == ["table"]:
        parser = argparse.ArgumentParser(prog="python -m bench.model table", description=bench_model.__doc__)
        parser.add_argument("--rounds", type=int, default=ROUNDS, help="fresh processes per row (>= 2)")
        parser.add_argument("--shape", action="append", choices=list(SHAPES), help="repeatable; default all")
        args = parser.parse_args(argv[1:])
        if args.rounds < 2:
            parser.error(f"--rounds {args.rounds}: a spread needs at least 2 rounds")
        bench_model(args.rounds, tuple(args.shape or SHAPES))
        return
    rows = {"step": CONTENDERS, "loss": LOSSES}
    parser = argparse.ArgumentParser(description="One row of make bench ARGS=model, printed as a JSON line")
    parser.add_argument(
        "kind", choices=list(rows), help="step: a training step; loss: the LM head + loss alone"
    )
    parser.add_argument("shape", choices=list(SHAPES))
    parser.add_argument("label", help=f"step: {', '.join(CONTENDERS)}; loss: {', '.join(LOSSES)}")
    parser.add_argument("--profile", action="store_true", help="step: also the share of time per aten op")
    args = parser.parse_args(argv)
    if args.label not in rows[args.kind]:
        parser.error(f"{args.kind} has no row {args.label!r}; one of: {', '.join(rows[args.kind])}")
    row = (
        step_row(args.shape, args.label, args.profile)
        if args.kind == "step"
        else loss_row(args.shape, args.label)
    )
    print(json.dumps(row))


if __name__ == "__main__":
    main(sys.argv[1:])
