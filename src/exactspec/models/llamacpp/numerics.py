"""How llama.cpp computes on this CPU so that one-token steps equal multi-token blocks bit for bit, chosen at
load by measuring: the KV cache's type, the threads of one-token steps, and the compute step (n_ubatch).

Why (ggml's CPU flash attention, ggml-cpu/ops.cpp, as vendored by llama-cpp-python 0.3.36):
- one query over an f16/f32 cache view of 512+ keys (llama.cpp pads the view to 256 cells, so past ~256
  tokens) takes a split-KV path on several threads: each thread reduces a slice of the keys and the
  slices are merged, another order of additions than a block's one-row-per-thread pass. A one-token step
  then differs from the same token inside a block (0.6-1.1 in the logits at 300-1200 tokens on an AMD
  EPYC and an Intel Xeon, 2 threads; greedy choices flip).
- 64+ query rows over such a cache take a tiled kernel, other sums again (so f16 needs n_ubatch < 64).
- both paths need K and V of type f16 (an f32 cache is cast to f16 for attention). With K in bf16 or
  q8_0 every pass runs the per-row kernel: steps on every thread and blocks of any size agree (measured
  here to 1200 tokens, blocks of 8 and 70, n_ubatch 512).
The candidates, in order: a q8_0-K cache and a bf16 cache on all threads, n_ubatch 512 (per-row kernel
everywhere); llama.cpp's own f16 cache and kernels with TILED PREFILL (adapter.py, prefill_plan.py: runs
of 64+ prompt tokens by the tiled kernel, assistant turns and decode passes under 64 rows, n_ubatch 512), one-token
steps as they are (bit-exact where llama.cpp was built without the split path: `make setup` builds it
so, scripts/build_llama_cpp.py), else kept off the split path by a pad; the f16 cache with one-token
steps on ONE thread and no tiles (n_ubatch 32). (Tiles with one-thread steps and no pad measured well
here, and lost across the peer bench on a Zen 5: the whole step then runs on one core.) Each is
tested: after a MEASURED-token prefill (capped by the context), blocks of BLOCK, WIDE and LONG tokens against
the same tokens one at a time, and the KV of a prefill of half a prompt, then the rest, equal to one prefill of the
whole (what the prefix cache relies on). Of those bit-equal, the one that serves an agent session fastest (a PROMPT-token prefill,
extrapolated from the two halves of the measured one, and STEPS one-token steps, priced by the mean of
the medians of steps near the start and at MEASURED tokens) is kept; an earlier one within 3% wins (the
per-row settings come first: see CANDIDATES); a setting sure to be slower than one already found bit-equal
stops after half its prefill (MEASURED_ORDER); where two or more are bit-equal, the two fastest are timed once
more in reverse order and ranked by their better timing (`retimed`: one noisy timing must not pick the
cache type). None bit-equal: the first, and greedy identity rests on
tolerance. The verdict is cached per CPU, model file, library build and settings -- the context only as far as
the test reads it (every context of 1,024 tokens or more shares one) and its rope scaling -- about half
a minute on 2 cores, once.
The cache type changes the model's numerics (not the exactness of speculation, which compares the
target with itself): `Verdict.describe` names it, and `generate --json` / `/v1/models` report it.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from ... import progress
from ...cachedir import cache_dir, file_identity, machine_key, measured_once, provisional, write_atomic
from ...errors import ExactSpecError

VERSION = 15  # bump when the test changes: old cache entries are then ignored
CONTEXT = 300  # tokens before the blocks: past the 256-key point where the split starts
BLOCK, LONG = 8, 70  # a verification-sized block, and one past the 64-row tiled kernel
WIDE = 14  # a wide verification pass (auto γ may choose 9-16 rows: patch 12's narrow microtile, direct passes)
GGML_TYPES = {"f16": 1, "q8_0": 8, "bf16": 30}  # ggml_type ids for llama_context_params.type_k / type_v
FAVOUR = 1.03  # an earlier candidate within 3% of the fastest is kept
# What a setting is ranked by: an agent session -- one cold PROMPT-token prompt (tool specs), then STEPS
# one-token steps (eight answers of 128; the prefix cache serves the later prompts)
PROMPT, STEPS = 2048, 1024
MEASURED = 953  # prompt tokens the self-test prefills (PROMPT's time is extrapolated from its two halves):
# a 1,024-token context's room beside the LONG block, so that it and every longer one share a verdict
SHALLOW = 32  # one-token steps timed from an empty context (a chat's answer), beside those at MEASURED
TILE = 64  # llama.cpp's flash-attention query tile (GGML_FA_TILE_Q): 64+ query rows take the tiled kernel
SPLIT = 3 * TILE + 10  # tokens of the prefix-plus-rest check: 101, then 101 more (tiles start off the grid)


@dataclass(frozen=True)
class Setting:
    """One way to run the context: K and V cache types, one-token-step threads (0 = all), n_ubatch, the
    prefill tile (0: none; see TILED PREFILL in adapter.py), and whether a tiled setting's lone tokens
    get a pad (not needed where llama.cpp was built without the split-KV kernel: scripts/build_llama_cpp.py)."""

    type_k: str
    type_v: str
    single_threads: int
    n_ubatch: int
    prefill_tile: int = 0
    pad: bool = True

    def llama_kwargs(self) -> dict:
        return {"type_k": GGML_TYPES[self.type_k], "type_v": GGML_TYPES[self.type_v], "n_ubatch": self.n_ubatch,
                "prefill_tile": self.prefill_tile, "pad_steps": self.pad}

    def describe(self, threads: int) -> str:
        steps = threads if self.single_threads == 0 else self.single_threads
        tiled = f", prompts prefilled in {self.prefill_tile}-row tiles (assistant turns per row)" if self.prefill_tile else ""
        tiled += ", lone tokens padded" if self.prefill_tile and self.pad and steps > 1 else ""
        return f"{self.type_k}/{self.type_v} KV cache, one-token steps on {steps} thread(s), n_ubatch {self.n_ubatch}{tiled}"


# Per-row settings first: near a tie they win, as a tiled setting's padded steps cost more across a whole
# bench than this measure says (docs/llama-cpp.md: on a Zen 5, chat at 0.59x llama-server with them, 0.94x
# without). The padded twin of a tiled setting is tried only where the unpadded one is not bit-exact.
CANDIDATES = (Setting("q8_0", "f16", 0, 512), Setting("bf16", "bf16", 0, 512),
              Setting("f16", "f16", 0, 512, TILE, pad=False), Setting("f16", "f16", 0, 512, TILE),
              Setting("f16", "f16", 1, 32))


# Measured in this order, picked in CANDIDATES' order: the tiled settings' prefill is fast wherever they are
# bit-exact, and a setting sure to be slower than a bit-exact one measured before it stops after its first
# prefill piece (a per-row prefill is most of the self-test's time where tiles win: `trial`'s `beat_ms`).
MEASURED_ORDER = tuple(sorted(CANDIDATES, key=lambda setting: not setting.prefill_tile))


@dataclass
class Verdict:
    setting: Setting
    exact: bool  # one-token steps bit-equal to blocks with it
    max_diff: float  # of the first candidate on this CPU
    step_ms: float  # its one-token step (mean of the medians near the start and at MEASURED tokens)
    prefill_tok_s: float = 0.0  # its prefill speed for a PROMPT-token prompt (from a MEASURED-token one)
    cached: bool = False
    provisional: str | None = None  # why the ranking is provisional: measured on a busy machine (cachedir)

    def describe(self, threads: int) -> str:
        how = self.setting.describe(threads)
        if self.provisional:
            how += (f"; PROVISIONAL: timed while {self.provisional}, measured again at the next quiet start"
                    " or by `exactspec tune --remeasure`")
        if not self.exact and math.isinf(self.max_diff):  # not a measured difference: a check that failed
            return ("by tolerance (a prompt prefilled in two parts differs from one prefill of it here, so a "
                    f"prefix-cache hit would not be bit-exact: the self-test's prefix check failed; {how})")
        if not self.exact:
            return f"by tolerance (llama.cpp's blocks differ from one-token steps by up to {self.max_diff:.3g} here; {how})"
        return f"bit-exact (self-test: blocks equal one-token steps; {how})"


def block_vs_steps(lm, ids: list[int], context: int, blocks: tuple[int, ...] | None = None,
                   give_up: Callable[[list[tuple[int, float]]], bool] = lambda prefill: False
                   ) -> tuple[float, list[float], list[tuple[int, float]]] | None:
    """Max |logits| difference between scoring ids[context:context + k] as one block, for each k in `blocks`
    (default: the whole stretch), and the same tokens one at a time, all after a prefill of ids[:context]
    (0.0: bit-equal); the seconds of each one-token step; and (tokens, seconds) of that prefill's two
    halves (split at a whole tile: the same computation as one prefill). None where `give_up(the pieces
    so far)` says so after a piece. The adapter is reset."""
    blocks = blocks or (len(ids) - context,)
    lm.reset()
    prefill = []
    half = context // 2 // TILE * TILE
    for piece in (ids[:half], ids[half:context]) if half else (ids[:context],):
        start = time.perf_counter()
        lm.prefill(torch.tensor([piece]))
        prefill.append((len(piece), time.perf_counter() - start))
        if give_up(prefill):
            lm.reset()
            return None
    scored = []  # [k, V] per block
    for k in blocks:
        scored.append(lm.forward(torch.tensor([ids[context:context + k]]))[0])
        lm.truncate(context)
    steps, seconds = [], []
    for t in ids[context:context + max(blocks)]:
        start = time.perf_counter()
        steps.append(lm.forward(torch.tensor([[t]]))[0])
        seconds.append(time.perf_counter() - start)
    lm.reset()
    steps = torch.cat(steps)  # [max k, V]
    return max(float((block - steps[:len(block)]).abs().max()) for block in scored), seconds, prefill


def prefill_seconds(pieces: list[tuple[int, float]], prompt: int) -> float:
    """Seconds to prefill `prompt` tokens, from (tokens, seconds) of consecutive prefill pieces: a token
    at depth d costs a + b*d (its weights, and attention over d keys: what grows with depth), fitted to
    the first two pieces (one piece: b = 0)."""
    if len(pieces) < 2:
        (n, t), = pieces
        return t / n * prompt
    (n1, t1), (n2, t2) = pieces[:2]
    # t1 = n1 a + b S1, t2 = n2 a + b S2, S = the depths summed over each piece
    s1, s2 = n1 * (n1 - 1) / 2, n2 * n1 + n2 * (n2 - 1) / 2
    b = max(0.0, (t2 * n1 - t1 * n2) / (s2 * n1 - s1 * n2))
    a = max(0.0, (t1 - b * s1) / n1)
    return prompt * a + b * prompt * (prompt - 1) / 2


def prefix_vs_whole(lm, ids: list[int]) -> bool:
    """Whether the KV of ids prefilled at once equals, byte for byte, that of a prefill of its first half
    followed by one of the rest (a prefix cache hit, then the prompt's new part): with TILED PREFILL both
    halves are tiled, the second's tiles starting off the first's grid. The adapter is reset."""
    lm.reset()
    lm.prefill(torch.tensor([ids]))
    whole = bytes(lm.snapshot_prefix(len(ids))[0][0])
    lm.reset()
    lm.prefill(torch.tensor([ids[:len(ids) // 2]]))
    lm.prefill(torch.tensor([ids[len(ids) // 2:]]))
    parts = bytes(lm.snapshot_prefix(len(ids))[0][0])
    lm.reset()
    return whole == parts


def trial(lm, beat_ms: float = math.inf) -> tuple[float, float, float] | None:
    """(max difference over BLOCK-, WIDE- and LONG-token blocks after a MEASURED-token prefill -- inf if a
    prefix plus the rest is not a whole prefill --, one-token step in ms -- the mean of the medians near
    the start and at MEASURED tokens: a session's answers lie between --, prefill tokens/s of a
    PROMPT-token prompt from that prefill): attention's share grows with depth, and only some settings
    keep their prefill speed there. None as soon as the setting's `request_ms` is sure to exceed
    `beat_ms` (a slow per-row prefill is not timed to the end, nor checked for bits)."""
    context = max(1, min(MEASURED, lm.max_length - LONG - 1))
    ids = torch.randint(0, lm.vocab_size, (context + LONG,), generator=torch.Generator().manual_seed(0)).tolist()
    lm.reset()
    shallow = []
    for t in ids[:SHALLOW]:
        start = time.perf_counter()
        lm.forward(torch.tensor([[t]]))
        shallow.append(time.perf_counter() - start)

    def give_up(prefill: list[tuple[int, float]]) -> bool:
        # at least: the prompt at the pieces' mean speed (a deeper token costs no less), and steps at
        # half the shallow median (the ranked step is the mean of it and the deep one)
        (n, seconds), = prefill[:1]
        at_least = PROMPT * seconds / n if len(prefill) == 1 else prefill_seconds(prefill, PROMPT)
        return at_least * 1e3 + STEPS * statistics.median(shallow) / 2 * 1e3 > beat_ms

    measured = block_vs_steps(lm, ids, context, (BLOCK, WIDE, LONG), give_up)
    if measured is None:
        return None
    diff, deep, prefill = measured
    if len(ids) > TILE and not prefix_vs_whole(lm, ids[:SPLIT]):
        diff = float("inf")
    step_ms = (statistics.median(shallow) + statistics.median(deep)) / 2 * 1e3
    return diff, step_ms, PROMPT / prefill_seconds(prefill, PROMPT)


def request_ms(step_ms: float, prefill_tok_s: float) -> float:
    """The milliseconds of the request settings are ranked by: PROMPT tokens prefilled, STEPS steps."""
    return PROMPT / prefill_tok_s * 1e3 + STEPS * step_ms


def choose(make, threads: int, key: str) -> Verdict:
    """The verdict for a model: from the cache under `key`, or by trying each candidate; `make(setting)`
    builds an adapter with that setting (the caller's, with `set_single_threads` applied)."""
    path = cache_dir("llamacpp-numerics") / f"{key}.json"
    verdict = measured_once(path, lambda: _cached_verdict(path), lambda: _measure_verdict(make, threads),
                            lambda v: write_atomic(path, json.dumps({k: x for k, x in asdict(v).items()
                                                                     if k not in ("cached", "provisional")})),
                            timed=threads)
    return replace(verdict, provisional=provisional(path))


def _cached_verdict(path) -> Verdict | None:
    if path.exists():
        try:
            data = json.loads(path.read_text())
            return Verdict(**{**data, "setting": Setting(**data["setting"]), "cached": True})
        except (ValueError, TypeError, KeyError):
            pass  # an unreadable entry is measured again
    return None


def _measure_verdict(make, threads: int) -> Verdict:
    progress.status("choosing llama.cpp's cache type and threads: bit-equality self-test (once per machine and model)")
    trials, unavailable = [], []
    with progress.timed("llama.cpp numerics self-test"):
        for setting in MEASURED_ORDER:
            if setting.single_threads >= threads:
                continue  # the same as an all-threads candidate
            if any(t[0] == replace(setting, pad=False) and t[1] == 0.0 for t in trials):
                continue  # its unpadded twin is bit-exact: the pad would only cost
            try:
                lm = make(setting)
            except ExactSpecError as e:  # a cache type this model's shapes cannot hold (q8_0 K: head size % 32)
                progress.status(f"llama.cpp self-test: {setting.describe(threads)} is not available for this model "
                                f"({e}); trying the others")
                unavailable.append(e)
                continue
            exact = [request_ms(t[2], t[3]) for t in trials if t[1] == 0.0]
            measured = trial(lm, min(exact, default=math.inf) * FAVOUR)
            del lm
            if measured is None:
                continue  # slower than a bit-exact one, whatever its bits: never picked
            trials.append((setting, *measured))
    if not trials:
        raise unavailable[0]
    return pick(sorted(retimed(make, trials), key=lambda t: CANDIDATES.index(t[0])))


def retimed(make, trials: list[tuple[Setting, float, float, float]]) -> list[tuple[Setting, float, float, float]]:
    """The bit-exact trials timed once more, in reverse order, each kept at its better timing (noise only
    slows): the verdict decides the cache type for good, and the first setting measured after the load, or
    one measured beside a neighbour's burst, ran up to a third slower here than the same setting a minute
    later -- enough to pick the q8_0 cache, whose prefill is half the tiled f16's (a plain server's agent
    and edit requests ~15% slower). Only the two fastest are timed again (the self-test's time: a third
    is rarely close); one finalist: nothing to decide, nothing timed again."""
    exact = sorted((request_ms(t[2], t[3]), i) for i, t in enumerate(trials) if t[1] == 0.0)
    if len(exact) < 2:
        return trials
    out = list(trials)
    for i in sorted((i for _, i in exact[:2]), reverse=True):
        setting, diff, step_ms, prefill_tok_s = out[i]
        lm = make(setting)
        again = trial(lm, math.inf)
        del lm
        if again is not None and again[0] == 0.0:
            out[i] = (setting, diff, min(step_ms, again[1]), max(prefill_tok_s, again[2]))
    return out


def pick(trials: list[tuple[Setting, float, float, float]]) -> Verdict:
    """Of (setting, max diff, step ms, prefill tokens/s) in candidate order: the bit-equal one with the
    fastest `request_ms`, an earlier one within FAVOUR of it kept; none bit-equal -> the first, inexact."""
    first = trials[0]
    exact = [t for t in trials if t[1] == 0.0]
    if not exact:
        return Verdict(first[0], False, first[1], first[2], first[3])
    fastest = min(request_ms(t[2], t[3]) for t in exact)
    setting, _, step_ms, prefill_tok_s = next(t for t in exact if request_ms(t[2], t[3]) <= fastest * FAVOUR)
    return Verdict(setting, True, first[1], step_ms, prefill_tok_s)


def key(identity: str, settings: dict, repack: bool) -> str:
    """CPU (machine_key) + llama-cpp-python version + its libraries' bytes (the build: CPU, compiler,
    flags) + the caller's settings + the kernel switches + the model file's identity."""
    import llama_cpp

    from .runtime import build_identity, kernel_switches, repack_label

    text = json.dumps(settings, sort_keys=True, default=str)
    return machine_key(VERSION, llama_cpp.__version__, build_identity(), text, repack_label(repack), kernel_switches(),
                       identity)


GIVEN = ("type_k", "type_v", "n_ubatch")  # a caller's own choice of these is kept as given


RAGGED = (BLOCK, 1, 3, 2)  # new tokens per row in the self-test's unpadded pass (as the loop feeds them)


def rows_vs_alone(lm) -> float:
    """Max |logits| difference between rows of uneven lengths scored TOGETHER (one llama_decode: a
    block of BLOCK tokens per row; one token per row; RAGGED[b] tokens in row b, unpadded) and the same
    rows scored ALONE (0.0: a row's logits do not depend on its neighbours). Needs lm.max_rows >= 2; the
    adapter is reset."""
    B = min(lm.max_rows, len(RAGGED))
    context = max(1, min(CONTEXT, lm.max_length // 2 - BLOCK))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, lm.vocab_size, (context + 37 * b,), generator=gen).tolist() for b in range(B)]
    feed = torch.randint(0, lm.vocab_size, (B, BLOCK), generator=gen)  # [B, BLOCK]
    lm.reset(0)
    for prompt in prompts:
        lm.append_rows(prompt + [0])  # the row holds `prompt`
    widths = {"block": [BLOCK] * B, "step": [1] * B, "ragged": list(RAGGED[:B])}
    together = {}
    for name, width in widths.items():
        together[name] = lm.forward_ragged([feed[b, :w].tolist() for b, w in enumerate(width)])  # [B, max w, V]
        lm.truncate_rows([len(p) for p in prompts])
    diff = 0.0
    for b, prompt in enumerate(prompts):
        lm.reset(1)
        lm.prefill(torch.tensor([prompt]))
        for name, width in widths.items():
            alone = lm.forward(feed[b:b + 1, :width[b]])[0]  # [w, V]
            lm.truncate(len(prompt))
            diff = max(diff, float((together[name][b, :width[b]] - alone).abs().max()))
    lm.reset()
    return diff


def steps_write_prefill_kv(lm) -> bool:
    """Whether the KV cells that one-token steps write equal, byte for byte, those a pass of many tokens
    writes (after a CONTEXT-token prefill, LONG more tokens in the passes the adapter gives a block:
    with TILED PREFILL the per-row kernel's, which a later prompt's plan gives an assistant turn): then
    the prefix cache may keep a generation's KV, not only its prompt's (`cache_generated_kv`; `reusable`
    says where a later prompt computes those positions alike). The adapter is reset."""
    context = max(1, min(CONTEXT, lm.max_length - LONG - 1))
    ids = torch.randint(0, lm.vocab_size, (context + LONG,), generator=torch.Generator().manual_seed(2)).tolist()
    lm.reset()
    lm.prefill(torch.tensor([ids[:context]]))
    lm.forward(torch.tensor([ids[context:]]))
    prefilled = bytes(lm.snapshot_prefix(len(ids))[0][0])
    lm.reset()
    lm.prefill(torch.tensor([ids[:context]]))
    for t in ids[context:]:
        lm.forward(torch.tensor([[t]]))
    stepped = bytes(lm.snapshot_prefix(len(ids))[0][0])
    lm.reset()
    return prefilled == stepped


def cached_check(key: str, name: str, check):
    """`check()` (a JSON value), cached under the numerics verdict's `key` and the check's `name`."""
    path = cache_dir("llamacpp-numerics") / f"{key}-{name}.json"

    def read():
        try:
            return json.loads(path.read_text())["value"]
        except (OSError, ValueError, TypeError, KeyError):
            return None  # absent or unreadable: measured (again)

    def measure():
        with progress.timed(f"llama.cpp {name} self-test"):
            return check()

    return measured_once(path, read, measure, lambda value: write_atomic(path, json.dumps({"value": value})))


def load_self_tested(path: str, n_ctx: int | None = None, threads: int | None = None, repack: bool | None = None,
                     rows: int = 1, **llama_kwargs):
    """A `LlamaCppLM` over `path` under the setting this self-test chose for the machine and file (its
    `identity` says which, and what greedy identity rests on; its `cost_key` keys auto γ's cached T(k),
    measure.target_costs). `llama_kwargs` go to the adapter; a cache type or n_ubatch among them
    overrides the candidates' (only their threads then differ). Its prefix cache keeps generated KV
    where one-token steps write the cells a prefill writes (`steps_write_prefill_kv`). `rows` > 1: a context for that many
    batched rows, kept batched only if a row scored beside others equals it scored alone, bit for bit
    (`rows_vs_alone`); otherwise its rows decode one at a time, and `identity` says so."""
    from .adapter import load_llama_cpp
    from .runtime import (check_gguf_file, default_context, default_threads, import_llama_cpp, repack_label,
                          resolve_repack, yarn_kwargs)

    import_llama_cpp()  # one line if llama-cpp-python is missing or its library does not load
    check_gguf_file(path)
    repack = resolve_repack(path, repack)
    given = {k: llama_kwargs[k] for k in GIVEN if k in llama_kwargs}

    def make(setting: Setting, rows: int = 1):
        lm = load_llama_cpp(path, n_ctx=n_ctx, threads=threads, repack=repack, rows=rows,
                            **{**llama_kwargs, **setting.llama_kwargs(), **given})
        if setting.single_threads:
            lm.set_single_threads(setting.single_threads)
        return lm

    n, file = threads or default_threads(), file_identity(path)
    # what the self-test reads of its context: contexts longer than that share one verdict (the rope's
    # scaling, which a longer context may bring, is keyed on its own)
    ctx = n_ctx or default_context(path)
    seen = {"seen": max(1, min(MEASURED, ctx - LONG - 1)), "rope": yarn_kwargs(path, ctx)}
    verdict_key = key(file, {**seen, "threads": n, **llama_kwargs}, repack)
    verdict = choose(make, n, verdict_key)
    lm = make(verdict.setting, rows)
    lm.identity = verdict.describe(lm.threads)
    lm.cache_generated_kv = verdict.exact and cached_check(verdict_key, "kv", lambda: steps_write_prefill_kv(lm))
    if rows > 1:
        diff = cached_check(f"{verdict_key}-{rows}", "rows-ragged", lambda: rows_vs_alone(lm))
        if diff != 0.0:
            lm.batched = lm.ragged = False
            lm.identity += f"; rows decode one at a time (a row scored beside others differs by {diff:.3g} here)"
    # T(k) depends on the build and the setting (a pad is a second token per step), not only the context's
    lm.cost_key = (f"llama.cpp|{import_llama_cpp().__version__}|{file}|{repack_label(repack)}|{json.dumps(verdict.setting.llama_kwargs(), sort_keys=True)}"
                   f"|{json.dumps(lm.context_kwargs(), sort_keys=True, default=str)}")
    # its snapshots' bytes depend on the same (the cache types, the build that wrote them), on the state
    # format (adapter.state_bytes), on the context's rows (llama.cpp refuses a sequence state written by a
    # context of another n_seq_max), on the CPU, the kernel switches and the self-test's key; and they mean
    # the same only with the tile rule that `kinds` records
    lm.persist_key = f"kv2|{lm.cost_key}|tile={lm.prefill_tile}|rows={lm.max_rows}|{verdict_key}"
    return lm
