"""
The formats the server can hold a model's weights in besides plain float32 (serve.weights,
serve.matvec_parts): what serve/app.prepare_weights applies at start and `make bench ARGS=serve` measures.
"""

import copy
import itertools

import torch
import torch.nn as nn
import torch.nn.functional as F


def int8_weights(model):
    """A copy of the model whose linear layers (the LM head included) hold int8 weights with one scale per
    output row, through torch's own dynamic quantization (fbgemm: int8 x int8 products, each input
    quantized per call): a decode step reads a quarter of the float32 bytes. The embedding lookup stays
    float32. CPU only; eager only (the compiled step takes float weights). torch.ao.quantization is marked
    deprecated in favour of torchao, whose int8 linears run 1.4-4x slower than float32 in eager on an AVX2
    CPU where this one runs several times faster (make bench ARGS=serve)."""
    spec = {nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig}
    return torch.ao.quantization.quantize_dynamic(model, spec, dtype=torch.qint8, inplace=False)


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


def split_matvec(model, parts, max_rows):
    """A copy of the model, sharing its weights, whose linear layers (the LM head included) are SplitLinear
    layers of `parts` blocks for products of up to max_rows rows; a layer whose output width `parts` does
    not divide stays as it is."""
    shared = {id(tensor): tensor for tensor in itertools.chain(model.parameters(), model.buffers())}
    split = copy.deepcopy(model, memo=shared)
    for parent in list(split.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.bias is None and child.out_features % parts == 0:
                setattr(parent, name, SplitLinear(child, parts, max_rows))
    return split
