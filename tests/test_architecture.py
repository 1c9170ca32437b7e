"""The shape of the package, read from its source: what may import what, no import cycles, and the
engine's insides kept inside it. README.md ("Architecture") describes the same table."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tokenmill"

# Each part of tokenmill/ and the parts it may import (besides itself). Arrows only point down:
# serve, choose → jobs → openai_compat → engine, bench → models, plan → cost, environment, gguf_header.
LAYERS: dict[str, set[str]] = {
    "cost": set(),
    "environment": set(),
    "gguf_header": set(),
    "plan": {"cost", "environment", "gguf_header"},
    "models": {"environment", "gguf_header"},
    "engine": {"models", "plan", "cost", "environment"},  # plan: hardware names as prices
    "vllm_engine": {"engine", "models", "environment"},  # vLLM behind the engine's interface
    "bench": {"engine", "vllm_engine", "models", "plan", "cost", "environment"},
    "openai_compat": {"engine"},
    "jobs": {"openai_compat", "engine", "vllm_engine", "models", "plan", "cost", "environment"},
    "serve": {"jobs", "openai_compat", "engine", "environment"},
    "choose": {"jobs", "openai_compat", "plan", "cost", "environment"},
    "cli": set(),  # loads each command's package by name (importlib), so it imports none of them
    "__main__": {"cli"},
    "__init__": {"engine"},  # `from tokenmill import LLM`: the facade for users, not for the package itself
}
# What code outside engine/ may import from it: the package's exports and the flag helper.
ENGINE_SURFACE = {"tokenmill.engine", "tokenmill.engine.args"}
ENGINE_INSIDES = {"scheduler", "block_manager"}  # attributes only engine/ touches


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def part_of(module: str) -> str:
    """tokenmill.jobs.runner → jobs; tokenmill → __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(module: str) -> Iterator[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import, wherever it stands:
    top level, inside functions and under TYPE_CHECKING alike."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield base, [a.name for a in node.names], node.lineno


def targets(module: str) -> Iterator[tuple[str, list[str], int]]:
    """The tokenmill modules `module` imports (a name that is itself a module counts as one)."""
    for base, names, line in imports(module):
        if base != "tokenmill" and not base.startswith("tokenmill."):
            continue
        submodules = [f"{base}.{n}" for n in names if f"{base}.{n}" in MODULES]
        yield from ((m, [], line) for m in submodules)
        rest = [n for n in names if f"{base}.{n}" not in MODULES]
        if rest or not names:
            yield base, rest, line


def graph() -> dict[str, set[str]]:
    return {m: {t for t, _, _ in targets(m) if t != m} for m in MODULES}


def test_every_part_has_a_place_in_the_layers() -> None:
    assert {part_of(m) for m in MODULES} == set(LAYERS)


def test_imports_only_point_down() -> None:
    wrong = [f"{m} imports {t}" for m in MODULES for t, _, _ in targets(m)
             if part_of(t) != part_of(m) and part_of(t) not in LAYERS[part_of(m)]]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles() -> None:
    edges = graph()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(" → ".join(c) for c in cycles)


def test_the_package_does_not_import_its_own_facade() -> None:
    wrong = [f"{m}:{line}" for m in MODULES if m != "tokenmill"
             for t, _, line in targets(m) if t == "tokenmill"]
    assert not wrong, f"import from the owning module, not `tokenmill`: {wrong}"


def test_outside_the_engine_only_its_surface_is_used() -> None:
    outside = [m for m in MODULES if part_of(m) != "engine"]
    reached = [f"{m}:{line} imports {t}" for m in outside for t, _, line in targets(m)
               if part_of(t) == "engine" and t not in ENGINE_SURFACE]
    touched = [f"{m}:{node.lineno} .{node.attr}" for m in outside
               for node in ast.walk(ast.parse(MODULES[m].read_text()))
               if isinstance(node, ast.Attribute) and node.attr in ENGINE_INSIDES]
    assert not reached + touched, "\n".join(reached + touched)


def test_no_private_name_is_imported_from_another_module() -> None:
    wrong = [f"{m}:{line} takes {n} from {t}" for m in MODULES for t, names, line in targets(m)
             for n in names if n.startswith("_") and t != m]
    assert not wrong, "\n".join(wrong)


def plant(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str, source: str) -> None:
    path = tmp_path / f"{name.rpartition('.')[2]}.py"
    path.write_text(source)
    monkeypatch.setitem(MODULES, name, path)


def test_the_checks_catch_a_planted_upward_import_and_cycle(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Inside a function, as lazy imports are: the walker reads function bodies too.
    plant(monkeypatch, tmp_path, "tokenmill.engine.planted_a",
          "def later():\n    from tokenmill.serve.state import ServeState\n    from . import planted_b\n")
    plant(monkeypatch, tmp_path, "tokenmill.engine.planted_b", "from tokenmill.engine.planted_a import later\n")
    with pytest.raises(AssertionError, match="engine.planted_a imports tokenmill.serve.state"):
        test_imports_only_point_down()
    with pytest.raises(AssertionError, match="planted_a → tokenmill.engine.planted_b → tokenmill.engine.planted_a"):
        test_no_import_cycles()
