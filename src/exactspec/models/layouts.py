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

That settles speculative == plain (greedy identity). The same text for the same request also needs a
row's logits not to depend on where its prompt's KV came from and what shares its forward, which the
serving loop varies: `identity_diffs` (version 4) scores a row's next tokens one at a time ALONE, then
  - `rows_joined`:  beside a longer, different prompt, both prefilled alone and joined (append_rows: the
                    prefix-cache / continuous-batching path), the other row fed a wider block (right-padded,
                    as the loop pads);
  - `rows_prefilled`: the two prompts prefilled together, right-padded (the loop's `start`);
  - `prefix`:       after a prefix-cache restore of half its prompt and a prefill of the rest;
  - `generated`:    an agent step: the KV of prompt + tokens that decode steps wrote restored, new
                    tokens prefilled, against a fresh prefill of all of it;
bit for bit, on a blocks qualifier. A qualifier that passes all of them is preferred to a faster one
that does not (bit-equality of the same request's text is promised there, `identity.reproducible`).
If `generated` alone fails, the engine keeps only prompts' prefilled KV in the prefix cache
(`cache_generated_kv`, as on llama.cpp) and that scope holds. If no qualifier passes, the fastest
qualifier stays (speculative == plain is still bit-exact), and the same request's text across batching
and prefix-cache hits rests on tolerance: `Choice.reproducible` and the words say which check failed.
The batch-invariant layouts prefill in the mode too (fast_llama.py): every token's KV comes from the
same fixed-shape matmuls whether prefilled alone, padded beside another prompt, after a restore or by a
decode step. So these scopes rest on the same fixed-shape kernels that blocks vs steps rests on. (While
the prefill ran outside the mode they failed on an AMD EPYC with AVX-512 BF16: up to 0.5 in bf16 logits,
3e-5 in fp32.)
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
from ..cachedir import cache_dir, file_identity, machine_key, measured_once, say_if_provisional, write_atomic
from .fast_llama import ATTN_BLOCK, FastLlamaLM

VERSION = 4  # bump when the test, the candidates or their forward change: old cache entries are then ignored
# (4: the invariant layouts prefill in the mode)
STRETCH = 33  # tokens compared: auto γ's widest verification (MAX_AUTO_GAMMA + 1)
BLOCKS = (5, 8, 3, 17)  # block sizes that tile the stretch: partial and whole 8-row chunks, the boundary
START = ATTN_BLOCK - 4  # the stretch starts 4 tokens before the first key-block boundary
SPEED_MARGIN = 0.05  # candidates within this share of the fastest T(1) are ranked by T(8)
PROMPT, OTHER, STEPS, EXTRA = 40, 150, 6, 6  # identity self-test: a row's prompt, the longer one beside it
# (past a key block and a prefill span: its row's steps attend over one block more than ours), the tokens
# scored one at a time after it, and an agent step's new tokens after prompt + STEPS
IDENTITY_SCOPES = ("rows_joined", "rows_prefilled", "prefix", "generated")


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
    identity: dict[str, float] | None = None  # `identity_diffs` on a qualifier (None: not tested)

    @property
    def reproducible(self) -> bool:
        """Every identity scope bit-equal, allowing `generated` (the engine then keeps prompts' KV only)."""
        return self.identity is not None and all(v == 0.0 for k, v in self.identity.items() if k != "generated")


@dataclass
class Choice:
    layout: str
    exact: bool  # True: greedy identity is bit-exact by the self-test; False: by tolerance
    reason: str
    trials: list[Trial] = field(default_factory=list)
    cached: bool = False
    reproducible: bool = False  # True: the same row's logits alone == batched == after a prefix-cache hit, bit for bit
    generated_kv: bool = True  # False: KV written by decode steps differs from a prefill's; keep prompts' KV only

    def trial(self) -> Trial | None:
        return next((t for t in self.trials if t.layout == self.layout), None)

    def identity_words(self) -> str:
        """What the same request's text rests on across batching and prefix-cache hits, in words."""
        trial = self.trial()
        if trial is None or trial.identity is None:
            return "alone vs batched vs after a prefix-cache hit: not self-tested"
        if self.reproducible:
            kept = "" if self.generated_kv else \
                " (the prefix cache keeps prompts' KV only: decode steps' KV differs from a prefill's)"
            return f"alone == batched == after a prefix-cache hit: bit-exact (self-test){kept}"
        failed = ", ".join(f"{k} {v:.3g}" for k, v in trial.identity.items() if v != 0.0)
        return f"alone vs batched vs after a prefix-cache hit: by tolerance (differ here: {failed})"

    def describe(self) -> str:
        how = "bit-exact greedy identity (self-test)" if self.exact else "greedy identity by tolerance (no layout passed the self-test)"
        return f"{self.layout}: {how}; {self.identity_words()}; {self.reason}{' (cached)' if self.cached else ''}"


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
    One model per dtype: the mode is a switch, and a timing does not depend on the bits of the KV the
    shared prefill wrote. Not yet qualified: bit_equal is None."""
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


def identity_diffs(lm: FastLlamaLM) -> dict[str, float]:
    """Max |logits| difference, per scope (IDENTITY_SCOPES, module doc), between a row's next STEPS
    tokens scored one at a time ALONE after a prefill of its prompt and the same tokens scored in that
    scope (0.0: bit-equal; a scope stops at its first difference). Tokens are forced (random, fixed
    seed), so equal logits mean equal greedy choices on any text. The adapter is reset."""
    gen = torch.Generator().manual_seed(4)
    other = max(2, min(OTHER, lm.max_length - 2 * STEPS - EXTRA - 2))
    plen = max(2, min(PROMPT, other // 2))
    ids = lambda n: torch.randint(0, lm.vocab_size, (n,), generator=gen).tolist()  # noqa: E731
    prompt, longer, feed, extra, wide = ids(plen), ids(other), ids(STEPS), ids(EXTRA), ids(STEPS + 3)
    diff = lambda a, b: float((a - b).abs().max())  # noqa: E731

    def steps(alone: torch.Tensor | None = None, row: int = 0, beside: list[int] | None = None):
        """feed one token at a time in row `row` -> its logits [STEPS, V], or, given `alone`, the max
        difference to it (stopping at the first one). With `beside`, the other row of two gets a 3-token
        block each time (ours right-padded with zeros, as the loop pads) and keeps one, as if it
        accepted it."""
        out, worst = [], 0.0
        for i, t in enumerate(feed):
            if beside is None:
                logits = lm.forward(torch.tensor([[t]]))[0, 0]
            else:
                kept = lm.lengths + 1
                block = torch.tensor([[t, 0, 0], beside[i : i + 3]])
                logits = lm.forward_rows(block if row == 0 else block.flip(0))[row, 0]
                lm.truncate_rows(kept)
            if alone is None:
                out.append(logits)
            elif (worst := max(worst, diff(logits, alone[i]))) > 0.0:
                break
        return torch.stack(out) if alone is None else worst

    lm.reset(1)
    lm.prefill(torch.tensor([prompt]))
    alone = steps()  # the cache now holds prompt + feed, written by decode steps
    decoded, _ = lm.snapshot_prefix(plen + STEPS)  # an agent step: the decoded KV from the prefix cache,
    lm.restore_prefix(decoded, plen + STEPS)
    lm.prefill(torch.tensor([extra]))  # its new tokens prefilled after it ...
    after = lm.forward(torch.tensor([[feed[0]]]))[0, 0]
    out = {}
    lm.reset(0)  # rows_joined: each prompt prefilled alone, then batched (ours second: another slot)
    lm.append_rows(longer + [0])
    lm.append_rows(prompt + [0])
    out["rows_joined"] = steps(alone, 1, wide)
    lm.reset(2)  # rows_prefilled: both prompts in one right-padded prefill
    lm.prefill(torch.tensor([prompt + [0] * (other - plen), longer]))
    lm.truncate_rows(torch.tensor([plen, other]))
    out["rows_prefilled"] = steps(alone, 0, wide)
    half = plen // 2  # prefix: half the prompt restored from a snapshot, the rest prefilled
    lm.reset(1)
    lm.prefill(torch.tensor([prompt]))
    state, _ = lm.snapshot_prefix(half)
    lm.restore_prefix(state, half)
    lm.prefill(torch.tensor([prompt[half:]]))
    out["prefix"] = steps(alone)
    lm.reset(1)  # generated: ... against a fresh prefill of prompt + feed + extra
    lm.prefill(torch.tensor([prompt + feed + extra]))
    out["generated"] = diff(lm.forward(torch.tensor([[feed[0]]]))[0, 0], after)
    lm.reset()
    return out


def check_identity(module: torch.nn.Module, trial: Trial) -> None:
    """Set trial.identity: `identity_diffs` on the trial's layout."""
    layout = layout_named(trial.layout)
    lm = FastLlamaLM(module, set(), batch_invariant=layout.batch_invariant, dtype=layout.dtype)
    trial.identity = identity_diffs(lm)


def self_test(module: torch.nn.Module) -> Choice:
    """Time every layout, then qualify them fastest first until `pick`'s answer is settled: the first
    that passes blocks vs steps AND the identity scopes, and any other within SPEED_MARGIN of its T(1)
    (T(8) breaks that tie). A qualifier that fails an identity scope does not settle it: slower layouts
    are tried on until one passes all (preferred) or none is left. Layouts that could not win are left
    untested (bit_equal None)."""
    trials = time_layouts(module)
    best = None  # T(1) of the fastest layout that passed everything
    for trial in sorted(trials, key=lambda t: t.t1_ms):
        if best is not None and trial.t1_ms > best * (1 + SPEED_MARGIN):
            break
        qualify(module, trial)
        if trial.bit_equal:
            check_identity(module, trial)
            if trial.reproducible and best is None:
                best = trial.t1_ms
    return pick(trials)


def pick(trials: list[Trial]) -> Choice:
    """The fastest qualifying layout (T(1), then T(8) within SPEED_MARGIN) among those that also pass the
    identity scopes, else among all qualifiers (`reproducible` False), else the float32 fallback."""
    passed = [t for t in trials if t.bit_equal]
    if not passed:
        return Choice(FALLBACK.name, False, "no candidate scored blocks bit-equal to single tokens", trials)
    pool = [t for t in passed if t.reproducible] or passed
    best_t1 = min(t.t1_ms for t in pool)
    near = [t for t in pool if t.t1_ms <= best_t1 * (1 + SPEED_MARGIN)]
    best = min(near, key=lambda t: t.t8_ms)
    others = ", ".join(f"{t.layout} {t.t1_ms:g}/{t.t8_ms:g} ms" for t in passed if t is not best)
    # decode steps' KV kept in the prefix cache unless dropping it is what makes the identity hold
    generated_kv = not best.reproducible or best.identity.get("generated", 0.0) == 0.0
    skipped = [t.layout for t in passed if not t.reproducible and t.t1_ms < best.t1_ms and best.reproducible]
    return Choice(best.layout, True, f"T(1)/T(8) {best.t1_ms:g}/{best.t8_ms:g} ms"
                  + (f" (also bit-equal: {others})" if others else "")
                  + (f"; faster {', '.join(skipped)} not used: its rows differ batched or after a prefix-cache hit"
                     if skipped else ""), trials, reproducible=best.reproducible, generated_kv=generated_kv)


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
    choice = measured_once(path, read, measure, lambda c: write_atomic(path, json.dumps(asdict(c), indent=1)),
                           timed=torch.get_num_threads())
    say_if_provisional(path, "the dtype choice")
    return choice


def _cached_choice(path) -> Choice | None:
    if path.exists():
        try:
            saved = json.loads(path.read_text())
            choice = Choice(**{**saved, "trials": [Trial(**t) for t in saved["trials"]], "cached": True})
            layout_named(choice.layout)
            return choice
        except (ValueError, TypeError, KeyError, StopIteration):
            pass  # an unreadable entry is re-measured
    return None
