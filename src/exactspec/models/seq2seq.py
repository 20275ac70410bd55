"""Encoder-decoder adapter: any local `AutoModelForSeq2SeqLM` checkpoint (T5, Flan-T5, mT5, BART).

The decode loop only sees the decoder, through the same `CausalLM` interface as a decoder-only
model: `set_source` runs the encoder ONCE per request and keeps its output; the loop's "prompt" is
then the decoder's start (`decoder_prompt`: decoder_start_token_id, plus BART's forced BOS), and
`forward` / `truncate` move along the decoder's tokens. The KV cache is a transformers
`EncoderDecoderCache`: its self-attention half grows with the decoder and rolls back by `crop`
(transformers 5.x: a negative count of tokens to drop), its cross-attention half (the projection
of the encoder's output, filled by the first decoder forward) only depends on the source, so
rollback, `reset` and every later forward leave it as it is.
"""

from __future__ import annotations

import json
import os

import torch

from ..errors import ExactSpecError
from .base import OneRow
from .torch_hf import cache_kwarg, crop


def is_encoder_decoder(path: str) -> bool:
    """Whether a local checkpoint directory holds an encoder-decoder model (GGUF files never do)."""
    config = os.path.join(path, "config.json")
    if not os.path.isdir(path) or not os.path.exists(config):
        return False
    try:
        with open(config) as f:
            return bool(json.load(f).get("is_encoder_decoder", False))
    except (OSError, ValueError):
        return False


def load_seq2seq_model(path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The transformers encoder-decoder module for a local checkpoint directory, in eval mode."""
    from transformers import AutoModelForSeq2SeqLM

    try:
        model = AutoModelForSeq2SeqLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except Exception as e:  # transformers raises many types for bad files
        raise ExactSpecError(f"cannot load encoder-decoder model from {path}: {type(e).__name__}: {str(e)[:200]}") from None
    return model.eval()


class Seq2SeqLM(OneRow):
    """`CausalLM` over the decoder of a transformers encoder-decoder model (batch 1)."""

    is_encoder_decoder = True

    def __init__(self, module: torch.nn.Module, eos_token_ids: set[int] | None = None):
        from transformers import DynamicCache, EncoderDecoderCache

        self._new_cache = lambda: EncoderDecoderCache(DynamicCache(config=module.config), DynamicCache(config=module.config))
        self.module = module
        self._cache_kw = cache_kwarg(module)  # read once: a signature lookup per step is needless work
        config, generation = module.config, module.generation_config
        self.vocab_size = int(module.get_output_embeddings().weight.shape[0])
        eos = eos_token_ids if eos_token_ids is not None else getattr(generation, "eos_token_id", None)
        if eos is None:
            eos = config.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, (list, tuple, set)) else ([eos] if eos is not None else []))
        start = getattr(generation, "decoder_start_token_id", None)
        start = config.decoder_start_token_id if start is None else start
        if start is None:
            raise ExactSpecError(f"{config.model_type} config has no decoder_start_token_id")
        forced = getattr(generation, "forced_bos_token_id", None)  # BART: generate forces BOS first
        self.decoder_prompt: list[int] = [int(start)] + ([int(forced)] if forced is not None else [])
        # T5 uses relative positions (n_positions is only its training length); BART has learned ones
        self.max_length = int(getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 512))
        self.source_ids: list[int] = []
        self.encoder_output = None
        self.cache = self._new_cache()
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    @torch.inference_mode()
    def set_source(self, source_ids: list[int]) -> None:
        """Run the encoder over the source once; the decoder cache starts empty (cross-attention is
        projected by the first decoder forward and then kept for the whole request)."""
        if not source_ids:
            raise ExactSpecError("the prompt is empty")
        if len(source_ids) > self.max_length:
            raise ExactSpecError(f"source of {len(source_ids)} tokens does not fit the {self.max_length}-token encoder")
        self.source_ids = list(source_ids)
        self.encoder_output = self.module.get_encoder()(input_ids=torch.tensor([source_ids]))
        self.cache = self._new_cache()
        self._length = 0

    def reset(self, batch: int = 1) -> None:
        """Forget the decoder's tokens; the source (and its cross-attention cache) stays."""
        self._set_rows(batch)
        self.truncate(0)

    @torch.inference_mode()
    def forward(self, new_ids: torch.Tensor) -> torch.Tensor:
        if self.encoder_output is None:
            raise ExactSpecError("encoder-decoder model: call set_source(source ids) before decoding")
        k = new_ids.shape[1]
        if self._length + k > self.max_length:
            raise ExactSpecError(f"decoder length {self._length + k} exceeds the model's {self.max_length} tokens")
        out = self.module(encoder_outputs=self.encoder_output, decoder_input_ids=new_ids, use_cache=True,
                          **{self._cache_kw: self.cache})
        self._length += k
        return out.logits.float()  # [1, k, V]

    def prefill(self, new_ids: torch.Tensor) -> None:
        self.forward(new_ids)

    def truncate(self, length: int) -> None:
        self._length = crop(self.cache, self._length, length)  # cross-attention stays (see torch_hf.crop)
