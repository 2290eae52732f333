"""Device profiles as data files, provider fallback (a warning, or with --strict an error), `doctor`."""
import json
import shutil

import pytest
from edgespec.exporters.export import ExportConfig, export
from edgespec.runtime.contract.errors import ExportError
from edgespec.runtime.contract.manifest import MANIFEST
from edgespec.runtime.execution.providers import usable_providers
from edgespec.runtime.pipeline import Pipeline
from edgespec.targets.profiles import DeviceProfile, profiles

from edgespec.cli import main

SHIPPED = ("cpu", "cpu-x86", "cpu-arm", "openvino-cpu", "ai-pc-intel", "ai-pc-qualcomm", "windows-directml", "apple", "android", "cuda")


def test_every_device_kind_has_a_valid_profile_file():
    found = profiles()
    assert set(SHIPPED) <= set(found)
    for name, profile in found.items():
        assert DeviceProfile.from_dict(profile.to_dict()) == profile
        assert profile.verify[-1].name == "CPUExecutionProvider" and profile.description
    assert found["ai-pc-intel"].draft[0].name == "OpenVINOExecutionProvider"
    assert dict(found["ai-pc-intel"].draft[0].options) == {"device_type": "NPU"}
    assert found["ai-pc-intel"].static_shapes and found["ai-pc-intel"].weights == "int8-symmetric"


@pytest.mark.parametrize("change,message", [
    ({"weights": "fp64"}, "weights"),
    ({"draft": []}, "at least one provider"),
    ({"draft": [{"name": "NPU"}]}, "ExecutionProvider"),
    ({"draft": [{"name": "CPUExecutionProvider", "options": {"threads": 2}}]}, "options are strings"),
    ({"max_tree_nodes": 0}, "max_tree_nodes"),
    ({"static_shapes": "yes"}, "static_shapes"),
])
def test_a_bad_profile_is_refused_with_what_is_wrong(change, message):
    data = {**profiles()["cpu"].to_dict(), **change}
    with pytest.raises(ValueError, match=message):
        DeviceProfile.from_dict(data)


def test_a_missing_provider_falls_back_with_a_warning_or_fails_strictly():
    cuda = profiles()["cuda"]
    with pytest.warns(RuntimeWarning, match="CUDAExecutionProvider is not in this onnxruntime build.*CPUExecutionProvider"):
        chosen = usable_providers(cuda.verify, "the target")
    assert chosen[0][0] == "CPUExecutionProvider"
    with pytest.raises(ValueError, match="--strict"):
        usable_providers(cuda.verify, "the target", strict=True)


@pytest.fixture
def cuda_bundle(bundle_factory, tmp_path):
    """The tiny bundle as if exported for the cuda profile (the profile is not among the checksummed files)."""
    bundle = tmp_path / "b"
    shutil.copytree(bundle_factory(), bundle)
    manifest = json.loads((bundle / MANIFEST).read_text())
    manifest["profile"] = profiles()["cuda"].to_dict()
    (bundle / MANIFEST).write_text(json.dumps(manifest))
    return bundle


def test_a_bundle_for_a_missing_provider_runs_on_the_cpu_and_says_so(cuda_bundle):
    with pytest.warns(RuntimeWarning, match="the target runs on CPUExecutionProvider"):
        pipeline = Pipeline(cuda_bundle)
    assert pipeline.generate("a b c").token_ids
    with pytest.raises(ValueError, match="--strict"):
        Pipeline(cuda_bundle, strict=True)


def test_older_manifests_name_providers_only(bundle_factory):
    data = {"name": "cpu", "draft_providers": ["CPUExecutionProvider"], "verify_providers": ["CPUExecutionProvider"],
            "static_shapes": False}
    profile = DeviceProfile.from_dict(data)
    assert profile.verify_providers == ("CPUExecutionProvider",) and profile.description


def test_doctor_names_providers_cores_and_placement(cuda_bundle, capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "providers in this build" in out and "cores:" in out and "cuda" in out
    assert "would run: the draft on CPUExecutionProvider, the target on CPUExecutionProvider" in out
    assert main(["doctor", str(cuda_bundle)]) == 0
    out = capsys.readouterr().out
    assert "exported for the cuda profile" in out and "measured placement: none yet" in out
    assert main(["doctor", str(cuda_bundle), "--strict"]) == 2
