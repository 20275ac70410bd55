"""Encoder-decoder targets: let a context drafter read the SOURCE text as well as the decoder's tokens.

The decode loop's context for an encoder-decoder target is the decoder's: its start token(s) and
what was generated. Summaries and translations copy from the source, which only the encoder sees,
so prompt lookup (or an n-gram model) over the decoder alone would find nothing to copy. This wrapper
hands the inner drafter `source + generated` instead (the decoder's start tokens and the source's
trailing EOS left out, so a copied span runs on from the source into the output).
"""

from __future__ import annotations

import torch

from ..speculative.sampling import SamplingParams
from ..speculative.interfaces import Drafter, Proposal
from .auto import AutoDrafter
from .model import ModelDrafter


def read_source(drafter: Drafter, source_ids: list[int], decoder_start: int, eos_token_ids: set[int]) -> Drafter:
    """`drafter` made to read the source: context drafters wrapped (each arm of `--draft auto`), a draft
    model left as it is (its own encoder read the source)."""
    if isinstance(drafter, ModelDrafter):
        return drafter
    if isinstance(drafter, AutoDrafter):  # each arm reads the source
        drafter.arms = {name: read_source(arm, source_ids, decoder_start, eos_token_ids)
                        for name, arm in drafter.arms.items()}
        return drafter
    return WithSource(drafter, source_ids, decoder_start, eos_token_ids)


class WithSource:
    """A context drafter that reads an encoder-decoder's source text before the decoder's context."""

    copies = False  # the inner drafter's matches are in the source + context: auto γ does not cut them

    def __init__(self, inner: Drafter, source_ids: list[int], decoder_start: int, eos_token_ids: set[int]):
        self.inner, self.start = inner, decoder_start
        end = len(source_ids)
        while end and source_ids[end - 1] in eos_token_ids:
            end -= 1
        self.source_ids = list(source_ids[:end])

    @property
    def name(self) -> str:
        return self.inner.name

    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None, law=None) -> Proposal:
        # `law` is not passed on: the inner drafter sees another context than the law's prefix. Its
        # drafts then come from its own unmasked law, which stays exact (q is the law it sampled from).
        return self.inner.propose(self.source_ids + context[self.start:], k, params, generator)

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        self.inner.observe(num_proposed, num_accepted)
