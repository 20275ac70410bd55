"""What a request sets, checked without torch: the sampling parameters, γ and the drafter's name. The
CLI and the server refuse bad settings with these before anything slow is imported or loaded."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import ExactSpecError, FieldError

# Prompt tokens the scheduler prefills per iteration while other rows decode (chunked prefill, batching.py):
# a long prompt joining delays the running streams by about one chunk's prefill, not its whole prompt's.
# With a per-row attention kernel (a q8_0-K cache) chunks cost no throughput; with TILED PREFILL neither,
# on make setup's build (its second patch hands ggml's threads whole 64-row tiles: a 3,072-token prompt in
# 64-token chunks took 9.7 s, in 512-token passes 9.9 s, Zen 5). 128-token chunks got a joining 3.3k-token
# prompt's first token ~10% sooner but let a running stream's worst gap reach 0.9-1.1 s, so 64 stays.
PREFILL_CHUNK = 64

VERIFICATIONS = ("token", "block")  # SamplingParams.verification: per draft token, or the block jointly

MIN_TEMPERATURE = 1e-5  # below it (and 0) sampling is greedy: logits / T would overflow to inf and NaN


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into a distribution. Defaults sample from the raw model (T=1); a temperature
    below MIN_TEMPERATURE is greedy (the limit of the tempered law, without its overflow)."""

    temperature: float = 1.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables
    min_p: float = 0.0  # 0 disables
    # Not a warp but the verifier's acceptance rule: 1 is exact; L in (0, 1) accepts more drafts and is
    # LOSSY (the output law moves towards the drafter's; see verify.py). Here so it travels with a request.
    lenience: float = 1.0
    # The verifier's rule for drafts with a real law (a draft model, bigram, unigram): "token" (default)
    # checks each draft in turn (Leviathan et al.); "block" verifies the block jointly (Sun et al. 2025,
    # verify.verify_block_with_uniforms): exact too, and never fewer accepted drafts in expectation.
    # Point-mass drafts (prompt lookup, suffix, grammar-forced) keep the coupled token rule either way.
    verification: str = "token"

    def __post_init__(self) -> None:
        if not (self.temperature >= 0) or self.temperature == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (0.0 < self.lenience <= 1.0):
            raise ValueError(f"lenience must be in (0, 1] (1 = exact; smaller is lossy), got {self.lenience}")
        if self.verification not in VERIFICATIONS:
            raise ValueError(f"verification must be one of {', '.join(VERIFICATIONS)}, got {self.verification!r}")
        if self.verification == "block" and self.lenience != 1:  # a FieldError: the server's 400 names the field
            raise FieldError("block verification is exact only: lenience < 1 applies to verification='token'",
                             "verification")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


def sampling_mode(params: SamplingParams) -> str:
    """"greedy" or "sampled": half of the key a copy's acceptance is learned under (autogamma's
    `Acceptance.of`), since a sampled row keeps a copied token less often than a greedy one."""
    return "greedy" if params.greedy else "sampled"


def check_gamma(gamma: int | str) -> int | str:
    """γ is an integer >= 0 (an int or its digits) or "auto"."""
    if gamma == "auto":
        return gamma
    valid = isinstance(gamma, int) and not isinstance(gamma, bool) or isinstance(gamma, str) and gamma.isdigit()
    if not valid or int(gamma) < 0:
        raise ExactSpecError(f"gamma must be an integer >= 0 or 'auto', got {gamma!r}")
    return int(gamma)


DRAFT_NAMES = ("prompt-lookup", "suffix", "bigram", "unigram", "auto", "none")
# Drafters whose drafts are point masses (copies, or no drafter: grammar-forced tokens alone): verified by
# the coupled token rule whatever `verification` (a seeded text is plain decoding's, verify.verify_coupled)
POINT_MASS_DRAFTS = ("prompt-lookup", "suffix", "none")


def check_draft(draft: str) -> str:
    """A drafter's name, or the path of a draft model that exists."""
    if draft not in DRAFT_NAMES and not os.path.exists(draft):
        raise ExactSpecError(f"unknown draft {draft!r}: choose one of {', '.join(DRAFT_NAMES)} or a model path")
    return draft
