"""Imports run one way: the front door (edgespec/: CLI, server, public API) -> distill/ -> exporters/ ->
quant/ -> runtime/ -> targets/, and inside runtime/ pipeline -> decoding/ -> execution/ -> contract/. The
errors every layer raises (runtime/contract/errors.py) are the floor. No module imports a layer above its
own, the import graph has no cycle, the contract imports no onnxruntime, and an import inside a function is
only for what an optional extra brings (export, distill, serve)."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
FOLDERS = {"edgespec": "edgespec", "runtime": "edgespec.runtime", "exporters": "edgespec.exporters",
           "quant": "edgespec.quant", "targets": "edgespec.targets", "distill": "edgespec.distill"}
LAYERS = {"targets": 0, "runtime": 1, "quant": 2, "exporters": 3, "distill": 4, "front": 5}
ROOMS = {"contract": 0, "execution": 1, "decoding": 2, "pipeline": 3}  # runtime/'s, bottom first
FLOOR = "edgespec.runtime.contract.errors"
OPTIONAL = ("edgespec.exporters", "edgespec.distill", "edgespec.serve")  # behind the export and serve extras


def module_name(path: Path) -> str:
    folder = path.relative_to(ROOT).parts[0]
    rest = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
    return ".".join([FOLDERS[folder], *rest])


MODULES = {module_name(p) for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")}


def imports() -> list[tuple[str, str, bool]]:
    """(importer, imported edgespec module, at module top?) for every import statement."""
    found = []
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            name = module_name(path)
            tree = ast.parse(path.read_text(encoding="utf-8"))
            top = {id(node) for node in tree.body}
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    if node.level:
                        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
                        package = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                        base = f"{package}.{node.module}" if node.module else package
                    else:
                        base = node.module or ""
                    # `from package import module` depends on the module itself, not only on the package
                    targets = [base] + [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
                elif isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                else:
                    continue
                found += [(name, t, id(node) in top) for t in targets if t == "edgespec" or t.startswith("edgespec.")]
    return found


def layer(module: str) -> int:
    if module == FLOOR:
        return -1
    parts = module.split(".")
    return LAYERS[parts[1] if len(parts) > 1 and parts[1] in LAYERS else "front"]


def room(module: str) -> int | None:
    """The runtime room a module sits in (None outside runtime/, or the package itself)."""
    parts = module.split(".")
    return ROOMS.get(parts[2]) if len(parts) > 2 and parts[1] == "runtime" else None


def test_the_walk_sees_the_project():
    found = imports()
    assert len(found) > 100
    assert ("edgespec.runtime.pipeline", "edgespec.runtime.decoding.engine", True) in found


def test_no_module_imports_a_layer_above_its_own():
    upward = [(a, b) for a, b, _ in imports() if layer(b) > layer(a)]
    assert upward == []


def test_runtime_rooms_import_downward_only():
    upward = [(a, b) for a, b, _ in imports()
              if room(a) is not None and room(b) is not None and room(b) > room(a)]
    assert upward == []


def test_every_runtime_module_sits_in_a_room():
    loose = [m for m in MODULES if m.startswith("edgespec.runtime.") and room(m) is None]
    assert loose == []


def test_the_contract_needs_no_onnxruntime():
    """Exporters and tools read manifests and graph signatures without the runtime's execution."""
    contract = sorted(m for m in MODULES if room(m) == 0)
    code = f"import sys; import {', '.join(contract)}; print(sorted(m for m in sys.modules if m.split('.')[0] " \
           "in ('onnxruntime', 'edgespec') and not m.startswith(('edgespec.runtime.contract', 'edgespec.targets'))))"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert found == "['edgespec', 'edgespec.runtime']"


def test_imports_inside_functions_are_for_optional_extras_only():
    hidden = [(a, b) for a, b, top in imports() if not top and not b.startswith(OPTIONAL)]
    assert hidden == []


def test_the_import_graph_has_no_cycle():
    graph: dict[str, set[str]] = {}
    for a, b, _ in imports():
        graph.setdefault(a, set()).add(b)
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]) if nxt in path
                            else f"import cycle through {nxt}")
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
