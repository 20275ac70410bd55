"""The package's import graph has no cycles, and server/ does not import scale/ (the layer built on
it): lazy imports inside functions count too (a cycle hidden in a function body is still two modules
that cannot be understood, tested or moved apart)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "exactspec"


def module_name(path: Path) -> str:
    parts = ["exactspec", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports anywhere in its file (relative imports resolved; `from pkg import
    sub` names the submodule when it is one, else the package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                out.add(sub if sub in known else base)
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, white/grey/black)."""
    state, stack = {}, []

    def visit(node: str) -> list[str] | None:
        state[node] = "grey"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "grey":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        stack.pop()
        state[node] = "black"
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_the_graph_is_read():
    edges = graph()
    assert "exactspec.engine" in edges and "exactspec.speculative.sampling" in edges["exactspec.speculative.verify"]


def test_a_planted_cycle_is_found():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_server_does_not_import_scale_out():
    """scale/ is built on server/ (its replicas serve server.app), never the other way round: the
    top-level CLI, not server/cli.py, hands `serve --replicas` to scale/."""
    edges = graph()
    upward = sorted(f"{name} -> {dep}" for name, deps in edges.items() if name.startswith("exactspec.server")
                    for dep in deps if dep.startswith("exactspec.scale"))
    assert not upward, "server/ imports scale/: " + ", ".join(upward)


def test_the_algorithm_imports_no_backend():
    """speculative/ (the loop, the verifiers, the contract in interfaces.py) imports nothing from models/:
    the backends implement its protocols, never the other way round."""
    edges = graph()
    upward = sorted(f"{name} -> {dep}" for name, deps in edges.items() if name.startswith("exactspec.speculative")
                    for dep in deps if dep.startswith("exactspec.models"))
    assert not upward, "speculative/ imports models/: " + ", ".join(upward)


def test_the_algorithm_imports_nothing_of_auto_gamma():
    """speculative/ (the algorithm, no I/O) imports nothing from autogamma/, and neither do the drafters:
    the loop, propose and the auto drafter reach a γ policy through the protocols of
    speculative/interfaces.py (`GammaPolicy`, `CutsCopies`, `SpacesLookups`, `PricesArms`), never its class,
    so a policy can change (or a new one be added) without them. Control: a planted edge is found."""
    def upward(edges: dict[str, set[str]]) -> list[str]:
        return sorted(f"{name} -> {dep}" for name, deps in edges.items()
                      if name.startswith(("exactspec.speculative", "exactspec.drafters"))
                      for dep in deps if dep.startswith("exactspec.autogamma"))
    assert upward({"exactspec.speculative.loop": {"exactspec.autogamma.policy"}})
    found = upward(graph())
    assert not found, "imports autogamma/: " + ", ".join(found)


IO_MODULES = {"time", "torch", "statistics", "json", "os", "pathlib"}  # a clock, a model, a file


def test_auto_gamma_is_priced_without_a_clock():
    """Auto γ's room: the prices (costs.py), the acceptance (acceptance.py), the policy (policy.py) and what
    an engine learns (learned.py) are arithmetic on what they are told (no clock, no model, no file, no
    torch); its one file with I/O is measure.py, the timed forwards that start the prices."""
    for path in sorted((PACKAGE / "autogamma").glob("*.py")):
        if path.name == "measure.py":
            continue
        tree = ast.parse(path.read_text())
        names = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                 for alias in node.names} | {node.module.split(".")[0] for node in ast.walk(tree)
                                             if isinstance(node, ast.ImportFrom) and node.module and not node.level}
        assert not names & IO_MODULES, f"autogamma/{path.name} imports {names & IO_MODULES}"


def unresolved(path: Path, name: str, known: set[str]) -> list[str]:
    """The relative imports in `path` that name no module of the package (`from .errors import X` left
    behind in a moved file: a lazy one fails only when its function is called)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level:
            anchor = package.split(".")
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([node.module] if node.module else []))
            folder = PACKAGE.joinpath(*base.split(".")[1:])
            if base not in known and not folder.is_dir():  # a module, or a package
                out.append(f"{name}:{node.lineno}: {'.' * node.level}{node.module or ''}")
    return out


def test_relative_imports_resolve():
    found = modules()
    bad = [line for name, path in found.items() for line in unresolved(path, name, set(found))]
    assert not bad, "relative imports of no module: " + ", ".join(bad)


PROBED = ("target", "drafter", "arm", "lm", "model")  # what an attribute probe must not be aimed at


def probes(source: str) -> list[str]:
    """The getattr / hasattr calls in `source` whose object is an adapter or a drafter, by its name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            subject = ast.unparse(node.args[0]) if node.args else ""
            if any(word in subject.replace(".", " ").replace("_", " ").split() for word in PROBED):
                found.append(ast.unparse(node))
    return found


def test_no_capability_is_probed_by_an_attributes_name():
    """The loop, the scheduler, the engine, the prefix cache and the drafters take an adapter's or a
    drafter's optional parts by their named protocols (speculative/interfaces.py), never by probing
    an attribute's name. Control: a planted probe is found."""
    assert probes("finish = getattr(row.drafter, 'finish', None)\nok = hasattr(self.target, 'ragged')") == [
        "getattr(row.drafter, 'finish', None)", "hasattr(self.target, 'ragged')"]
    checked = [PACKAGE / "engine.py", PACKAGE / "batching.py", PACKAGE / "drafting.py",
               *(PACKAGE / "autogamma").glob("*.py"),
               *(PACKAGE / "speculative").glob("*.py"),
               *(PACKAGE / "drafters").glob("*.py")]
    found = {str(p.relative_to(PACKAGE)): probes(p.read_text()) for p in checked}
    assert not {k: v for k, v in found.items() if v}


def rooms(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between the package's rooms (a top-level module, or a folder as one)."""
    def room(name: str) -> str:
        return name.split(".")[1] if "." in name else name

    out: dict[str, set[str]] = {}
    for name, deps in edges.items():
        out.setdefault(room(name), set()).update(room(d) for d in deps if room(d) != room(name))
    return out


def floors(edges: dict[str, set[str]]) -> list[str]:
    """The longest chain of imports between rooms (an acyclic graph), top floor first."""
    memo: dict[str, list[str]] = {}

    def chain(node: str) -> list[str]:
        if node not in memo:
            memo[node] = [node, *max((chain(d) for d in sorted(edges[node])), key=len, default=[])]
        return memo[node]
    return max((chain(n) for n in sorted(edges)), key=len)


def test_the_rooms_import_one_another_in_at_most_ten_floors():
    """Between rooms (server/, models/, engine.py, ...) there is no cycle, and no chain of imports longer
    than ten rooms (cli -> scale -> server -> cli_common -> engine -> loading -> models -> speculative ->
    device -> errors): a room that imports one more floor down is a layer a reader must hold in mind."""
    between = rooms(graph())
    assert find_cycle(between) is None, find_cycle(between)
    assert len(floors(between)) <= 10, " -> ".join(floors(between))


TESTS = Path(__file__).resolve().parent


def test_tests_mirror_the_package_and_import_no_test_file():
    """A test file lives in the folder of the package room it tests (tests/speculative/ for
    exactspec/speculative/, ...; a top-level module's tests at the top), and takes shared helpers from
    conftest.py or tests/helpers/, never from another test file."""
    package_rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    top_modules = {p.stem for p in PACKAGE.glob("*.py")}
    for path in TESTS.rglob("test_*.py"):
        folder = path.parent.relative_to(TESTS).parts
        assert not folder or folder[0] in package_rooms, f"{path.relative_to(TESTS)}: no package room {folder[0]}/"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.split(".")[-1].startswith("test_"), \
                    f"{path.relative_to(TESTS)}:{node.lineno} imports the test file {node.module}"
    cross_cutting = {"test_cli", "test_readme", "test_imports"}  # the package as a whole
    top = {p.stem for p in TESTS.glob("test_*.py")} - cross_cutting
    named = top_modules | {room.removesuffix("s") for room in package_rooms}  # test_chat_template: chat_templates/
    strays = sorted(t for t in top if t.removeprefix("test_") not in named)
    assert not strays, f"top-level test files for no top-level module: {strays}"
