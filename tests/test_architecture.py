"""The shape of the package, read from its source: what may import what, no import cycles, and the
engine's insides kept inside it. README.md ("Architecture") describes the same table."""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tokenmill"

# Each part of tokenmill/ and the parts it may import (besides itself). Arrows only point down:
# cascade → choose; serve, choose, split → jobs → openai_compat, engines, bench → vllm_engine → embed → engine → models,
# plan → cost, environment, formats; jobs, bench → http_client.
LAYERS: dict[str, set[str]] = {
    "cost": set(),
    "environment": set(),
    "formats": set(),  # model files read without torch: GGUF and safetensors headers, GGUF → config
    "settings": set(),  # dataclass fields that are also flags (stdlib only): a library type's errors name fields
    "http_client": set(),  # the one HTTP client (aiohttp, no torch): jobs' endpoints and Batch API, bench
    "plan": {"cost", "environment", "formats"},
    "models": {"environment", "formats"},
    "engine": {"models", "plan", "cost", "environment", "settings"},  # plan: hardware names as prices
    # the embedding engine: an encoder and its pooling, or a decoder on the engine's model runner
    "embed": {"engine", "models", "environment", "settings"},
    # vLLM behind the engine's interface; args.py: every in-process engine's flags → its spec
    "vllm_engine": {"engine", "embed", "models", "environment", "settings"},
    "engines": {"engine", "embed", "vllm_engine", "models"},  # which in-process engine: the one loader of a spec
    "bench": {"engines", "engine", "embed", "vllm_engine", "models", "plan", "cost", "environment", "openai_compat",
              "http_client"},
    "openai_compat": {"engine", "embed"},
    "jobs": {"openai_compat", "engines", "engine", "embed", "vllm_engine", "models", "plan", "cost", "environment",
             "settings", "http_client"},
    "serve": {"jobs", "openai_compat", "engines", "engine", "embed", "vllm_engine", "environment"},
    "choose": {"jobs", "openai_compat", "plan", "cost", "environment"},
    "cascade": {"choose", "jobs", "openai_compat", "plan", "cost", "environment"},  # tiers are choose's candidates
    # `tokenmill split`: run's input reading and part cutting, no backend
    "split": {"jobs", "openai_compat", "settings"},
    "cli": {"settings"},  # loads each command's package by name (importlib), so it imports none of them
    "__main__": {"cli"},
    # `from tokenmill import LLM, run_job`: the facade for users (the Python API), not for the package itself
    "__init__": {"engine", "embed", "jobs", "vllm_engine"},
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


# jobs/ inside: each layer imports only those before it (docs/layout.md).
JOBS_LAYERS = ["base", "input", "journal", "backends", "job"]
JOBS_BASE = {"tokenmill.jobs.storage", "tokenmill.jobs.errors"}
# What other packages may import from jobs/: these fronts, never the modules behind them.
JOBS_SURFACE = {"tokenmill.jobs", "tokenmill.jobs.input", "tokenmill.jobs.journal", "tokenmill.jobs.backends",
                "tokenmill.jobs.results", "tokenmill.jobs.flags", "tokenmill.jobs.storage"}


def jobs_layer(module: str) -> str:
    """tokenmill.jobs.journal.index → journal; tokenmill.jobs.runner → job; storage, errors → base."""
    if module in JOBS_BASE:
        return "base"
    parts = module.split(".")
    return parts[2] if len(parts) > 3 or parts[2:3] in (["input"], ["journal"], ["backends"]) else "job"


def test_inside_jobs_imports_only_point_down() -> None:
    inside = [m for m in MODULES if part_of(m) == "jobs" and m != "tokenmill.jobs"]
    wrong = [f"{m} ({jobs_layer(m)}) imports {t} ({jobs_layer(t)})" for m in inside for t, _, _ in targets(m)
             if part_of(t) == "jobs" and t != "tokenmill.jobs"
             and JOBS_LAYERS.index(jobs_layer(t)) > JOBS_LAYERS.index(jobs_layer(m))]
    assert not wrong, "\n".join(wrong)


def test_outside_jobs_only_its_fronts_are_used() -> None:
    outside = [m for m in MODULES if part_of(m) not in ("jobs", "__init__")]
    wrong = [f"{m}:{line} imports {t}" for m in outside for t, _, line in targets(m)
             if part_of(t) == "jobs" and t not in JOBS_SURFACE]
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


def test_the_jobs_checks_catch_planted_imports(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    plant(monkeypatch, tmp_path, "tokenmill.jobs.input.planted", "from tokenmill.jobs.journal.rows import error_row\n")
    plant(monkeypatch, tmp_path, "tokenmill.serve.planted_c", "from tokenmill.jobs.journal.index import read_index\n")
    with pytest.raises(AssertionError, match=r"input.planted \(input\) imports \S+journal.rows \(journal\)"):
        test_inside_jobs_imports_only_point_down()
    with pytest.raises(AssertionError, match="tokenmill.serve.planted_c:1 imports tokenmill.jobs.journal.index"):
        test_outside_jobs_only_its_fronts_are_used()


# ---- command modules and cold start ----------------------------------------------------------------


def test_no_package_imports_another_packages_cli_module() -> None:
    """A command's cli module is its argument parsing and wiring, for `tokenmill.cli` to load by
    name: what another package needs from it (a default, a helper) lives in a module of its own, so
    that building one command's parser never imports another command."""
    wrong = [f"{m}:{line} imports {t}" for m in MODULES if m not in ("tokenmill.cli", "tokenmill.__main__")
             for t, _, line in targets(m)
             if len(t.split(".")) == 3 and t.endswith(".cli") and part_of(t) != part_of(m)]
    assert not wrong, "\n".join(wrong)


def test_the_cli_check_catches_a_planted_import(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    plant(monkeypatch, tmp_path, "tokenmill.choose.planted", "def later():\n    from tokenmill.jobs import cli\n")
    with pytest.raises(AssertionError, match="tokenmill.choose.planted:2 imports tokenmill.jobs.cli"):
        test_no_package_imports_another_packages_cli_module()


HEAVY = ("torch", "transformers", "llguidance")  # seconds to import; none is needed to parse flags
# Runs `tokenmill ARGS` in a fresh interpreter and writes down what it imported: the exit code, the
# tokenmill modules, and for each heavy library the chain that first imported it (module bodies and
# tokenmill functions, outermost first), so a failure names the import to cut.
PROBE = """
import json, os, sys

HEAVY = HEAVY_NAMES
first = {}


def chain():
    frame, links = sys._getframe(2), []
    while frame is not None:
        name, code = frame.f_globals.get("__name__", "?"), frame.f_code.co_name
        if code == "<module>":
            links.append(name)
        elif name.startswith("tokenmill"):
            links.append(f"{name}.{code}()")
        frame = frame.f_back
    links.reverse()
    return [link for i, link in enumerate(links) if i == 0 or link != links[i - 1]]


class Watch:
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in HEAVY and top not in first:
            first[top] = [*chain(), name]
        return None


sys.meta_path.insert(0, Watch())
from tokenmill.cli import main

try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
report = {"code": code, "heavy": {m: first.get(m, ["?"]) for m in HEAVY if m in sys.modules},
          "modules": sorted(m for m in sys.modules if m.startswith("tokenmill"))}
with open(os.environ["TOKENMILL_PROBE"], "w") as out:
    json.dump(report, out)
""".replace("HEAVY_NAMES", repr(HEAVY))


def probe(args: list[str], tmp_path: Path, timeout: float = 120) -> dict[str, Any]:
    report = tmp_path / "probe.json"
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}  # the stub is on 127.0.0.1
    env.update(TOKENMILL_PROBE=str(report), PYTHONPATH=str(PACKAGE.parent))
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert report.exists(), f"tokenmill {' '.join(args)} crashed:\n{proc.stderr[-3000:]}"
    result = json.loads(report.read_text())
    result["stderr"] = proc.stderr
    return result


def heavy_imports(result: dict[str, Any]) -> str:
    return "\n".join(f"{lib}: {' → '.join(links)}" for lib, links in result["heavy"].items())


def cli_modules(result: dict[str, Any]) -> list[str]:
    return [m for m in result["modules"] if m == "tokenmill.cli" or m.endswith(".cli")]


def test_tokenmill_help_imports_no_command(tmp_path: Path) -> None:
    result = probe(["--help"], tmp_path)
    assert result["code"] == 0, result["stderr"]
    assert not result["heavy"], heavy_imports(result)
    assert cli_modules(result) == ["tokenmill.cli"]


def test_run_help_imports_only_the_jobs_command(tmp_path: Path) -> None:
    result = probe(["run", "--help"], tmp_path)
    assert result["code"] == 0, result["stderr"]
    assert cli_modules(result) == ["tokenmill.cli", "tokenmill.jobs.cli"]
    assert not result["heavy"], heavy_imports(result)


def test_split_imports_no_heavy_library(tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text("first document\nsecond document\n")
    result = probe(["split", "in.txt", "-o", "parts", "--max-requests", "1"], tmp_path)
    assert result["code"] == 0, result["stderr"]
    assert cli_modules(result) == ["tokenmill.cli", "tokenmill.split.cli"]
    assert not result["heavy"], heavy_imports(result)
    assert sorted(p.name for p in (tmp_path / "parts").iterdir()) == ["part-00001.jsonl", "part-00002.jsonl"]


def test_plan_imports_no_heavy_library(tmp_path: Path) -> None:
    result = probe(["plan", "--model", "qwen2.5-7b", "--hardware", "h100-sxm"], tmp_path)
    assert result["code"] == 0, result["stderr"]
    assert cli_modules(result) == ["tokenmill.cli", "tokenmill.plan.cli"]
    assert not result["heavy"], heavy_imports(result)


def test_a_job_against_an_endpoint_imports_no_heavy_library(tmp_path: Path) -> None:
    from .jobs.stub_server import StubServer

    rows = [{"custom_id": f"r-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"messages": [{"role": "user", "content": f"doc {i}"}]}} for i in range(10)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with StubServer() as stub:
        result = probe(["run", "in.jsonl", "-o", "out", "--endpoint", stub.url, "--max-tokens", "4",
                        "--no-progress"], tmp_path)
    assert result["code"] == 0, result["stderr"]
    assert len((tmp_path / "out" / "results.jsonl").read_text().splitlines()) == 10
    assert not result["heavy"], heavy_imports(result)


def test_the_engine_exports_and_flags_load_without_torch(tmp_path: Path) -> None:
    """What commands read to build their flags and defaults: the engine's settings, the sampling
    defaults, the grammar check (llguidance loads when a grammar is checked, not before)."""
    code = ("import sys, tokenmill, tokenmill.engine.args\n"
            "from tokenmill.engine import DEFAULT_MAX_TOKENS, EngineConfig, SamplingParams, StructuredOutputsParams\n"
            "EngineConfig(dtype='bfloat16'); SamplingParams(max_tokens=DEFAULT_MAX_TOKENS)\n"
            "StructuredOutputsParams(choice=['a', 'b'])\n"
            f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_engine_exports_load_on_first_use() -> None:
    import tokenmill
    import tokenmill.engine as engine

    assert set(engine._EXPORTS) == set(engine.__all__)
    for name, home in engine._EXPORTS.items():
        assert getattr(engine, name) is getattr(importlib.import_module(f"tokenmill.engine.{home}"), name)
    assert callable(engine.perplexity) and engine.Perplexity.__module__ == "tokenmill.engine.perplexity"
    shared = set(tokenmill.__all__) & set(engine.__all__)
    assert all(getattr(tokenmill, name) is getattr(engine, name) for name in shared)
    with pytest.raises(AttributeError):
        _ = engine.NotAnExport
