"""Transformers adapter: any local `AutoModelForCausalLM` checkpoint, or a GGUF file.

GGUF weights are dequantised into ordinary float `nn.Linear` weights on load (a k-token forward then
costs about what dense matmuls cost; packed-GGUF kernels made it 1.7-2.2x a 1-token step here), once:
a GGUF loads from its cached conversion (checkpoint.py), as the transformers-free module of
light_llama.py when only the lean forward will run it.
The KV cache is a transformers `DynamicCache`; rollback is `crop` (which in transformers 5.x takes
the negative number of tokens to drop). Sliding-window and chunked-attention layers keep their whole
history (`rollback_cache`): transformers' window layers drop what falls out of the window, so a rollback
past it cannot be undone, and a verification pass rolls back every iteration.
"""

from __future__ import annotations

import inspect

import torch

from .. import progress
from ..errors import ExactSpecError
from .base import OneRow
from .checkpoint import converted_dir, entry_info, split_path
from .light_llama import load_light
from .light_tokenizer import LightTokenizer


def load_tokenizer(path: str):
    """The tokenizer stored with a local checkpoint (directory or GGUF file; a GGUF's from its cached
    conversion, see checkpoint.py)."""
    local = converted_dir(path)
    directory, gguf = (str(local), None) if local is not None else split_path(path)
    try:
        with progress.timed("tokenizer"):
            if local is not None and entry_info(local).get("light_tokenizer"):
                return LightTokenizer(local)
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(directory, gguf_file=gguf, local_files_only=True)
    except Exception as e:  # transformers raises many types for bad files
        raise ExactSpecError(f"cannot load tokenizer from {path}: {type(e).__name__}: {str(e)[:200]}") from None


def load_hf_model(path: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                  light: bool = False):
    """The transformers module for a local checkpoint, in eval mode, on `device`. `light`: for the lean
    forward only, a converted GGUF may come as the bare weights module of light_llama.py (no transformers)."""
    local = converted_dir(path)
    directory, gguf = (str(local), None) if local is not None else split_path(path)
    try:
        with progress.timed("load"):
            if light and local is not None and entry_info(local).get("light_model"):
                return load_light(local).to(device=device, dtype=dtype)
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=dtype, local_files_only=True)
    except Exception as e:
        raise ExactSpecError(f"cannot load model from {path}: {type(e).__name__}: {str(e)[:200]}") from None
    return model.to(device).eval()


class HFCausalLM(OneRow):
    """`CausalLM` over a transformers model with one sequence (batch 1) and a DynamicCache."""

    def __init__(self, module: torch.nn.Module, eos_token_ids: set[int] | None = None):
        self.module = module
        self._cache_kw = cache_kwarg(module)  # read once: a signature lookup per step is needless work
        self.device = next(module.parameters()).device
        config = module.config
        self.vocab_size = int(module.get_output_embeddings().weight.shape[0])
        eos = eos_token_ids if eos_token_ids is not None else getattr(module.generation_config, "eos_token_id", None)
        if eos is None:
            eos = config.eos_token_id
        self.eos_token_ids = set(eos if isinstance(eos, (list, tuple, set)) else ([eos] if eos is not None else []))
        self.max_length = int(getattr(config, "max_position_embeddings", 2048))
        self.reset()

    @property
    def length(self) -> int:
        return self._length

    def reset(self, batch: int = 1) -> None:
        self._set_rows(batch)
        self.cache = rollback_cache(self.module.config)
        self._length = 0

    @torch.inference_mode()
    def forward(self, new_ids: torch.Tensor) -> torch.Tensor:
        k = new_ids.shape[1]
        if self._length + k > self.max_length:
            raise ExactSpecError(f"context length {self._length + k} exceeds the model's {self.max_length} tokens")
        positions = torch.arange(self._length, self._length + k, device=self.device)[None]  # [1, k]
        out = self.module(input_ids=new_ids.to(self.device), position_ids=positions, use_cache=True,
                          **{self._cache_kw: self.cache})
        self._length += k
        return out.logits.float()  # [1, k, V]

    def prefill(self, new_ids: torch.Tensor) -> None:
        """`forward`, logits dropped (transformers computes them anyway)."""
        self.forward(new_ids)

    def truncate(self, length: int) -> None:
        self._length = crop(self.cache, self._length, length)


def cache_kwarg(module: torch.nn.Module) -> str:
    """The name a transformers forward takes its KV cache by: `cache` from transformers 5.24 on (where
    `past_key_values` warns until 5.40), `past_key_values` before (where `cache` is swallowed by
    **kwargs and the model runs with no cache at all)."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def rollback_cache(config):
    """A DynamicCache for `config` that rolls back to any length: its sliding-window and chunked layers
    are whole-history layers. Their attention masks still apply the window (transformers builds the
    window mask from the config, over whatever keys the layer holds), so the logits are the windowed
    model's; the memory is a full layer's."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache(config=config)
    cache.layers = [DynamicLayer() if isinstance(layer, DynamicSlidingWindowLayer) else layer for layer in cache.layers]
    return cache


def crop(cache, cached: int, length: int) -> int:
    """Roll a transformers cache holding `cached` tokens back to `length` (transformers 5.x: `crop(-n)`
    drops the last n; an EncoderDecoderCache crops its self-attention half only). Returns `length`."""
    if length > cached:
        raise ValueError(f"cannot truncate to {length}: only {cached} tokens cached")
    if length < cached and any(cache.is_linear):
        raise ExactSpecError("this model's recurrent layers (linear attention or convolution states) cannot roll "
                             "back a rejected draft: decode it with --gamma 0")
    if length < cached:
        cache.crop(length - cached)
    return length
