"""
ENLACE's own decode-step kernels on a CPU (decode/matvec.cpp: enlace::matvec and enlace::matvecs;
decode/attention.cpp: enlace::decode_attention), built by torch.utils.cpp_extension with $CXX (else c++) into a
cache folder per build key and loaded as torch operators. `make kernels` builds them ahead of a server.
"""

import argparse
import hashlib
import os
import shutil
import sys

import torch
from torch.utils import cpp_extension

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = tuple(os.path.join(HERE, name) for name in ("matvec.cpp", "attention.cpp"))
NAME = "enlace_kernels"
# The kernels are written for AVX2 and FMA; -fopenmp gives at::parallel_for its threads. cpp_extension adds
# -fPIC, -shared, -std=c++20 and torch's headers and libraries.
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-Wall", "-Wextra")
LDFLAGS = ("-fopenmp",)
CAPABILITIES = ("AVX2", "AVX512")  # torch.backends.cpu.get_cpu_capability() values with AVX2 and FMA


class KernelUnavailable(Exception):
    """The kernel cannot run on this machine; the message says why."""


def cache_dir(kind="kernels"):
    """ENLACE's folder of built things of one kind (kernels; aot: decode/aot.py's packages)."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "enlace", kind)


def build_key(cxx):
    """A digest of what changes the binary: the sources, the compiler and flags, torch's version and the
    instruction set torch runs at (a cache folder shared with another CPU builds its own); and the paths in
    ninja's commands (the sources', torch's), so that two checkouts or venvs do not rebuild in turn."""
    capability = torch.backends.cpu.get_cpu_capability()
    settings = (
        torch.__version__,
        os.path.dirname(torch.__file__),
        capability,
        cxx,
        *CFLAGS,
        *LDFLAGS,
        *SOURCES,
    )
    digest = hashlib.sha256("\0".join(settings).encode())
    for source in SOURCES:
        with open(source, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def last_compiler_line(output):
    """The compiler's last line in ninja's output (ninja's own lines and the commands left out)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    said = [line for line in lines if not line.startswith(("ninja: ", "FAILED: ", "[", "Error building"))]
    return (said or lines or ["no output"])[-1][:300]


def build(folder=None, verbose=False):
    """The path of the compiled library, loaded into the process: torch.utils.cpp_extension builds it in
    folder/<build key> (~15 s on a 2-core CPU) unless that folder holds it already; processes building at
    once wait on its lock. verbose: ninja's commands and the compiler's output on stdout."""
    folder = folder or cache_dir()
    cxx = cpp_extension.get_cxx_compiler()
    if shutil.which(cxx) is None:
        raise KernelUnavailable(f"no C++ compiler: {cxx!r} is not on PATH (install g++ or set CXX)")
    if not cpp_extension.is_ninja_available():
        raise KernelUnavailable("no ninja on PATH: torch builds C++ extensions with it (pip install ninja)")
    directory = os.path.join(folder, build_key(cxx))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise KernelUnavailable(f"cannot write the kernel into {folder}: {e.strerror or e}") from None
    try:
        return cpp_extension.load(
            name=NAME,
            sources=list(SOURCES),
            extra_cflags=list(CFLAGS),
            extra_ldflags=list(LDFLAGS),
            build_directory=directory,
            verbose=verbose,
            is_python_module=False,
        )
    except RuntimeError as e:
        if not str(e).startswith("Error building extension"):
            raise KernelUnavailable(f"cannot load the kernel built in {directory}: {e}") from None
        shutil.rmtree(directory, ignore_errors=True)  # no half-built folder left behind
        raise KernelUnavailable(f"{cxx} could not build decode/*.cpp: {last_compiler_line(str(e))}") from None
    except OSError as e:
        raise KernelUnavailable(f"cannot load the kernel built in {directory}: {e}") from None


def load(verbose=False):
    """torch.ops.enlace.matvec (the products; torch.ops.enlace.decode_attention alongside), built if needed
    and loaded once per process; KernelUnavailable with the reason on a CPU without AVX2 (or one torch was
    told to treat so: ATEN_CPU_CAPABILITY) or without a working compiler."""
    if not hasattr(torch.ops.enlace, "matvec"):
        capability = torch.backends.cpu.get_cpu_capability()
        if capability not in CAPABILITIES:
            raise KernelUnavailable(f"this CPU runs torch at {capability}; the kernel needs AVX2 and FMA")
        build(verbose=verbose)

        @torch.library.register_fake("enlace::matvec")
        def _(x, weight, scale):  # the output's shape and dtype, for torch.compile's tracing
            return x.new_empty((*x.shape[:-1], weight.shape[0]))

        @torch.library.register_fake("enlace::matvecs")
        def _(x, weights, scale):
            return x.new_empty((*x.shape[:-1], sum(weight.shape[0] for weight in weights)))

        @torch.library.register_fake("enlace::decode_attention")
        def _(q, keys, values, ends):
            return torch.empty_like(q)

    return torch.ops.enlace.matvec


def main(argv):
    """make kernels: build them for this machine (ninja's commands and the compiler's output shown) and say
    where they are; a machine that cannot run them is told why."""
    argparse.ArgumentParser(
        description="Build ENLACE's CPU kernels once and print where they are."
    ).parse_args(argv)
    try:
        load(verbose=True)
    except KernelUnavailable as e:
        print(f"kernels: {e}", file=sys.stderr)
        return 1
    print(f"kernels: {build()}")  # built and loaded: the path of the library
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
