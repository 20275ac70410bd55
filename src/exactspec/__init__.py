"""exactspec: exact speculative decoding for local Transformer language models.

The public names are imported on first use (PEP 562), so `exactspec --version`, `theory` or
`import exactspec` do not pay for torch until a model is needed."""

from __future__ import annotations

import importlib

from ._version import __version__

_EXPORTS = {
    "decode": ".speculative.loop", "Drafter": ".speculative.interfaces", "Proposal": ".speculative.interfaces", "ModelDrafter": ".drafters.model",
    "NGramDrafter": ".drafters.ngram", "PromptLookupDrafter": ".drafters.suffix", "Engine": ".engine",
    "GenerationResult": ".generation", "load": ".engine", "ExactSpecError": ".errors", "SamplingParams": ".speculative.sampling",
    "warp": ".speculative.sampling", "Stats": ".stats", "verify": ".speculative.verify", "verify_with_uniforms": ".speculative.verify",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'exactspec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
