"""Benchmark workloads shipped with the package: `grounded` (the answer copies the prompt: edits,
rewrites, conversions, summaries) and `chat` (open questions)."""

from __future__ import annotations

from importlib import resources

WORKLOADS = ("grounded", "chat")


def load_workload(name: str) -> list[str]:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}: choose from {', '.join(WORKLOADS)}")
    text = resources.files(__package__).joinpath("workloads", f"{name}.txt").read_text()
    return [p.strip() for p in text.split("\n===\n") if p.strip()]
