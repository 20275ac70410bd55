"""Where the torch backend runs and in which dtype, decided at load from what the machine has.

    device: "auto" -> the first CUDA GPU when one is visible, else the CPU; or "cpu", "cuda", "cuda:N".
    dtype:  "auto" -> bfloat16 on a GPU; on a CPU, float32 for loading, after which the lean Llama
            forward's layout (dtype + batch-invariant mode) is chosen by a self-test on the loaded model
            (models/layouts.py); or "float32", "bfloat16", "float16".

Why not from /proc/cpuinfo flags: greedy identity needs the logits of a token scored inside a k-token
block to be bit-equal to scoring it alone, and whether a layout gives that, and which layout is faster,
depends on the CPU's kernels: bf16 won on an AMD EPYC with AVX-512 BF16 and lost to fp32 on an Intel
Xeon with AMX, where the same flags are listed. So the flags only name the CPU in `describe`.
No CUDA call happens unless a GPU was asked for or found (torch.cuda.is_available() is safe on CPU).
"""

from __future__ import annotations

import torch

from .errors import ExactSpecError

DEVICES = ("auto", "cpu", "cuda", "cuda:N")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # named in `describe`: native bf16 dot products


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


def _cpuinfo(field: str, path: str = "/proc/cpuinfo") -> str | None:
    """The first value of `field` in /proc/cpuinfo, or a file of its format (None where there is none)."""
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == field:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    return set((_cpuinfo("flags") or "").split())


def resolve_dtype(spec: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """"auto" or a dtype name -> the torch dtype for weights and activations on `device`."""
    if isinstance(spec, torch.dtype):
        return spec
    spec = "auto" if spec is None else spec
    if spec == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if spec not in DTYPES:
        raise ExactSpecError(f"unknown dtype {spec!r}: choose auto, {', '.join(DTYPES)}")
    return DTYPES[spec]


def describe(device: torch.device, dtype: torch.dtype, layout=None) -> str:
    """One line naming the device, the dtype, the CPU it runs on and, when the dtype self-test chose the
    layout (`layout`: a models.layouts.Choice), what it found."""
    name = str(dtype).removeprefix("torch.")
    if device.type == "cuda":
        return f"device {device} ({torch.cuda.get_device_name(device)}), dtype {name}"
    chosen = f"; dtype auto chose {layout.describe()}" if layout is not None else ""
    return f"device cpu ({cpu_label()}, {torch.backends.cpu.get_cpu_capability()}), dtype {name}{chosen}"


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo ("unknown CPU" where there is none)."""
    return _cpuinfo("model name") or "unknown CPU"


def cpu_label() -> str:
    """The CPU as a figure should name it: model name, family and model, vector flags. The name alone is
    ambiguous: a VM's "AMD EPYC" has been an AVX2-only Zen 3 (family 25 model 1) one day and an AVX-512
    BF16 Zen 4 (family 25 model 17) another, with other speeds and another dtype self-test result."""
    family, model = _cpuinfo("cpu family"), _cpuinfo("model")
    flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_vnni", *BF16_FLAGS, "amx_tile", "amx_int8"})
    where = f"family {family} model {model}; " if family and model else ""
    return f"{cpu_name()} ({where}flags: {' '.join(flags) or 'none'})"


def device_of(model) -> torch.device:
    """The device an adapter computes on (CPU for adapters that do not say: llama.cpp, test doubles)."""
    return getattr(model, "device", None) or torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work (timing); nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
