"""How near prefill runs to this CPU's limits: the multiply-adds a prompt token costs a GGUF model (its
matrices as int8 multiply-adds, as the quantized kernels compute them; attention's two products as f32
multiply-adds, at the prompt's mean depth), held against the peaks scripts/roofline.c measures (AVX-512
VNNI int8 and FMA f32 multiply-adds per second, read bandwidth), then a timed prefill of the model under
its self-tested setting, and the fraction of the limit it reaches.

    env -u OMP_WAIT_POLICY .venv/bin/python scripts/roofline.py [--prompt 3072] [--threads 2] [--target F.gguf]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from exactspec.device import cpu_name
from exactspec.embedded import embedded_model_path
from exactspec.models.gguf import GGUFFile


def peaks(threads: int) -> dict[str, float]:
    """{"vnni_int8_macs", "fma_f32_macs", "read_bytes"} per second on `threads` threads (vnni absent
    without AVX-512 VNNI)."""
    source = Path(__file__).with_name("roofline.c")
    with tempfile.TemporaryDirectory() as tmp:
        binary = os.path.join(tmp, "roofline")
        subprocess.run(["cc", "-O2", "-march=native", "-pthread", str(source), "-o", binary], check=True)
        out = subprocess.run([binary, str(threads)], check=True, capture_output=True, text=True).stdout
    return {name: float(value) for name, value in (line.split() for line in out.splitlines())}


def macs_per_token(path: str, prompt: int) -> tuple[float, float, float]:
    """(matrix multiply-adds, attention multiply-adds, weight bytes) per prompt token of a `prompt`-token
    prefill: every 2-D `blk.*` weight once; QK^T and PV over the mean depth (prompt + 1) / 2."""
    model = GGUFFile(path)
    arch = model.metadata["general.architecture"]
    layers = int(model.metadata[f"{arch}.block_count"])
    heads = int(model.metadata[f"{arch}.attention.head_count"])
    head_dim = int(model.metadata.get(f"{arch}.attention.key_length",
                                      int(model.metadata[f"{arch}.embedding_length"]) // heads))
    matrices = [t for name, t in model.tensors.items() if name.startswith("blk.") and len(t.dims) == 2]
    matrix = float(sum(t.dims[0] * t.dims[1] for t in matrices))
    attention = 2.0 * layers * heads * head_dim * (prompt + 1) / 2
    size = os.path.getsize(path)
    return matrix, attention, float(size)


def timed_prefill(path: str, prompt: int, threads: int) -> tuple[float, str]:
    """Seconds for a `prompt`-token prefill (best of 2) under the self-tested setting, and that setting."""
    from exactspec.models.llamacpp.numerics import load_self_tested

    lm = load_self_tested(path, n_ctx=max(4096, prompt + 64), threads=threads)
    ids = [(i * 7919) % min(40000, lm.vocab_size - 200) + 100 for i in range(prompt)]  # [prompt]
    best = float("inf")
    for _ in range(2):
        lm.reset()
        start = time.perf_counter()
        lm.prefill(torch.tensor([ids]))
        best = min(best, time.perf_counter() - start)
    return best, lm.identity


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=3072)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--target", default=None, help="a GGUF file (default: the embedded model)")
    args = p.parse_args()
    path = args.target or embedded_model_path()
    peak = peaks(args.threads)
    matrix, attention, size = macs_per_token(path, args.prompt)
    int8 = peak.get("vnni_int8_macs")
    print(f"CPU: {cpu_name()}, {args.threads} thread(s); OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}")
    print(f"peaks: {int8 or 0:.3g} int8 MAC/s (VNNI), {peak['fma_f32_macs']:.3g} f32 MAC/s (FMA), "
          f"{peak['read_bytes'] / 1e9:.1f} GB/s read")
    print(f"per prompt token ({args.prompt} tokens): {matrix / 1e6:.1f}M matrix MACs, "
          f"{attention / 1e6:.1f}M attention MACs (mean depth {(args.prompt + 1) / 2:.0f})")
    limit_s = (matrix / int8 if int8 else matrix / peak["fma_f32_macs"]) + attention / peak["fma_f32_macs"]
    print(f"compute limit: {1 / limit_s:.0f} tokens/s (matrices {matrix / (int8 or peak['fma_f32_macs']) * 1e3:.3f} ms"
          f" + attention {attention / peak['fma_f32_macs'] * 1e3:.3f} ms a token); a one-token step reads the"
          f" {size / 1e6:.0f} MB file: {peak['read_bytes'] / size:.0f} steps/s at most")
    seconds, identity = timed_prefill(path, args.prompt, args.threads)
    rate = args.prompt / seconds
    print(f"prefill: {rate:.0f} tokens/s = {rate * limit_s:.1%} of the compute limit ({identity})")


if __name__ == "__main__":
    main()
