"""A second execution provider, for real: the draft on onnxruntime-openvino's OpenVINO provider (its CPU
plugin, on this CPU), the target on onnxruntime's CPU kernels, in an environment of its own (the package
replaces `onnxruntime`). `make test` builds that environment and names its interpreter in
EDGESPEC_OPENVINO_PYTHON; the bundles are exported here and decoded there (tests/openvino_check.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

OPENVINO_PYTHON = os.environ.get("EDGESPEC_OPENVINO_PYTHON")
pytestmark = pytest.mark.skipif(not OPENVINO_PYTHON, reason="no onnxruntime-openvino environment: `make test` "
                                "builds one (.venv-openvino) and sets EDGESPEC_OPENVINO_PYTHON")


@pytest.mark.parametrize("draft,tree", [("target", "topk:2x2"), ("draft", "chain:3")])
def test_the_draft_on_openvino_keeps_plain_decodings_tokens(draft, tree, models, tmp_path):
    from edgespec.exporters.export import ExportConfig, export

    folder = export(ExportConfig(model=str(models["target"]), draft=str(models[draft]), out=tmp_path / "bundle",
                                 tree=tree, context=256, profile="openvino-cpu", also_profiles=("ai-pc-intel",)))
    found = subprocess.run([OPENVINO_PYTHON, str(Path(__file__).parent / "openvino_check.py"), str(folder)],
                           capture_output=True, text=True, timeout=600,
                           env={**os.environ, "EDGESPEC_CACHE": str(tmp_path / "cache")})
    assert found.returncode == 0, found.stderr[-3000:]
    report = json.loads(found.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1), file=sys.stderr)
    assert "OpenVINOExecutionProvider" in report["providers"]
    on_openvino = [r for r in report["runs"] if r["placement"]["draft"]["name"] == "OpenVINOExecutionProvider"]
    assert on_openvino and all(r["draft_providers"][0] == "OpenVINOExecutionProvider" for r in on_openvino)
    assert any(r["placement"]["overlap"] and r["drafted_ahead"] > 0 for r in on_openvino)
    assert all(r["identical"] for r in report["runs"])
    if draft == "target":  # the draft is the target: on either provider its tokens get accepted
        assert all(r["accepted"] > 0 for r in report["runs"])
    # the NPU profile's static draft, attention in standard operators: OpenVINO runs all of it; the dynamic
    # draft's fused attention runs on onnxruntime's CPU kernels
    nodes = report["draft_nodes"]
    assert set(nodes["draft.static.onnx"]) == {"OpenVINOExecutionProvider"}
    assert nodes["draft.onnx"].get("CPUExecutionProvider", 0) > 0
    # the ai-pc-intel profile asks OpenVINO for an NPU, then a GPU: neither is here, and the fallback is named
    npu = report["ai_pc_intel"]
    assert npu["identical"]
    if npu["draft_providers"][0] == "CPUExecutionProvider":
        assert any("device_type=NPU" in w and "runs on CPUExecutionProvider" in w for w in npu["warnings"])
        # calibration measures only what starts: no placement named for an NPU that is not here
        assert npu["measured"] and all(m["draft"]["name"] == "CPUExecutionProvider" for m in npu["measured"])
