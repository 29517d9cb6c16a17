"""The engine's layout: subpackages by pipeline stage, imports pointing one way.

Every import of every engine module, deferred ones inside functions included, goes to
its own subpackage or to a lower layer, and no two modules import each other through
any chain. The README's architecture picture is this table."""

import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parent.parent / "engine"

LAYERS = [
    {"errors", "version", "config", "paths", "weights", "arrays", "files"},   # leaves every stage may use
    {"graph", "data"},                                      # the IR, the op table, the reference; reading data
    {"optimize", "autodiff"},                               # graph -> graph
    {"codegen"},                                            # a node -> WGSL
    {"compile"},                                            # a graph -> ExecutionPlan
    {"runtime"},                                            # plans on a device; profiler, traces
    {"train"},                                              # training sessions and the Trainer
    {"models"},                                             # built-in models
    {"importers"},                                          # ONNX files and checkpoints
    {"cli"},                                                # the meganeura command
]
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ENGINE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Absolute engine modules ``path`` imports, anywhere in it."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "engine":
                continue
            for alias in node.names:   # `from . import codegen` imports a module
                sub = f"{target}.{alias.name}"
                found.add(sub if (ENGINE.parent / sub.replace(".", "/")).with_suffix(".py").exists()
                          or (ENGINE.parent / sub.replace(".", "/")).is_dir() else target)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "engine"}
    return found


MODULES = {module_name(p): p for p in ENGINE.rglob("*.py")}
GRAPH = {name: {t for t in imports_of(p) if t != name} for name, p in MODULES.items()}


def stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


@pytest.mark.parametrize("module", sorted(m for m in MODULES if stage(m) not in (None, "__main__")))
def test_imports_point_down_the_pipeline(module):
    own = stage(module)
    assert own in LEVEL, f"{module}: engine/{own} is in no layer of this test (and the README's picture)"
    for target in GRAPH[module]:
        other = stage(target)
        assert other is not None, f"{module} imports the engine package itself ({target})"
        assert other == own or LEVEL[other] < LEVEL[own] or LEVEL[own] == LEVEL[other] == 0, \
            f"{module} (layer {LEVEL[own]}, {own}) imports {target} (layer {LEVEL[other]}, {other})"


def test_no_import_cycles_deferred_imports_included():
    def resolve(target):   # a package import reaches its __init__
        return target if target in MODULES else None
    state, cycles = {}, []

    def visit(m, path):
        state[m] = "open"
        for t in sorted(filter(None, map(resolve, GRAPH[m]))):
            if state.get(t) == "open":
                cycles.append(path[path.index(t):] + [t] if t in path else [m, t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"
    for m in sorted(MODULES):
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles


def test_no_module_is_a_monolith():
    big = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 1000}
    assert not big, f"modules over 1,000 lines: {big}"
