"""exactspec: exact speculative decoding for local Transformer language models."""

from .decode import decode
from .drafters.base import Drafter, Proposal
from .drafters.model import ModelDrafter
from .drafters.ngram import NGramDrafter, PromptLookupDrafter
from .engine import Engine, GenerationResult, load
from .errors import ExactSpecError
from .sampling import SamplingParams, warp
from .stats import Stats
from .verify import verify, verify_with_uniforms

__all__ = [
    "decode", "Drafter", "Proposal", "ModelDrafter", "NGramDrafter", "PromptLookupDrafter", "Engine",
    "GenerationResult", "load", "ExactSpecError", "SamplingParams", "warp", "Stats", "verify",
    "verify_with_uniforms",
]
