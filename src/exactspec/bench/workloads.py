"""Benchmark workloads shipped with the package: `grounded` (the answer copies the prompt: edits,
rewrites, conversions, summaries), `chat` (open questions) and `edit` (apply a small change to a 150-400
token code or prose file and return the whole file: the answer is a long copy with an edit in it)."""

from __future__ import annotations

from importlib import resources

WORKLOADS = ("grounded", "chat", "edit")


def load_workload(name: str) -> list[str]:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}: choose from {', '.join(WORKLOADS)}")
    text = resources.files(__package__).joinpath("workloads", f"{name}.txt").read_text()
    return [p.strip() for p in text.split("\n===\n") if p.strip()]
