"""
The decode step compiled ahead of time on a CPU (serve.compile.cpu: aot): engine.decode_all (and, with the
prefix cache on, engine.prefill_block for one block of a prompt) exported with torch.export and
built by AOTInductor into a package, cached on disk under a digest of the exported graph (a later start with
the same shapes loads it in a second instead of compiling for ~30-90 s), then run from C++ with the model's
weights and the decoder's KV cache bound in place (user-managed constants: no copies; the step writes its
keys and values into the cache the prefills fill). torch.compile's step pays a Python entry on every step
(dynamo's guards and the wrappers handing ~250 tensors to the graph): measured ~0.4 ms of a 12-layer step
whatever its width, which the package does not pay; an eager prefill pays torch's per-operator overhead,
about half of a 21-token block of the smoke model (docs/rendimiento.md).
"""

import hashlib
import os
import types

import torch
import torch.nn as nn

import fileio
from decode import engine, kernel
from decode.weights import rows_independent

# The package keeps no weight: every constant is bound at load (user-managed, in place). Without
# always_keep_tensor_constants inductor writes a 1-D constant of up to 8 values (head_dim 8's q_norm and
# k_norm) into the generated code, and a package cached for one model of these shapes would decode another
# with the first one's norms: a row then drifted from its eager logits by ~1e-4 at the widths loaded
# from the cache, enough to change a seeded draw (serve's solo and batched answers differed).
INDUCTOR_CONFIGS = {"aot_inductor.package_constants_in_so": False, "always_keep_tensor_constants": True}


class Bound(nn.Module):
    """One of the model's static-shape functions over one decoder's KV cache (decode_all: (tokens, positions)
    -> logits; prefill_block: (tokens, slot, start, last) -> logits), the cache's tensors held as buffers."""

    def __init__(self, model, cache, method):
        super().__init__()
        self.model, self.method, self.max_len, self.layers = model, method, cache.max_len, len(cache.keys)
        for index, (keys, values) in enumerate(zip(cache.keys, cache.values, strict=True)):
            self.register_buffer(f"keys{index}", keys, persistent=False)
            self.register_buffer(f"values{index}", values, persistent=False)

    def forward(self, *inputs):
        cache = types.SimpleNamespace(
            keys=[getattr(self, f"keys{index}") for index in range(self.layers)],
            values=[getattr(self, f"values{index}") for index in range(self.layers)],
            max_len=self.max_len,
        )
        return getattr(engine, self.method)(self.model, *inputs, cache)


def package_key(program, bound):
    """A digest of what shapes the package: torch's version, the instruction set inductor compiled for (a
    cache folder shared with another CPU must not hand it this one's code), the exported graph and its
    signature, the build's inductor settings, and every constant's name, shape and dtype (the values are
    bound at load, so they are not part of it: INDUCTOR_CONFIGS keeps every one of them out of the code)."""
    digest = hashlib.sha256(f"{torch.__version__} {torch.backends.cpu.get_cpu_capability()}".encode())
    digest.update(repr(sorted(INDUCTOR_CONFIGS.items())).encode())
    digest.update(program.graph_module.code.encode())
    digest.update(str(program.graph_signature).encode())
    for name, tensor in constants(bound).items():
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
    return digest.hexdigest()[:20]


def constants(bound):
    return dict(bound.named_parameters(remove_duplicate=False)) | dict(
        bound.named_buffers(remove_duplicate=False)
    )


def read_constants(program):
    """The names of the parameters and buffers the exported graph reads (export lifts every one of the
    module's: a layer's own int8 scales, which KernelProjections holds concatenated, are read by nothing)."""
    signature = program.graph_signature
    lifted = signature.inputs_to_parameters | signature.inputs_to_buffers
    return [lifted[node.name] for node in program.graph.nodes
            if node.op == "placeholder" and node.name in lifted and node.users]  # fmt: skip


class AotProgram:
    """One Bound function exported at `example`'s shapes, built into a package (or loaded from the cache
    folder) on its first call."""

    def __init__(self, bound, example, folder, name, what):
        self.bound, self.example, self.folder, self.name, self.what = bound, example, folder, name, what
        self.runner, self.loaded_from_cache, self.builds = None, False, 0

    @torch.no_grad()
    def build(self):
        program = torch.export.export(self.bound, self.example, strict=False)
        path = os.path.join(self.folder, f"{self.name}-{package_key(program, self.bound)}.pt2")
        self.loaded_from_cache = os.path.exists(path)
        if not self.loaded_from_cache:
            temp = f"{path}.{os.getpid()}.tmp.pt2"
            with fileio.reporting_storage(path, what=self.what):
                os.makedirs(self.folder, exist_ok=True)
                try:
                    torch._inductor.aoti_compile_and_package(program, package_path=temp,
                                                             inductor_configs=INDUCTOR_CONFIGS)  # fmt: skip
                    os.replace(temp, path)
                finally:
                    if os.path.exists(temp):
                        os.remove(temp)
        runner = torch._inductor.aoti_load_package(path)
        self.builds += 1
        tensors = constants(self.bound)
        bound = runner.get_constant_fqns()
        held = {tensors[name].data_ptr() for name in bound}  # a tied weight is bound once, by one name
        baked = [name for name in read_constants(program) if tensors[name].data_ptr() not in held]
        if baked:
            raise ValueError(f"{path}: {self.what} holds {', '.join(baked)} in its code, not bound at load; "
                             "delete the file to rebuild it")  # fmt: skip
        runner.load_constants({name: tensors[name] for name in bound}, check_full_update=True,
                              user_managed=True)  # fmt: skip
        return runner

    def __call__(self, *inputs):
        if self.runner is None:
            self.runner = self.build()
        return self.runner(*inputs)


def narrowed(cache, width):
    """The decoder's KV cache seen as its first `width` slots (views: a step bound to them writes in place)."""
    return types.SimpleNamespace(keys=[keys[:width] for keys in cache.keys],
                                 values=[values[:width] for values in cache.values], max_len=cache.max_len)  # fmt: skip


def step_widths(model, slots):
    """The widths to build decode steps for: every slot, and where each row is computed on its own (ENLACE's
    kernels: decode/weights.rows_independent) also 1, 2, 4, ... below it, run over the first slots, so a
    step with few rows in use costs their width and not every slot's (smoke, 2 cores: 0.52 ms at width 1,
    0.96 ms at 8) with each row's logits the same bit for bit."""
    narrower = [2**power for power in range(slots.bit_length()) if 2**power < slots]
    return (narrower if rows_independent(model, slots) else []) + [slots]


class AotStep:
    """A Decoder's compiled step (engine.Decoder's compile_with): decode_all at each of `widths` (the first
    slots; step_widths) and, given a block (the prefix cache's), prefill_block for a block of that many
    tokens. Each is built or loaded on its first call, which Decoder.compile makes at start. Called with the
    decoder's own cache, the one it was bound to."""

    def __init__(self, model, cache, folder=None, block=None):
        self.cache, self.block, folder = cache, block, folder or kernel.cache_dir("aot")
        self.widths = step_widths(model, cache.keys[0].shape[0])
        self.steps = {
            width: AotProgram(
                Bound(model, narrowed(cache, width), "decode_all"),
                tuple(torch.zeros(width, dtype=torch.long) for _ in "tp"),
                folder,
                "step",
                "the compiled decode step",
            )
            for width in self.widths
        }
        self.prefill = None
        if block is not None:
            # Three tensors, not one three times: export would take them for one input.
            example = (torch.zeros(1, block, dtype=torch.long), *(torch.tensor(0) for _ in "ssl"))
            self.prefill = AotProgram(Bound(model, cache, "prefill_block"), example, folder, "prefill",
                                      "the compiled prefill")  # fmt: skip

    @property
    def programs(self):
        return [*self.steps.values(), *([self.prefill] if self.prefill is not None else [])]

    @property
    def builds(self):
        return sum(program.builds for program in self.programs)

    @property
    def loaded_from_cache(self):
        return all(program.loaded_from_cache for program in self.programs)

    @property
    def runner(self):
        return self.steps[self.widths[-1]].runner

    def check(self, cache):
        if cache is not self.cache:
            raise ValueError("this compiled step is bound to another decoder's KV cache")

    def __call__(self, tokens, positions, cache):
        """decode_all over the first len(tokens) slots (one of self.widths)."""
        self.check(cache)
        return self.steps[len(tokens)](tokens, positions)

    def prefill_block(self, tokens, slot, start, last, cache):
        self.check(cache)
        return self.prefill(tokens, slot, start, last)
