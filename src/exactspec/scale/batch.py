"""Offline batch generation over a JSON-lines file: in-process (`Engine.generate_batch`) or on Ray Data.

Each input line is one request, with the server's fields (server/schemas.py):
    {"id": "q1", "prompt": "raw text"}                        # as /v1/completions: no chat template
    {"id": "q2", "messages": [{"role": "user", "content": "..."}], "max_tokens": 64, "temperature": 0}
and optional `seed`, `stop`, `top_p`, `top_k`, `min_p`, `gamma`. Defaults are the server's (OpenAI's
temperature 1), except the token budget: `max_tokens` (or `max_completion_tokens`) if the line sets
it, else the command's --max-tokens; either way at most what the context leaves. Each output line,
in input order, is {"id", "text", "token_ids", "finish_reason", "stats"}, or {"id", "error"} for a
line that cannot run (the error names its line number); a bad line never stops the others.

A chunk of lines is decoded as batches: the lines with the same sampling options form ONE
`generate_batch` call, each line keeping its own seed, so every output is what a lone request with
that seed gives. On Ray (`replicas`), chunks go to `map_batches` over an actor pool of engines
(one `_RayWorker` per worker: `ActorPoolStrategy(size=replicas)`,
what Ray < 2.51 spelled `concurrency=replicas`); the file's order is kept.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ..errors import ExactSpecError

Line = tuple[int, str]  # (1-based line number, raw text)
OPTION_FIELDS = ("temperature", "top_k", "top_p", "min_p", "gamma")


@dataclass
class _Request:
    line: int
    id: object
    prompt: str | list[dict]
    seed: int | None
    options: dict  # generate_batch keywords except prompts and seed

    def group(self) -> str:
        return json.dumps(self.options, sort_keys=True)


def _parse(engine, line: int, raw: str, default_max_tokens: int) -> _Request:
    """A line -> a request checked against this engine (fields, prompt, context); ExactSpecError if bad."""
    from pydantic import ValidationError

    from ..server.schemas import ChatCompletionRequest, CompletionRequest

    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ExactSpecError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ExactSpecError("expected a JSON object")
    chat = "messages" in obj
    if not chat and "prompt" not in obj:
        raise ExactSpecError('needs "prompt" (raw text) or "messages" (chat)')
    try:
        body = (ChatCompletionRequest if chat else CompletionRequest).model_validate(obj)
    except ValidationError as e:
        first = e.errors()[0]
        raise ExactSpecError(f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None
    if body.n != 1:
        raise ExactSpecError("n must be 1 in a batch line (repeat the line with other seeds instead)")
    prompt = body.chat() if chat else body.text()
    try:
        ids = engine.encode(prompt, chat_template=False)
    except Exception as e:  # a chat template refusing the messages
        raise ExactSpecError(f"cannot encode the prompt: {e}") from None
    context = engine.target.max_length
    if not ids or len(ids) >= context:
        raise ExactSpecError(f"the prompt has {len(ids)} tokens; this model's context is {context} tokens")
    explicit = "max_tokens" in obj or "max_completion_tokens" in obj
    budget = min(body.token_budget() if explicit else default_max_tokens, context - len(ids))
    options = {name: getattr(body, name) for name in OPTION_FIELDS}
    options.update(max_new_tokens=budget, stop=body.stop_list())
    return _Request(line, obj.get("id"), prompt, body.seed, options)


def _result_line(request: _Request, result) -> dict:
    return {"id": request.id, "text": result.text, "token_ids": result.token_ids,
            "finish_reason": result.finish_reason, "stats": result.stats.to_dict()}


def _error_line(line: int, id_: object, error: Exception) -> dict:
    return {"id": id_, "error": f"line {line}: {error}"}


def _raw_id(raw: str) -> object:
    try:
        obj = json.loads(raw)
        return obj.get("id") if isinstance(obj, dict) else None
    except json.JSONDecodeError:
        return None


def _generate(engine, requests: list[_Request]) -> list[dict]:
    """One `generate_batch` for requests sharing options (one seed per line)."""
    results, _ = engine.generate_batch([r.prompt for r in requests], seed=[r.seed for r in requests],
                                       chat_template=False, **requests[0].options)
    return [_result_line(r, res) for r, res in zip(requests, results)]


def run_lines(engine, lines: list[Line], default_max_tokens: int = 256) -> list[dict]:
    """Output objects for `lines`, in their order. Lines with the same options decode as one batch; a
    batch that fails is retried line by line, so only its bad lines carry errors."""
    out: dict[int, dict] = {}
    groups: dict[str, list[_Request]] = {}
    for line, raw in lines:
        try:
            request = _parse(engine, line, raw, default_max_tokens)
        except ExactSpecError as e:
            out[line] = _error_line(line, _raw_id(raw), e)
            continue
        groups.setdefault(request.group(), []).append(request)
    for requests in groups.values():
        try:
            outputs = _generate(engine, requests)
        except Exception:
            outputs = []
            for r in requests:
                try:
                    outputs += _generate(engine, [r])
                except Exception as e:
                    outputs.append(_error_line(r.line, r.id, e))
        for r, output in zip(requests, outputs):
            out[r.line] = output
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
