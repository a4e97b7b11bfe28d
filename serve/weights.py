"""
The formats the server can hold a model's weights in besides float32 (serve.weights): what
serve/app.prepare_weights applies at start and `make bench ARGS=serve` measures.
"""

import torch
import torch.nn as nn


def int8_weights(model):
    """A copy of the model whose linear layers (the LM head included) hold int8 weights with one scale per
    output row, through torch's own dynamic quantization (fbgemm: int8 x int8 products, each input
    quantized per call): a decode step reads a quarter of the float32 bytes. The embedding lookup stays
    float32. CPU only; eager only (the compiled step takes float weights). torch.ao.quantization is marked
    deprecated in favour of torchao, whose int8 linears run 1.4-4x slower than float32 in eager on an AVX2
    CPU where this one runs several times faster (make bench ARGS=serve)."""
    spec = {nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig}
    return torch.ao.quantization.quantize_dynamic(model, spec, dtype=torch.qint8, inplace=False)
