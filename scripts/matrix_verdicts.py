"""The llama.cpp self-test's verdict for each tiny random GGUF of the model matrix (tests/models/
test_model_matrix.py): which architectures x quant types are bit-exact on this machine and build, and why
the others are not. Each file is written and quantized at run time; verdicts go to a fresh cache.

    env -u OMP_WAIT_POLICY .venv/bin/python scripts/matrix_verdicts.py [--archs llama,gemma3] [--quants Q4_K_M,Q6_K] [--no-repack]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from tests.helpers.gguf_models import ARCHS, QUANTS, quantize, write_gguf  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--archs", default=",".join(ARCHS))
    p.add_argument("--quants", default=",".join(QUANTS))
    p.add_argument("--no-repack", action="store_true", help="weights not repacked (the path of a CPU without AMX)")
    args = p.parse_args()
    os.environ["EXACTSPEC_CACHE"] = tempfile.mkdtemp()  # a verdict of its own, not a user's cached one
    from exactspec.engine import llamacpp_engine

    with tempfile.TemporaryDirectory() as folder:
        for arch in args.archs.split(","):
            source = write_gguf(arch, os.path.join(folder, f"{arch}.gguf"))
            for quant in args.quants.split(","):
                path = quantize(source, os.path.join(folder, f"{arch}-{quant}.gguf"), quant)
                engine = llamacpp_engine(path, n_ctx=256, repack=False if args.no_repack else None)
                print(f"{arch} {quant}: {engine.runtime()['greedy_identity']}", flush=True)


if __name__ == "__main__":
    main()
