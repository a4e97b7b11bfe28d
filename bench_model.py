"""
`make bench ARGS=model` and `ARGS=decode`: training throughput against transformers' Qwen3 at the same
shapes, MFU and where the time goes; KV-cached decoding against no cache.
"""

import os
import statistics
import tempfile
import time

import torch
from torch.profiler import profile

import model
import train
from bench_common import layer

# -----------------------------------------------------------------------------
# model: training throughput against transformers' Qwen3 at the same shapes, MFU, where the time goes


def qwen3_twin(model_cfg):
    """transformers' Qwen3ForCausalLM with our config (export.hf_config's mapping), random init."""
    from transformers import Qwen3Config, Qwen3ForCausalLM  # a development dependency: only this bench

    import export

    hf_cfg = Qwen3Config.from_dict(export.hf_config({"model": model_cfg}, "f32"), use_cache=False)
    return Qwen3ForCausalLM(hf_cfg)


def training_steps(model_cfg, batch_size, contenders, train_cfg, warmup, rounds):
    """Seconds per optimizer step (forward + backward + the trainer's AdamW) of each contender on the same
    random tokens, timed in interleaved rounds so a neighbour process slows all of them alike. contenders:
    {label: (module, loss_of(module, idx, targets))}. Returns {label: [seconds, ...]} and the step fns."""
    idx = torch.randint(0, model_cfg["vocab_size"], (batch_size, model_cfg["seq_len"]))
    targets = torch.randint(0, model_cfg["vocab_size"], (batch_size, model_cfg["seq_len"]))
    steps = {}
    for label, (net, loss_of) in contenders.items():
        optimizer = train.build_optimizer(net, train_cfg, torch.device("cpu"))

        def step(net=net, loss_of=loss_of, optimizer=optimizer):
            loss_of(net, idx, targets).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        steps[label] = step
    times = {label: [] for label in contenders}
    for round_index in range(warmup + rounds):
        for label, step in steps.items():
            start = time.perf_counter()
            step()
            if round_index >= warmup:
                times[label].append(time.perf_counter() - start)
    return times, steps


def compile_seconds(compiled, model_cfg, batch_size):
    """Seconds of the first two forward + backward passes of a torch.compile'd model: the compile (the
    second pass may still recompile for the training-mode guards), not yet steady training."""
    idx = torch.randint(0, model_cfg["vocab_size"], (batch_size, model_cfg["seq_len"]))
    start = time.perf_counter()
    for _ in range(2):
        enlace_loss(compiled, idx, idx).backward()
    compiled.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def where_time_goes(step, top=6):
    """Share of one step's CPU time per aten op, largest first."""
    with profile() as prof:
        step()
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return ", ".join(f"{e.key[6:]} {100 * e.self_cpu_time_total / total:.0f}%" for e in events[:top])


def bench_model():
    """ENLACE as the cpu profile trains it, the same model with the math kernel and torch.compile'd, and
    transformers' Qwen3 built from the same config, trained with the same AdamW on the same tokens. The
    MFU divides by train.measure_peak_tflops, the figure a run's log uses."""
    profile_cfg = layer("hardware", "cpu")
    shapes = [("smoke", layer("train", "smoke")["micro_batch_size"], 2, 5), ("tiny-50m", 1, 1, 3)]
    print(f"model: timing {len(shapes)} shapes x 4 contenders between two matmul peaks (minutes)", flush=True)
    # Measured before and after the steps and the higher one kept: a neighbour process that slows one
    # measurement must not shrink the peak and so flatter the MFU.
    peak = train.measure_peak_tflops(torch.device("cpu")) * 1e12
    backend = profile_cfg["attention_backend"]
    results = []
    for name, batch_size, warmup, rounds in shapes:
        cfg = layer("model", name)
        torch.manual_seed(0)
        contenders = {
            f"ENLACE ({backend}, cpu profile)": (model.Transformer(cfg, backend), enlace_loss),
            "ENLACE (math)": (model.Transformer(cfg, "math"), enlace_loss),
            "transformers Qwen3": (qwen3_twin(cfg), qwen3_loss),
        }
        # hardware.compile: true on the same model; its first two steps (the compile) timed apart, with an
        # empty inductor cache, as a first run sees it (a warm cache makes it look 5x cheaper).
        compiled = torch.compile(model.Transformer(cfg, backend))
        with tempfile.TemporaryDirectory(prefix="bench-inductor-") as cache:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
            try:
                compile_s = compile_seconds(compiled, cfg, batch_size)
            finally:
                del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        contenders[f"ENLACE ({backend}, compiled)"] = (compiled, enlace_loss)
        times, steps = training_steps(cfg, batch_size, contenders, layer("train", "smoke"), warmup, rounds)
        first = next(iter(contenders))
        flops_per_token = contenders[first][0].flops_per_token(cfg["seq_len"])
        params = contenders[first][0].num_params()
        rates = {label: batch_size * cfg["seq_len"] / statistics.median(t) for label, t in times.items()}
        breakdown = where_time_goes(steps[first])
        results.append((name, batch_size, cfg, params, flops_per_token, rates, rounds, breakdown, compile_s))
    peak = max(peak, train.measure_peak_tflops(torch.device("cpu")) * 1e12)
    print(f"model: float32 matmul peak {peak / 1e9:.1f} GFLOP/s ({torch.get_num_threads()} threads)")
    for name, batch_size, cfg, params, flops_per_token, rates, rounds, breakdown, compile_s in results:
        print(
            f"model: {name} B={batch_size} T={cfg['seq_len']} | {params / 1e6:.1f}M params | median of {rounds}"
        )
        reference = rates["transformers Qwen3"]
        for label, rate in rates.items():
            print(
                f"model:   {label:28s} {rate:8,.0f} tok/s | MFU {100 * flops_per_token * rate / peak:3.0f}% | "
                f"{rate / reference:.2f}x transformers"
            )
        print(f"model:   time per op (cpu profile): {breakdown}")
        eager_s, compiled_s = (
            batch_size * cfg["seq_len"] / rates[f"ENLACE ({backend}, {kind})"]
            for kind in ("cpu profile", "compiled")
        )
        overhead_s = compile_s - 2 * compiled_s  # the two compiling passes less two ordinary steps
        pays = (
            f"pays for itself after {overhead_s / (eager_s - compiled_s):,.0f} steps"
            if compiled_s < eager_s
            else "never pays"
        )
        print(f"model:   torch.compile: {overhead_s:.0f} s of compiling before the first step, {pays}")


def enlace_loss(net, idx, targets):
    return net(idx, targets)[1]["loss"]


def qwen3_loss(net, idx, targets):
    # shift_labels: position t predicts targets[t], as in ENLACE (labels alone would be shifted by one).
    return net(input_ids=idx, labels=targets, shift_labels=targets).loss


# -----------------------------------------------------------------------------
# decode: generation with the KV cache against a full forward pass per token, and past seq_len


def decode_rates(net, prompt, new_tokens):
    """(seconds to the first token, tokens/s after it) of greedy model.generate with the KV cache."""
    start = time.perf_counter()
    stream = net.generate(prompt, new_tokens, temperature=0)
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
    backend = layer("hardware", "cpu")["attention_backend"]
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
