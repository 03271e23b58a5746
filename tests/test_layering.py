"""The package's imports point one way, down the floors (STYLE.md "Our layout"):

    entrypoints.cli → benchmarks → entrypoints (server, LLM), plan → engine, executor
      → core (scheduler, KV managers, messages), worker, hisparse.{manager, worker},
        distributed.kv_transfer
      → model_executor, attention, distributed, hisparse → kernels → config, KV formats, utils

Read from the source (static: an import inside a function counts, one under ``TYPE_CHECKING``
does not, since it never runs). Also: no import cycle between modules, production code calls no
``*_ref`` reference function of the kernels, and the house's records stay current (no diagnostic
build knobs or diary references in the sources).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "vllm"

# (module prefix, floor): a module's floor is that of its longest matching prefix; a module may
# import only modules on its own floor or below
FLOORS = {
    "vllm": 7,
    "vllm.entrypoints.cli": 7,
    "vllm.benchmarks": 6,
    "vllm.entrypoints": 5,
    "vllm.plan": 5,
    "vllm.engine": 4,
    "vllm.executor": 4,
    "vllm.metrics": 4,
    "vllm.outputs": 4,
    "vllm.sampling_params": 4,
    "vllm.tokenizer": 4,
    "vllm.reasoning": 4,
    "vllm.core": 3,
    "vllm.worker": 3,
    "vllm.hisparse.manager": 3,
    "vllm.hisparse.worker": 3,
    "vllm.distributed.kv_transfer": 3,
    "vllm.model_executor": 2,
    "vllm.attention": 2,
    "vllm.distributed": 2,
    "vllm.hisparse": 2,
    "vllm.structured_output": 2,
    "vllm.kernels": 1,
    "vllm._custom_ops": 1,
    "vllm.config": 0,
    "vllm.kv_cache_interface": 0,
    "vllm.utils": 0,
}


def _modules() -> dict[str, Path]:
    mods = {}
    for p in PKG.rglob("*.py"):
        name = p.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
        mods[name.removesuffix(".__init__")] = p
    return mods


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The vllm modules `name` imports at run time."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - child.level + 1]
                    base = ".".join(parts + ([child.module] if child.module else []))
                targets = [f"{base}.{a.name}" for a in child.names] + [base]
            else:
                visit(child)
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                # the root package is imported before any of its modules anyway (and keeps its
                # own imports light: vllm/__init__.py)
                if t and t != name and t != "vllm":
                    found.add(t)

    visit(ast.parse(path.read_text()))
    return found


def _floor(name: str) -> int:
    best = max((p for p in FLOORS if name == p or name.startswith(p + ".")), key=len)
    return FLOORS[best]


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def test_imports_point_down_the_floors():
    up = [
        f"{m} (floor {_floor(m)}) imports {d} (floor {_floor(d)})"
        for m, deps in _graph().items()
        for d in sorted(deps)
        if _floor(d) > _floor(m)
    ]
    assert not up, "\n".join(up)


def test_no_import_cycles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            strongconnect(v)
    assert not cycles, cycles


def test_the_floor_table_catches_an_upward_import():
    """The checks above can fail: a kernel importing the attention layer is upward."""
    assert _floor("vllm.kernels.sparse_mla") < _floor("vllm.attention.layer")
    assert _floor("vllm.hisparse.resolver") == 2 and _floor("vllm.hisparse.manager") == 3


def test_production_code_calls_no_reference_function():
    """``*_ref`` functions define the kernels' semantics for tests; each op's public function
    picks the kernel or its reference. Outside ``vllm/kernels`` nothing calls a ``*_ref``."""
    calls = []
    for name, path in _modules().items():
        if name.startswith("vllm.kernels"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            ref = None
            if isinstance(node, ast.Name) and node.id.endswith("_ref"):
                ref = node.id
            elif isinstance(node, ast.Attribute) and node.attr.endswith("_ref"):
                ref = node.attr
            elif isinstance(node, ast.alias) and node.name.endswith("_ref"):
                ref = node.name
            if ref:
                calls.append(f"{name}: {ref}")
    assert not calls, calls


def _sources():
    for base in (PKG, ROOT / "csrc"):
        for p in base.rglob("*"):
            if p.suffix in (".py", ".cu", ".cuh", ".h", ".cpp") and p.is_file():
                yield p


def test_no_diagnostic_knobs_or_diary_references():
    """Diagnostics live on branches and history in docs/design/; comments give reasons, not
    pointers into a diary ("BENCHMARKS.md, twelfth session")."""
    diary = re.compile(r"(BENCHMARKS\.md[^\n]{0,40}session|\b(first|second|third|\w+th) session\b)")
    bad = []
    for p in _sources():
        text = p.read_text(errors="replace")
        if "DIAG_" in text:
            bad.append(f"{p.relative_to(ROOT)}: DIAG_")
        bad += [f"{p.relative_to(ROOT)}: {m.group(0)}" for m in diary.finditer(text)]
    assert not bad, bad


def test_benchmarks_md_is_current_results():
    """BENCHMARKS.md holds the current figures (one table per component), not a history."""
    lines = (ROOT / "BENCHMARKS.md").read_text().splitlines()
    assert len(lines) <= 400, len(lines)
