"""One decode loop for every backend: runtime/decoding/engine.py's. A second loop elsewhere (as CoreML once had
its own, with no stop strings, sampling or chat) is what this walk finds: a function outside engine.py that
accepts drafted tokens (runtime/decoding/accept.py), or that loops while it runs a model and picks the next
token from the logits."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
ENGINE = ROOT / "runtime" / "decoding" / "engine.py"
SCANNED = ("runtime", "edgespec", "exporters", "quant", "distill", "targets", "benchmarks", "examples")
PASSES = {"forward", "run", "predict", "run_with_iobinding"}  # what runs a model: a runner's, a session's, CoreML's
PICKS = {"argmax", "sample", "choice", "multinomial"}  # what turns logits into the next token


def _called(node: ast.AST) -> set[str]:
    """The names every call under `node` calls (f(...) and x.f(...) alike)."""
    names = set()
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
        func = call.func
        names.add(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", ""))
    return names


def acceptance_functions() -> set[str]:
    tree = ast.parse((ROOT / "runtime" / "decoding" / "accept.py").read_text(encoding="utf-8"))
    return {f.name for f in tree.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")}


def decode_loops(path: Path, root: Path = ROOT) -> list[str]:
    """The functions of `path` that accept drafted tokens, or loop over model passes picking tokens."""
    accepting = acceptance_functions()
    found = []
    for function in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        own = _called(function)
        loops = [n for n in ast.walk(function) if isinstance(n, ast.While)]
        if own & accepting or any(_called(loop) & PASSES and _called(loop) & PICKS for loop in loops):
            found.append(f"{path.relative_to(root)}:{function.lineno} {function.name}")
    return found


def test_the_walk_sees_the_engines_loop():
    found = decode_loops(ENGINE)
    assert any(name.endswith((" verify", " generate")) for name in found), found


def test_it_finds_a_loop_of_its_own(tmp_path):
    """A greedy loop as runtime/execution/coreml.py had one (greedy_generate, until issue 45): it ran the verify
    function, took the argmax and accepted; either alone is found."""
    path = tmp_path / "loop.py"
    path.write_text("def greedy(model, cache, chain):\n"
                    "    while True:\n"
                    "        out = model.run('verify', cache, chain)\n"
                    "        chain = [int(out['logits'].argmax())]\n", encoding="utf-8")
    assert decode_loops(path, tmp_path) == ["loop.py:1 greedy"]
    path.write_text("from accept import accept_greedy\n\ndef step(tokens, children, choices):\n"
                    "    return accept_greedy(tokens, children, choices)\n", encoding="utf-8")
    assert decode_loops(path, tmp_path) == ["loop.py:3 step"]


@pytest.mark.parametrize("folder", SCANNED)
def test_no_decode_loop_outside_the_engine(folder):
    paths = [p for p in sorted((ROOT / folder).rglob("*.py")) if p != ENGINE]
    assert [found for p in paths for found in decode_loops(p)] == []
