"""The real coding-agent CLIs, pinned, from npm (installed once into a cached folder), and a real
`exactspec serve` for them: each CLI is configured only by base URL and key, as its docs say."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

PINNED = {"codex": ("@openai/codex", "0.169.0"), "claude": ("@anthropic-ai/claude-code", "2.1.328"),
          "qwen": ("@qwen-code/qwen-code", "0.24.4")}
KEY = "sk-agent-cli-test"
# A Lark grammar of Codex's patch format (the shape of its free-form `apply_patch` tool's), ours
PATCH_GRAMMAR = ('start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF\nend_patch: "*** End Patch" LF?\n'
                 'hunk: add_hunk | update_hunk\nadd_hunk: "*** Add File: " filename LF add_line+\n'
                 'update_hunk: "*** Update File: " filename LF change?\nfilename: /(.+)/\n'
                 'add_line: "+" /(.*)/ LF -> line\nchange: (change_context | change_line)+\n'
                 'change_context: ("@@" | "@@ " /(.+)/) LF\nchange_line: ("+" | "-" | " ") /(.*)/ LF\n%import common.LF\n')
QUIET = {"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
         "DISABLE_ERROR_REPORTING": "1", "NO_COLOR": "1", "CI": "true"}


def folder() -> Path:
    """Where the pinned CLIs are installed: outside the suite's own cache, so a new clone reuses them."""
    tag = "_".join(f"{name}-{version}" for name, (_, version) in sorted(PINNED.items()))
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = Path(root, "exactspec-agent-clis", tag)
    path.mkdir(parents=True, exist_ok=True)
    return path


def cli(name: str) -> str:
    """The path of a pinned CLI, installed with npm on first use (a lock: two test workers, one install).
    A CLI that cannot be installed fails the test with npm's reason: it never skips."""
    where = folder()
    binary = where / "node_modules" / ".bin" / name
    with open(where / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not binary.exists():
            npm = shutil.which("npm")
            if npm is None:
                pytest.fail("npm is not on PATH: the agent-CLI tests need Node.js and npm", pytrace=False)
            packages = [f"{package}@{version}" for package, version in PINNED.values()]
            done = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(where), *packages],
                                  capture_output=True, text=True, timeout=900)
            if done.returncode != 0 or not binary.exists():
                pytest.fail(f"npm could not install {' '.join(packages)}: {done.stderr.strip()[-800:]}", pytrace=False)
    return str(binary)


class Served:
    """A real `exactspec serve` subprocess on loopback (the embedded model unless `target`), its log read
    for the status of every request it answered."""

    def __init__(self, tmp: Path, *args: str) -> None:
        from .servers import _free_port

        self.port, self.log_path = _free_port(), tmp / "serve.log"
        key_file = tmp / "key"
        key_file.write_text(KEY)
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "exactspec.cli", "serve", "--port", str(self.port), "--api-key-file", str(key_file),
             *args], stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"exactspec serve exited: {self.log_path.read_text()[-2000:]}"
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"exactspec serve did not start: {self.log_path.read_text()[-2000:]}")

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def statuses(self) -> list[tuple[str, int]]:
        """(request line, status) of every request in uvicorn's access log."""
        out = []
        for line in self.log_path.read_text().splitlines():
            if '" ' in line and "HTTP/1.1" in line:
                request, _, status = line.rpartition('" ')
                out.append((request.split('"', 1)[-1], int(status.split()[0])))
        return out

    def stop(self) -> str:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()
        return self.log_path.read_text()


def codex(served, home: Path, workdir: Path, prompt: str, *flags: str, model: str = "exactspec",
          timeout: float = 900) -> subprocess.CompletedProcess:
    """`codex exec [FLAGS] PROMPT` against `served` (anything with a `base` URL), configured by its base URL
    and key alone. `model`: the name Codex asks for (one it has metadata for changes its tools: "gpt-5.5"
    gets a free-form `apply_patch` tool with a Lark grammar)."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f'model = "{model}"\nmodel_provider = "exactspec"\n\n[model_providers.exactspec]\nname = "exactspec"\n'
        f'base_url = "{served.base}/v1"\nwire_api = "responses"\nenv_key = "EXACTSPEC_API_KEY"\n')
    env = {**os.environ, **QUIET, "CODEX_HOME": str(home), "EXACTSPEC_API_KEY": KEY}
    return subprocess.run([cli("codex"), "exec", "--skip-git-repo-check", "--cd", str(workdir), *flags, prompt], env=env,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def claude(served, home: Path, workdir: Path, prompt: str, *flags: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """`claude -p PROMPT [FLAGS]` against `served` (anything with a `base` URL), configured by
    ANTHROPIC_BASE_URL and the key alone."""
    home.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **QUIET, "HOME": str(home), "ANTHROPIC_BASE_URL": served.base, "ANTHROPIC_API_KEY": KEY}
    return subprocess.run([cli("claude"), "-p", prompt, *flags], env=env, cwd=workdir, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def qwen(served, home: Path, workdir: Path, prompt: str, *flags: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """`qwen -p PROMPT [FLAGS]` (Qwen Code: OpenAI chat completions) against `served`, configured by
    OPENAI_BASE_URL, the key and a model name alone."""
    home.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **QUIET, "HOME": str(home), "OPENAI_BASE_URL": f"{served.base}/v1", "OPENAI_API_KEY": KEY,
           "OPENAI_MODEL": "exactspec"}
    return subprocess.run([cli("qwen"), "-p", prompt, *flags], env=env, cwd=workdir, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def said(proc: subprocess.CompletedProcess) -> str:
    """What a CLI run printed, for an assertion message."""
    return json.dumps({"rc": proc.returncode, "stdout": proc.stdout[-1500:], "stderr": proc.stderr[-1500:]})
