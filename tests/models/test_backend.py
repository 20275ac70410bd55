"""`--backend auto`: which engine runs the target, and the one-line fallback when llama.cpp cannot."""

from __future__ import annotations

import os
import subprocess
import sys

from exactspec.embedded import embedded_model_path
from exactspec.loading import choose_backend

from ..conftest import tiny_llama


def test_auto_picks_llamacpp_for_a_gguf_on_the_cpu_and_torch_otherwise(tmp_path):
    gguf = embedded_model_path()
    tiny = tmp_path / "tiny"
    tiny_llama(0, vocab=16).save_pretrained(tiny)
    assert choose_backend(gguf, "prompt-lookup", "auto", "cpu")[0] == "llama.cpp"
    assert choose_backend(gguf, "auto", None, "auto")[0] == "llama.cpp"
    assert choose_backend(str(tiny), "prompt-lookup", "auto", "cpu") == ("torch", "the target is not a GGUF file")
    assert choose_backend(gguf, "prompt-lookup", "float32", "cpu")[0] == "torch"  # a dtype is a torch notion
    assert choose_backend(gguf, str(tiny), "auto", "cpu")[0] == "torch"  # an HF draft model needs torch
    assert choose_backend(str(tmp_path / "missing.gguf"), "none", "auto", "cpu")[0] == "torch"  # torch names it


def test_auto_falls_back_to_torch_in_one_line_when_llamacpp_cannot_load():
    """llama_cpp made unimportable in a real process: the embedded GGUF still decodes, on torch, and stderr
    says why in one line."""
    code = ("import sys; sys.modules['llama_cpp'] = None\n"
            "from exactspec import progress; progress.enable()\n"
            "import exactspec; e = exactspec.load(draft='none', gamma=0)\n"
            "print(e.backend, len(e.generate('Say hi.', max_new_tokens=2, temperature=0).token_ids))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["torch", "2"], proc.stdout
    fallback = [line for line in proc.stderr.splitlines() if "backend" in line]
    assert len(fallback) == 1 and fallback[0].startswith("exactspec: backend torch: llama.cpp cannot run"), proc.stderr
