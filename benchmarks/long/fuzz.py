"""Property-based fuzzing at benchmark scale: manifests, prompts (arbitrary unicode and bytes),
generation settings, server request bodies (parsed, and through the HTTP app). A crash is anything but a
result or an EdgespecError (a 4xx answer from the server).

    python benchmarks/long/fuzz.py [--examples 2000]      (six properties: 6 x EXAMPLES cases, fresh random cases)

It runs tests/test_fuzz.py, which CI runs with a small fixed-seed slice.
"""
import argparse
import os
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=2000, help="cases per property")
    args = parser.parse_args()
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "EDGESPEC_FUZZ_EXAMPLES": str(args.examples), "EDGESPEC_FUZZ_RANDOM": "1"}
    started = time.time()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_fuzz.py",
                          "--hypothesis-show-statistics"], cwd=root, env=env)
    print(f"{6 * args.examples} cases in {time.time() - started:.0f} s: "
          + ("0 crashes" if run.returncode == 0 else "a property failed (above)"))
    sys.exit(run.returncode)


if __name__ == "__main__":
    main()
