"""make bench ARGS=serve's scaling table measures the decoding the server does: the weights and the
compiled step of configs/serve/default.yaml, built once per slot count."""

import torch

from bench import serve as bench_serve
from decode import aot, kernel, weights
from tests.test_model import build, tiny


def test_the_scaling_table_decodes_through_the_servers_weights_and_ahead_of_time_step():
    net = build(tiny(seq_len=32))
    decoders = bench_serve.served_decoders(net, (1, 2))
    assert sorted(decoders) == [1, 2] and all(d.slots == slots for slots, d in decoders.items())
    assert all(isinstance(d.compiled_step, aot.AotStep) and d.compiled_step.runner for d in decoders.values())
    if torch.backends.cpu.get_cpu_capability() in kernel.CAPABILITIES:
        assert any(isinstance(m, weights.KernelLinear) for m in decoders[2].model.modules())
    assert bench_serve.stream_rate(decoders[2], 3, 5) > 0  # three answers through two slots
    assert not decoders[2].rows  # every row left: the decoder serves the next call
