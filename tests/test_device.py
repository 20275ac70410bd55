"""Device-parametrised exactness (CPU always, CUDA when PyTorch sees a GPU; the checks live in
device_checks.py so scripts/gpu-check runs the same ones without pytest), the batch invariance of
the dtype `auto` picks for this CPU, and the device options' errors."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from exactspec.device import cpu_flags, describe, resolve_device, resolve_dtype
from exactspec.errors import ExactSpecError
from exactspec.models.fast_llama import FastLlamaLM

from . import device_checks
from .device_checks import CHECKS


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("device", device_checks.devices())
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_device_check(check, device):
    CHECKS[check](device)


@pytest.mark.usefixtures("one_thread")
def test_negative_control_of_the_verifier_check_fails():
    """The reference comparison is not vacuous: a verifier that drops the acceptance test is caught."""
    import exactspec.verify_torch as vt

    real = vt.verify_rows

    def accept_all(draft_ids, gammas, draft_probs, target_probs, uniforms):
        accepted, nxt = real(draft_ids, gammas, draft_probs, target_probs, uniforms * 0)
        return accepted, nxt

    device_checks.verify_rows = accept_all
    try:
        with pytest.raises(AssertionError):
            device_checks.check_verifier_matches_reference("cpu")
    finally:
        device_checks.verify_rows = real


def block_vs_sequential(lm: FastLlamaLM, ids: torch.Tensor, prefix: int, ks: list[int]) -> dict[int, float]:
    """Max |logits| difference between scoring ids[prefix:] in k-token blocks and one token at a time."""
    def run(k: int) -> torch.Tensor:
        lm.reset()
        lm.prefill(ids[:, :prefix])
        out = [lm.forward(ids[:, s : s + k]) for s in range(prefix, ids.shape[1], k)]
        return torch.cat(out, 1)

    one = run(1)
    diffs = {k: float((run(k) - one).abs().max()) for k in ks}
    lm.reset()
    return diffs


def test_auto_cpu_dtype_is_batch_invariant(embedded):
    """The dtype `auto` picks for this CPU, on the embedded model: logits of a token scored inside a
    k-token block equal scoring it alone, bit for bit in batch-invariant mode (bf16 with native bf16
    dot products, as on an AVX-512 BF16 CPU). fp32 (CPUs without native bf16) is not bit-equal in
    the attention kernel (differences ~1e-9 after attention, ~5e-5 in the logits): there the test
    holds it to that bound and to equal argmaxes, which is what greedy identity needs in practice."""
    dtype = resolve_dtype("auto", torch.device("cpu"))
    module = copy.deepcopy(embedded.target.module).to(dtype)
    lm = FastLlamaLM(module, embedded.target.eos_token_ids)
    assert lm.batch_invariant == (dtype != torch.float32)
    ids = torch.tensor([embedded.encode("Rewrite in the past tense: I walk to school and I see a dog.")])
    ids = torch.cat([ids, torch.randint(0, lm.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))], 1)
    diffs = block_vs_sequential(lm, ids, ids.shape[1] - 16, [2, 5, 8, 16])
    if dtype == torch.bfloat16:
        assert diffs == {2: 0.0, 5: 0.0, 8: 0.0, 16: 0.0}, diffs
    else:
        assert max(diffs.values()) < 1e-3, diffs


@pytest.mark.skipif(resolve_dtype("auto", torch.device("cpu")) != torch.bfloat16, reason="needs native bf16")
def test_bf16_blocks_stay_invariant_across_a_key_block_boundary(embedded):
    """Blocks that cross the 512-key boundary of invariant attention, up to auto γ's widest (33 tokens
    = several 8-query chunks), score each token as scoring it alone does, bit for bit."""
    module = copy.deepcopy(embedded.target.module).to(torch.bfloat16)
    lm = FastLlamaLM(module, embedded.target.eos_token_ids)
    ids = torch.randint(0, lm.vocab_size, (1, 556), generator=torch.Generator().manual_seed(1))
    assert block_vs_sequential(lm, ids, 490, [3, 11, 33]) == {3: 0.0, 11: 0.0, 33: 0.0}


def test_unchunked_bf16_is_not_invariant(embedded):
    """Negative control for the test above: the same bf16 forward without batch-invariant mode drifts."""
    module = copy.deepcopy(embedded.target.module).to(torch.bfloat16)
    lm = FastLlamaLM(module, embedded.target.eos_token_ids, batch_invariant=False)
    ids = torch.randint(0, lm.vocab_size, (1, 132), generator=torch.Generator().manual_seed(0))
    assert max(block_vs_sequential(lm, ids, 100, [4, 32]).values()) > 0


def test_auto_choices_follow_the_hardware():
    cpu = torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    native = bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})
    assert resolve_dtype("auto", cpu) == (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("float16", cpu) == torch.float16
    assert "dtype" in describe(cpu, torch.float32)
    with pytest.raises(ExactSpecError):
        resolve_dtype("float8", cpu)
    with pytest.raises(ExactSpecError):
        resolve_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_device_cuda_without_gpu_is_one_line_exit_2():
    proc = subprocess.run([sys.executable, "-m", "exactspec.cli", "generate", "hi", "--device", "cuda"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("exactspec: error: --device cuda: no CUDA GPU"), proc.stderr
