"""
A checkpoint turned into a ready decoder: the run's model and tokenizer, its weights in the format the
serve layer asks for (ENLACE's kernels, int8, split products), the KV cache checked against the device's
memory, and the Decoder's options (the decode step compiled, the prefix cache). The server, and whatever
else decodes a run the way the server does, start here; so do the command lines that read a run (sample.py,
python -m evaluation.bpb: run_command).
"""

import argparse
import sys

import fileio


class LoadError(Exception):
    """A run that cannot be decoded as configured, in one line that says what to change."""


# ---- the command line of a command that reads a run (sample.py, python -m evaluation.bpb) ----


def run_parser(description):
    """An argument parser with the run to read and the device to read it on."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("run", help="run directory (newest checkpoint) or a checkpoint file")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    return parser


def check_batch(parser, args):
    """--max-new-tokens and --batch of a command that decodes: at least 1 (parser.error otherwise)."""
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    if args.batch is not None and args.batch < 1:
        parser.error(f"--batch {args.batch}: must be >= 1")


@fileio.takes_text_arguments()
def run_command(argv, parse_args, body):
    """The main of a command that reads a run: an argument that is not text refused, parse_args(argv)
    (args with .run and .device), the run loaded there (checkpoint.load_run: the model, its config and its
    tokenizer), then body(model, cfg, tokenizer, args). A problem the person can fix (a LoadError, a
    checkpoint's, a chat file's, a data file's, a value's) is one line `error: ...` and exit status 2."""
    import checkpoint
    import data
    from chat import template

    args = parse_args(argv)
    try:
        model, cfg, tokenizer, _ = checkpoint.load_run(args.run, args.device)
        body(model, cfg, tokenizer, args)
    except (LoadError, checkpoint.CheckpointError, template.ChatError, data.DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


# ---- a run ready to serve ----


def load_model(run, device):
    """(model, tokenizer, model id, context length) of a run that can chat."""
    import checkpoint

    try:
        model, cfg, tokenizer, ckpt_path = checkpoint.load_run(run, device)
    except checkpoint.CheckpointError as e:
        raise LoadError(str(e)) from None
    if "<|end|>" not in tokenizer.special_ids:
        raise LoadError(
            f"{run}: trained with the {tokenizer.name} tokenizer, which has no chat control tokens; serve a run "
            "with a sentencepiece tokenizer (make smoke-corpus, then make serve RUN=runs/smoke-corpus-cpu)"
        )
    print(f"serve: loaded {ckpt_path} ({model.num_params() / 1e6:.1f}M parameters)", file=sys.stderr)
    model.checkpoint_path = ckpt_path  # what snapshots of the database record (serving_info)
    return model, tokenizer, cfg["run_name"], cfg["model"]["seq_len"]


def free_memory_bytes(device):
    """Memory free for the KV cache on the device: CUDA's free memory, or the kernel's MemAvailable for the
    CPU; None where it cannot be read."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.mem_get_info(torch.device(device))[0]
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def memory_text(size):
    return f"{size / 2**20:,.1f} MiB" if size >= 2**20 else f"{size / 1024:.0f} KiB"


def check_kv_cache(model, settings, device):
    """Print the KV cache's memory for serve.max_batch slots; a LoadError when it exceeds
    serve.max_kv_cache_mib or the device's free memory, with the largest max_batch that fits."""
    from decode import kvcache

    slots = settings["max_batch"]
    per_slot = kvcache.kv_cache_bytes(model, 1, model.layout().embed.weight.element_size())
    needed = slots * per_slot
    print(f"serve: KV cache {slots} slots x {memory_text(per_slot)} = {memory_text(needed)} (serve.max_batch="
          f"{slots}, {model.layout().seq_len} positions per slot)", file=sys.stderr)  # fmt: skip
    limits = []
    cap = settings["max_kv_cache_mib"]
    if cap is not None:
        limits.append((cap * 2**20, f"serve.max_kv_cache_mib={cap}"))
    free = free_memory_bytes(device)
    if free is not None:
        limits.append((free, f"the {memory_text(free)} free on {device}"))
    for limit, what in limits:
        if needed > limit:
            fits = int(limit // per_slot)
            advice = f"set serve.max_batch to at most {fits}" if fits else "not even one slot fits"
            raise LoadError(f"serve.max_batch={slots}: the KV cache needs {memory_text(needed)} "
                             f"({memory_text(per_slot)} per slot), more than {what}; {advice}")  # fmt: skip


COMPILE_MODES = {"off": None, "inductor": "default", "cuda-graphs": "reduce-overhead"}  # torch.compile's


def prepare_weights(model, settings, device):
    """The model in serve.weights' format for this device: through ENLACE's kernel with serve.matvec_kernel
    (where it cannot run, float32 weights go on without it and the server says why), else float32 with
    serve.matvec_parts > 1 split for the decode step; a LoadError for int8 without the kernel."""
    from decode import kernel, weights

    kind = "cuda" if device.startswith("cuda") else "cpu"
    dtype, parts = settings["weights"][kind], settings["matvec_parts"][kind]
    if dtype == "int8" and not settings["matvec_kernel"][kind]:
        raise LoadError(f"serve.weights.{kind}=int8 runs through ENLACE's kernel: set serve.matvec_kernel.{kind}=true "
                         f"(or serve.weights.{kind}=float32)")  # fmt: skip
    if settings["matvec_kernel"][kind]:
        try:
            served = weights.with_kernels(model, dtype, settings["max_batch"])
        except kernel.KernelUnavailable as e:
            if dtype == "int8":
                raise LoadError(f"serve.weights.{kind}=int8 runs through ENLACE's kernel, but {e}; set "
                                 f"serve.weights.{kind}=float32") from None  # fmt: skip
            print(
                f"serve: serve.matvec_kernel.{kind} is on but {e}; decoding with torch's products",
                file=sys.stderr,
            )
        else:
            print(f"serve: decode products through decode/matvec.cpp, {dtype} weights (serve.matvec_kernel)",
                  file=sys.stderr)  # fmt: skip
            return served
    if parts == 1:
        return model
    split = weights.split_matvec(model, parts, settings["max_batch"])
    print(f"serve: decode products in {parts} blocks (serve.matvec_parts)", file=sys.stderr)
    return split


def decoding_options(settings, device):
    """The worker's engine.Decoder options for this device: serve.compile as a torch.compile mode (aot: the
    step built ahead of time, decode/aot.py), and serve.prefix_cache."""
    setting, prefix = (
        settings["compile"]["cuda" if device.startswith("cuda") else "cpu"],
        settings["prefix_cache"],
    )
    if setting == "aot":
        from decode.aot import AotStep

        compiled = {"compile_with": AotStep}
    else:
        compiled = {"compile_mode": COMPILE_MODES[setting]} if COMPILE_MODES[setting] else {}
    return compiled | (
        {"prefix_block": prefix["block_tokens"], "prefix_cache_bytes": prefix["mib"] * 2**20}
        if prefix["mib"]
        else {}
    )


def compile_failure(error, settings, device):
    """The one-line reason a server with serve.compile on did not start, and what to do."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]
    needs = (
        "a working C++ compiler (g++, or the one CXX names)" if kind == "cpu" else "a working CUDA toolchain"
    )
    return (f"serve.compile.{kind}={settings['compile'][kind]}: the decode step did not compile ({reason}); "
            f"compiling needs {needs}: install it, or set serve.compile.{kind}=off")  # fmt: skip
