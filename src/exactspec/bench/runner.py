"""Side-by-side benchmark in ONE process: our plain decoding (the baseline of every ratio), our
speculative decoding per drafter and γ, and Hugging Face `generate` anchors. Runs are interleaved
(every method on a prompt before the next prompt, the method order rotating per repetition) and each
ratio is taken within a repetition, then the median over repetitions: the machine is noisy.

At T = 0 every method stops at the same EOS (greedy identity). At T > 0 each method samples its own
continuation, so runs are fixed-length there (EOS does not stop them): with EOS stopping the lengths
differ at random while the prompt's prefill, the same for all, is spread over them, and on long
grounded prompts that noise (±20%) swamped the methods' speeds. Constrained cases stop at EOS at every
temperature: the schema ends them (after it, only EOS is allowed).

Constrained workloads (`json`: each prompt has a JSON schema) run every method that can honour a
constraint under it: our plain constrained decoding is the baseline there, `exactspec-plain-unconstrained`
(the same prompts, no grammar) shows what the constraint costs, and drafter `none` is speculation on
grammar-forced tokens alone. Rows add the share of emitted tokens the grammar forced and the share of
outputs that parse and follow their schema. Anchors without a grammar engine (HF generate) are skipped there."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..engine import Engine
from ..models.light_llama import hf_module
from ..speculative.params import POINT_MASS_DRAFTS
from ..speculative.sampling import SamplingParams
from ..stats import Stats, total
from .methods import Method, exactspec_method, fresh_store
from .workloads import CONSTRAINED, load_cases, load_workload, schema_valid

def hf_method(engine: Engine, method: str, **generate_kwargs) -> Method:
    module = hf_module(engine.target.module)  # a converted GGUF's lean module -> transformers' over its weights
    eos = sorted(engine.target.eos_token_ids)
    # generate returns prompt + new tokens; an encoder-decoder's, the decoder's start + new tokens
    start = len(engine.target.decoder_prompt) if engine.is_encoder_decoder else None

    def run(prompt_ids, params, max_new_tokens, seed, response_format=None):
        torch.manual_seed(seed)
        kwargs = dict(max_new_tokens=max_new_tokens, eos_token_id=eos if params.greedy else None,
                      pad_token_id=eos[0] if eos else 0,
                      do_sample=not params.greedy, top_k=0 if params.greedy else params.top_k, **generate_kwargs)
        if not params.greedy:
            kwargs.update(temperature=params.temperature, top_p=params.top_p, min_p=params.min_p or None)
        ids = torch.tensor([prompt_ids])
        t = time.perf_counter()
        with torch.inference_mode():
            out = module.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
        return out[0, len(prompt_ids) if start is None else start:].tolist(), time.perf_counter() - t, None

    gamma = generate_kwargs.get("prompt_lookup_num_tokens")
    drafter = {"hf-prompt-lookup": "prompt-lookup", "hf-assisted": "model"}.get(method)
    return Method(method, drafter, gamma, run)


def build_methods(engine: Engine, drafters: list[str], gammas: list[int], auto: bool, hf: bool,
                  hf_draft_module=None, backend: str = "torch", constrained: bool = False,
                  verifications: tuple[str, ...] = ("token",)) -> list[Method]:
    """Our plain decoding first (every ratio's baseline), then our speculative rows, then the anchors
    a user would pick instead: HF generate on the torch backend, llama-cpp-python's on llama.cpp.
    With `constrained` workloads among the run's: also our unconstrained plain decoding and
    speculation on grammar-forced tokens alone (drafter `none`), for those workloads. Each speculative
    row once per rule in `verifications` ("token", "block"), side by side per γ; a point-mass drafter
    (prompt lookup, suffix) is verified by the token rule under either, so it gets its token row only."""
    methods = [exactspec_method(engine, None, 0)]
    if constrained:
        methods.append(exactspec_method(engine, None, 0, constrained=False))
        for m in [exactspec_method(engine, "none", g) for g in gammas] + ([exactspec_method(engine, "none", "auto")] if auto else []):
            m.only_constrained = True
            methods.append(m)
    for drafter in drafters:
        rules = dict.fromkeys("token" if drafter in POINT_MASS_DRAFTS else v for v in verifications)
        methods += [exactspec_method(engine, drafter, g, verification=v)
                    for g in [*gammas, *(["auto"] if auto else [])] for v in rules]
    if hf and backend == "llama.cpp":
        from .llamacpp import llamacpp_methods

        methods += llamacpp_methods(engine)
    elif hf:
        methods += [hf_method(engine, "hf-plain"), hf_method(engine, "hf-prompt-lookup", prompt_lookup_num_tokens=10)]
        if hf_draft_module is not None:
            methods.append(hf_method(engine, "hf-assisted", assistant_model=hf_draft_module))
    return methods


def run_bench(engine: Engine, methods: list[Method], workloads: list[str], temperatures: list[float],
              prompts_per_workload: int, reps: int, max_new_tokens: int | None, progress=None,
              default_max_new_tokens: int = 96) -> list[dict]:
    """-> rows in the JSON shape documented in docs/benchmarks.md (one per workload x temperature x method).
    `max_new_tokens` None: each case's own budget (json), else `default_max_new_tokens`."""
    cost = {m.drafter: engine.cost_model(m.drafter) for m in methods if m.method == "exactspec-spec"}
    rows = []
    for workload in workloads:
        cases = load_cases(workload)[:prompts_per_workload]
        constrained = any(c.response_format for c in cases)
        chosen = methods_for(methods, constrained)
        prompt_ids = [engine.encode(c.prompt) for c in cases]
        if constrained:  # the grammar engine's tokenizer is built once per engine: not inside a timing
            engine.grammar_tokenizer()
        for temperature in temperatures:
            params = SamplingParams(temperature=temperature)
            per_rep: list[list[Run]] = []
            for rep in range(reps):
                order = chosen[rep % len(chosen):] + chosen[: rep % len(chosen)]
                results = {id(m): [] for m in chosen}
                for i, (ids, case) in enumerate(zip(prompt_ids, cases)):
                    for m in order:
                        budget = max_new_tokens or case.max_new_tokens or default_max_new_tokens
                        out, seconds, stats = m.run(ids, params, budget, 1000 * rep + i, case.response_format)
                        valid = cut = None
                        if case.response_format and m.constrains:  # judged when complete, not cut at the budget
                            cut = len(out) >= budget and out[-1] not in engine.target.eos_token_ids
                            valid = None if cut else schema_valid(
                                engine.tokenizer.decode(out, skip_special_tokens=True), case.response_format)
                        results[id(m)].append(Run(len(out), seconds, stats, valid, cut))
                        if progress is not None:
                            progress.update(1)
                per_rep.append([_total(results[id(m)]) for m in chosen])
            rows += _rows(workload, temperature, chosen, per_rep, cost, constrained)
    return rows


def methods_for(methods: list[Method], constrained: bool) -> list[Method]:
    """The methods that run on a (constrained) workload: there, those that decode under its schemas
    and the rows made for it (unconstrained plain decoding, forced drafts only)."""
    if constrained:
        return [m for m in methods if m.constrains or m.only_constrained]
    return [m for m in methods if not m.only_constrained]


@dataclass
class Run:
    tokens: int
    seconds: float
    stats: Stats | None
    valid: float | None  # share of complete outputs that follow their schema (constrained workloads)
    cut: float | None = None  # share of constrained outputs cut at the token budget (not judged)


def _total(runs: list[Run]) -> Run:
    stats = None if runs[0].stats is None else total(r.stats for r in runs)
    valid = [r.valid for r in runs if r.valid is not None]
    cut = [r.cut for r in runs if r.cut is not None]
    return Run(sum(r.tokens for r in runs), sum(r.seconds for r in runs), stats,
               sum(valid) / len(valid) if valid else None, sum(cut) / len(cut) if cut else None)


ANCHORS = ("llamacpp-defaults", "hf-plain", "llamacpp-plain")  # "vs anchor plain": the first one run


def _rows(workload, temperature, methods, per_rep, cost, constrained=False) -> list[dict]:
    tps = [[r.tokens / r.seconds for r in rep] for rep in per_rep]  # [rep][method]
    anchor = next((i for name in ANCHORS for i, m in enumerate(methods) if m.method == name), None)
    rows = []
    for j, m in enumerate(methods):
        merged = None if per_rep[0][j].stats is None else total(rep[j].stats for rep in per_rep)
        valid = [rep[j].valid for rep in per_rep if rep[j].valid is not None]
        cut = [rep[j].cut for rep in per_rep if rep[j].cut is not None]
        predicted = None
        if m.method == "exactspec-spec" and isinstance(m.gamma, int) and merged.alpha is not None:
            predicted = cost[m.drafter].predicted_speedup(merged.alpha, m.gamma)
        elif m.method == "exactspec-plain":
            predicted = 1.0
        rows.append({
            "workload": workload, "temperature": temperature, "method": m.method, "drafter": m.drafter,
            "gamma": m.gamma, "verification": m.verification, "tokens_per_s": statistics.median(r[j] for r in tps),
            "speedup_vs_plain": statistics.median(r[j] / r[0] for r in tps),
            "speedup_vs_anchor_plain": statistics.median(r[j] / r[anchor] for r in tps) if anchor is not None else None,
            "acceptance_rate": merged.acceptance_rate if merged else None,
            "tokens_per_target_call": merged.tokens_per_target_call if merged else None,
            "predicted_speedup": predicted,
            "accepted_run_lengths": merged.run_lengths if merged else None,  # [n]: iterations accepting n drafts
            "constrained": constrained and m.constrains,
            "forced_share": merged.forced_accepted / merged.emitted if merged and merged.emitted else None,
            "decode_ms_per_token": 1e3 * merged.decode_s / merged.emitted if merged and merged.emitted else None,
            "valid_share": statistics.mean(valid) if valid else None,  # of the outputs that completed
            "cut_share": statistics.mean(cut) if cut else None,  # outputs cut at the budget, not judged
        })
    return rows


def _f(x, fmt="{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def to_markdown(rows: list[dict]) -> str:
    """One table for free-text workloads, one for constrained ones (forced share, schema-valid share)."""
    free = [r for r in rows if r["workload"] not in CONSTRAINED]
    constrained = [r for r in rows if r["workload"] in CONSTRAINED]
    return "\n\n".join(t for t in (_free_table(free) if free else "",
                                     _constrained_table(constrained) if constrained else "") if t)


def _lead(rows: list[dict]) -> tuple[list[str], Callable[[dict], str]]:
    """The columns every table starts with (workload, T, method, drafter, γ, and the verifier's rule when
    a row verified by block: a run with --verification token,block) and a row's cells for them."""
    rules = any(r["verification"] == "block" for r in rows)

    def cells(r: dict) -> str:
        return (f"| {r['workload']} | {r['temperature']:g} | {r['method']} | {r['drafter'] or '–'} | "
                f"{'–' if r['gamma'] is None else r['gamma']} | " + (f"{r['verification'] or '–'} | " if rules else ""))

    return ["workload", "T", "method", "drafter", "γ"] + (["verification"] if rules else []), cells


def _header(columns: list[str]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def _constrained_table(rows: list[dict]) -> str:
    f, (lead, cells) = _f, _lead(rows)
    lines = _header(lead + ["tokens/s", "vs our plain constrained", "vs anchor plain", "tokens/call", "forced share",
                            "decode ms/token", "schema-valid"])
    for r in rows:
        lines.append(f"{cells(r)}{f(r['tokens_per_s'], '{:.1f}')} | "
                     f"{f(r['speedup_vs_plain'], '{:.2f}×')} | {f(r['speedup_vs_anchor_plain'], '{:.2f}×')} | "
                     f"{f(r['tokens_per_target_call'])} | {f(r['forced_share'])} | "
                     f"{f(r['decode_ms_per_token'], '{:.1f}')} | {f(r['valid_share'], '{:.0%}')} |")
    return "\n".join(lines)


def _free_table(rows: list[dict]) -> str:
    f, (lead, cells) = _f, _lead(rows)
    lines = _header(lead + ["tokens/s", "vs our plain", "vs anchor plain", "acceptance", "tokens/call", "predicted",
                            "accepted runs (≥8 / ≥16)"])
    for r in rows:
        lines.append(f"{cells(r)}{f(r['tokens_per_s'], '{:.1f}')} | "
                     f"{f(r['speedup_vs_plain'], '{:.2f}×')} | {f(r['speedup_vs_anchor_plain'], '{:.2f}×')} | {f(r['acceptance_rate'])} | "
                     f"{f(r['tokens_per_target_call'])} | {f(r['predicted_speedup'])} | {_long_runs(r['accepted_run_lengths'])} |")
    return "\n".join(lines)


def _long_runs(runs: list[int] | None) -> str:
    """Share of speculative iterations that accepted at least 8 / 16 drafts."""
    if not runs or not sum(runs):
        return "–"
    return f"{sum(runs[8:]) / sum(runs):.0%} / {sum(runs[16:]) / sum(runs):.0%}"


def plot(rows: list[dict], path: str) -> None:
    """Measured and predicted speed-up vs γ, per drafter (and verifier's rule), one panel per workload x
    temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["workload"], r["temperature"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (workload, temperature) in zip(axes[0], panels):
        spec = [r for r in rows if (r["workload"], r["temperature"]) == (workload, temperature)
                and r["method"] == "exactspec-spec" and isinstance(r["gamma"], int)]
        for drafter, rule in sorted({(r["drafter"], r.get("verification")) for r in spec}):  # agent rows: no rule
            pts = sorted((r["gamma"], r["speedup_vs_plain"], r["predicted_speedup"]) for r in spec
                         if (r["drafter"], r.get("verification")) == (drafter, rule))
            name = drafter + (" (block)" if rule == "block" else "")
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{name} measured")
            ax.plot([p[0] for p in pts], [p[2] for p in pts], "x--", color=line.get_color(), label=f"{name} predicted")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(title=f"{workload}, T={temperature:g}", xlabel="γ", ylabel="speed-up vs plain")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def run_batch_bench(engine: Engine, batches: list[int], workload: str, temperature: float, drafter: str,
                    gamma: int | str, max_new_tokens: int, reps: int, progress=None) -> list[dict]:
    """Throughput of B rows (B different prompts of the workload, cycled): batched speculative,
    batched plain, and the same B rows one after another, speculative and plain; interleaved.
    `progress`: a tqdm bar, sized here: one unit a method's run of a batch size."""
    prompts = load_workload(workload)
    kwargs = dict(max_new_tokens=max_new_tokens, temperature=temperature, draft=drafter, seed=0)
    methods = {
        "batched-spec": lambda ps: engine.generate_batch(ps, gamma=gamma, **kwargs),
        "batched-plain": lambda ps: engine.generate_batch(ps, gamma=0, **kwargs),
        "sequential-spec": lambda ps: _one_by_one(engine, ps, gamma, kwargs),
        "sequential-plain": lambda ps: _one_by_one(engine, ps, 0, kwargs),
    }
    if progress is not None:
        progress.reset(total=len(methods) * len(batches) * reps)
    rows = []
    for batch in batches:
        chosen = [prompts[i % len(prompts)] for i in range(batch)]
        tps: dict[str, list[float]] = {m: [] for m in methods}
        for _ in range(reps):
            for name, fn in methods.items():
                fresh_store(engine)
                t = time.perf_counter()
                results, _ = fn(chosen)
                tps[name].append(sum(len(r.token_ids) for r in results) / (time.perf_counter() - t))
                if progress is not None:
                    progress.update(1)
        for name in methods:
            rows.append({"batch": batch, "method": name, "drafter": drafter if "spec" in name else None,
                         "gamma": gamma if "spec" in name else 0, "tokens_per_s": statistics.median(tps[name]),
                         "speedup_vs_sequential_plain": statistics.median(
                             a / b for a, b in zip(tps[name], tps["sequential-plain"]))})
    return rows


def _one_by_one(engine: Engine, prompts: list[str], gamma, kwargs) -> tuple[list, None]:
    return [engine.generate(p, gamma=gamma, **kwargs) for p in prompts], None


def batch_table(rows: list[dict]) -> str:
    lines = ["| batch | method | drafter | γ | tokens/s | vs sequential plain |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['method']} | {r['drafter'] or '–'} | {r['gamma']} | "
                     f"{r['tokens_per_s']:.1f} | {r['speedup_vs_sequential_plain']:.2f}× |")
    return "\n".join(lines)
