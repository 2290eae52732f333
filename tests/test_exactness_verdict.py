"""Exactness does not drift silently: a bundle records the device its exactness was checked on; on any
other, the first use checks it once, caches the verdict per device, and a failing verdict turns
speculation off with a warning (the output stays plain decoding's)."""
import json
import shutil

import pytest

from edgespec.runtime import exactness as exactness_module
from edgespec.runtime.bundle import MANIFEST
from edgespec.runtime.device import machine_key
from edgespec.runtime.drafters import NoDrafter
from edgespec.runtime.engine import GenerationConfig
from edgespec.runtime.pipeline import Pipeline


@pytest.fixture
def elsewhere(bundle_factory, tmp_path, monkeypatch):
    """The tiny bundle as if exported on another device, with an empty cache folder."""
    bundle = tmp_path / "b"
    shutil.copytree(bundle_factory(), bundle)
    manifest = json.loads((bundle / MANIFEST).read_text())
    manifest["exactness"]["machine"] = "another-device"
    (bundle / MANIFEST).write_text(json.dumps(manifest))
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path / "cache"))
    return bundle


def test_the_exporting_device_is_recorded_with_its_verdict(bundle_factory):
    recorded = json.loads((bundle_factory() / MANIFEST).read_text())["exactness"]
    assert recorded["machine"] == machine_key() and recorded["exact"] is True and recorded["rows"] > 40
    assert Pipeline(bundle_factory()).exactness.reason.startswith("checked at export")


def test_another_device_checks_once_and_remembers(elsewhere, monkeypatch):
    calls = []
    real = exactness_module.check_exact_rows
    monkeypatch.setattr(exactness_module, "check_exact_rows", lambda runner: calls.append(1) or real(runner))
    first = Pipeline(elsewhere).exactness
    assert first.exact and first.reason.startswith("checked on first load") and calls == [1]
    again = Pipeline(elsewhere).exactness
    assert again == first and calls == [1]  # the cached verdict, no second check


def test_a_device_that_rounds_differently_decodes_plainly_and_says_why(elsewhere, monkeypatch):
    monkeypatch.setattr(exactness_module, "check_exact_rows", lambda runner: (48, ["row 3"]))
    pipeline = Pipeline(elsewhere)
    with pytest.warns(RuntimeWarning, match="speculation is off.*1 of 48 rows differ"):
        drafter = pipeline.make_drafter(True)
    assert isinstance(drafter, NoDrafter)
    config = GenerationConfig(max_new_tokens=12)
    with pytest.warns(RuntimeWarning):
        spec = pipeline.generate("a b c a b c", config=config, speculate=True)
    assert spec.token_ids == pipeline.generate("a b c a b c", config=config, speculate=False).token_ids
    assert spec.stats.target_passes == 0 or spec.stats.accepted_drafts == 0


def test_a_cache_that_cannot_be_written_costs_a_check_not_the_generation(elsewhere, monkeypatch):
    monkeypatch.setenv("EDGESPEC_CACHE", "/proc/edgespec-cannot-write-here")
    pipeline = Pipeline(elsewhere)
    assert pipeline.exactness.exact
    assert pipeline.generate("a b c", config=GenerationConfig(max_new_tokens=4)).token_ids
