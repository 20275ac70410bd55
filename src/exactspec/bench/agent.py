"""The `agent` workload: multi-turn transcripts replayed step by step, measuring per-step latency.

An agent re-sends the whole conversation every step (system prompt with tool schemas, the task, every
earlier tool output and answer) and waits for a short answer that often copies from that history
(a JSON tool call, a quote of the tool output, a one-line summary). Its wall-clock per step is the
prefill of the history plus the decoding of the answer. Each replay starts from an empty prefix cache;
step k's messages are the transcript's tool outputs so far and the method's OWN earlier answers (as an
agent would send them), so every exactspec row sees the same prompts at T = 0 (greedy identity).

Per step: latency (request to last token), time to first token, tokens generated, target calls, prompt
tokens whose KV came from a cache. Rows report medians (and p90) over every step of every transcript;
repetitions interleave the methods, rotating their order. The transcripts are the data file
`workloads/agent.json`.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources

import torch

from ..engine import Engine
from ..generation import GenerationResult
from ..models.light_llama import hf_module
from ..progress import shrink
from ..speculative.sampling import SamplingParams
from ..stats import Stats, total
from .budget import fit_sessions

TOOL_PREFIX = "Tool output:\n"


@dataclass
class Step:
    latency_s: float
    ttft_s: float
    tokens: int
    prompt_tokens: int
    cached_tokens: int  # prompt tokens not prefilled (reused from a cache)
    stats: Stats | None  # exactspec rows only
    text: str


# (messages) -> Step; a fresh replay per transcript: `begin()` empties the method's caches
StepFn = Callable[[list[dict], SamplingParams, int, int], Step]


@dataclass
class AgentMethod:
    method: str
    drafter: str | None
    gamma: int | str | None
    begin: Callable[[], None]
    step: StepFn
    store_mb: float = 0  # the store of earlier outputs it drafts from (drafters/suffix.py)


def load_agent_workload() -> dict:
    """{"system": str, "max_new_tokens": int, "transcripts": [{"task": str, "steps": [tool output, ...]}]}."""
    return json.loads(resources.files(__package__).joinpath("workloads", "agent.json").read_text())


def load_agent_repeat() -> dict:
    """`agent-repeat`: agent.json's system prompt, and the sessions of `workloads/agent-repeat.json` (each
    kind's task and tool outputs filled with one session's values), interleaved: every kind's first
    session, then every kind's second, ... (as a server sees many agents doing the same kinds of task)."""
    folder = resources.files(__package__).joinpath("workloads")
    repeat = json.loads(folder.joinpath("agent-repeat.json").read_text())
    kinds = repeat["kinds"]
    sessions = [{"task": kind["task"].format(**values), "steps": [s.format(**values) for s in kind["steps"]],
                 "kind": kind["name"]}
                for i in range(max(len(k["sessions"]) for k in kinds)) for kind in kinds
                if i < len(kind["sessions"]) for values in [kind["sessions"][i]]]
    return {"system": load_agent_workload()["system"], "max_new_tokens": repeat["max_new_tokens"],
            "transcripts": sessions, "continuous": True}


def opening(workload: dict, transcript: dict) -> list[dict]:
    """A session's first messages, before its first tool output: the system prompt, the task, the
    agent's first answer (each step then appends a tool output and the answer to it)."""
    return [{"role": "system", "content": workload["system"]}, {"role": "user", "content": transcript["task"]},
            {"role": "assistant", "content": "I will use the tools step by step."}]


def repeat_steps(engine: Engine, steps: int) -> Iterator[GenerationResult]:
    """The first `steps` steps of agent-repeat's sessions on `engine`, session by session, greedy, each
    answer fed back into its session (a server's traffic for scripts/bench_mixed.py's history and
    bench_first_start.py): yields each step's result."""
    work, done = load_agent_repeat(), 0
    for transcript in work["transcripts"]:
        messages = opening(work, transcript)
        for tool in transcript["steps"]:
            if done == steps:
                return
            messages.append({"role": "user", "content": TOOL_PREFIX + tool})
            out = engine.generate(messages, max_new_tokens=work["max_new_tokens"], temperature=0)
            messages.append({"role": "assistant", "content": out.text})
            done += 1
            yield out


def replay(method: AgentMethod, workload: dict, transcript: dict, params: SamplingParams, max_new_tokens: int,
           seed: int, steps: int | None = None, begin: bool = True) -> list[Step]:
    """Run one transcript's steps against `method`, appending its own answers to the history. `begin`:
    start from empty caches (False: a server's next session, after the ones before it)."""
    if begin:
        method.begin()
    messages = opening(workload, transcript)
    out = []
    for i, tool in enumerate(transcript["steps"][:steps]):
        messages.append({"role": "user", "content": TOOL_PREFIX + tool})
        step = method.step(messages, params, max_new_tokens, seed + i)
        out.append(step)
        messages.append({"role": "assistant", "content": step.text})
    return out


# --- methods ------------------------------------------------------------------------------------------
def exactspec_agent_method(engine: Engine, drafter: str | None, gamma: int | str, cache_mb: float,
                           store_mb: float = 0) -> AgentMethod:
    """Our decoding through the engine's streaming API; `cache_mb` 0: without the prefix cache;
    `store_mb`: the suffix drafter's store (suffix, auto), emptied with the cache at every `begin`."""
    name = "exactspec-plain-nocache" if cache_mb == 0 else ("exactspec-plain" if gamma == 0 else "exactspec-spec")

    def begin() -> None:
        engine.set_prefix_cache(cache_mb)  # a fresh, empty cache per replay
        engine.drafts.set_store(store_mb)

    def step(messages, params, max_new_tokens, seed) -> Step:
        t = time.perf_counter()
        result = engine.new_result(messages)
        first = None
        for _ in engine.stream(messages, max_new_tokens, seed=seed, gamma=gamma, draft=drafter or "none",
                               result=result, **dataclasses.asdict(params)):
            first = first or time.perf_counter()
        end = time.perf_counter()
        return Step(end - t, (first or end) - t, len(result.token_ids), len(result.prompt_token_ids),
                    result.stats.cached_tokens, result.stats, result.text)

    return AgentMethod(name, drafter if gamma != 0 else None, gamma, begin, step, store_mb)


class _FirstToken:
    """A transformers streamer that notes when the first generated token arrives (put #2: #1 is the prompt)."""

    def __init__(self) -> None:
        self.puts, self.first = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def hf_agent_method(engine: Engine) -> AgentMethod:
    """Hugging Face `generate` on the same weights: the whole history prefilled every step."""
    module, eos = hf_module(engine.target.module), sorted(engine.target.eos_token_ids)

    def step(messages, params, max_new_tokens, seed) -> Step:
        t = time.perf_counter()
        prompt = engine.encode(messages)
        ids = torch.tensor([prompt])
        torch.manual_seed(seed)
        streamer = _FirstToken()
        kwargs = dict(do_sample=not params.greedy, top_k=0 if params.greedy else params.top_k)
        if not params.greedy:
            kwargs.update(temperature=params.temperature, top_p=params.top_p)
        with torch.inference_mode():
            out = module.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  eos_token_id=eos, pad_token_id=eos[0] if eos else 0, streamer=streamer, **kwargs)
        end = time.perf_counter()
        new = out[0, len(prompt):].tolist()
        text = engine.tokenizer.decode(new, skip_special_tokens=True)
        return Step(end - t, (streamer.first or end) - t, len(new), len(prompt), 0, None, text)

    return AgentMethod("hf-plain", None, None, lambda: None, step)


def llamacpp_cache_agent_method(engine: Engine, path: str, cache_mb: float, threads: int | None) -> AgentMethod:
    """llama-cpp-python's own completion API with its prompt cache (`Llama.set_cache(LlamaRAMCache)`), on
    the same GGUF with the context settings of exactspec's llama.cpp adapter; it keeps its live KV
    between calls too (the longest prefix of its last sequence is reused)."""
    from ..models.llamacpp.adapter import LlamaCppLM
    from ..models.llamacpp.runtime import import_llama_cpp, make_llama, resolve_repack
    from .llamacpp import sampler_kwargs

    llama_cpp = import_llama_cpp()
    if isinstance(engine.target, LlamaCppLM):
        settings, repack = engine.target.context_kwargs(), engine.target.repack
    else:
        from ..models.llamacpp.runtime import DEFAULT_N_UBATCH, default_threads

        n = threads or default_threads()
        settings = dict(n_ctx=min(4096, engine.target.max_length), n_batch=512, n_ubatch=DEFAULT_N_UBATCH,
                        n_threads=n, n_threads_batch=n, flash_attn=True)
        repack = resolve_repack(path)
    llama = make_llama(path, repack, **settings)

    def begin() -> None:
        llama.reset()
        llama.set_cache(llama_cpp.LlamaRAMCache(capacity_bytes=int(cache_mb * 2**20)))

    def step(messages, params, max_new_tokens, seed) -> Step:
        t = time.perf_counter()
        prompt = engine.encode(messages)
        before = llama.n_tokens
        reused = next((i for i, (a, b) in enumerate(zip(llama._input_ids[:before], prompt)) if a != b), min(before, len(prompt)))
        kw = sampler_kwargs(params)
        kw["temperature"] = kw.pop("temp")
        first, text, pieces = None, "", 0
        for chunk in llama.create_completion(prompt, max_tokens=max_new_tokens, stream=True, seed=seed, **kw):
            first = first or time.perf_counter()
            text += chunk["choices"][0]["text"]
            pieces += 1
        end = time.perf_counter()
        tokens = len(engine.tokenizer.encode(text, add_special_tokens=False)) if text else 0
        return Step(end - t, (first or end) - t, tokens, len(prompt), reused, None, text)

    return AgentMethod("llamacpp-plain-cache", None, None, begin, step)


def build_agent_methods(engine: Engine, drafters: list[str], gammas: list[int | str], cache_mb: float, hf: bool,
                        llamacpp_path: str | None = None, threads: int | None = None,
                        store_mb: float = 0) -> list[AgentMethod]:
    """exactspec without cache and speculation (the baseline), with the cache, with cache + speculation
    per drafter and γ (the suffix drafter with a store of `store_mb`); then the anchors: llama-cpp-python
    with its prompt cache when installed, HF generate."""
    methods = [exactspec_agent_method(engine, None, 0, 0), exactspec_agent_method(engine, None, 0, cache_mb)]
    for d in drafters:
        methods += [exactspec_agent_method(engine, d, g, cache_mb, store_mb if d == "suffix" else 0) for g in gammas]
    if hf and llamacpp_path is not None:
        try:
            methods.append(llamacpp_cache_agent_method(engine, llamacpp_path, cache_mb, threads))
        except Exception:  # ExactSpecError: llama-cpp-python not installed
            pass
    if hf and hasattr(engine.target, "module"):
        methods.append(hf_agent_method(engine))
    return methods


def run_agent_bench(engine: Engine, methods: list[AgentMethod], temperature: float = 0.0,
                    transcripts: int | None = None, steps: int | None = None, reps: int = 1,
                    max_new_tokens: int | None = None, progress=None, name: str = "agent",
                    budget_s: float | None = None) -> list[dict]:
    """-> one row per method (the bench's JSON row fields, plus per-step latency fields). `name`:
    "agent" (each transcript from empty caches, methods interleaved per transcript) or "agent-repeat"
    (each method runs the interleaved sessions in one go, its caches and store kept from session to
    session as a server's are; the method order rotates per repetition). `budget_s`: fewer sessions
    (agent-repeat: still one kind seen twice), then fewer steps, then shorter answers, to fit it
    (bench/budget.py). `progress`: a tqdm bar of one unit a replayed session, less the ones cut."""
    workload = load_agent_repeat() if name == "agent-repeat" else load_agent_workload()
    chosen = workload["transcripts"][:transcripts]
    max_new = max_new_tokens or workload["max_new_tokens"]
    params = SamplingParams(temperature=temperature)
    if any(m.gamma == "auto" for m in methods) or budget_s is not None:
        cost = engine.cost_model()  # measured before the timed steps (as the server does at start-up)
    if budget_s is not None:
        asked = len(chosen)
        least = len({t.get("kind") for t in chosen}) + 1 if workload.get("continuous") else 1
        fitted, steps, max_new = fit_sessions(budget_s, len(methods) * cost.seconds(1), asked,
                                              steps or max(len(t["steps"]) for t in chosen), max_new, least)
        chosen = chosen[:fitted]
        shrink(progress, len(methods) * reps * (asked - fitted))
    steps_of: dict[int, list[Step]] = {id(m): [] for m in methods}
    store = engine.drafts.store  # each method's `begin` sets its own: the engine's is put back after
    for rep in range(reps):
        for i, transcript in enumerate(chosen):
            shift = (rep * len(chosen) + i) % len(methods)
            for m in methods[shift:] + methods[:shift]:
                if workload.get("continuous"):  # all sessions, in order, per method (at i == 0)
                    for j, t in enumerate(chosen if i == 0 else []):
                        steps_of[id(m)] += replay(m, workload, t, params, max_new, 1000 * rep + 100 * j, steps,
                                                  begin=j == 0)
                        if progress is not None:
                            progress.update(1)
                else:
                    steps_of[id(m)] += replay(m, workload, transcript, params, max_new, 1000 * rep + 100 * i, steps)
                    if progress is not None:
                        progress.update(1)
    engine.set_prefix_cache(None)
    engine.drafts.store = store
    base = _median([s.latency_s for s in steps_of[id(methods[0])]])
    anchor = next((m for m in methods if m.method in ("hf-plain", "llamacpp-plain-cache")), None)
    anchor_latency = _median([s.latency_s for s in steps_of[id(anchor)]]) if anchor else None
    return [_row(m, steps_of[id(m)], temperature, base, anchor_latency, name) for m in methods]


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))] if xs else float("nan")


def _row(m: AgentMethod, steps: list[Step], temperature: float, base: float, anchor: float | None,
         workload: str = "agent") -> dict:
    latency = [s.latency_s for s in steps]
    merged = total(s.stats for s in steps) if steps and steps[0].stats is not None else None
    tokens, seconds = sum(s.tokens for s in steps), sum(latency)
    return {
        "workload": workload, "temperature": temperature, "method": m.method, "drafter": m.drafter, "gamma": m.gamma,
        "store_mb": m.store_mb,
        "tokens_per_s": tokens / seconds if seconds else None,
        "speedup_vs_plain": base / _median(latency),  # median step latency of exactspec-plain-nocache / this one's
        "speedup_vs_anchor_plain": anchor / _median(latency) if anchor else None,
        "acceptance_rate": merged.acceptance_rate if merged else None,
        "tokens_per_target_call": merged.tokens_per_target_call if merged else None,
        "predicted_speedup": None,
        "steps": len(steps),
        "step_latency_s": _median(latency), "step_latency_p90_s": _p90(latency),
        "ttft_s": _median([s.ttft_s for s in steps]), "ttft_p90_s": _p90([s.ttft_s for s in steps]),
        "cached_tokens": _median([s.cached_tokens for s in steps]),
        "cached_tokens_p90": _p90([s.cached_tokens for s in steps]),
        "prompt_tokens": _median([s.prompt_tokens for s in steps]),
        "prefill_tokens_avoided": sum(s.cached_tokens for s in steps),
        "completion_tokens": tokens,
    }


def agent_table(rows: list[dict]) -> str:
    def f(x, fmt="{:.2f}"):
        return "–" if x is None else fmt.format(x)

    lines = ["| method | drafter | γ | store MiB | step latency median (p90) s | TTFT median (p90) s | cached tokens/step median "
             "(p90) | prompt tokens/step | tokens/call | vs plain no cache | vs anchor |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['drafter'] or '–'} | {'–' if r['gamma'] is None else r['gamma']} | "
                     f"{r.get('store_mb') or 0:g} | "
                     f"{r['step_latency_s']:.2f} ({r['step_latency_p90_s']:.2f}) | {r['ttft_s']:.2f} "
                     f"({r['ttft_p90_s']:.2f}) | {r['cached_tokens']:.0f} ({r['cached_tokens_p90']:.0f}) | "
                     f"{r['prompt_tokens']:.0f} | {f(r['tokens_per_target_call'])} | {f(r['speedup_vs_plain'])}× | "
                     f"{f(r['speedup_vs_anchor_plain'])}× |")
    return "\n".join(lines)
