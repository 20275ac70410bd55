"""What batch-invariant mode costs: the 300-token prefill, one decode step and 4 / 8-token blocks of the
embedded model's lean forward at that context, fp32 and bf16, with and without `batch_invariant`,
interleaved in one process (medians of 3 rounds, milliseconds). Usage: .venv/bin/python scripts/bench_invariance.py"""

import copy
import statistics
import time

import torch

from exactspec.device import describe
from exactspec.embedded import embedded_model_path
from exactspec.models.fast_llama import FastLlamaLM
from exactspec.models.torch_hf import load_hf_model

torch.set_num_threads(2)
base = load_hf_model(embedded_model_path(), torch.float32)
models = {}
for dtype in (torch.float32, torch.bfloat16):
    module = copy.deepcopy(base).to(dtype)
    for invariant in (True, False):
        models[(str(dtype)[6:], invariant)] = FastLlamaLM(module, set(), batch_invariant=invariant)
context = torch.randint(0, base.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
times: dict[tuple, list[float]] = {}
for _ in range(3):
    for key, lm in models.items():
        lm.reset()
        t = time.perf_counter()
        lm.prefill(context)
        times.setdefault(key + ("prefill",), []).append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        for _ in range(20):
            lm.forward(torch.tensor([[5]]))
        times.setdefault(key + ("k=1",), []).append((time.perf_counter() - t) / 20 * 1000)
        for k in (4, 8):
            lm.truncate(300)
            t = time.perf_counter()
            lm.forward(torch.randint(0, lm.vocab_size, (1, k)))
            times.setdefault(key + (f"k={k}",), []).append((time.perf_counter() - t) * 1000)
print(describe(torch.device("cpu"), torch.bfloat16))
for (dtype, invariant, what), ts in times.items():
    print(f"{dtype:9s} invariant={invariant!s:5s} {what}: {statistics.median(ts):6.1f} ms")
