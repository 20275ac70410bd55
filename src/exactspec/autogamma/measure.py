"""Timing the target and the drafters for auto γ: forwards on a warm cache, read by the clock. The
prices they start (`costs.py`) are then refined by the decode loop's own timed iterations."""

from __future__ import annotations

import json
import statistics
import time

import torch

from ..cachedir import cache_dir, machine_key, measured_once, say_if_provisional, write_atomic
from ..device import device_of, synchronize
from .costs import MAX_AUTO_GAMMA, TARGET_DEPTHS
from ..speculative.interfaces import CausalLM


REFINE_BOUND = 2.0  # a persisted refinement stays within this factor of the table as measured
MEASURED_K = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 33)  # T(k) is measured at these k, interpolated between
DEEP_K = (1, 2, 4, 8, 16, 33)  # the k measured at the deeper depths (fewer: they cost more)
DEEP_REPS = 3  # repetitions at the deeper depths
DEEP_PREFILL_S = 20.0  # at most this long prefilling the deeper depths (then the depth reached is the last)
DEEP_PREFILL_CHUNK = 256  # tokens per prefill forward on the way down
CHANGE_CAP = 0.25  # the most a change of pass shape is charged, as a share of T(1) (~0.1 measured: `_measure_at`)


def target_costs(target: CausalLM, max_k: int) -> tuple[list[int], list[list[float]]]:
    """The target's T(1..max_k) at the context depths of TARGET_DEPTHS (seconds on a CPU; `measure_target`
    at the first, `measure_deeper` at those the target's context holds) -> (the depths, T(k) at each),
    read back from the cache when its loader gave the adapter a `cost_key` (a model file, its settings)
    and it was measured on this machine with as many torch threads before: with auto γ the default,
    every CLI start would pay for it again. The decode loop refines T(k) from real iterations either way."""
    if target.cost_key is None:
        return measure_depths(target, max_k)
    path = costs_path(target, max_k)
    read = lambda: _read_costs(path, max_k)  # noqa: E731
    costs = measured_once(path, read, lambda: measure_depths(target, max_k),
                          lambda m: write_atomic(path, json.dumps({"depths": m[0], "target_s": m[1]})),
                          timed=torch.get_num_threads())
    say_if_provisional(path, "auto γ's T(k)")
    return costs


def costs_path(target: CausalLM, max_k: int):
    """The cache entry of a keyed target's T(k) on this machine, with as many torch threads."""
    return cache_dir("target-costs") / f"{machine_key(5, target.cost_key, max_k, TARGET_DEPTHS, torch.get_num_threads())}.json"


def _read_costs(path, max_k: int, field: str = "target_s") -> tuple[list[int], list[list[float]]] | None:
    """(depths, T(k) at each) of a cache entry (`field`: the table in use, or "measured_s", the table as
    first measured when real iterations have refined it since); None if absent or malformed."""
    try:
        entry = json.loads(path.read_text())
        depths, curves = entry["depths"], entry.get(field, entry["target_s"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None  # absent or unreadable: measured (again)
    ok = (isinstance(depths, list) and isinstance(curves, list) and len(depths) == len(curves) >= 1
          and all(isinstance(d, int) and d > 0 for d in depths) and depths == sorted(set(depths))
          and all(isinstance(c, list) and len(c) == max_k and all(isinstance(t, float) and t > 0 for t in c)
                  for c in curves))
    return (depths, curves) if ok else None


def save_refined(target: CausalLM, depths: list[int], curves: list[list[float]]) -> bool:
    """Write T(k) as real iterations refined it (`curves` at `depths`, K = len of each) back to a keyed
    target's cache entry, so that the next start begins from it: each value kept within REFINE_BOUND x
    (either way) of the table as measured, which the entry keeps beside it (a table refined on wrong
    evidence cannot drift far; a measurement taken on a busy machine heals). False: nothing written (an
    unkeyed target, or an entry of other depths)."""
    if target.cost_key is None:
        return False
    path, max_k = costs_path(target, len(curves[0])), len(curves[0])
    measured = _read_costs(path, max_k, "measured_s")
    if measured is None or measured[0] != depths:
        return False
    bounded = [[min(max(t, m / REFINE_BOUND), m * REFINE_BOUND) for t, m in zip(curve, held)]
               for curve, held in zip(curves, measured[1])]
    write_atomic(path, json.dumps({"depths": depths, "target_s": bounded, "measured_s": measured[1]}))
    return True


def measure_depths(target: CausalLM, max_k: int) -> tuple[list[int], list[list[float]]]:
    """T(1..max_k) at the base depth and the deeper ones the target's context holds (and its prefill
    reaches in `DEEP_PREFILL_S`)."""
    base = fitting_depth(target, max_k, TARGET_DEPTHS[0])
    curve = measure_target(target, max_k=max_k)
    depths, curves = measure_deeper(target, max_k, deeper_depths(target, max_k, base), base=base)
    return [base, *depths], [curve, *curves]


def measure_target(model: CausalLM, max_k: int = MAX_AUTO_GAMMA + 1, context: int = TARGET_DEPTHS[0],
                   reps: int = 4) -> list[float]:
    """Median seconds of a forward over k = 1..max_k new tokens on a warm cache of `context` tokens,
    measured at the k of MEASURED_K (and max_k) and interpolated linearly between them. The k values are
    interleaved across repetitions so machine noise spreads over all of them. A model whose context
    cannot hold `context` + max_k tokens is measured on a shorter warm cache (`fitting_depth`)."""
    context = fitting_depth(model, max_k, context)
    ks = sorted({k for k in MEASURED_K if k < max_k} | {max_k})
    gen = torch.Generator().manual_seed(0)
    model.reset()
    try:
        model.forward(torch.randint(0, model.vocab_size, (1, context), generator=gen))
        return _measure_at(model, context, ks, max_k, reps, gen)
    finally:
        model.reset()


def fitting_depth(model: CausalLM, max_k: int, depth: int) -> int:
    """`depth`, capped so that the model's context holds it and max_k more tokens."""
    return max(1, min(depth, model.max_length - max_k - 1))


def deeper_depths(model: CausalLM, max_k: int, base: int, depths: tuple[int, ...] = TARGET_DEPTHS) -> list[int]:
    """The depths of `depths` beyond `base` worth measuring on `model`: capped by its context, each at
    least twice the one before (closer ones would differ by noise)."""
    kept = [base]
    for depth in depths:
        depth = fitting_depth(model, max_k, depth)
        if depth >= 2 * kept[-1]:
            kept.append(depth)
    return kept[1:]


def measure_deeper(model: CausalLM, max_k: int, depths: list[int], reps: int = DEEP_REPS, base: int = 0,
                   budget_s: float = DEEP_PREFILL_S) -> tuple[list[int], list[list[float]]]:
    """T(1..max_k) at each of `depths` (ascending; `deeper_depths`), as `measure_target` but at DEEP_K
    only and `reps` times (they cost more) -> (the depths measured, T(k) at each). One cache serves all:
    it is prefilled to each depth in turn, in chunks; once the prefill has taken `budget_s` (a big model
    on a small CPU), the depth reached is the last one measured (if at least twice the one before)."""
    gen = torch.Generator().manual_seed(1)
    ks = sorted({k for k in DEEP_K if k < max_k} | {max_k})
    measured, curves, filled, spent = [], [], 0, 0.0
    model.reset()
    try:
        for depth in depths:
            while filled < depth and spent < budget_s:
                n = min(DEEP_PREFILL_CHUNK, depth - filled)
                t = time.perf_counter()
                model.forward(torch.randint(0, model.vocab_size, (1, n), generator=gen))
                synchronize(device_of(model))
                spent, filled = spent + time.perf_counter() - t, filled + n
            if filled < 2 * (measured[-1] if measured else base):
                break
            curves.append(_measure_at(model, filled, ks, max_k, reps, gen))
            measured.append(filled)
            if filled < depth:  # out of budget
                break
    finally:
        model.reset()
    return measured, curves


def _measure_at(model: CausalLM, context: int, ks: list[int], max_k: int, reps: int,
                gen: torch.Generator) -> list[float]:
    """T(1..max_k) on the model's warm cache of `context` tokens: medians at `ks`, linear between. Priced as
    decoding meets them: T(1) is a one-token step after one-token steps; a wider pass comes between
    one-token steps, so it is charged what changing shape costs it AND the step after it (llama.cpp builds
    a new graph for every new pass shape: ~0.5 ms per change, ~10% of a step, on a Zen 5 with the embedded
    model): each wider k is measured after another shape, and charged once more for the step after it."""
    times: dict[int, list[float]] = {k: [] for k in ks}
    steps: list[list[float]] = [[], []]  # one-token steps after the widest pass, after a one-token step

    def timed(k: int) -> float:
        """Seconds of one forward over k random tokens on the warm cache, which is then cut back."""
        ids = torch.randint(0, model.vocab_size, (1, k), generator=gen)
        t = time.perf_counter()
        model.forward(ids)
        synchronize(device_of(model))
        seconds = time.perf_counter() - t
        model.truncate(context)
        return seconds

    for rep in range(reps + 1):  # the first round warms up
        for k in ks:
            seconds = timed(k)
            if rep:
                times[k].append(seconds)
        for j in range(3):  # the first changes shape (after the widest k); the next two do not
            seconds = timed(1)
            if rep:
                steps[min(j, 1)].append(seconds)
    med = {k: statistics.median(ts) for k, ts in times.items()}
    one = min(med[1], statistics.median(steps[1]))
    # what a change of shape costs a pass: from the fastest of each kind (a step slowed by another process
    # is not a change of shape), and at most CHANGE_CAP of a step (a test suite's two workers measured
    # 20 ms beside a 12 ms step once, and auto γ then never drafted)
    change = min(max(min(steps[0]) - min(steps[1]), 0.0), CHANGE_CAP * one)
    out = []
    for k in range(1, max_k + 1):
        lo = max(j for j in ks if j <= k)
        hi = min(j for j in ks if j >= k)
        out.append(med[lo] if hi == lo else med[lo] + (med[hi] - med[lo]) * (k - lo) / (hi - lo))
    return [one, *(t + change for t in out[1:])]  # each wider k was measured after a change of shape


def measure_drafter(drafter, vocab_size: int, params, k: int = 4, context: int = 100, reps: int = 5) -> float:
    """Median seconds per proposed token of `drafter` on a context that repeats itself (so that
    prompt lookup finds matches, as on grounded prompts)."""
    gen = torch.Generator().manual_seed(0)
    half = torch.randint(0, vocab_size, (context // 2,), generator=gen).tolist()
    ctx = half + half
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        proposal = drafter.propose(ctx, k, params, gen)
        times.append((time.perf_counter() - t) / max(len(proposal), 1))
    return statistics.median(times)
