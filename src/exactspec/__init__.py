"""exactspec: exact speculative decoding for local Transformer language models."""

from .spec.loop import decode
from .spec.interfaces import Drafter, Proposal
from .drafters.model import ModelDrafter
from .drafters.ngram import NGramDrafter, PromptLookupDrafter
from .engine import Engine, GenerationResult, load
from .errors import ExactSpecError
from .spec.sampling import SamplingParams, warp
from .stats import Stats
from .spec.verify import verify, verify_with_uniforms

__all__ = [
    "decode", "Drafter", "Proposal", "ModelDrafter", "NGramDrafter", "PromptLookupDrafter", "Engine",
    "GenerationResult", "load", "ExactSpecError", "SamplingParams", "warp", "Stats", "verify",
    "verify_with_uniforms",
]
