"""
ENLACE's own decode-step kernels on a CPU: the products (serve/matvec.cpp, the torch operators enlace::matvec
and enlace::matvecs, several weights at once) and the attention (serve/attention.cpp,
enlace::decode_attention), built once with the machine's C++ compiler ($CXX, else g++) into a cache folder,
one library per sources, torch and compiler, then loaded into the process. serve/weights.with_kernels puts
them in a model; serve.matvec_kernel switches them on; `make bench ARGS=llama` measures them against
llama.cpp.
"""

import hashlib
import os
import shutil
import subprocess

import torch
from torch.utils import cpp_extension

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = tuple(os.path.join(HERE, name) for name in ("matvec.cpp", "attention.cpp"))
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++20", "-w")
CAPABILITIES = ("AVX2", "AVX512")  # torch.backends.cpu.get_cpu_capability() values with AVX2 and FMA


class KernelUnavailable(Exception):
    """The kernel cannot run on this machine; the message says why."""


def cache_dir(kind="kernels"):
    """ENLACE's folder of built things of one kind (kernels; aot: serve/aot.py's packages)."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "enlace", kind)


def compile_command(cxx, output):
    library = cpp_extension.library_paths()[0]
    return [
        cxx,
        *FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-I{path}" for path in cpp_extension.include_paths()),
        *SOURCES,
        "-o",
        output,
        f"-L{library}",
        "-ltorch",
        "-ltorch_cpu",
        "-lc10",
        f"-Wl,-rpath,{library}",
    ]


def build(folder=None, cxx=None):
    """The path of the compiled library, building it first when the cache has none for this source, torch
    and compiler (~15 s on a 2-core CPU). Two processes building at once each write their own temp file and
    rename it into place."""
    folder = folder or cache_dir()
    cxx = cxx or os.environ.get("CXX") or "g++"
    digest = hashlib.sha256("\0".join((torch.__version__, cxx, *FLAGS)).encode())
    for source in SOURCES:
        with open(source, "rb") as f:
            digest.update(f.read())
    library = os.path.join(folder, f"enlace-{digest.hexdigest()[:16]}.so")
    if os.path.exists(library):
        return library
    if shutil.which(cxx) is None:
        raise KernelUnavailable(f"no C++ compiler: {cxx!r} is not on PATH (install g++ or set CXX)")
    temp = f"{library}.{os.getpid()}.tmp"
    try:
        os.makedirs(folder, exist_ok=True)
        done = subprocess.run(compile_command(cxx, temp), capture_output=True, text=True)
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if line.strip()] or [
                f"exit status {done.returncode}"
            ]
            raise KernelUnavailable(f"{cxx} could not build serve/*.cpp: {lines[-1].strip()[:300]}")
        os.replace(temp, library)
    except OSError as e:
        raise KernelUnavailable(f"cannot write the kernel into {folder}: {e.strerror or e}") from None
    finally:
        if os.path.exists(temp):
            os.remove(temp)
    return library


def load():
    """torch.ops.enlace.matvec (the products; torch.ops.enlace.decode_attention alongside), built if needed
    and loaded once per process; KernelUnavailable with the reason on a CPU without AVX2 (or one torch was
    told to treat so: ATEN_CPU_CAPABILITY) or without a working compiler."""
    if not hasattr(torch.ops.enlace, "matvec"):
        capability = torch.backends.cpu.get_cpu_capability()
        if capability not in CAPABILITIES:
            raise KernelUnavailable(f"this CPU runs torch at {capability}; the kernel needs AVX2 and FMA")
        torch.ops.load_library(build())

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
