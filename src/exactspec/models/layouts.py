"""`dtype auto` on a CPU: the lean forward's layout chosen by a self-test on the loaded model, not by flags.

Greedy identity by construction needs a token's logits to be the same bits whether it is scored alone
(plain decoding) or inside a k-token verification block. Whether a layout gives that depends on the
CPU's matmul kernels (an AMD EPYC with AVX-512 BF16 and an Intel Xeon with AMX disagreed), and which
layout is faster depends on it too (bf16 beat fp32 on the EPYC and lost on the Xeon). So each
candidate is tried on the model itself:

  1. time: T(1) (a decode step at a ~510-token context) and T(8) (an 8-token verification there);
  2. qualify, fastest first: logits of a 33-token stretch (auto γ's widest verification) scored in
     blocks of 33, 5, 8, 3 and 17 tokens, crossing the invariant attention's ATTN_BLOCK-key block boundary and
     its 8-row chunks, must equal scoring it one token at a time, bit for bit;
  3. the fastest qualifier by T(1) wins; qualifiers within 5% of it are ranked by T(8). Layouts slower
     than a qualifier by more than that are not qualified at all (they could not win).
If none qualifies: float32, and greedy identity rests on tolerance (~5e-5 in the logits), said in words.
The decision and its figures are cached per CPU model + flags + torch version + threads + model file
(cachedir.py), so a warm start costs a file read; `exactspec tune --dtype-test` re-runs it.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from .. import progress
from ..cachedir import cache_dir, file_identity, machine_key, measured_once, write_atomic
from .fast_llama import ATTN_BLOCK, FastLlamaLM

VERSION = 2  # bump when the test or the candidates change: old cache entries are then ignored
STRETCH = 33  # tokens compared: auto γ's widest verification (MAX_AUTO_GAMMA + 1)
BLOCKS = (5, 8, 3, 17)  # block sizes that tile the stretch: partial and whole 8-row chunks, the boundary
START = ATTN_BLOCK - 4  # the stretch starts 4 tokens before the first key-block boundary
SPEED_MARGIN = 0.05  # candidates within this share of the fastest T(1) are ranked by T(8)


@dataclass(frozen=True)
class Layout:
    """How the lean forward computes: weights/activations dtype, and whether in batch-invariant mode."""
    dtype: torch.dtype
    batch_invariant: bool

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.") + ("-invariant" if self.batch_invariant else "")


CANDIDATES = (Layout(torch.bfloat16, True), Layout(torch.float32, True), Layout(torch.float32, False),
              Layout(torch.bfloat16, False))
FALLBACK = Layout(torch.float32, False)


@dataclass
class Trial:
    layout: str
    bit_equal: bool | None  # None: not tested (slower than a layout that passed)
    max_diff: float  # largest |block - one-at-a-time| logit difference seen before the test stopped
    t1_ms: float | None = None  # median decode step at the test's context
    t8_ms: float | None = None  # median 8-token block


@dataclass
class Choice:
    layout: str
    exact: bool  # True: greedy identity is bit-exact by the self-test; False: by tolerance
    reason: str
    trials: list[Trial] = field(default_factory=list)
    cached: bool = False

    def describe(self) -> str:
        how = "bit-exact greedy identity (self-test)" if self.exact else "greedy identity by tolerance (no layout passed the self-test)"
        return f"{self.layout}: {how}; {self.reason}{' (cached)' if self.cached else ''}"


def layout_named(name: str) -> Layout:
    return next(c for c in CANDIDATES if c.name == name)


def compare_blocks(lm: FastLlamaLM, ids: torch.Tensor, start: int, blocks: tuple[int, ...],
                   stop_early: bool = True) -> float:
    """Max |logits| difference between scoring ids[start:] one token at a time and in blocks: the whole
    stretch as one block, then tiled by `blocks`. 0.0 means bit-equal. Stops at the first difference
    when `stop_early`."""
    n = ids.shape[1] - start
    lm.reset()
    lm.prefill(ids[:, :start])
    whole = lm.forward(ids[:, start:])[0]  # [n, V]: the stretch as one block
    lm.truncate(start)
    single, worst = [], 0.0  # [V] logits per position, scored one at a time
    for i in range(n):
        single.append(lm.forward(ids[:, start + i : start + i + 1])[0, 0])
        worst = max(worst, float((single[-1] - whole[i]).abs().max()))
        if worst and stop_early:
            return worst
    single = torch.stack(single)  # [n, V]
    for offset, k in [(sum(blocks[:j]), k) for j, k in enumerate(blocks)]:
        lm.truncate(start + offset)
        block = lm.forward(ids[:, start + offset : start + offset + k])[0]  # [k, V]
        worst = max(worst, float((block - single[offset : offset + k]).abs().max()))
        if worst and stop_early:
            break
    return worst


def tiles(n: int) -> tuple[int, ...]:
    """BLOCKS cut to cover exactly n tokens."""
    out, left = [], n
    for k in BLOCKS:
        if left > 0:
            out.append(min(k, left))
            left -= out[-1]
    return tuple(out)


def _stretch(lm: FastLlamaLM) -> tuple[torch.Tensor, int, int]:
    """-> (ids [1, start + stretch], start, stretch): a short-context model is tested over its whole reach."""
    stretch = min(STRETCH, lm.max_length // 2)
    start = min(START, lm.max_length - stretch - 1)
    ids = torch.randint(0, lm.vocab_size, (1, start + stretch), generator=torch.Generator().manual_seed(0))
    return ids, start, stretch


def time_layouts(module: torch.nn.Module, reps: int = 3) -> list[Trial]:
    """T(1) and T(8) of every candidate at the test's context, interleaved (each round times every
    candidate once, so a burst of load elsewhere hits them alike; medians after one warm-up round).
    One model per dtype: the mode is a switch, and the prefill never runs in the mode, so both modes
    share it. Not yet qualified: bit_equal is None."""
    models = {}
    for dtype in dict.fromkeys(c.dtype for c in CANDIDATES):
        lm = FastLlamaLM(module, set(), dtype=dtype)
        ids, start, stretch = _stretch(lm)
        lm.prefill(ids[:, :start])
        models[dtype] = (lm, ids, start, stretch)
    times = {(c, k): [] for c in CANDIDATES for k in (1, 8)}
    for _ in range(reps + 1):
        for (layout, k), runs in times.items():
            lm, ids, start, stretch = models[layout.dtype]
            lm.batch_invariant = layout.batch_invariant
            lm.truncate(start)
            began = time.perf_counter()
            lm.forward(ids[:, start : start + min(k, stretch)])
            runs.append(time.perf_counter() - began)
    ms = lambda runs: round(1000 * statistics.median(runs[1:]), 2)  # noqa: E731
    return [Trial(c.name, None, 0.0, ms(times[c, 1]), ms(times[c, 8])) for c in CANDIDATES]


def qualify(module: torch.nn.Module, trial: Trial) -> None:
    """Set trial.bit_equal / max_diff: blocks vs one token at a time across the stretch (see module doc)."""
    layout = layout_named(trial.layout)
    lm = FastLlamaLM(module, set(), batch_invariant=layout.batch_invariant, dtype=layout.dtype)
    ids, start, stretch = _stretch(lm)
    trial.max_diff = compare_blocks(lm, ids, start, tiles(stretch))
    trial.bit_equal = trial.max_diff == 0.0


def self_test(module: torch.nn.Module) -> Choice:
    """Time every layout, then qualify them fastest first until `pick`'s answer is settled: the first
    that passes, and any other within SPEED_MARGIN of its T(1) (T(8) breaks that tie). Slower layouts
    are left untested (bit_equal None): they could not win."""
    trials = time_layouts(module)
    best = None  # T(1) of the fastest layout that passed
    for trial in sorted(trials, key=lambda t: t.t1_ms):
        if best is not None and trial.t1_ms > best * (1 + SPEED_MARGIN):
            break
        qualify(module, trial)
        if trial.bit_equal and best is None:
            best = trial.t1_ms
    return pick(trials)


def pick(trials: list[Trial]) -> Choice:
    """The fastest qualifying layout (T(1), then T(8) within SPEED_MARGIN), else the float32 fallback."""
    passed = [t for t in trials if t.bit_equal]
    if not passed:
        return Choice(FALLBACK.name, False, "no candidate scored blocks bit-equal to single tokens", trials)
    best_t1 = min(t.t1_ms for t in passed)
    near = [t for t in passed if t.t1_ms <= best_t1 * (1 + SPEED_MARGIN)]
    best = min(near, key=lambda t: t.t8_ms)
    others = ", ".join(f"{t.layout} {t.t1_ms:g}/{t.t8_ms:g} ms" for t in passed if t is not best)
    return Choice(best.layout, True, f"T(1)/T(8) {best.t1_ms:g}/{best.t8_ms:g} ms"
                  + (f" (also bit-equal: {others})" if others else ""), trials)


def cache_key(model_path: str | None) -> str:
    """CPU model name + flags + torch version + threads + the model file's identity."""
    model = file_identity(model_path) if model_path else "unknown"
    return machine_key(VERSION, torch.__version__, torch.get_num_threads(), model)


def choose_layout(module: torch.nn.Module, model_path: str | None, refresh: bool = False) -> Choice:
    """The layout for `module` on this CPU: from the cache, or by running every candidate's self-test."""
    path = cache_dir("layouts") / f"{cache_key(model_path)}.json"
    def measure() -> Choice:
        progress.status("choosing the dtype: self-test of each layout on this CPU (once per machine and model)")
        with progress.timed("dtype self-test"):
            return self_test(module)

    read = (lambda: None) if refresh else (lambda: _cached_choice(path))
    return measured_once(path, read, measure, lambda choice: write_atomic(path, json.dumps(asdict(choice), indent=1)))


def _cached_choice(path) -> Choice | None:
    if path.exists():
        try:
            saved = json.loads(path.read_text())
            choice = Choice(**{**saved, "trials": [Trial(**t) for t in saved["trials"]]})
            choice.cached = True
            layout_named(choice.layout)
            return choice
        except (ValueError, TypeError, KeyError, StopIteration):
            pass  # an unreadable entry is re-measured
    return None
