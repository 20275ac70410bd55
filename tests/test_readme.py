"""The README and docs/ as a newcomer reads them: every `exactspec ...` line in their fenced code blocks
is accepted by the real argument parser (parsed, never run), every docs page is linked from the
README, and every relative link (and its #anchor) leads somewhere."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from exactspec.cli import build_parser
from exactspec.server.launch import split_passed

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_ENDS = {"|", "||", "&&", ";", "<", ">", ">>", "2>", "2>&1", "&"}  # the rest of the line is not argv
PLACEHOLDER = re.compile(r"^\[.*\]$|^<.*>$|^\.\.\.$|^…$")  # `[options]`, `<command>`: not parseable as given


def fenced_lines(text: str) -> list[str]:
    """Lines of the fenced code blocks, backslash continuations joined."""
    lines, inside, pending = [], False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside, pending = not inside, ""
            continue
        if not inside:
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    return lines


def command_argv(line: str) -> list[str] | None:
    """The argv after `exactspec` on a shell line that runs it (env assignments and a path before it
    allowed), cut at pipes and redirections; None for other lines and for lines with placeholders."""
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        return None
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", words[0]):
        words = words[1:]
    if not words or Path(words[0]).name != "exactspec":
        return None
    argv = []
    for word in words[1:]:
        if word in SHELL_ENDS:
            break
        argv.append(word)
    return None if any(PLACEHOLDER.match(word) for word in argv) else argv


def commands() -> list[tuple[str, str, list[str]]]:
    found = []
    for page in PAGES:
        for line in fenced_lines(page.read_text(encoding="utf-8")):
            argv = command_argv(line)
            if argv is not None:
                found.append((page.relative_to(ROOT).as_posix(), line.strip(), argv))
    return found


def parse_error(argv: list[str]) -> str | None:
    """argparse's complaint about argv (None: accepted; --help and --version count as accepted)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(split_passed(argv)[0])  # as main() parses: a launch's `-- ARGS` are the CLI's
    except SystemExit as exit_:
        return None if exit_.code in (0, None) else err.getvalue().strip() or f"exit {exit_.code}"
    return None


def test_the_pages_show_enough_commands_to_check():
    found = commands()
    subcommands = {argv[0] for _, _, argv in found if argv}
    assert len(found) >= 30, found
    assert {"generate", "serve", "batch", "bench", "tune", "theory"} <= subcommands
    assert any(page == "README.md" and argv[:1] == ["generate"] for page, _, argv in found)


def test_every_documented_command_line_parses():
    failures = [f"{page}: {line}\n    {error}" for page, line, argv in commands()
                if (error := parse_error(argv)) is not None]
    assert not failures, "command lines the parser refuses:\n" + "\n".join(failures)


@pytest.mark.parametrize("argv", [["generate", "hi", "--no-such-flag"], ["generate", "hi", "--gamma"],
                                  ["serve", "--port", "eighty"], ["no-such-command"]])
def test_the_check_refuses_a_bad_line(argv):
    assert parse_error(argv) is not None


def test_the_extraction_reads_shell_as_a_user_types_it():
    assert command_argv('OMP_WAIT_POLICY=PASSIVE .venv/bin/exactspec generate - < p.txt  # note') == ["generate", "-"]
    assert command_argv("exactspec serve --port 8000 | grep x") == ["serve", "--port", "8000"]
    assert command_argv('exactspec generate "Hi" [options]') is None
    assert command_argv("curl -s localhost:8000/health") is None
    assert fenced_lines("```sh\nexactspec bench \\\n    --quick\n```\n") == ["exactspec bench      --quick"]


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in PAGES[1:] if f"](docs/{p.name}" not in readme]
    assert not missing, f"docs pages the README does not link: {missing}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = page.read_text(encoding="utf-8")
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def test_relative_links_and_their_anchors_resolve():
    broken = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked here
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
