"""
The hardware profile against the real board: the only code that knows how boards differ.

probe_device() says what this machine offers, check_hardware() what a profile (configs/hardware/) asks that
the board cannot do, SDPA_KERNELS what each attention kernel takes (attention_problems() checks a profile
and a model against it, on the CPU too, before anything is downloaded), BOARD_ONLY what a CPU run of a
board's policy cannot show, setup_hardware() turns the profile into a Hardware (device, autocast,
GradScaler, attention kernel, peak TFLOP/s for MFU) and init_distributed() joins torchrun's process group.
"""

import contextlib
import datetime
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class HardwareError(Exception):
    """A profile this machine cannot run; the message names the profile, the board and what to use."""


# -----------------------------------------------------------------------------
# The board and the profile


@dataclass
class DeviceCaps:
    """What the machine offers, probed once (or passed in by tests)."""

    cuda_available: bool
    name: str = "cpu"
    capability: tuple = (0, 0)  # CUDA compute capability
    bf16_native: bool = False  # False on Turing, where bf16 only runs emulated
    memory_gib: float | None = None  # the board's whole memory; None: not known (the CPU), not checked


def bf16_is_native(device_index=0):
    """True only where bf16 runs in hardware. The default is_bf16_supported() also says True on an
    RTX 2060, where bf16 is emulated ~2.6x slower than fp16: that is exactly the case to refuse."""
    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # older torch without the argument
        return torch.cuda.get_device_capability(device_index) >= (8, 0)


def probe_device(local_rank=0):
    if not torch.cuda.is_available():
        return DeviceCaps(cuda_available=False)
    return DeviceCaps(
        cuda_available=True,
        name=torch.cuda.get_device_name(local_rank),
        capability=torch.cuda.get_device_capability(local_rank),
        bf16_native=bf16_is_native(local_rank),
        memory_gib=torch.cuda.get_device_properties(local_rank).total_memory / 2**30,
    )


def check_hardware(profile, caps, model_cfg=None):
    """Problems of running `profile` (and the model of `model_cfg`, where given) on a device with `caps`;
    empty when it fits."""
    name = f"hardware profile '{profile['name']}'"
    if profile["device"] == "cpu":
        return attention_problems(profile, model_cfg)
    if not caps.cuda_available:
        return [
            f"{name} needs CUDA, but this machine has no CUDA device (found: cpu); "
            "use configs/hardware/cpu.yaml"
        ]
    problems = []
    sm = f"sm{caps.capability[0]}{caps.capability[1]}"
    if profile["dtype"] == "bfloat16" and not caps.bf16_native:
        problems.append(
            f"{name} asks for bfloat16, but {caps.name} ({sm}) has no native bf16 (only emulated, ~2.6x "
            "slower than float16); use dtype: float16 with grad_scaler: true "
            "(configs/hardware/turing-2060.yaml)"
        )
    if profile["muon_ns_dtype"] == "bfloat16" and not caps.bf16_native:
        problems.append(
            f"{name} runs Muon's Newton-Schulz iteration in bfloat16, but {caps.name} ({sm}) has no native "
            "bf16 (only emulated, ~2.6x slower than float16); use muon_ns_dtype: float16"
        )
    problems.extend(attention_problems(profile, model_cfg, caps.capability))
    if profile["dtype"] == "float16" and not profile["grad_scaler"]:
        problems.append(f"{name}: float16 without a GradScaler underflows; set grad_scaler: true")
    if caps.memory_gib is not None and profile["memory_gib"] and caps.memory_gib < profile["memory_gib"]:
        problems.append(
            f"{name} lets a training step fill memory_gib: {profile['memory_gib']} GiB, but {caps.name} has "
            f"{caps.memory_gib:.1f} GiB in all; use the profile of this board, or a memory_gib below "
            f"{caps.memory_gib:.1f} (the board's memory less ~1 GiB for the CUDA context and the allocator)"
        )
    return problems


# -----------------------------------------------------------------------------
# Attention kernels: what each scaled_dot_product_attention kernel takes, the one table of it


@dataclass(frozen=True)
class KernelLimits:
    """What one SDPA kernel takes on one device type. A capability is a CUDA compute capability (major,
    minor); the CPU counts as (0, 0)."""

    dtypes: dict  # dtype name -> the oldest capability whose kernel takes it
    capability: tuple = ((0, 0), (0, 0))  # the boards it runs on, first and last inclusive
    gqa: bool = True  # takes fewer key/value heads than query heads (enable_gqa=True)
    head_dim_max: int | None = None
    head_dim_multiple: dict = field(default_factory=dict)  # dtype name -> head_dim must be a multiple of it
    # (first capability, last capability, head_dim above, head_dim up to): no backward on those boards
    train_head_dim_gaps: tuple = ()


ALL_DTYPES = {"float32": (0, 0), "float16": (0, 0), "bfloat16": (0, 0)}
# torch 2.11-2.13 as documented: scaled_dot_product_attention's docstring ("GQA ... works only for
# Flash_attention and math kernel on CUDA tensor") and the checks behind torch.backends.cuda.
# can_use_flash_attention / can_use_efficient_attention (aten/src/ATen/native/transformers/cuda/
# sdp_utils.cpp): flash on sm80-sm121, float16/bfloat16, q/k/v head_dim equal and <= 256, no backward for
# head_dim in (192, 224] on sm86-sm89 and sm120-sm121; mem_efficient on sm50-sm121, float16/float32 and
# bfloat16 from sm80, head_dim a multiple of the GEMM alignment (8 for 16-bit dtypes, 4 for float32). Some
# later sources let mem_efficient take GQA on CUDA; the docstring does not, so the model repeats k/v for it,
# which is right under either. The CPU has flash (any float dtype, GQA) and math kernels, no mem_efficient.
SDPA_KERNELS = {
    ("flash", "cuda"): KernelLimits(
        dtypes={"float16": (8, 0), "bfloat16": (8, 0)},
        capability=((8, 0), (12, 1)),
        head_dim_max=256,
        train_head_dim_gaps=(((8, 6), (8, 9), 192, 224), ((12, 0), (12, 1), 192, 224)),
    ),
    ("flash", "cpu"): KernelLimits(dtypes=ALL_DTYPES),
    ("mem_efficient", "cuda"): KernelLimits(
        dtypes={"float16": (5, 0), "float32": (5, 0), "bfloat16": (8, 0)},
        capability=((5, 0), (12, 1)),
        gqa=False,
        head_dim_multiple={"float16": 8, "bfloat16": 8, "float32": 4},
    ),
    ("math", "cuda"): KernelLimits(dtypes=ALL_DTYPES, capability=((0, 0), (99, 99))),
    ("math", "cpu"): KernelLimits(dtypes=ALL_DTYPES),
}


def kernel_takes_gqa(backend):
    """Whether the kernel named `backend` takes fewer key/value heads than query heads on every device that
    has it; where not, the model repeats each key/value head for its group of query heads."""
    return all(limits.gqa for (name, _), limits in SDPA_KERNELS.items() if name == backend)


def sm_name(capability):
    return f"sm{capability[0]}{capability[1]}"


def kernel_refusals(backend, device, dtype, capability, head_dim):
    """Why the kernel `backend` cannot run attention of `dtype` and `head_dim` on `device` of `capability`
    (training: forward and backward); empty when it can."""
    limits = SDPA_KERNELS.get((backend, device))
    if limits is None:
        return [f"has no {device} kernel"]
    reasons = []
    first, last = limits.capability
    if not first <= capability <= last:
        return [f"runs on {sm_name(first)} to {sm_name(last)} only"]
    oldest = limits.dtypes.get(dtype)
    if oldest is None or capability < oldest:
        takes = [name for name, since in limits.dtypes.items() if since <= capability]
        reasons.append(f"takes no {dtype} here (it takes {', '.join(takes) or 'none'})")
    if head_dim is None:  # no model given: the board and the dtype only
        return reasons
    if limits.head_dim_max and head_dim > limits.head_dim_max:
        reasons.append(f"takes head_dim <= {limits.head_dim_max}")
    multiple = limits.head_dim_multiple.get(dtype)
    if multiple and head_dim % multiple:
        reasons.append(f"takes a {dtype} head_dim that is a multiple of {multiple}")
    for gap_first, gap_last, above, up_to in limits.train_head_dim_gaps:
        if gap_first <= capability <= gap_last and above < head_dim <= up_to:
            reasons.append(f"has no backward for head_dim in ({above}, {up_to}] on {sm_name(capability)}")
    return reasons


def attention_problems(profile, model_cfg=None, capability=None):
    """The line saying why the profile's attention kernel cannot train this model (the board and dtype
    only without one): [] when it can. `capability` is the board's, where one is at hand; otherwise the
    profile's `capability` (what a plan checks on any machine before the first download)."""
    device, dtype, backend = profile["device"], profile["dtype"], profile["attention_backend"]
    if device == "cpu":
        capability = (0, 0)
    capability = tuple(capability or profile.get("capability") or (0, 0))
    head_dim = model_cfg["d_model"] // model_cfg["n_heads"] if model_cfg else None
    reasons = kernel_refusals(backend, device, dtype, capability, head_dim)
    if not reasons:
        return []
    board = f"{sm_name(capability)} " if device == "cuda" else ""
    takers = [
        name
        for name in sorted({name for name, _ in SDPA_KERNELS})
        if not kernel_refusals(name, device, dtype, capability, head_dim)
    ]
    model = (
        f" for a model of head_dim {head_dim} (d_model {model_cfg['d_model']} / n_heads {model_cfg['n_heads']})"
        if model_cfg
        else ""
    )
    return [
        f"hardware profile '{profile['name']}' ({board}{device}, {dtype}) asks for attention_backend "
        f"{backend}{model}, but {backend} {'; '.join(reasons)}; kernels that take this on this board: "
        f"{', '.join(takers) or 'none'}"
    ]


# What a CPU profile standing for a board (its `stands_for`) cannot show of it; the run says so at start.
BOARD_ONLY = (
    "the board's CUDA attention kernel (mem_efficient on the 2060, flash on the 5090 and H200)",
    "tensor-core matmuls in float16/bfloat16 and their accumulation (the board's losses, bit for bit)",
    "CUDA memory: whether the micro-batch fits memory_gib (torch.cuda.max_memory_allocated)",
    "tokens/s and MFU against the board's peak",
    "torch.compile, CUDA graphs and NCCL across GPUs",
)


def not_exercised(profile):
    """The line a CPU run of a board's policy prints: what it did not exercise. None for other profiles."""
    if not profile.get("stands_for"):
        return None
    boards = ", ".join(profile["stands_for"])
    return (
        f"hardware profile '{profile['name']}' runs the dtype policy of {boards} on the CPU; not exercised "
        f"here (only a board shows it): {'; '.join(BOARD_ONLY)}"
    )


def measure_peak_tflops(device, dtype=torch.float32, size=2048, seconds=1.0, min_timings=5):
    """Dense matmul throughput actually reached on this device: the reference for MFU where the hardware
    profile gives none, and the figure `make bench` divides by, so a run's logged MFU and the bench's
    agree. Square matmuls of `size` (large enough that the BLAS kernel runs at full speed), one untimed
    for warm-up, then the best of repeated timings for `seconds` and at least `min_timings`: a neighbour
    process can only slow a timing down, never speed it up. On the CPU a matmul on every core is slowed
    by any neighbour on any core (a peak taken on a busy machine made a run log MFU 119% once the machine
    was quiet): there it is one thread's best over many short matmuls (a neighbour seldom holds that
    core through one of them) times the threads a run computes with."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        size = min(size, 512)  # ~3 ms on one core: short enough to fall between a neighbour's time slices
        torch.set_num_threads(1)
    try:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)

        def timed_matmul():
            start = time.perf_counter()
            a @ b
            if device.type == "cuda":
                torch.cuda.synchronize()
            return time.perf_counter() - start

        timed_matmul()
        timings = []
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline or len(timings) < min_timings:
            timings.append(timed_matmul())
    finally:
        torch.set_num_threads(threads)
    return 2 * size**3 / min(timings) / 1e12 * (threads if device.type == "cpu" else 1)


# Measured once per process and device: a --resume-check's three runs, or a test session's many tiny
# runs, share one figure instead of paying for it each time.
_measured_peak_tflops = {}


@dataclass
class Hardware:
    """The run's hardware section, read once and set up on this machine by setup_hardware(): what builds
    the model, runs a step or logs the run takes it from here, never from cfg["hardware"] again."""

    device: torch.device
    dtype: str  # the profile's: float32, bfloat16 or float16 (the autocast dtype)
    autocast: object  # a callable returning a context manager
    scaler: torch.amp.GradScaler
    attention_backend: str
    loss_chunk_size: int  # positions per chunk of the LM head + loss; 0: the full logits
    compile: bool  # wrap the model in torch.compile
    memory_gib: float | None  # what a step may use (microbatch.py's estimate); None: not checked
    peak_tflops: float  # the profile's, or measured here: the MFU reference
    muon_ns_dtype: str  # Muon's Newton-Schulz iteration (train.optimizer muon)
    description: str


def setup_hardware(profile, local_rank=0, caps=None, model_cfg=None):
    caps = caps or probe_device(local_rank)
    problems = check_hardware(profile, caps, model_cfg)
    if problems:
        raise HardwareError("\n".join(problems))
    if profile["device"] == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        description = f"{caps.name} (sm{caps.capability[0]}{caps.capability[1]})"
    else:
        device = torch.device("cpu")
        description = f"cpu ({torch.get_num_threads()} threads)"
    dtype = getattr(torch, profile["dtype"])
    if dtype == torch.float32:
        autocast = contextlib.nullcontext
    else:
        autocast = lambda: torch.autocast(device_type=device.type, dtype=dtype)
    scaler = torch.amp.GradScaler(device.type, enabled=profile["grad_scaler"])
    peak = profile["peak_tflops"]
    if not peak:
        key = (str(device), dtype if device.type == "cuda" else torch.float32)
        if key not in _measured_peak_tflops:
            _measured_peak_tflops[key] = measure_peak_tflops(device, key[1])
        peak = _measured_peak_tflops[key]
    return Hardware(
        device=device,
        dtype=profile["dtype"],
        autocast=autocast,
        scaler=scaler,
        attention_backend=profile["attention_backend"],
        loss_chunk_size=profile["loss_chunk_size"],
        muon_ns_dtype=profile["muon_ns_dtype"],
        compile=profile["compile"],
        memory_gib=profile["memory_gib"],
        peak_tflops=peak,
        description=description,
    )


# -----------------------------------------------------------------------------
# Distributed: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; without them we are one process


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self):
        return self.world_size > 1

    @property
    def is_main(self):
        return self.rank == 0


def init_distributed(profile, timeout_s):
    """This process's place in torchrun's job, the process group joined (nccl for a cuda profile, gloo
    on the CPU); a lone process without torchrun's variables."""
    if "RANK" not in os.environ:
        return Dist()
    ctx = Dist(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]))
    # A collective that waits longer than the timeout raises instead of hanging, so a crashed rank ends
    # the whole job (torchrun then stops the rest).
    dist.init_process_group(
        backend="nccl" if profile["device"] == "cuda" else "gloo",
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return ctx


def all_ranks_true(flag, ctx, device):
    if not ctx.enabled:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())
