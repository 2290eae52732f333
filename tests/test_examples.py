"""The examples run as written (on a tiny bundle instead of the default one)."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def env_with_cli():
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env


def test_embedded_app(bundle_factory):
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "embedded_app.py"), str(bundle_factory())],
                            capture_output=True, text=True, env=env_with_cli(), timeout=300)
    assert result.returncode == 0, result.stderr
    assert "tokens per target pass" in result.stdout


def test_ci_export_script(models, tmp_path):
    out = tmp_path / "dist"
    result = subprocess.run(["bash", str(ROOT / "examples" / "ci_export.sh"), str(models["target"]), "ngram", str(out), "256"],
                            capture_output=True, text=True, env=env_with_cli(), timeout=300)
    assert result.returncode == 0, result.stderr
    assert "sha256 verified" in result.stdout and "exact rows: 48 of 48" in result.stdout
    assert (out / "bundle-cpu" / "manifest.json").is_file() and (out / "bundle-cpu.smoke.json").is_file()
