"""Hardware validation: each profile is checked against the device before anything is built."""

import os

import pytest
import torch
import yaml

import config
import hardware
from hardware import DeviceCaps, check_hardware

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RTX_2060 = DeviceCaps(
    cuda_available=True, name="NVIDIA GeForce RTX 2060", capability=(7, 5), bf16_native=False
)
RTX_5090 = DeviceCaps(
    cuda_available=True, name="NVIDIA GeForce RTX 5090", capability=(12, 0), bf16_native=True
)
NO_CUDA = DeviceCaps(cuda_available=False)


def profile(name):
    """A shipped hardware profile, as the config layer resolves it."""
    with open(os.path.join(ROOT, "configs", "hardware", f"{name}.yaml")) as f:
        return yaml.safe_load(f)["hardware"]


def test_each_shipped_profile_fits_the_board_it_is_named_after():
    assert check_hardware(profile("turing-2060"), RTX_2060) == []
    assert check_hardware(profile("blackwell-5090"), RTX_5090) == []
    assert check_hardware(profile("cpu"), NO_CUDA) == []


def test_bf16_on_a_board_that_only_emulates_it_is_refused():
    problem, newton_schulz, kernel = check_hardware(
        profile("blackwell-5090") | {"attention_backend": "mem_efficient"}, RTX_2060
    )
    assert "asks for bfloat16" in problem and "RTX 2060 (sm75) has no native bf16" in problem
    assert "float16 with grad_scaler: true" in problem
    assert "Muon's Newton-Schulz iteration in bfloat16" in newton_schulz  # the profile's Muon dtype too
    assert "mem_efficient takes no bfloat16 here" in kernel  # and its attention kernel


def test_flash_attention_before_sm80_is_refused():
    problems = check_hardware(profile("turing-2060") | {"attention_backend": "flash"}, RTX_2060)
    assert problems == [
        "hardware profile 'turing-2060' (sm75 cuda, float16) asks for attention_backend flash, but flash "
        "runs on sm80 to sm121 only; kernels that take this on this board: math, mem_efficient"
    ]


def model_layer(name):
    with open(os.path.join(ROOT, "configs", "model", f"{name}.yaml")) as f:
        return yaml.safe_load(f)["model"]


PROFILES = ("turing-2060", "blackwell-5090", "hopper-h200", "cpu")
MODELS = ("smoke", "tiny-50m")


@pytest.mark.parametrize("name", PROFILES)
def test_each_shipped_profile_has_an_attention_kernel_for_each_shipped_model(name):
    for model in MODELS:
        assert hardware.attention_problems(profile(name), model_layer(model)) == []
    caps = {"turing-2060": RTX_2060, "blackwell-5090": RTX_5090, "hopper-h200": RTX_5090, "cpu": NO_CUDA}
    assert check_hardware(profile(name), caps[name], model_layer("tiny-50m")) == []


def test_the_table_says_which_kernels_take_grouped_query_attention():
    # torch's docstring: GQA "works only for Flash_attention and math kernel on CUDA tensor"
    assert hardware.kernel_takes_gqa("flash") and hardware.kernel_takes_gqa("math")
    assert not hardware.kernel_takes_gqa("mem_efficient")


@pytest.mark.parametrize(
    "board, changes, model_changes, expected",
    [
        ("turing-2060", {"dtype": "bfloat16"}, {}, "but mem_efficient takes no bfloat16 here (it takes float16, float32)"),
        ("turing-2060", {}, {"d_model": 480, "n_heads": 8}, "takes a float16 head_dim that is a multiple of 8"),
        ("hopper-h200", {}, {"d_model": 2304, "n_heads": 8}, "but flash takes head_dim <= 256; kernels that take "
         "this on this board: math, mem_efficient"),
        ("blackwell-5090", {}, {"d_model": 1600, "n_heads": 8}, "flash has no backward for head_dim in (192, 224] on sm120"),
        ("blackwell-5090", {"dtype": "float32", "grad_scaler": False}, {}, "flash takes no float32 here"),
        ("cpu", {"attention_backend": "mem_efficient"}, {}, "but mem_efficient has no cpu kernel; kernels that take "
         "this on this board: flash, math"),
    ],
)  # fmt: skip
def test_a_kernel_the_board_cannot_run_for_the_model_is_one_line_naming_both(
    board, changes, model_changes, expected
):
    model = model_layer("tiny-50m") | model_changes
    (line,) = hardware.attention_problems(profile(board) | changes, model)
    assert line.startswith(f"hardware profile '{board}' (")
    assert f"head_dim {model['d_model'] // model['n_heads']} (d_model {model['d_model']} / n_heads 8)" in line
    assert expected in line


def test_the_board_found_wins_over_the_capability_the_profile_was_written_for():
    bf16 = profile("turing-2060") | {"dtype": "bfloat16", "grad_scaler": False, "muon_ns_dtype": "bfloat16"}
    assert hardware.attention_problems(bf16, model_layer("tiny-50m"))  # sm75: no bf16 mem_efficient
    assert hardware.attention_problems(bf16, model_layer("tiny-50m"), capability=(8, 6)) == []
    with pytest.raises(hardware.HardwareError, match="asks for attention_backend mem_efficient for a model"):
        hardware.setup_hardware(profile("cpu") | {"attention_backend": "mem_efficient"}, caps=NO_CUDA,
                                model_cfg=model_layer("smoke"))  # fmt: skip


def test_a_cuda_profile_names_the_capability_it_was_written_for():
    with pytest.raises(config.ConfigError, match="capability"):
        config.load(os.path.join(ROOT, "configs", "pretrain-2060.yaml"), ["hardware.capability=null"])


def test_float16_without_grad_scaler_is_refused_on_the_gpu_too():
    problems = check_hardware(profile("turing-2060") | {"grad_scaler": False}, RTX_2060)
    assert any("float16 without a GradScaler" in p for p in problems)


def test_a_cuda_profile_on_a_machine_without_cuda_names_the_profile_and_the_device_found():
    (problem,) = check_hardware(profile("turing-2060"), NO_CUDA)
    assert "hardware profile 'turing-2060' needs CUDA" in problem and "found: cpu" in problem
    with pytest.raises(hardware.HardwareError, match="turing-2060"):
        hardware.setup_hardware(profile("turing-2060"), caps=NO_CUDA)


def test_native_bf16_is_asked_without_emulation(monkeypatch):
    # What torch reports on an RTX 2060: bf16 "supported" only when emulation counts.
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert hardware.bf16_is_native() is False


def test_native_bf16_falls_back_to_compute_capability_on_older_torch(monkeypatch):
    def old_signature():  # no including_emulation argument
        return True

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", old_signature)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (7, 5))
    assert hardware.bf16_is_native() is False
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (8, 0))
    assert hardware.bf16_is_native() is True


def test_the_cpu_profile_measures_its_own_peak_for_mfu():
    cpu = hardware.setup_hardware(profile("cpu"), caps=NO_CUDA)
    assert cpu.device.type == "cpu" and cpu.peak_tflops > 0
    assert not cpu.scaler.is_enabled()


def test_a_negative_loss_chunk_size_is_refused_naming_the_key():
    with pytest.raises(
        config.ConfigError, match=r"hardware.loss_chunk_size: -1 is out of range; expected >= 0"
    ):
        config.load(os.path.join(ROOT, "configs", "smoke-cpu.yaml"), ["hardware.loss_chunk_size=-1"])


def fake_board(monkeypatch, name, capability, total_bytes):
    """torch.cuda's device queries answering as the named board would."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: capability)
    monkeypatch.setattr(
        torch.cuda, "is_bf16_supported", lambda including_emulation=True: capability >= (8, 0)
    )
    properties = type("Properties", (), {"total_memory": total_bytes})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: properties)


def test_a_board_with_less_memory_than_the_profile_assumes_is_refused_in_one_line(monkeypatch):
    fake_board(monkeypatch, "NVIDIA GeForce RTX 2060", (7, 5), 6 * 10**9)  # the 6 GB RTX 2060
    with pytest.raises(hardware.HardwareError) as refused:
        hardware.setup_hardware(profile("turing-2060"))
    (line,) = str(refused.value).splitlines()
    assert "hardware profile 'turing-2060' lets a training step fill memory_gib: 10.5 GiB" in line
    assert "NVIDIA GeForce RTX 2060 has 5.6 GiB in all" in line


def test_the_board_memory_is_probed_and_a_board_with_enough_passes(monkeypatch):
    fake_board(monkeypatch, "NVIDIA GeForce RTX 2060", (7, 5), 12 * 10**9)  # the 12 GB RTX 2060
    caps = hardware.probe_device()
    assert caps.memory_gib == pytest.approx(11.18, abs=0.01)
    assert check_hardware(profile("turing-2060"), caps) == []
    assert check_hardware(profile("cpu"), caps) == []  # a CPU profile never asks for board memory


def test_measured_throughput_is_an_optional_map_of_model_to_figure_date_and_machine():
    run = os.path.join(ROOT, "configs", "smoke-cpu.yaml")
    figure = '{"tiny-50m": {"tokens_per_s": 41000, "date": "2026-12-04", "machine": "RTX 2060 12 GB"}}'
    cfg = config.load(run, [f"hardware.measured={figure}"])
    assert cfg["hardware"]["measured"]["tiny-50m"]["tokens_per_s"] == 41000
    with pytest.raises(config.ConfigError, match=r"hardware.measured.tiny-50m.machine: required key missing"):
        config.load(run, ['hardware.measured={"tiny-50m": {"tokens_per_s": 41000, "date": "2026-12-04"}}'])
    for board in ("turing-2060", "blackwell-5090", "hopper-h200"):
        assert profile(board)["measured"] == {}  # nothing measured yet: no figure is made up
