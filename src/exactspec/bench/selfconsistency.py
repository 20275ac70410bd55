"""The `selfconsistency` workload: n samples of one reasoning prompt at T = 0.7, decoded as ONE batch
(`Engine.generate_batch(prompt, n=8)`), as self-consistency voting asks for them. Throughput counts
every sample's tokens.

The samples of one prompt share most of their phrases, so with a store (drafters/suffix.py) each
sample drafts from its siblings' committed tokens. Point-mass drafts are verified with the plain
sampler's coupling (speculative/verify.py `verify_coupled`), so for a seed plain decoding and the suffix
drafter sample the SAME texts (checked here): they differ only in time. `auto` may pick the bigram
drafter, whose sampled drafts leave the law exact but not the texts, so its rows sample others.

Methods (interleaved per prompt, the order rotating per repetition): batched plain decoding (the
baseline), batched `--draft auto --gamma auto`, prompt lookup under auto γ, and the suffix drafter
(context + store) under auto γ. The store is emptied before every prompt, so what
a method gains comes from the siblings alone.
"""

from __future__ import annotations

import json
import statistics
import time
from importlib import resources

from ..engine import Engine
from ..progress import shrink
from ..stats import total
from .budget import fit_batches


def load_selfconsistency() -> dict:
    """{"n", "temperature", "max_new_tokens", "prompts"} from workloads/selfconsistency.json."""
    return json.loads(resources.files(__package__).joinpath("workloads", "selfconsistency.json").read_text())


METHODS = (  # (method, drafter, γ, store on)
    ("exactspec-plain", None, 0, False),
    ("exactspec-spec", "auto", "auto", True),
    ("exactspec-spec", "prompt-lookup", "auto", False),
    ("exactspec-spec", "suffix", "auto", True),
)


def run_selfconsistency_bench(engine: Engine, prompts: int | None = None, reps: int = 1,
                              max_new_tokens: int | None = None, store_mb: float = 64, progress=None,
                              budget_s: float | None = None) -> list[dict]:
    """-> one row per method: the bench's JSON row fields, with `n` and `store_mb`. `budget_s`: fewer
    prompts, then shorter samples, to fit it (bench/budget.py; `progress`, a tqdm bar of one unit a
    batch, loses the batches cut)."""
    work = load_selfconsistency()
    chosen, n, temperature = work["prompts"][:prompts], work["n"], work["temperature"]
    budget = max_new_tokens or work["max_new_tokens"]
    engine.cost_model("auto")  # measured before anything is timed
    cost = engine.cost_model("suffix")
    if budget_s is not None:
        asked = len(chosen)
        fitted, budget = fit_batches(budget_s, len(METHODS) * cost.seconds(1, n), asked, budget)
        chosen = chosen[:fitted]
        shrink(progress, len(METHODS) * reps * (asked - fitted))
    tps, stats, texts, kept = {m: [] for m in METHODS}, {m: [] for m in METHODS}, {}, engine.drafts.store
    for rep in range(reps):
        order = METHODS[rep % len(METHODS):] + METHODS[: rep % len(METHODS)]
        seconds = {m: 0.0 for m in METHODS}
        tokens = {m: 0 for m in METHODS}
        for i, prompt in enumerate(chosen):
            for m in order:
                _, drafter, gamma, store = m
                engine.drafts.set_store(store_mb if store else 0)
                t = time.perf_counter()
                results, batch = engine.generate_batch(prompt, n=n, max_new_tokens=budget, temperature=temperature,
                                                       seed=1000 * rep + 100 * i, gamma=gamma, draft=drafter or "none")
                seconds[m] += time.perf_counter() - t
                tokens[m] += sum(len(r.token_ids) for r in results)
                stats[m].append(batch)
                if drafter in (None, "suffix", "prompt-lookup"):  # point masses: plain decoding's texts
                    texts.setdefault((rep, i), [r.token_ids for r in results])
                    if texts[(rep, i)] != [r.token_ids for r in results]:
                        raise AssertionError(f"{m} sampled other texts than plain decoding from the same seeds")
                if progress is not None:
                    progress.update(1)
        for m in METHODS:
            tps[m].append(tokens[m] / seconds[m])
    engine.drafts.store = kept  # the engine's own, as it was
    base = METHODS[0]
    rows = []
    for m in METHODS:
        method, drafter, gamma, store = m
        merged = total(stats[m])
        rows.append({
            "workload": "selfconsistency", "temperature": temperature, "method": method, "drafter": drafter,
            "gamma": gamma, "tokens_per_s": statistics.median(tps[m]),
            "speedup_vs_plain": statistics.median(a / b for a, b in zip(tps[m], tps[base])),
            "speedup_vs_anchor_plain": None,
            "acceptance_rate": merged.acceptance_rate if gamma else None,
            "tokens_per_target_call": merged.tokens_per_target_call,
            "predicted_speedup": None, "n": n, "store_mb": store_mb if store else 0,
        })
    return rows


def selfconsistency_table(rows: list[dict]) -> str:
    lines = ["| method | drafter | γ | store MiB | tokens/s (all samples) | vs batched plain | tokens/call (rows) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['drafter'] or '–'} | {r['gamma']} | {r['store_mb']:g} | "
                     f"{r['tokens_per_s']:.1f} | {r['speedup_vs_plain']:.2f}× | {r['tokens_per_target_call']:.2f} |")
    return "\n".join(lines)
