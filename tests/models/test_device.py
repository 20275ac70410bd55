"""Device-parametrised exactness (CPU always, CUDA when PyTorch sees a GPU; the checks live in
device_checks.py so scripts/gpu-check runs the same ones without pytest), the batch invariance of
the layout `dtype auto` picks by self-test on this CPU (with a planted-bug control), and the device
options' errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from exactspec import device
from exactspec.device import describe, resolve_device, resolve_dtype
from exactspec.embedded import embedded_model_path
from exactspec.errors import ExactSpecError
from exactspec.models import layouts
from exactspec.models.fast_llama import FastLlamaLM

from ..helpers import device_checks
from ..helpers.device_checks import CHECKS


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("device", device_checks.devices())
@pytest.mark.parametrize("check", sorted(CHECKS))
def test_device_check(check, device):
    CHECKS[check](device)


@pytest.mark.usefixtures("one_thread")
def test_negative_control_of_the_verifier_check_fails():
    """The reference comparison is not vacuous: a verifier that drops the acceptance test is caught."""
    import exactspec.speculative.verify_torch as vt

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


def test_the_layout_auto_picks_is_bit_equal_across_a_key_block_boundary(embedded):
    """Whatever this CPU is, the layout `dtype auto` picks for the embedded model by its self-test (the
    entry a user's load reads, measured now if this machine has none) scores a token inside a block (of 3,
    11 or 19 tokens, crossing invariant attention's ATTN_BLOCK-key boundary and its 8-row chunks) exactly
    as scoring it alone, bit for bit: other blocks, another context than the self-test's. If no layout
    passed, the fallback is float32 and the engine says greedy identity is by tolerance."""
    module = embedded.target.module  # float32; the trials cast copies
    choice = layouts.choose_layout(module, embedded_model_path())
    assert {t.layout for t in choice.trials} == {c.name for c in layouts.CANDIDATES}
    layout = layouts.layout_named(choice.layout)
    lm = FastLlamaLM(module, set(), batch_invariant=layout.batch_invariant, dtype=layout.dtype)
    ids = torch.randint(0, lm.vocab_size, (1, 523), generator=torch.Generator().manual_seed(1))
    diff = layouts.compare_blocks(lm, ids, 490, (3, 11, 19), stop_early=False)
    if choice.exact:
        assert diff == 0.0, (choice, diff)
    else:
        assert layout == layouts.FALLBACK and "tolerance" in choice.describe() and diff < 1e-3, (choice, diff)


def test_a_layout_that_is_not_bit_equal_fails_the_self_test(tmp_path, monkeypatch):
    """Negative control, on any CPU: a forward that adds 2^-20 to the logits of blocks (a planted
    batch-variance) fails every candidate, and auto falls back to float32 saying "by tolerance". (On a
    tiny random Llama: the planted drift fails any model; the real model's pick is tested above.)"""
    monkeypatch.setenv("EXACTSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(layouts, "START", 24)  # the planted drift shows at any context: a short one is enough
    real = FastLlamaLM.forward_rows

    def drifting(self, new_ids, logits=True):
        out = real(self, new_ids, logits)
        return out + 2.0 ** -20 if out is not None and new_ids.shape[1] > 1 else out

    monkeypatch.setattr(FastLlamaLM, "forward_rows", drifting)
    module = device_checks.tiny_llama(0, "cpu", 64, 8.0, 2)
    choice = layouts.choose_layout(module, None)
    assert not choice.cached and {t.layout for t in choice.trials} == {c.name for c in layouts.CANDIDATES}
    assert not any(t.bit_equal for t in choice.trials) and all(t.max_diff > 0 for t in choice.trials)
    assert choice.layout == "float32" and not choice.exact and "tolerance" in choice.describe()
    again = layouts.choose_layout(module, None)  # the second choice comes from the cache
    assert again.cached and again.layout == choice.layout and again.trials == choice.trials


def test_layout_pick_prefers_the_fastest_step_then_the_fastest_block():
    trial = lambda name, ok, t1, t8: layouts.Trial(name, ok, 0.0 if ok else 1.0, t1, t8)  # noqa: E731
    assert layouts.pick([trial("bfloat16-invariant", True, 42.0, 45.0),
                         trial("float32-invariant", True, 60.0, 61.0)]).layout == "bfloat16-invariant"
    assert layouts.pick([trial("bfloat16-invariant", True, 42.0, 45.0),
                         trial("float32-invariant", True, 41.0, 80.0)]).layout == "bfloat16-invariant"
    assert layouts.pick([trial("bfloat16-invariant", False, None, None),
                         trial("float32-invariant", True, 60.0, 61.0)]).layout == "float32-invariant"
    assert layouts.pick([trial("float32", False, None, None)]).exact is False


@pytest.mark.parametrize("model,flags,label", [
    ("1", "fpu avx2 fma", "AMD EPYC (family 25 model 1; flags: avx2)"),
    ("17", "avx2 avx512f avx512_bf16 avx512_vnni", "AMD EPYC (family 25 model 17; flags: avx2 avx512_bf16 avx512_vnni avx512f)"),
])
def test_figures_name_the_cpu_beyond_its_model_name(monkeypatch, model, flags, label):
    """One VM reported "AMD EPYC" as a Zen 3 (AVX2) one day and a Zen 4 (AVX-512 BF16) the next: the
    label every figure carries tells them apart (the field "model" is not the prefix of "model name")."""
    info = {"model name": "AMD EPYC", "cpu family": "25", "model": model, "flags": flags}
    monkeypatch.setattr(device, "_cpuinfo", info.get)
    assert device.cpu_label() == label
    assert label in describe(torch.device("cpu"), torch.float32)


def test_cpuinfo_fields_are_read_by_their_whole_name(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("model name\t: AMD EPYC\ncpu family\t: 25\nmodel\t\t: 1\nflags\t\t: fpu avx2\n")  # "model" after "model name"
    read = lambda field: device._cpuinfo(field, str(path))  # noqa: E731
    assert (read("cpu family"), read("model"), read("model name"), read("flags")) == ("25", "1", "AMD EPYC", "fpu avx2")
    assert read("stepping") is None and device._cpuinfo("model", str(tmp_path / "none")) is None


def test_auto_choices_follow_the_hardware():
    cpu = torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", cpu) == torch.float32  # loading; the lean forward's layout is self-tested
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


def test_gpu_check_script_runs_on_the_cpu(tmp_path):
    """scripts/gpu-check (what a lent GPU runs) imports what exists and measures a tiny shape: an import
    it swallows into its report (as the renamed `exactspec.spec` once was) fails here, not on the GPU."""
    script = device_checks.__file__.replace("tests/helpers/device_checks.py", "scripts/gpu-check")
    done = subprocess.run([sys.executable, script, "--smoke", "--skip-checks", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert done.returncode == 0 and report["errors"] == [], done.stdout[-2000:] + done.stderr[-2000:]
    assert [s["shape"] for s in report["shapes"]] == ["tiny"] and report["shapes"][0]["plain_tokens_per_s"] > 0


def test_the_cache_goes_by_the_name_the_forward_takes():
    """transformers 5.24 takes the KV cache as `cache`; 5.17 (the lent GPU's) as `past_key_values`, and
    swallowed `cache=` into **kwargs: the model then ran without a cache (gpu-check, H200). Both names
    are read from the signature, the deprecation wrapper's included."""
    from exactspec.models.torch_hf import cache_kwarg

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs):
            return input_ids

    assert cache_kwarg(Old()) == "past_key_values"
    assert cache_kwarg(device_checks.tiny_llama(0, "cpu")) == "cache"
