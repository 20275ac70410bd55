"""The lean Llama forward computes what transformers computes, rolls back by length, and in batch-invariant
mode prefills in a decode step's shapes."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from exactspec.models.fast_llama import ATTN_BLOCK, PREFILL_SPAN, FastLlamaLM, supports
from exactspec.models.light_llama import hf_module
from exactspec.models.torch_hf import HFCausalLM

from ..conftest import tiny_llama


def test_tiny_logits_match_transformers_through_rollbacks():
    """Prefill (no logits), then forwards and truncations: both adapters give the same logits."""
    module = tiny_llama(3, vocab=16)
    hf, fast = HFCausalLM(module, set()), FastLlamaLM(module, set(), capacity=8)  # capacity grows
    ids = torch.randint(0, 16, (1, 40), generator=torch.Generator().manual_seed(0))
    for lm in (hf, fast):
        assert lm.prefill(ids[:, :10]) is None and lm.length == 10
    for start, k, keep in [(10, 4, 12), (12, 6, 15), (15, 1, 16), (16, 9, 25)]:
        a, b = hf.forward(ids[:, start : start + k]), fast.forward(ids[:, start : start + k])
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
        hf.truncate(keep)
        fast.truncate(keep)
    assert fast.length == 25


def test_embedded_model_matches_transformers(embedded):
    target = embedded.target
    assert isinstance(target, FastLlamaLM) and supports(target.module)
    hf = HFCausalLM(hf_module(target.module), target.eos_token_ids)
    ids = torch.tensor([embedded.encode("Name three colours.")])
    a, b = hf.forward(ids), target.forward(ids) if target.reset() is None else None
    assert torch.allclose(a, b, atol=1e-4)
    target.reset()


def test_embedded_greedy_equals_transformers_generate(embedded):
    ids = embedded.encode("Rewrite in the past tense: I walk to school.")
    ours = embedded.generate("Rewrite in the past tense: I walk to school.", max_new_tokens=24, temperature=0, gamma=4)
    eos = sorted(embedded.target.eos_token_ids)
    with torch.inference_mode():
        out = hf_module(embedded.target.module).generate(input_ids=torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                              eos_token_id=eos, pad_token_id=eos[0])
    assert ours.token_ids == out[0, len(ids):].tolist()


class _Shapes(TorchFunctionMode):
    """Records the shape of every matmul, row-wise mean and fused attention the forward calls: a matrix
    product by its operands' last two dims (the leading ones batch it), F.linear by input and weight."""

    RECORDED = {"linear", "matmul", "mean", "scaled_dot_product_attention"}  # `a @ b` arrives as matmul

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.RECORDED:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            whole = name == "linear"  # F.linear's weight is one matrix; the input's leading dims are rows
            self.seen.add((name, tuple(tensors[0].shape[-2:]),
                           *(tuple(t.shape) if whole else tuple(t.shape[-2:]) for t in tensors[1:])))
        return func(*args, **(kwargs or {}))


def _prefill_shapes(invariant: bool) -> tuple[set, set]:
    """(shapes of a decode step, shapes of prefills): two right-padded prompts prefilled together, past a
    prefill span and a key block, and a prompt's rest prefilled after a restored prefix."""
    module = tiny_llama(3, vocab=16)
    module.config.max_position_embeddings = 3 * ATTN_BLOCK  # room for a prompt past a key block
    lm = FastLlamaLM(module, set(), batch_invariant=invariant, dtype=torch.float32)
    ids = torch.randint(0, 16, (2, PREFILL_SPAN + ATTN_BLOCK // 2), generator=torch.Generator().manual_seed(0))
    lm.reset(1)
    lm.prefill(ids[:1, :40])
    with _Shapes() as step:
        lm.forward(ids[:1, 40:41])
    with _Shapes() as prefills:
        lm.reset(2)
        lm.prefill(ids)
        state, _ = lm.snapshot_prefix(20)
        lm.restore_prefix(state, 20)
        lm.prefill(ids[:1, 20:45])
    return step.seen, prefills.seen


def test_a_batch_invariant_prefill_computes_in_a_decode_steps_shapes():
    """By construction, whatever the CPU: in batch-invariant mode every matmul, RMSNorm mean and attention
    product of a prefill has a shape a one-token decode step also uses, and no fused attention runs. So a
    prompt's KV does not depend on what it is prefilled beside, after or in how many pieces, and equals
    the KV decode steps write (the identity self-test, models/layouts.py, then checks the bits). Control:
    outside the mode the prefill's shapes follow the prompt's length."""
    step, prefills = _prefill_shapes(invariant=True)
    assert prefills <= step, prefills - step
    assert not any(name == "scaled_dot_product_attention" for name, *_ in prefills | step)
    step, prefills = _prefill_shapes(invariant=False)
    assert not prefills <= step
