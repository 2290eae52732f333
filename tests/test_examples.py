"""The examples run as written (on a tiny bundle instead of the default one)."""
import hashlib
import os
import re
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
    assert "sha256 verified" in result.stdout
    checks = re.findall(r"exact rows: (\d+) of (\d+) tokens", result.stdout)  # the static graph's passes are shorter
    assert len(checks) == 3 and all(kept == compared for kept, compared in checks)
    for profile in ("cpu", "ai-pc-intel", "apple"):
        bundle = out / f"bundle-{profile}"
        assert (bundle / "manifest.json").is_file() and (out / f"bundle-{profile}.smoke.json").is_file()
        digest, name = (out / f"bundle-{profile}.tar.gz.sha256").read_text().split()
        assert name == f"bundle-{profile}.tar.gz" and hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
    assert (out / "bundle-apple" / "coreml" / "target.mlpackage").is_dir()
    assert not (out / "bundle-cpu" / "coreml").exists()


def test_github_workflow_runs_the_script_per_profile():
    import yaml

    workflow = yaml.safe_load((ROOT / "examples" / "github-workflow.yml").read_text())
    job = workflow["jobs"]["export"]
    profiles = [entry["profile"] for entry in job["strategy"]["matrix"]["include"]]
    assert set(profiles) <= set(_profile_names()) and len(profiles) >= 3
    steps = " ".join(str(step.get("run", "")) for step in job["steps"])
    assert "examples/ci_export.sh" in steps and "torch==2.13.0" in steps


def _profile_names():
    from edgespec.targets.profiles import profiles

    return profiles()
