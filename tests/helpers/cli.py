"""Running `exactspec` as a user does (a subprocess, stdin closed) and checking a refusal is one clear line."""

from __future__ import annotations

import os
import subprocess
import sys

ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}


def exactspec(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exactspec.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV, stdin=subprocess.DEVNULL)


def assert_one_line_error(proc: subprocess.CompletedProcess, words: str) -> None:
    """Exit 2 and one error line, last; before it at most exactspec's own status lines ("loading ...")."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("exactspec: error:")]
    assert errors == lines[-1:] and words in errors[0], proc.stderr
    assert all(line.startswith("exactspec: ") for line in lines), proc.stderr
