"""A K-quant sliding-window model against stock llama.cpp: a long prompt's prefill, and plain decoding.

No real Gemma 3 file can be downloaded here, so this writes one of Gemma 3 270M's shapes (18 layers, five
of six with a 512-token window; hidden 640, one K/V head of 256, a 262,144-token vocabulary) with random
weights (tests/helpers/gguf_models.py) and quantizes it to Q4_K_M with llama.cpp's own quantizer: speed
depends on the shapes and the quant types, not on the weights' values. Then, in alternated rounds:

- stock: `llama-bench` of the stock build (../shared/tools/build-llama-server.sh) with flash attention on
  (llama-server's default on a CPU): pp N (the prompt's prefill, llama-server's time to first token less
  its HTTP) and tg 128; `--repack 0` where its repacked AMX kernels die (a GCC 12 build's tile
  configuration is empty: scripts/llama_cpp_patches/11-*; probed with a 16-token prompt);
- ours: exactspec's llama.cpp adapter under its self-tested setting: a cold prefill of N random tokens
  (an empty cache, no prefix reuse) and 128 one-token steps after a short prompt.

Printed: tokens/s per round, the verdict, and the median ratios ours / stock.

    env -u OMP_WAIT_POLICY .venv/bin/python scripts/bench_kquant_peer.py --llama-bench PATH --prompt 8192 --rounds 3

`--shape llama`: a 12-layer Llama whose every matrix takes K-quants (tests/helpers/gguf_models.SHAPED) instead.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests.helpers.gguf_models import SHAPED, quantize, write_gguf  # noqa: E402

DECODE = 128


def stock(bench: str, path: str, prompt: int, no_repack: bool) -> tuple[float, float]:
    """(prefill tokens/s of a `prompt`-token prompt, decode tokens/s) by llama-bench, one repetition each."""
    speeds = []
    for p, n in ((prompt, 0), (0, DECODE)):
        cmd = [bench, "-m", path, "-p", str(p), "-n", str(n), "-r", "1", "-fa", "on", "-t", str(os.cpu_count()),
               "-o", "json"] + (["--repack", "0"] if no_repack else [])
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        speeds.append(json.loads(out)[0]["avg_ts"])
    return speeds[0], speeds[1]


def stock_repack_crashes(bench: str, path: str) -> bool:
    """Whether the stock llama-bench dies by a signal on a 16-token prompt with its weights repacked."""
    from exactspec.models.llamacpp.runtime import cpu_has_amx

    if not cpu_has_amx():
        return False
    done = subprocess.run([bench, "-m", path, "-p", "16", "-n", "0", "-r", "1", "-o", "json"], capture_output=True)
    return done.returncode < 0


def ours(lm, prompt: int) -> tuple[float, float]:
    """(prefill tokens/s of a cold `prompt`-token prompt, tokens/s of DECODE one-token steps)."""
    ids = torch.randint(3, lm.vocab_size, (prompt,), generator=torch.Generator().manual_seed(1))
    lm.reset()
    t0 = time.perf_counter()
    lm.prefill(ids[None])
    prefill = prompt / (time.perf_counter() - t0)
    lm.reset()
    lm.prefill(ids[None, :16])
    t0 = time.perf_counter()
    for t in ids[16:16 + DECODE].tolist():
        lm.forward(torch.tensor([[t]]))
    decode = DECODE / (time.perf_counter() - t0)
    lm.reset()
    return prefill, decode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-bench", required=True, help="the stock build's llama-bench")
    p.add_argument("--prompt", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quant", default="Q4_K_M")
    p.add_argument("--shape", choices=("gemma3", "llama"), default="gemma3",
                   help="Gemma 3 270M's shapes, or a 12-layer Llama whose every matrix takes K-quants")
    args = p.parse_args()
    from exactspec.models.llamacpp.numerics import load_self_tested

    env = {k: os.environ.get(k, "") for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    print(f"# {platform.machine()}, {os.cpu_count()} CPUs; env {env}", flush=True)
    folder = tempfile.mkdtemp(prefix="kquant-")
    source = write_gguf(args.shape, os.path.join(folder, f"{args.shape}-shape.gguf"), context=args.prompt + 512,
                        **SHAPED[args.shape])
    path = quantize(source, os.path.join(folder, f"{args.shape}-shape-{args.quant}.gguf"), args.quant)
    os.remove(source)
    no_repack = stock_repack_crashes(args.llama_bench, path)
    lm = load_self_tested(path, n_ctx=args.prompt + 256)
    print(f"# ours: {lm.identity}; stock llama-bench{' --repack 0' if no_repack else ''}", flush=True)
    ratios = {"prefill": [], "decode": []}
    for r in range(args.rounds):
        sides = {}
        for side in (("ours", "stock") if r % 2 == 0 else ("stock", "ours")):
            sides[side] = ours(lm, args.prompt) if side == "ours" else stock(args.llama_bench, path, args.prompt, no_repack)
        for i, what in enumerate(ratios):
            ratios[what].append(sides["ours"][i] / sides["stock"][i])
        print(json.dumps({"round": r, **{f"{s}_{w}_tok_s": round(v[i], 1) for s, v in sides.items()
                                         for i, w in enumerate(ratios)}}), flush=True)
    for what, xs in ratios.items():
        print(f"{what}: ours / stock median {statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}] "
              f"over {args.rounds} rounds ({args.quant}, prompt {args.prompt} tokens)", flush=True)


if __name__ == "__main__":
    main()
