"""`autotp serve`'s packages import one way, with no circle, and the layers that say "no torch" import none: read
from the source's import statements (ast), so a new arrow up or a stray torch import fails here, not in review."""

from __future__ import annotations

import ast
from pathlib import Path

SERVE = Path(__file__).parent.parent / "src" / "autotp" / "serve"

# each part of serve/ -> the parts it may import (besides itself); a part is a package, or one module
MAY_IMPORT = {
    "types": set(),
    "options": set(),
    "lockstep.step": {"types"},
    "engine": {"types", "lockstep.step"},
    "runner": {"types", "lockstep.step"},
    "lockstep": {"types", "lockstep.step"},  # wire, watchdog, executor: the runner is handed in, never imported
    "pipeline": {"types", "lockstep.step", "lockstep"},  # links, liveness, executor: the runner is handed in too
    "startup": {"types", "options", "lockstep", "runner"},
    "api": {"types", "engine"},
    "preflight": {"options", "runner"},  # the backends' refusals, before the server's imports
    "server": {"types", "options", "lockstep.step", "lockstep", "pipeline", "engine", "runner", "startup", "api",
               "preflight"},
    "offline": {"types", "lockstep", "pipeline", "engine", "runner", "server"},  # generate --pp: the server's parts
}
NO_TORCH = ("types", "options", "lockstep.step", "engine", "api")


def part(module: str) -> str:
    """autotp.serve.engine.loop -> engine; autotp.serve.lockstep.step -> lockstep.step; autotp.serve.types -> types."""
    rest = module.removeprefix("autotp.serve.").split(".")
    return "lockstep.step" if rest[:2] == ["lockstep", "step"] else rest[0]


def imports() -> dict[str, set[str]]:
    """Every module of serve/ -> the modules it imports (autotp's, and the top-level names of others)."""
    out = {}
    for path in SERVE.rglob("*.py"):
        name = ".".join(("autotp", *path.relative_to(SERVE.parent).with_suffix("").parts)).removesuffix(".__init__")
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
                found |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES}
        out[name] = found
    return out


MODULES = {".".join(("autotp", *p.relative_to(SERVE.parent).with_suffix("").parts)).removesuffix(".__init__")
           for p in SERVE.rglob("*.py")}


def test_every_arrow_runs_down_the_layers():
    up = []
    for module, found in imports().items():
        if module == "autotp.serve":
            continue
        for target in found:
            if target.startswith("autotp.serve.") and target in MODULES and part(target) != part(module):
                if part(target) not in MAY_IMPORT[part(module)]:
                    up.append(f"{module} -> {target}")
    assert up == []


def test_no_module_of_serve_is_in_a_circle():
    graph = {m: {t for t in found if t in MODULES and t != m} for m, found in imports().items()}
    state: dict[str, int] = {}
    circles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in graph[m]:
            if state.get(t) == 1:
                circles.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [m])
    assert circles == []


def test_the_layers_without_torch_import_none():
    heavy = {f"{m} -> {t}" for m, found in imports().items() if m != "autotp.serve" and part(m) in NO_TORCH
             for t in found if t.split(".")[0] in ("torch", "transformers", "numpy") and part(m) != "engine"}
    heavy |= {f"{m} -> {t}" for m, found in imports().items() if part(m) == "engine"
              for t in found if t.split(".")[0] in ("torch", "transformers")}  # the engine's lookup searches numpy
    assert heavy == set()
