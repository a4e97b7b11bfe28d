"""The optimizer recipe: Muon for the block matrices, AdamW for the rest, Newton-Schulz in the profile's dtype."""

import io
import os
import shutil

import pytest
import torch
from conftest import tiny_args, tiny_config
from test_distributed import TORCHRUN, newest, torchrun
from test_dpo import dpo_config, pair_data  # noqa: F401 (a fixture, used by name)

import checkpoint
import config
import hardware
import optim
import train
from model import Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "configs", "smoke-cpu.yaml")
SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_hidden=64",
         "model.seq_len=16"]  # fmt: skip


def muon_config(*overrides):
    return config.load(SMOKE, [*SMALL, "train.optimizer=muon", *overrides])


def model_of(cfg, seed=0):
    torch.manual_seed(seed)
    return Transformer(cfg["model"])


def seeded_gradients(model, seed):
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        param.grad = torch.randn(param.shape, generator=generator)


def linear_loss(model, seed):
    """A loss whose gradient is a seeded random tensor per parameter."""
    generator = torch.Generator().manual_seed(seed)
    return sum((p * torch.randn(p.shape, generator=generator)).sum() for p in model.parameters())


def test_muon_gets_the_block_matrices_and_adamw_the_embedding_and_norms_each_parameter_once():
    cfg = muon_config()
    model = model_of(cfg)
    opt = optim.build_optimizer(model, cfg["train"], "float32")
    names = {id(p): n for n, p in model.named_parameters()}
    muon = [names[id(p)] for g in opt.muon.param_groups for p in g["params"]]
    embedding, norms = ([names[id(p)] for p in g["params"]] for g in opt.adamw.param_groups)
    assert sorted(muon) == sorted(
        f"layers.{i}.{part}.weight"
        for i in range(2)
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
        + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    )
    assert embedding == ["embed_tokens.weight"]  # the tied LM head is the same tensor
    assert norms and all("norm" in name for name in norms)
    assert sorted(muon + embedding + norms) == sorted(names.values())
    assert [g["weight_decay"] for g in opt.adamw.param_groups] == [cfg["train"]["weight_decay"], 0.0]
    assert opt.muon.param_groups[0]["weight_decay"] == cfg["train"]["muon"]["weight_decay"]


def test_adamw_stays_one_fused_adamw_that_decays_matrices_only():
    cfg = config.load(SMOKE, [*SMALL, "train.optimizer=adamw"])
    opt = optim.build_optimizer(model_of(cfg), cfg["train"], "float32")
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"]
    assert [g["weight_decay"] for g in opt.param_groups] == [cfg["train"]["weight_decay"], 0.0]
    assert all(p.dim() >= 2 for p in opt.param_groups[0]["params"])


def test_the_schedule_scales_muon_to_its_own_peak_and_adamw_to_train_lr():
    cfg = muon_config("train.lr=0.004", "train.muon.lr=0.02")
    opt = optim.build_optimizer(model_of(cfg), cfg["train"], "float32")
    optim.set_lr(opt, 0.002, cfg["train"])  # half the peak: warmup or decay
    assert opt.muon.param_groups[0]["lr"] == pytest.approx(0.01)
    assert [g["lr"] for g in opt.adamw.param_groups] == [0.002, 0.002]


@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_muon_in_bfloat16_follows_torch_optim_muon_to_bfloat16_precision(adjust_lr_fn):
    """Only the Newton-Schulz dtype and where it normalises are ours (before the cast, torch after): with
    torch's bfloat16 every step follows torch.optim.Muon's to bfloat16's precision."""
    torch.manual_seed(0)
    start = [torch.randn(48, 32), torch.randn(32, 80)]  # tall and wide: both transposition branches
    ours = [p.clone().requires_grad_() for p in start]
    theirs = [p.clone().requires_grad_() for p in start]
    settings = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True, "ns_steps": 5}
    settings["adjust_lr_fn"] = adjust_lr_fn
    mine = optim.Muon(ours, "bfloat16", **settings)
    reference = torch.optim.Muon(theirs, **settings)
    for step in range(3):
        grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(step)) for p in start]
        for a, b, g in zip(ours, theirs, grads, strict=True):
            a.grad, b.grad = g.clone(), g.clone()
        mine.step()
        reference.step()
    for a, b, p in zip(ours, theirs, start, strict=True):
        moved = (b - p).norm()
        assert (a - b).norm() < 0.02 * moved  # bfloat16's ~1% on an update (see the float64 test below)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_newton_schulz_runs_in_the_asked_dtype_and_orthogonalizes(dtype):
    torch.manual_seed(0)
    grad = torch.randn(64, 24) @ torch.diag(torch.logspace(-1, 1, 24))  # singular values over 2 decades
    result = optim.newton_schulz(grad, 5, dtype)
    assert result.dtype == dtype and result.shape == grad.shape
    singular = torch.linalg.svdvals(result.float())
    # the quintic's fixed point band (Keller Jordan: S' ~ U(0.5, 1.5)), whatever the input's spread
    assert singular.min() > 0.3 and singular.max() < 1.3, singular


def newton_schulz_error(grad, dtype):
    """The relative Frobenius distance of the iteration in `dtype` from the same iteration in float64."""
    exact = optim.newton_schulz(grad.double(), 5, torch.float64)
    return ((optim.newton_schulz(grad, 5, dtype).double() - exact).norm() / exact.norm()).item()


NORMS = (1e-2, 1e-3, 1e-4, 1e-5, 1e-6)


def unit_gradient():
    torch.manual_seed(0)
    direction = torch.randn(1408, 512)  # tiny-50m's MLP shape
    return direction / direction.norm()


@pytest.mark.parametrize("dtype, bound", [(torch.float16, 0.01), (torch.bfloat16, 0.012)])
def test_newton_schulz_keeps_its_accuracy_at_every_gradient_norm(dtype, bound):
    """From Frobenius norm 1e-2 to 1e-6: a cast before the normalisation left a float16 gradient of norm
    1e-5 mostly zeros (121% off). float16 (the 2060's) stays within 1%; bfloat16 (8 mantissa bits) within
    its own floor, ~1.1% (see the next test), the same at every norm."""
    errors = [newton_schulz_error(unit_gradient() * norm, dtype) for norm in NORMS]
    assert max(errors) <= bound, errors
    assert max(errors) < 1.1 * min(errors), errors  # no norm is worse than another


def test_bfloat16_newton_schulz_is_as_close_to_float64_as_torch_muons_own():
    # bfloat16's floor is its arithmetic, not our code: torch.optim.Muon's own iteration (bfloat16 always,
    # Keller Jordan's) is as far from float64 at every norm, so 1% would need float32 steps on every bf16 board
    from torch.optim._muon import _zeropower_via_newtonschulz as torch_iteration  # a test only: private

    for norm in NORMS:
        grad = unit_gradient() * norm
        exact = optim.newton_schulz(grad.double(), 5, torch.float64)
        theirs = torch_iteration(grad, optim.NS_COEFFICIENTS, 5, optim.NS_EPS).double()
        ours = newton_schulz_error(grad, torch.bfloat16)
        assert ours <= ((theirs - exact).norm() / exact.norm()).item(), norm


def test_newton_schulz_never_writes_into_its_input():
    grad = torch.randn(48, 32)
    kept = grad.clone()
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        optim.newton_schulz(grad, 5, dtype)
        assert torch.equal(grad, kept), dtype


@pytest.mark.parametrize("nesterov", [True, False])
def test_one_muon_step_leaves_the_momentum_buffer_at_its_share_of_the_gradient(nesterov):
    """With nesterov off the buffer itself is what gets orthogonalised; it must stay (1 - momentum) * g,
    not be normalised to norm 1 in its place (the float32 CPU profile's dtype, where .to() copies nothing)."""
    param = torch.randn(48, 32, requires_grad=True)
    param.grad = torch.randn(48, 32) * 3.0
    muon = optim.Muon([param], "float32", lr=0.02, momentum=0.95, nesterov=nesterov)
    muon.step()
    buffer = muon.state[param]["momentum_buffer"]
    torch.testing.assert_close(buffer, 0.05 * param.grad)
    assert buffer.norm().item() == pytest.approx(0.05 * param.grad.norm().item(), rel=1e-5)


def test_gradscaler_unscales_before_the_orthogonalization():
    """float16 training scales the loss; Muon's momentum must sum the true gradients (a power-of-two scale
    unscales exactly, so the two runs are bit-identical)."""
    cfg = muon_config()
    plain, scaled = model_of(cfg), model_of(cfg)
    opt_plain = optim.build_optimizer(plain, cfg["train"], "float32")
    opt_scaled = optim.build_optimizer(scaled, cfg["train"], "float32")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1000)
    for step in range(3):
        linear_loss(plain, step).backward()  # gradient = the seeded tensors
        scaler.scale(linear_loss(scaled, step)).backward()  # the same, times 2^12
        opt_plain.step()
        scaler.unscale_(opt_scaled)
        scaler.step(opt_scaled)
        scaler.update()
        opt_plain.zero_grad()
        opt_scaled.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), scaled.parameters(), strict=True))


def test_the_state_dict_round_trips_through_a_weights_only_checkpoint_and_continues_bit_exact():
    cfg = muon_config()
    first, second = model_of(cfg), model_of(cfg)
    opt_first = optim.build_optimizer(first, cfg["train"], "float32")
    for step in range(2):
        seeded_gradients(first, step)
        opt_first.step()
    second.load_state_dict(first.state_dict())
    buffer = io.BytesIO()
    torch.save(opt_first.state_dict(), buffer)
    buffer.seek(0)
    opt_second = optim.build_optimizer(second, cfg["train"], "float32")
    opt_second.load_state_dict(torch.load(buffer, weights_only=True))
    for model, opt in ((first, opt_first), (second, opt_second)):
        seeded_gradients(model, 2)
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters(), strict=True))


def test_an_adamw_state_is_refused_by_muon_with_the_reason():
    cfg = muon_config()
    adamw_state = optim.build_optimizer(
        model_of(cfg), config.load(SMOKE, [*SMALL, "train.optimizer=adamw"])["train"], "float32"
    )
    opt = optim.build_optimizer(model_of(cfg), cfg["train"], "float32")
    with pytest.raises(ValueError, match="not Muon \\+ AdamW"):
        opt.load_state_dict(adamw_state.state_dict())


def test_a_float16_profile_refuses_bfloat16_newton_schulz():
    with pytest.raises(
        config.ConfigError, match="hardware.muon_ns_dtype: bfloat16, but the profile autocasts"
    ):
        config.load(os.path.join(ROOT, "configs", "smoke-2060.yaml"), ["hardware.muon_ns_dtype=bfloat16"])


def test_optimizer_muon_needs_its_settings():
    with pytest.raises(config.ConfigError, match="muon"):
        config.load(SMOKE, ["train.optimizer=muon", "train.muon=null"])


# -----------------------------------------------------------------------------
# In training: accumulation, resume, float16 + GradScaler, DDP, SFT and DPO

quiet = lambda *a, **k: None  # noqa: E731
MUON = ["train.optimizer=muon", "train.decay_fraction=0"]  # no decay: a run to be extended keeps its schedule


def final_checkpoint(cfg):
    return checkpoint.load_checkpoint(train.list_checkpoints(train.run_dir_of(cfg))[0])


def assert_resumes_bit_exact(make_config, steps=8):
    """make_config(name, *overrides) -> resolved config; full run vs half + resume."""
    train.train(make_config("full"), log=quiet)
    assert train.train(make_config("split", f"train.max_steps={steps // 2}"), log=quiet) == steps // 2
    assert train.train(make_config("split"), resume=True, log=quiet) == steps
    a, b = final_checkpoint(make_config("full")), final_checkpoint(make_config("split"))
    count, differing, largest = checkpoint.compare_states(a, b)
    assert count > 0 and not differing, f"{len(differing)}/{count} tensors differ (largest {largest})"
    momentum = a["optimizer"]["state"]["muon"]
    assert len(momentum) == 14 and all("momentum_buffer" in s for s in momentum.values())  # 2 blocks x 7
    return a, b


@pytest.mark.parametrize("kind", ["bytes", "chat"])
def test_a_muon_run_with_accumulation_resumes_bit_exact_in_pretraining_and_sft(tmp_path, kind, request):
    data_dir = request.getfixturevalue("byte_data_dir" if kind == "bytes" else "chat_data_dir")

    def make(name, *overrides):
        cfg = tiny_config(tmp_path, kind, data_dir, f"run_name={name}", *MUON, *overrides)
        assert cfg["train"]["grad_accum_steps"] > 1
        return cfg

    assert_resumes_bit_exact(make)


def test_a_muon_run_on_the_float16_grad_scaler_path_resumes_bit_exact(tmp_path, byte_data_dir):
    # The RTX 2060 profile on the CPU's float16 autocast (config.py keeps real CPU runs in float32, so the
    # resolved dict is switched): Newton-Schulz in float16, the loss scaled, unscaled before the step.
    def make(name, *overrides):
        cfg = tiny_config(tmp_path, "bytes", byte_data_dir, f"run_name={name}", *MUON, *overrides)
        cfg["hardware"] |= {"dtype": "float16", "grad_scaler": True, "muon_ns_dtype": "float16"}
        return cfg

    a, b = assert_resumes_bit_exact(make)
    assert a["scaler"] == b["scaler"] and a["scaler"]["scale"] > 1


def test_a_muon_dpo_run_resumes_bit_exact(tmp_path, chat_run, request):
    pairs = request.getfixturevalue("pair_data")  # test_dpo's fixture, imported above

    def make(name, *overrides):
        return dpo_config(pairs, chat_run, tmp_path, f"run_name={name}", *MUON, *overrides)

    assert_resumes_bit_exact(make)


@pytest.mark.skipif(not shutil.which(TORCHRUN), reason="torchrun not found beside the interpreter")
def test_two_muon_ranks_with_accumulation_k_match_one_process_with_2k(tmp_path, shard_data_dir):
    # DDP all-reduces the gradients before the step: both ranks orthogonalize the same matrices.
    args = tiny_args(tmp_path, "shards", shard_data_dir, "run_name=ddp", "train.grad_accum_steps=2", *MUON)
    ddp = torchrun(args)
    assert ddp.returncode == 0, ddp.stdout + ddp.stderr
    single = tiny_config(
        tmp_path, "shards", shard_data_dir, "run_name=single", "train.grad_accum_steps=4", *MUON
    )
    train.train(single, log=quiet)
    a, b = newest(tmp_path / "ddp"), newest(tmp_path / "single")
    assert a["step"] == b["step"] == 8 and a["world_size"] == 2
    for name, tensor in a["model"].items():
        assert torch.allclose(tensor, b["model"][name], rtol=1e-4, atol=1e-5), name


def test_the_profile_check_refuses_bfloat16_newton_schulz_on_a_board_that_only_emulates_it():
    rtx_2060 = hardware.DeviceCaps(cuda_available=True, name="RTX 2060", capability=(7, 5), bf16_native=False)
    profile = config.load(os.path.join(ROOT, "configs", "smoke-2060.yaml"))["hardware"]
    assert hardware.check_hardware(profile, rtx_2060) == []
    (problem,) = hardware.check_hardware(profile | {"muon_ns_dtype": "bfloat16"}, rtx_2060)
    assert "Newton-Schulz iteration in bfloat16" in problem and "use muon_ns_dtype: float16" in problem
