"""The layers import one way (docs/design/architecture.md): every `vllm_omni` import of every
module is read from its source, those made only for type checking and those inside
functions included, since each still says which layer a module leans on."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import vllm_omni

ROOT = Path(vllm_omni.__file__).parent
# What a layer may not import: the layers above it.
ABOVE = {
    "config": {"engine", "models", "orchestrator", "cluster", "entrypoints"},
    "engine": {"orchestrator", "cluster", "entrypoints"},
    "models": {"orchestrator", "cluster", "entrypoints"},
    "transfer": {"config", "engine", "models", "orchestrator", "cluster", "entrypoints"},
    "orchestrator": {"cluster", "entrypoints"},
    "cluster": {"entrypoints"},
}


def unit(module: str) -> str:
    """The package a module counts in: engine/ar, models/qwen2_5_omni, entrypoints/openai
    are packages of their own; elsewhere the top-level one."""
    parts = module.split(".")[1:] or ["vllm_omni"]
    if parts[0] in ("engine", "models", "entrypoints") and len(parts) > 1:
        return "/".join(parts[:2])
    return parts[0]


def imports() -> dict[str, set[str]]:
    """Every module of the package and the vllm_omni modules it imports."""
    found = {}
    for path in ROOT.rglob("*.py"):
        module = ".".join(("vllm_omni", *path.relative_to(ROOT).with_suffix("").parts))
        module = module.removesuffix(".__init__")
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        found[module] = {n for n in names if n.split(".")[0] == "vllm_omni"}
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one package (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in list(graph):
        if v not in index:
            visit(v)
    return groups


def test_no_layer_imports_one_above_it():
    wrong = [f"{module} imports {name}"
             for module, names in imports().items() for name in names
             if unit(name).split("/")[0] in ABOVE.get(unit(module).split("/")[0], ())]
    assert not wrong, "\n".join(sorted(wrong))


def test_packages_import_without_cycles():
    graph: dict[str, set[str]] = defaultdict(set)
    for module, names in imports().items():
        graph[unit(module)] |= {unit(n) for n in names} - {unit(module)}
    assert cycles(graph) == []


def test_the_check_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
