"""Where the torch backend runs and in which dtype, decided at load from what the machine has.

    device: "auto" -> the first CUDA GPU when one is visible, else the CPU; or "cpu", "cuda", "cuda:N".
    dtype:  "auto" -> bfloat16 on a GPU; on a CPU, bfloat16 when /proc/cpuinfo lists native bf16 dot
            products (avx512_bf16 or amx_bf16), float32 otherwise; or "float32", "bfloat16", "float16".

Why bf16 on such a CPU: plain decoding is ~1.7x faster than fp32 and a k-token pass (k <= 8) costs about
one step. Greedy identity needs more than speed: the logits of a token scored inside a k-token block
must be bit-equal to scoring it alone. In bf16 the projections (oneDNN) are bit-equal for any number
of rows; attention over a block was not (the fused kernel's q.K^T block depends on the query count),
which the lean forward fixes by scoring every query as its own one-row attention (models/fast_llama.py).
fp32 projections go through MKL, whose 1-row and k-row kernels differ by ~5e-5: fp32 is the fallback
for CPUs without native bf16, close to invariant but not bit-equal (tests/test_device.py).
No CUDA call happens unless a GPU was asked for or found (torch.cuda.is_available() is safe on CPU).
"""

from __future__ import annotations

import torch

from .errors import ExactSpecError

DEVICES = ("auto", "cpu", "cuda", "cuda:N")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # CPU flags under which bf16 matmuls run natively


def resolve_device(spec: str | torch.device | None = "auto") -> torch.device:
    """"auto" / "cpu" / "cuda" / "cuda:N" -> a torch.device; a GPU that is not there is one clear error."""
    spec = "auto" if spec is None else str(spec)
    if spec == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or spec.startswith("cuda:") and spec[5:].isdigit():
        if not torch.cuda.is_available():
            raise ExactSpecError(f"--device {spec}: no CUDA GPU is visible to PyTorch {torch.__version__} "
                                 "(use --device cpu or auto)")
        index = int(spec[5:]) if ":" in spec else 0
        if index >= torch.cuda.device_count():
            raise ExactSpecError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) visible")
        return torch.device("cuda", index)
    raise ExactSpecError(f"unknown device {spec!r}: choose auto, cpu, cuda or cuda:N")


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def resolve_dtype(spec: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """"auto" or a dtype name -> the torch dtype for weights and activations on `device`."""
    if isinstance(spec, torch.dtype):
        return spec
    spec = "auto" if spec is None else spec
    if spec == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_flags() & set(BF16_FLAGS) else torch.float32
    if spec not in DTYPES:
        raise ExactSpecError(f"unknown dtype {spec!r}: choose auto, {', '.join(DTYPES)}")
    return DTYPES[spec]


def describe(device: torch.device, dtype: torch.dtype) -> str:
    """One line naming the device, the dtype and the hardware facts the choice rests on."""
    name = str(dtype).removeprefix("torch.")
    if device.type == "cuda":
        return f"device {device} ({torch.cuda.get_device_name(device)}), dtype {name}"
    flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_vnni", *BF16_FLAGS, "amx_tile", "amx_int8"})
    return (f"device cpu ({torch.backends.cpu.get_cpu_capability()}; flags: {' '.join(flags) or 'none'}), "
            f"dtype {name}")


def device_of(model) -> torch.device:
    """The device an adapter computes on (CPU for adapters that do not say: llama.cpp, test doubles)."""
    return getattr(model, "device", None) or torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work (timing); nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
