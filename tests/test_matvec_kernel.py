"""ENLACE's own decode-step kernels (decode/matvec.cpp and decode/attention.cpp through decode/kernel.py): the
same sums as torch's, each row its own whatever else is in the step, int8 weights within their rounding,
attention over a slot's filled keys only, and a clear way out on a machine that cannot build or run them."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from decode import kernel
from tests.test_engine import assert_decodes_the_plain_models_tokens, forced_tokens, run_rows
from tests.test_model import build, tiny, tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

needs_avx2 = pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in kernel.CAPABILITIES,
    reason="the kernel needs AVX2 (make test-other-cpu runs torch as a CPU without it)",
)


def rounded(weight):
    """(int8 weights, row scales) as KernelLinear rounds them."""
    scale = weight.abs().amax(dim=1) / 127
    return torch.round(weight / scale[:, None]).to(torch.int8), scale


@needs_avx2
@pytest.mark.parametrize("columns", [32, 40, 517, 4100])  # whole vectors, a tail, both, past an int32 chunk
def test_float32_products_equal_f_linear_within_float_rounding_for_every_row_count(columns):
    matvec = kernel.load()
    generator = torch.Generator().manual_seed(columns)
    weight = torch.randn(96, columns, generator=generator)
    for rows in range(1, 10):
        x = torch.randn(rows, columns, generator=generator)
        want = F.linear(x, weight)
        assert torch.allclose(matvec(x, weight, None), want, rtol=1e-5, atol=1e-5 * columns**0.5)


@needs_avx2
@pytest.mark.parametrize("columns", [32, 40, 517, 4100])
def test_int8_products_equal_the_dequantized_product_within_the_rounding_of_x_to_14_bits(columns):
    matvec = kernel.load()
    generator = torch.Generator().manual_seed(columns)
    weight, scale = rounded(torch.randn(96, columns, generator=generator))
    for rows in (1, 3, 8):
        x = torch.randn(rows, columns, generator=generator)
        want = F.linear(x, weight.float() * scale[:, None])
        bound = x.abs().amax(dim=1, keepdim=True) / 16383 * (weight.float().abs() * scale[:, None]).sum(dim=1)
        assert ((matvec(x, weight, scale) - want).abs() <= bound + 1e-4).all()


@needs_avx2
def test_int8_sums_do_not_overflow_on_long_rows_of_the_largest_values():
    # 127 x 16383 in every column of 8,200 columns: 1.7e10, far past an int32; the kernel sums 4,096-column
    # chunks in int32 and the chunks in float.
    columns = 8200
    weight, scale = torch.full((16, columns), 127, dtype=torch.int8), torch.ones(16)
    x = torch.ones(2, columns)
    got = kernel.load()(x, weight, scale)
    assert torch.allclose(got, torch.full((2, 16), 127.0 * columns), rtol=1e-6)


@needs_avx2
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_rows_product_is_bit_for_bit_the_same_alone_among_other_rows_and_on_one_thread(dtype):
    matvec = kernel.load()
    generator = torch.Generator().manual_seed(3)
    weight, scale = torch.randn(300, 520, generator=generator), None
    if dtype == "int8":
        weight, scale = rounded(weight)
    x = torch.randn(9, 520, generator=generator)
    together = matvec(x, weight, scale)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = matvec(x, weight, scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, together)
    for row in range(9):
        assert torch.equal(matvec(x[row : row + 1], weight, scale)[0], together[row])
    for count in (2, 4, 5):  # the input rows in tiles of 3, 2 and 1
        assert torch.equal(matvec(x[:count], weight, scale), together[:count])


@needs_avx2
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_several_weights_in_one_call_give_each_weights_own_product_bit_for_bit(dtype):
    kernel.load()
    generator = torch.Generator().manual_seed(4)
    weights = [torch.randn(rows, 520, generator=generator) for rows in (96, 44, 44)]  # q, k, v; a block tail
    scales = []
    if dtype == "int8":
        weights, scales = (
            list(parts) for parts in zip(*(rounded(weight) for weight in weights), strict=True)
        )
    for rows in (1, 3, 8):
        x = torch.randn(rows, 1, 520, generator=generator)
        together = torch.ops.enlace.matvecs(x, weights, torch.cat(scales) if scales else None)
        assert together.shape == (rows, 1, 184)
        alone = [torch.ops.enlace.matvec(x, w, s) for w, s in zip(weights, scales or [None] * 3, strict=True)]
        assert torch.equal(together, torch.cat(alone, dim=-1))
    with pytest.raises(RuntimeError, match="weight must be float32 or int8, all the weights of a call alike"):
        torch.ops.enlace.matvecs(x, [torch.randn(8, 520), torch.randn(8, 520).to(torch.int8)], None)


@needs_avx2
def test_decode_attention_reads_each_slots_filled_keys_only_and_gives_torchs_softmax_within_1e_6():
    kernel.load()
    attention = torch.ops.enlace.decode_attention
    generator = torch.Generator().manual_seed(5)
    slots, kv_heads, group, dim, max_len = 4, 2, 3, 24, 40  # dim 24: three vectors of 8, no tail
    q = torch.randn(slots, kv_heads, group, dim, generator=generator) * dim**-0.5
    keys, values = (torch.randn(slots, kv_heads, max_len, dim, generator=generator) for _ in range(2))
    ends = torch.tensor([1, 17, 0, 40])
    y = attention(q, keys, values, ends)
    assert torch.equal(y[2], torch.zeros_like(y[2]))  # a slot not in use gives zeros, as the eager step
    poisoned_keys, poisoned_values = keys.clone(), values.clone()
    for slot, end in enumerate(ends.tolist()):
        poisoned_keys[slot, :, end:], poisoned_values[slot, :, end:] = float("nan"), float("nan")
        if end:
            want = (q[slot] @ keys[slot, :, :end].transpose(1, 2)).softmax(-1) @ values[slot, :, :end]
            assert torch.allclose(y[slot], want, atol=1e-6, rtol=0)
    assert torch.equal(attention(q, poisoned_keys, poisoned_values, ends), y)  # nothing past the end is read
    alone = attention(q[3:], keys[3:], values[3:], ends[3:])
    assert torch.equal(alone[0], y[3])  # the same alone as among other slots
    with pytest.raises(RuntimeError, match="end 41 of slot 0 is outside 0..40"):
        attention(q, keys, values, torch.tensor([41, 0, 0, 0]))


@needs_avx2
def test_bad_arguments_get_a_message_naming_what_is_wrong():
    matvec = kernel.load()
    weight = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="x has 12 columns, weight 16"):
        matvec(torch.randn(1, 12), weight, None)
    with pytest.raises(RuntimeError, match="int8 weights need their row scales"):
        matvec(torch.randn(1, 16), weight.to(torch.int8), None)
    with pytest.raises(RuntimeError, match="x must be float32"):
        matvec(torch.randn(1, 16, dtype=torch.float64), weight, None)


@needs_avx2
def test_with_kernels_share_float32_weights_and_decode_the_plain_models_tokens_with_logits_within_1e_5():
    from bench.decoding import step_bytes
    from decode.weights import KernelLinear, with_kernels

    net = build(tiny(seq_len=32))
    served = with_kernels(net, "float32", max_rows=4)
    assert len([m for m in served.modules() if isinstance(m, KernelLinear)]) == 7 * net.cfg["n_layers"] + 1
    assert all(getattr(layer.self_attn, "decode_kernel", None) is not None for layer in served.layers)
    assert all(
        layer.self_attn.qkv_kernel.layers
        == (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)
        for layer in served.layers
    )
    assert all(
        layer.mlp.gate_up_kernel.layers == (layer.mlp.gate_proj, layer.mlp.up_proj) for layer in served.layers
    )
    for layer in net.layers:  # the plain model: as it was, without hooks
        assert not hasattr(layer.self_attn, "decode_kernel") and not hasattr(layer.self_attn, "qkv_kernel")
        assert not hasattr(layer.mlp, "gate_up_kernel")
    assert served.lm_head.weight is served.embed_tokens.weight is net.embed_tokens.weight  # shared, tied
    assert step_bytes(served, 4, 16) == step_bytes(net, 4, 16)
    x = tokens(1, 12)
    with torch.no_grad():  # 12 rows > max_rows: a prefill goes through F.linear, bit for bit
        assert torch.equal(served(x)[0], net(x)[0])
    assert_decodes_the_plain_models_tokens(net, served)


def huge_page_eligible(address):
    """Whether Linux may back the mapping holding `address` with huge pages (smaps' THPeligible)."""
    with open("/proc/self/smaps", encoding="ascii") as f:
        for line in f:
            if "-" in line.split(" ")[0] and len(line.split()) >= 5:
                low, high = (int(part, 16) for part in line.split(" ")[0].split("-"))
                inside = low <= address < high
            elif inside and line.startswith("THPeligible:"):
                return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_avx2
def test_the_kernels_float32_weights_move_into_one_block_on_huge_pages_with_the_same_values_and_tensors():
    from decode.weights import KernelLinear, huge_page_bytes, with_kernels

    net = build(tiny(d_model=256, ffn_hidden=768, seq_len=32))  # weights past one 2 MiB page
    before = {name: tensor.clone() for name, tensor in net.state_dict().items()}
    served = with_kernels(net, "float32", max_rows=4)
    weights = [layer.weight for layer in served.modules() if isinstance(layer, KernelLinear)]
    page = huge_page_bytes()
    if page is None or "[never]" in open("/sys/kernel/mm/transparent_hugepage/enabled").read():
        pytest.skip("this machine has no transparent huge pages")
    assert len({weight.untyped_storage().data_ptr() for weight in weights}) == 1  # one block
    assert weights[0].data_ptr() % page == 0
    assert huge_page_eligible(weights[0].data_ptr())
    for name, tensor in net.state_dict().items():  # the plain model: the same values, in the block too
        assert torch.equal(tensor, before[name])
    shared = net.layers[0].mlp.up_proj.weight
    assert served.layers[0].mlp.up_proj.weight is shared
    assert shared.untyped_storage().data_ptr() == weights[0].untyped_storage().data_ptr()


@needs_avx2
def test_int8_with_kernels_hold_a_quarter_of_the_bytes_move_the_logits_by_about_a_percent_and_compile():
    from bench.decoding import step_bytes
    from decode.weights import KernelLinear, with_kernels

    for seed in range(3):
        net = build(tiny(seq_len=32), seed=seed)
        served = with_kernels(net, "int8", max_rows=4)
        layers = [m for m in served.modules() if isinstance(m, KernelLinear)]
        assert len(layers) == 7 * net.cfg["n_layers"] + 1
        assert all(layer.weight.dtype == torch.int8 for layer in layers)
        assert net.lm_head.weight.dtype == torch.float32  # the plain model is left as it was
        weights = step_bytes(net, 1, 0)
        assert step_bytes(served, 1, 0) == weights // 4 + 4 * sum(layer.weight.shape[0] for layer in layers)
        x = tokens(2, 16, seed=seed)
        with torch.no_grad():
            want, got = net(x)[0], served(x)[0]  # a 16-row prefill, through the kernel too
        assert float((got - want).abs().max() / want.abs().max()) < 0.03
    plans = [(forced_tokens(n, seed=n), first, last, {"temperature": 0})
             for n, first, last in [(7, 0, 12), (2, 1, 10)]]  # fmt: skip
    eager, compiled = run_rows(served, 4, plans, 13), run_rows(served, 4, plans, 13, "default")
    for (eager_tokens, eager_logits), (tokens_, logits) in zip(eager, compiled, strict=True):
        assert tokens_ == eager_tokens
        # A 1e-7 difference between the compiled and eager norms can move x's rounding to 14 bits by one
        # step: 1.8e-5 measured on logits of about 1, so 1e-4 rather than float32's 1e-5.
        assert all(torch.allclose(a, b, atol=1e-4, rtol=0) for a, b in zip(logits, eager_logits, strict=True))


PREPARE = """
import sys
import model, serve.app as serve
from decode import load
from tests.test_model import build, tiny
net = build(tiny(seq_len=32))
net.checkpoint_path = "x"
served = load.prepare_weights(net, serve.load_settings(serve.DEFAULT_CONFIG, sys.argv[1:]), "cpu")
print(sorted({type(m).__name__ for m in served.modules() if "Linear" in type(m).__name__}))
"""


@pytest.mark.parametrize(
    "environment, reason",
    [
        pytest.param(  # a CPU without AVX2 is told that first (make test-other-cpu's setting)
            {"CXX": "no-such-g++"},
            "no C++ compiler: 'no-such-g++' is not on PATH (install g++ or set CXX)",
            marks=needs_avx2,
            id="no compiler",
        ),
        pytest.param(
            {"ATEN_CPU_CAPABILITY": "default"},
            "this CPU runs torch at DEFAULT; the kernel needs AVX2 and FMA",
            id="no AVX2",
        ),
    ],
)
def test_a_machine_that_cannot_run_the_kernel_is_told_why_and_the_server_uses_torchs_products(
    tmp_path, environment, reason
):
    # A fresh process with an empty kernel cache, as on a family machine's first start.
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), **environment}
    done = subprocess.run([sys.executable, "-c", PREPARE], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"serve: serve.matvec_kernel.cpu is on but {reason}; decoding with torch's products" in done.stderr
    assert done.stdout.strip() == "['SplitLinear']"  # serve.matvec_parts.cpu: 2
    int8 = ["serve.weights.cpu=int8"]
    done = subprocess.run(
        [sys.executable, "-c", PREPARE, *int8], cwd=ROOT, env=env, capture_output=True, text=True
    )
    # int8 runs through the kernel only (torch's int8 was retired): prepare_weights refuses and says why
    assert (
        done.returncode != 0
        and f"serve.weights.cpu=int8 runs through ENLACE's kernel, but {reason}" in done.stderr
    )


def test_a_compiler_that_fails_names_itself_and_its_last_line_and_leaves_no_file(tmp_path, monkeypatch):
    failing = tmp_path / "failing-g++"
    failing.write_text("#!/bin/sh\necho 'matvec.cpp:1: error: out of memory' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("CXX", str(failing))
    with pytest.raises(kernel.KernelUnavailable) as raised:
        kernel.build(folder=str(tmp_path / "cache"))
    assert str(raised.value) == f"{failing} could not build decode/*.cpp: matvec.cpp:1: error: out of memory"
    assert os.listdir(tmp_path / "cache") == []


def test_a_machine_without_ninja_is_told_so_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel.cpp_extension, "is_ninja_available", lambda: False)
    with pytest.raises(kernel.KernelUnavailable, match=r"no ninja on PATH: .* \(pip install ninja\)"):
        kernel.build(folder=str(tmp_path / "cache"))
    assert not os.path.exists(tmp_path / "cache")


def test_the_build_folder_changes_with_the_sources_compiler_flags_torch_and_instruction_set(
    tmp_path, monkeypatch
):
    copies = [tmp_path / os.path.basename(source) for source in kernel.SOURCES]
    for source, copy in zip(kernel.SOURCES, copies, strict=True):
        copy.write_bytes(open(source, "rb").read())
    monkeypatch.setattr(kernel, "SOURCES", tuple(str(copy) for copy in copies))
    key = kernel.build_key("g++")
    assert kernel.build_key("g++") == key and len(key) == 16
    changes = [
        (kernel, "CFLAGS", (*kernel.CFLAGS, "-DCHANGED")),
        (torch, "__version__", "0.0.0"),
        (torch, "__file__", str(tmp_path / "torch" / "__init__.py")),  # another venv
        (torch.backends.cpu, "get_cpu_capability", lambda: "ANOTHER"),
    ]
    keys = {kernel.build_key("clang++")}
    for change in changes:
        with monkeypatch.context() as patched:
            patched.setattr(*change)
            keys.add(kernel.build_key("g++"))
    copies[1].write_bytes(copies[1].read_bytes() + b"\n")  # a source edited in place
    keys.add(kernel.build_key("g++"))
    assert key not in keys and len(keys) == 6
