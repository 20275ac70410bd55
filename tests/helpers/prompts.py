"""Real prompts for greedy-identity checks on the embedded model."""

from __future__ import annotations

REAL_PROMPTS = [
    "Rewrite this sentence in the past tense: I walk to the shop and I buy some bread.",
    "Rename the variable x to count in this code:\n\nx = 0\nfor item in items:\n    x += 1\nprint(x)",
    "What is the capital of France?",
]
