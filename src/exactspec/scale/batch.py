"""Offline batch generation over a JSON-lines file: in-process or on Ray Data.

Each input line is one request body of the server (server/schemas.py), checked and translated as
the server does it (server/translate.py), so each field is honoured or the line gets an error, never
ignored:
    {"id": "q1", "prompt": "raw text"}                        # as /v1/completions: no chat template
    {"id": "q2", "messages": [{"role": "user", "content": "..."}], "max_tokens": 64, "temperature": 0}
Defaults are the server's (OpenAI's temperature 1), except the token budget: `max_tokens` (or
`max_completion_tokens`) if the line sets it, else the command's --max-tokens, at most what the context
leaves. A line cannot ask for n > 1 (repeat it with other seeds), `stream` or `stream_options` (its
output is written whole). Each output line, in input order, is {"id", "text", "token_ids",
"finish_reason", "stats"}, plus the server's "logprobs" object when the line asks for logprobs and
"tool_calls" when it gave tools and the model called one; or {"id", "error"} for a line that cannot
run (the error names its line number); a bad line never stops the others.

A chunk of lines is decoded as ONE batch by the scheduler every caller shares (batching.py): lines
with different settings share it, each keeping its own seed, so every output is what a lone request
with that seed gives. On Ray (`replicas`), chunks go to `map_batches` over an actor pool of engines
(one `_RayWorker` per worker: `ActorPoolStrategy(size=replicas)`, what Ray < 2.51 spelled
`concurrency=replicas`); the file's order is kept.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..batching import Job, run_jobs
from ..errors import ExactSpecError

if TYPE_CHECKING:
    from ..server.shapes import Shapes
    from ..server.schemas import GenerationRequest

Line = tuple[int, str]  # (1-based line number, raw text)


@dataclass
class _Planned:
    """A line translated: its one job, and how its output reads (the server's response shapes)."""

    line: int
    id: object
    job: Job
    shapes: "Shapes"


def _plan(engine, line: int, raw: str, default_max_tokens: int) -> _Planned:
    """A line -> its job, checked against this engine as the server checks a request; ExactSpecError if bad."""
    from ..server.shapes import Shapes
    from ..server.schemas import ChatCompletionRequest
    from ..server.translate import ApiError, plan_chat, plan_text

    body = _body(raw)
    chat = isinstance(body, ChatCompletionRequest)
    try:
        if chat:
            jobs, tools = plan_chat(engine, body, default_max_tokens)
        else:  # without max_tokens: the command's --max-tokens, not OpenAI's 16
            jobs, tools = plan_text(engine, body, default_max_tokens, openai_budget=False), None
    except ApiError as e:
        raise ExactSpecError(f"{e.param}: {e.message}" if e.param else e.message) from None
    shapes = Shapes(chat, body.model or "", lambda t: engine.tokenizer.decode([t]), tools, engine.token_bytes)
    return _Planned(line, _raw_id(raw), jobs[0], shapes)


def _body(raw: str) -> "GenerationRequest":
    """A line's request body (the server's schema), refusing what a batch line cannot do."""
    from pydantic import ValidationError

    from ..server.schemas import ChatCompletionRequest, CompletionRequest

    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ExactSpecError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ExactSpecError("expected a JSON object")
    if "messages" not in obj and "prompt" not in obj:
        raise ExactSpecError('needs "prompt" (raw text) or "messages" (chat)')
    try:
        body = (ChatCompletionRequest if "messages" in obj else CompletionRequest).model_validate(obj)
    except ValidationError as e:
        first = e.errors()[0]
        raise ExactSpecError(f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None
    if body.n != 1:
        raise ExactSpecError("n must be 1 in a batch line (repeat the line with other seeds instead)")
    if body.stream or body.stream_options is not None:
        raise ExactSpecError(f"{'stream' if body.stream else 'stream_options'}: a batch line is written whole")
    return body


def _result_line(planned: _Planned) -> dict:
    result, shapes = planned.job.result, planned.shapes
    out = {"id": planned.id, "text": result.text, "token_ids": result.token_ids,
           "finish_reason": shapes.finish_reason(result), "stats": result.stats.to_dict()}
    if (logprobs := shapes.logprobs(result)) is not None:
        out["logprobs"] = logprobs
    if shapes.chat and (calls := shapes.read(result)[1]):
        out["tool_calls"] = calls
    return out


def _error_line(line: int, id_: object, error: Exception) -> dict:
    return {"id": id_, "error": f"line {line}: {error}"}


def _raw_id(raw: str) -> object:
    try:
        obj = json.loads(raw)
        return obj.get("id") if isinstance(obj, dict) else None
    except json.JSONDecodeError:
        return None


def run_lines(engine, lines: list[Line], default_max_tokens: int = 256) -> list[dict]:
    """Output objects for `lines`, in their order: the good lines decode as one batch, whatever their
    settings; a line that fails (its translation, its row) carries its error alone."""
    out: dict[int, dict] = {}
    planned = []
    for line, raw in lines:
        try:
            planned.append(_plan(engine, line, raw, default_max_tokens))
        except Exception as e:  # ExactSpecError; anything else is a bug, but it must not take the run down
            out[line] = _error_line(line, _raw_id(raw), e if isinstance(e, ExactSpecError)
                                    else ExactSpecError(f"cannot translate this line: {type(e).__name__}: {e}"))
    for p, error in zip(planned, run_jobs(engine, [[p.job] for p in planned])):
        out[p.line] = _result_line(p) if error is None else _error_line(p.line, p.id, error)
    return [out[line] for line, _ in lines]


def read_lines(path: str) -> Iterator[Line]:
    """(line number, text) for every non-blank line of a JSON-lines file ('-': standard input)."""
    try:
        f = sys.stdin if path == "-" else open(path, encoding="utf-8")
    except OSError as e:
        raise ExactSpecError(f"cannot read {path}: {e.strerror}") from None
    with f:
        for number, raw in enumerate(f, 1):
            if raw.strip():
                yield number, raw


def chunks(lines: Iterable[Line], size: int) -> Iterator[list[Line]]:
    chunk: list[Line] = []
    for line in lines:
        chunk.append(line)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def run_local(engine, lines: Iterable[Line], batch_size: int, default_max_tokens: int) -> Iterator[dict]:
    """In-process: `batch_size` lines at a time through one engine."""
    for chunk in chunks(lines, batch_size):
        yield from run_lines(engine, chunk, default_max_tokens)


class _RayWorker:
    """A Ray Data actor: one engine, loaded once, applied to batches of {"line", "raw"} columns."""

    def __init__(self, load_kwargs: dict, default_max_tokens: int) -> None:
        from ..engine import load

        self.engine, self.default_max_tokens = load(**load_kwargs), default_max_tokens

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        lines = list(zip((int(n) for n in batch["line"]), (str(r) for r in batch["raw"])))
        outputs = run_lines(self.engine, lines, self.default_max_tokens)
        return {"line": np.array([n for n, _ in lines]),
                "out": np.array([json.dumps(o) for o in outputs], dtype=object)}


def run_ray(load_kwargs: dict, lines: Iterable[Line], batch_size: int, default_max_tokens: int,
            replicas: int, cpus: float = 1.0) -> Iterator[dict]:
    """On the connected Ray cluster: `replicas` engine actors with `cpus` CPUs each (and as many torch
    threads), `batch_size` lines per call; outputs come back in input order."""
    from . import require_ray

    ray = require_ray("data")
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    items = [{"line": n, "raw": raw} for n, raw in lines]
    if not items:
        return
    threads = load_kwargs.get("threads") or max(1, int(cpus))
    blocks = min(-(-len(items) // batch_size), 32 * replicas)  # enough inputs to keep every worker busy
    ds = ray.data.from_items(items, override_num_blocks=blocks)
    ds = ds.map_batches(_RayWorker, fn_constructor_kwargs={"load_kwargs": {**load_kwargs, "threads": threads},
                                                           "default_max_tokens": default_max_tokens},
                        batch_size=batch_size, compute=ray.data.ActorPoolStrategy(size=replicas), num_cpus=cpus,
                        batch_format="numpy")
    for row in ds.iter_rows():
        yield json.loads(row["out"])


def write(outputs: Iterable[dict], path: str, total: int | None = None) -> tuple[int, int, float]:
    """Write output objects as JSON lines with a progress bar; returns (lines, errors, seconds).
    Errors are also reported on stderr as they come."""
    from tqdm import tqdm

    start, count, errors = time.perf_counter(), 0, 0
    try:
        f = open(path, "w", encoding="utf-8")
    except OSError as e:
        raise ExactSpecError(f"cannot write {path}: {e.strerror}") from None
    with f, tqdm(total=total, desc="batch", unit="line", file=sys.stderr, disable=None) as bar:
        for output in outputs:
            f.write(json.dumps(output) + "\n")
            count += 1
            if "error" in output:
                errors += 1
                bar.write(f"exactspec: {output['error']}", file=sys.stderr)
            bar.update()
    return count, errors, time.perf_counter() - start
