"""Wall time and peak RSS of exporting the default recipe (the bundle `make demo` builds), each round in a
process of its own; with --tree, alternating with another checkout of edgespec (e.g. a `git worktree` of an
earlier commit), so a change to the exporter can be held against the one before it.

    python benchmarks/measure/export_cost.py --workdir W [--rounds 2] [--tree /path/to/older/checkout]
"""
import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PACKAGES = {"runtime": "runtime", "exporters": "exporters", "quant": "quant", "targets": "targets",
            "distill": "distill"}
CHILD = """
import sys
tree = sys.argv[1]
if tree != "-":  # import edgespec from that checkout instead of the installed one
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in str(f)]
    sys.path.insert(0, tree)
from pathlib import Path
from edgespec import defaults
from edgespec.exporters.export import ExportConfig, export
export(ExportConfig(**{**defaults.DEFAULT_RECIPE, "draft": str(defaults._default_draft_folder())},
                    quant_policy=defaults.HEAD_INT8_POLICY, out=Path(sys.argv[2]), cache_dir=defaults.cache_dir()))
"""


def package_view(tree: Path, into: Path) -> Path:
    """A folder whose `edgespec` package is `tree`'s, laid out as installed (runtime/ as edgespec.runtime, ...)."""
    package = into / "edgespec"
    shutil.copytree(tree / "edgespec", package)
    for name, folder in PACKAGES.items():
        (package / name).symlink_to(tree / folder)
    return into


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for name in ("target.onnx", "target.weights", "draft.onnx", "draft.weights"):
        h.update((folder / name).read_bytes())
    return h.hexdigest()[:12]


def run(tree: str, out: Path) -> tuple[float, float]:
    """(seconds, the child's own peak RSS in MB)."""
    started = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", CHILD, tree, str(out)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise SystemExit(f"the export failed:\n{child.stderr.read().decode()[-2000:]}")
    return time.perf_counter() - started, usage.ru_maxrss / 1024


parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--workdir", type=Path, required=True)
parser.add_argument("--rounds", type=int, default=2)
parser.add_argument("--tree", type=Path, help="another checkout of edgespec to alternate with")
args = parser.parse_args()
args.workdir.mkdir(parents=True, exist_ok=True)
trees = {"installed": "-"}
if args.tree:
    trees["other"] = str(package_view(args.tree.resolve(), Path(tempfile.mkdtemp(dir=args.workdir))))
for round_ in range(args.rounds):
    for name, tree in (trees.items() if round_ % 2 == 0 else reversed(trees.items())):
        out = args.workdir / f"{name}-{round_}"
        shutil.rmtree(out, ignore_errors=True)
        seconds, peak = run(tree, out)
        print(f"round {round_} {name:9s} {seconds:6.1f} s  peak RSS {peak:7.0f} MB  graphs {digest(out)}")
