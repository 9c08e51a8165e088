"""The package's shape: imports point down (no circle, imports inside functions included), the
loop asks drafters through protocols (no `hasattr`), KV compaction lives in the cache alone,
and the package root stays a short list of modules."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mlx_speculate"
MAX_ROOT_MODULES = 25


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def type_checking_nodes(tree: ast.AST) -> set[int]:
    """The nodes under `if TYPE_CHECKING:` (annotations only: no arrow at run time)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(sub) for sub in ast.walk(node))
    return inside


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports anywhere in its text (functions included)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skipped = type_checking_nodes(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            candidates = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found.update(c for c in candidates if c in known and c != name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    known = modules()
    graph = {name: imports(name, path, set(known)) for name, path in known.items()}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_circle():
    """The check above has power: a two-module circle and a longer one are found."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["e", "f"]]


def test_the_loop_finds_no_capability_by_hasattr():
    loops = ["decode.py", "step.py", "sequence.py"]
    loops += [str(p.relative_to(PACKAGE)) for p in sorted((PACKAGE / "batch").glob("*.py"))]
    for name in loops:
        tree = ast.parse((PACKAGE / name).read_text())
        calls = [
            node.lineno
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("hasattr", "getattr")
        ]
        assert calls == [], f"{name} probes attributes at lines {calls}"


def test_the_batch_engine_reads_no_decoder():
    """The batch engine schedules `Sequence`s through their operations, and a lone one through
    the single-stream scheduler's public `Decoder.run`/`resume`: it never reaches into that
    scheduler (`StepBuilder`, a session's decoder) or anything's private state."""
    for path in sorted((PACKAGE / "batch").glob("*.py")):
        tree = ast.parse(path.read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        attributes = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        imported = {
            (node.module or "").rpartition(".")[2]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
        }
        assert "StepBuilder" not in names, path.name
        assert "decoder" not in attributes, path.name
        if "decode" in imported:  # a lone sequence's steps (engine.py)
            assert {"run", "resume"} <= attributes, path.name
        private = {a for a in attributes if a.startswith("_") and not a.startswith("__")}
        own = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | {
            t.attr
            for n in ast.walk(tree)
            if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Attribute)
        }
        assert private <= own, f"{path.name} reads {sorted(private - own)}"


def test_one_commit_for_both_schedulers():
    """A verified step's tokens reach the context, drafter and grammar through one function
    (`Sequence.commit`), whichever scheduler ran the step."""
    for name in ("decode.py", "batch/engine.py"):
        text = (PACKAGE / name).read_text()
        assert ".commit(" in text, name
        for internal in ("context.extend", "context.append", ".extend(features", ".settle("):
            assert internal not in text, f"{name} commits by hand: {internal}"


def test_kv_compaction_is_defined_in_the_cache_only():
    defined = {
        f"{module_name(path)}.{node.name}"
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and "compact" in node.name
    }
    assert defined == {"mlx_speculate.cache.compact"}


def test_the_package_root_holds_few_modules():
    root = [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    assert len(root) <= MAX_ROOT_MODULES, sorted(root)
