"""Sliding-window and chunked attention on the torch backend (issue #57): a verification pass rolls the
cache back every iteration, and transformers' window layers cannot roll back once the window is full
(`crop` raised inside auto γ's T(k) measurement at depth). Tiny random configs with a 6-token window:
every path that rolls back (the adapter's truncate, the cost measurement at depth, the decode loop
with a fixed and an automatic γ) runs far past the window."""

from __future__ import annotations

import pytest
import torch

from exactspec.drafters.suffix import PromptLookupDrafter
from exactspec.autogamma.measure import measure_depths
from exactspec.errors import ExactSpecError
from exactspec.models.torch_hf import HFCausalLM
from exactspec.autogamma.policy import AutoGamma
from exactspec.autogamma.costs import CostModel
from exactspec.speculative.loop import decode
from exactspec.speculative.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, WINDOW = 16, 6


def windowed(kind: str, window: int | None = WINDOW, seed: int = 0) -> torch.nn.Module:
    """A tiny random model of `kind` whose attention looks `window` tokens back (None: no window)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    if kind == "gemma3":  # three window layers, then a global one, as Gemma 3 alternates them
        layers = ["sliding_attention"] * 3 + ["full_attention"]
        config = Gemma3TextConfig(**common, head_dim=8, sliding_window=window or 512,
                                  layer_types=layers if window else ["full_attention"] * 4)
        model = Gemma3ForCausalLM(config)
    else:  # Mistral-style: every layer windowed
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=window))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # laws far from uniform, so drafts can disagree
    return model.eval()


@pytest.mark.parametrize("kind", ["gemma3", "mistral"])
def test_rollback_past_the_window_keeps_the_windowed_logits(kind):
    """Verification-shaped passes (k tokens, then a rollback into them) far past the window: every logit
    equals a cache-free forward of the whole sequence, which applies the window by its mask. Control: the
    same weights without a window give other logits, so the window is in force."""
    module = windowed(kind)
    ids = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        whole = module(input_ids=ids).logits.float()[0]  # [64, V]
        unwindowed = windowed(kind, window=None)
        unwindowed.load_state_dict(module.state_dict())
        assert not torch.allclose(unwindowed(input_ids=ids).logits.float()[0, 20:], whole[20:], atol=1e-3)
    lm = HFCausalLM(module, set())
    lm.prefill(ids[:, :20])
    for start, k, keep in [(20, 5, 21), (21, 8, 29), (29, 3, 29), (29, 1, 30), (30, 9, 34), (34, 6, 40)]:
        assert lm.length == start
        got = lm.forward(ids[:, start : start + k])[0]
        torch.testing.assert_close(got, whole[start : start + k], atol=1e-4, rtol=0)
        lm.truncate(keep)
    lm.truncate(12)  # back inside the prefill, past many windows
    torch.testing.assert_close(lm.forward(ids[:, 12:48])[0], whole[12:48], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["gemma3", "mistral"])
def test_auto_gamma_measures_at_depth_and_decodes_greedy_identical(kind):
    """The crash as a user met it: auto γ measures T(k) at depths far past the window (each timed pass
    rolled back), then the loop with auto and with a fixed γ equals plain greedy decoding."""
    lm = HFCausalLM(windowed(kind), set())
    depths, curves = measure_depths(lm, 4)
    assert depths[0] > WINDOW and all(len(c) == 4 and min(c) > 0 for c in curves)
    greedy = SamplingParams(temperature=0)
    prompt = [3, 5, 2, 3, 5, 7, 2, 3, 5, 2, 9, 4] * 3
    plain = list(decode(lm, None, prompt, greedy, 0, 40))
    assert list(decode(lm, PromptLookupDrafter(), prompt, greedy, 4, 40, torch.Generator())) == plain
    auto = AutoGamma(CostModel(target_s=curves[0], draft_s_per_token=0.0), prior_alpha=0.9)
    assert list(decode(lm, PromptLookupDrafter(), prompt, greedy, auto, 40, torch.Generator())) == plain


def test_a_cache_that_cannot_roll_back_is_refused_by_name():
    """A recurrent layer (linear attention) keeps no per-token state to roll back: a clear error that says
    what to do, never transformers' RuntimeError from inside `crop`; a full cache still rolls back."""
    from transformers import DynamicCache

    from exactspec.models.torch_hf import crop, rollback_cache

    class Recurrent:
        model_type = "recurrent-test"
        layer_types = ["linear_attention", "full_attention"]
        per_layer_config = [None, None]

        def get_text_config(self, decoder=True):
            return self

    cache = rollback_cache(Recurrent())
    assert crop(cache, 10, 10) == 10  # nothing to drop: fine
    with pytest.raises(ExactSpecError, match="recurrent layers .* --gamma 0"):
        crop(cache, 10, 8)
    full = DynamicCache()
    full.update(torch.zeros(1, 1, 10, 4), torch.zeros(1, 1, 10, 4), 0)
    assert crop(full, 10, 8) == 8 and full.get_seq_length() == 8
