"""Benchmark workloads shipped with the package (data files in workloads/):

- `grounded`: the answer copies the prompt (edits, rewrites, conversions, summaries);
- `chat`: open questions;
- `edit`: apply a small change to a 150-400 token code or prose file and return the whole file (a long
  copy with an edit in it);
- `short`: answers of a few tokens (a tool name, yes / no, a one-line reply), as agents get them: what
  the defaults must not slow down, with nothing to gain;
- `paraphrase`, `translate`: draft-hostile: the prompt holds a text the answer must NOT copy (rewritten
  in other words, or in another language), so copies are proposed and rejected: what the defaults must
  not lose on;
- `json`: structured output (extraction and tool-call prompts, each with a JSON schema its answer must
  follow: `{"name", "max_new_tokens", "prompt", "schema"}` per line of json.jsonl; string lengths and
  array sizes are bounded so that every answer the schema allows fits `max_new_tokens`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

WORKLOADS = ("grounded", "chat", "edit", "short", "paraphrase", "translate", "json")
CONSTRAINED = ("json",)  # workloads whose cases carry a response_format


@dataclass(frozen=True)
class Case:
    prompt: str
    response_format: dict | None = None  # OpenAI's {"type": "json_schema", ...}; None: free text
    max_new_tokens: int | None = None  # the case's own budget (json: room for any answer its schema allows)


def load_cases(name: str) -> list[Case]:
    """The workload's prompts, with their constraints (json)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}: choose from {', '.join(WORKLOADS)}")
    folder = resources.files(__package__).joinpath("workloads")
    if name in CONSTRAINED:
        lines = folder.joinpath(f"{name}.jsonl").read_text().splitlines()
        return [_json_case(json.loads(line)) for line in lines if line.strip()]
    text = folder.joinpath(f"{name}.txt").read_text()
    return [Case(p.strip()) for p in text.split("\n===\n") if p.strip()]


def load_workload(name: str) -> list[str]:
    """The workload's prompts alone (their constraints dropped)."""
    return [case.prompt for case in load_cases(name)]


def _json_case(item: dict) -> Case:
    schema = {"name": item["name"], "schema": item["schema"], "strict": True}
    return Case(item["prompt"], {"type": "json_schema", "json_schema": schema}, item.get("max_new_tokens"))


def schema_valid(text: str, response_format: dict) -> bool:
    """Does `text` parse as JSON and follow the response_format's schema?"""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError:
        return False
    schema = response_format.get("json_schema", {}).get("schema", {"type": "object"})
    return jsonschema.Draft202012Validator(schema).is_valid(value)
