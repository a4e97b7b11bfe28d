"""
The formats the server can hold a model's weights in besides plain float32 (serve.weights,
serve.matvec_kernel, serve.matvec_parts): what decode/load.prepare_weights applies at start and
`make bench ARGS=serve` measures. int8 weights go through ENLACE's kernel (KernelLinear); torch's dynamic
quantization measured slower and was retired (docs/rendimiento.md).
"""

import copy
import ctypes
import itertools

import torch
import torch.nn as nn
import torch.nn.functional as F

from decode import kernel
from model import Attention


class SplitLinear(nn.Module):
    """nn.Linear without bias whose product with a few rows (at most max_rows: a decode step's) runs as one
    batched matmul over `parts` blocks of output rows. Decoding reads every weight once per token, and on a
    CPU F.linear of one row (MKL's sgemv) reads them on one core at about half the machine's bandwidth;
    torch spreads a batched product over its threads, one block each. More rows (a prefill) go through
    F.linear, which is already threaded. Holds the same Parameter as the layer it replaces: no copy, the
    same state_dict."""

    def __init__(self, linear, parts, max_rows):
        super().__init__()
        self.weight = linear.weight
        self.parts = parts
        self.max_rows = max_rows

    def forward(self, x):
        out_features, in_features = self.weight.shape
        rows = x.numel() // in_features
        if rows > self.max_rows:
            return F.linear(x, self.weight)
        flat = x.reshape(rows, in_features)
        blocks = self.weight.view(self.parts, out_features // self.parts, in_features)
        y = torch.matmul(blocks, flat.t().expand(self.parts, in_features, rows))  # (parts, block, rows)
        return y.permute(2, 0, 1).reshape(*x.shape[:-1], out_features)


class KernelLinear(nn.Module):
    """nn.Linear without bias whose product with a decode step's rows (at most max_rows) runs through ENLACE's
    own AVX2 kernel (decode/matvec.cpp, enlace::matvec), which reads the weights at close to the machine's
    bandwidth on every core. float32 holds the same Parameter as the layer it replaces; int8 holds the
    weights rounded per output row (absmax / 127) and those scales: a quarter of the bytes per token. More
    float32 rows (a prefill) go through F.linear; int8 rows always go through the kernel, which on 2 cores
    multiplies a prefill's rows about as fast as F.linear does and needs no float32 copy of the weights."""

    def __init__(self, linear, dtype, max_rows):
        super().__init__()
        kernel.load()
        self.max_rows = max_rows
        if dtype == "float32":
            self.weight, self.scale = linear.weight, None
        else:
            weight = linear.weight.detach().float()
            scale = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
            self.register_buffer("weight", torch.round(weight / scale[:, None]).to(torch.int8))
            self.register_buffer("scale", scale)

    def takes(self, rows):
        """Whether a product with this many rows goes through the kernel (float32 up to max_rows; int8 any)."""
        return self.scale is not None or rows <= self.max_rows

    def forward(self, x):
        if not self.takes(x.numel() // x.shape[-1]):
            return F.linear(x, self.weight)
        return torch.ops.enlace.matvec(x, self.weight, self.scale)


class KernelProjections(nn.Module):
    """KernelLinear layers that read the same input (a layer's q, k and v; gate and up) as one call of the
    kernel (enlace::matvecs): one pass of the threads instead of one per layer, and int8's input rounded
    once; each output is the one its layer gives alone. The layers stay where they are (not submodules
    here): the same weights, read once."""

    def __init__(self, layers):
        super().__init__()
        self.layers = tuple(layers)
        self.widths = [layer.weight.shape[0] for layer in layers]
        int8 = layers[0].scale is not None  # int8: the layers' row scales one after another (a small copy)
        self.register_buffer("scale", torch.cat([layer.scale for layer in layers]) if int8 else None)

    def forward(self, x):
        first = self.layers[0]
        if not first.takes(x.numel() // x.shape[-1]):
            return tuple(layer(x) for layer in self.layers)  # a prefill: F.linear, threaded already
        weights = [layer.weight for layer in self.layers]
        return torch.ops.enlace.matvecs(x, weights, self.scale).split(self.widths, dim=-1)


def rows_independent(model, rows):
    """Whether every row of a decode step of up to `rows` rows is computed on its own, bit for bit whatever
    the other rows: each linear layer a KernelLinear that takes that many rows (the kernel sums each row in
    a fixed order, whatever the number of rows) and each attention layer's step the decode kernel (each row
    over its own keys). torch's products may round a row differently when the number of rows changes
    (decode/engine.decode_step)."""
    modules = list(model.modules())
    products = [m for m in modules if isinstance(m, (nn.Linear, SplitLinear, KernelLinear))]
    attention = [m for m in modules if isinstance(m, Attention)]
    kernel_only = all(isinstance(m, KernelLinear) and m.takes(rows) for m in products)
    return kernel_only and all(getattr(m, "decode_kernel", None) for m in attention)


def with_linears(model, replace):
    """A copy of the model, sharing its parameters and buffers, where replace(layer) stands in for each
    nn.Linear without bias (the LM head included) for which it returns a module (None: the layer stays)."""
    shared = {id(tensor): tensor for tensor in itertools.chain(model.parameters(), model.buffers())}
    copied = copy.deepcopy(model, memo=shared)
    for parent in list(copied.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.bias is None and (new := replace(child)) is not None:
                setattr(parent, name, new)
    return copied


def split_matvec(model, parts, max_rows):
    """A copy of the model, sharing its weights, whose linear layers (the LM head included) are SplitLinear
    layers of `parts` blocks for products of up to max_rows rows; a layer whose output width `parts` does
    not divide stays as it is."""
    return with_linears(
        model, lambda layer: SplitLinear(layer, parts, max_rows) if layer.out_features % parts == 0 else None
    )


HUGE_PAGE_SIZE = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"  # Linux's, 2 MiB on x86-64
MADV_HUGEPAGE = 14  # <sys/mman.h>
ALIGNMENT = 64  # bytes between the weights in the block: a cache line


def huge_page_bytes():
    """The size of Linux's transparent huge pages, or None where the machine has none."""
    try:
        with open(HUGE_PAGE_SIZE, encoding="ascii") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


@torch.no_grad()
def move_to_huge_pages(tensors):
    """Move `tensors` (the weights a decode step streams) into one block of memory that Linux is asked to back
    with huge pages (madvise): read through 4 KiB pages, every 4 KiB of weights also costs a page-table
    walk (measured: the 85 float32 products of a tiny-50m step 7-10% faster on 2 MiB pages, one answer
    6-13% more tokens/s). Same values, same
    tensor objects (a float32 Parameter shared with the plain model moves for both). Where the machine
    has no transparent huge pages nothing moves."""
    page = huge_page_bytes()
    tensors = list({id(tensor): tensor for tensor in tensors}.values())  # a tied weight once
    if page is None or not tensors:
        return
    sizes = [-(-tensor.nbytes // ALIGNMENT) * ALIGNMENT for tensor in tensors]
    pages = -(-sum(sizes) // page) * page
    block = torch.empty(pages + page, dtype=torch.uint8)  # from its first page boundary on: `pages` bytes
    start = -block.data_ptr() % page
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    if libc.madvise(block.data_ptr() + start, pages, MADV_HUGEPAGE) != 0:
        return  # huge pages switched off in this kernel: the weights stay where they are
    offset = start
    for tensor, size in zip(tensors, sizes, strict=True):
        moved = block[offset : offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        moved.copy_(tensor)
        tensor.data = moved
        offset += size


def with_kernels(model, dtype, max_rows):
    """A copy of the model that decodes through ENLACE's CPU kernels: its linear layers (the LM head included)
    KernelLinear layers in dtype (float32: sharing the weights; int8), q, k and v (and gate and up) in one
    call each, each attention layer's decode step over its filled keys only (decode/attention.cpp), and
    float32 weights on huge pages (move_to_huge_pages); kernel.KernelUnavailable when they cannot run
    here."""
    kernel.load()
    served = with_linears(model, lambda layer: KernelLinear(layer, dtype, max_rows))
    for block in served.layout().blocks:
        block.attention.decode_kernel = torch.ops.enlace.decode_attention
        block.attention.qkv_kernel = KernelProjections(block.qkv)
        block.ffn.gate_up_kernel = KernelProjections(block.gate_up)
    if dtype == "float32":  # int8's quarter of the bytes decoded no faster on huge pages (measured)
        move_to_huge_pages(layer.weight for layer in served.modules() if isinstance(layer, KernelLinear))
    return served
