"""Exactness does not drift silently: a bundle records the device its exactness was checked on; on any
other, the first use checks it once, caches the verdict per device, and a failing verdict turns
speculation off with a warning (the output stays plain decoding's). The same check decides how many
rows a one-token step runs on the device: one where one row keeps the bits, else a padding row."""
import json
import shutil
from types import SimpleNamespace

import pytest
from edgespec.runtime.contract.manifest import MANIFEST
from edgespec.runtime.decoding import exactness as exactness_module
from edgespec.runtime.decoding.drafters import NoDrafter
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.execution.device import machine_key
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
    monkeypatch.setattr(exactness_module, "check_exact_rows", lambda runner: calls.append(runner.min_rows) or real(runner))
    first = Pipeline(elsewhere).exactness
    assert first.exact and first.reason.startswith("checked on first load")
    assert calls == ([1] if first.min_rows == 1 else [1, 2])  # one row first; a padding row if one row differs
    again = Pipeline(elsewhere).exactness
    assert again == first and len(calls) == first.min_rows  # the cached verdict, no second check


def _stub_runner(graph_min_rows: int):
    return SimpleNamespace(graph_min_rows=graph_min_rows, min_rows=graph_min_rows, static=None)


@pytest.mark.parametrize("differ_at,expected", [
    ((), 1),  # one row keeps the bits: no padding row
    ((1,), 2),  # one row rounds differently: the padding row, checked clean
    ((1, 2), 2),  # neither: the graph's minimum, with what differs (speculation then turns off)
])
def test_a_one_token_step_runs_one_row_only_where_the_check_proves_it(differ_at, expected):
    calls = []

    def check(runner):
        calls.append(runner.min_rows)
        return 50, (["row"] if runner.min_rows in differ_at else [])

    runner = _stub_runner(2)
    min_rows, compared, differ = exactness_module.fewest_exact_rows(runner, check)
    assert (min_rows, runner.min_rows, compared) == (expected, expected, 50)
    assert calls == ([1] if expected == 1 else [1, 2])
    assert bool(differ) == (2 in differ_at)


def test_a_check_that_fails_midway_leaves_the_padding_row():
    def check(runner):
        raise MemoryError("the check ran out of memory")

    runner = _stub_runner(2)
    with pytest.raises(MemoryError):
        exactness_module.fewest_exact_rows(runner, check)
    assert runner.min_rows == 2  # one row was never proven


def test_a_graph_exact_at_one_row_is_checked_at_one_row_only():
    calls = []
    runner = _stub_runner(1)  # integer matmuls: one row on any device (quant/integer.py)
    found = exactness_module.fewest_exact_rows(runner, lambda r: calls.append(r.min_rows) or (48, ["row"]))
    assert found == (1, 48, ["row"]) and calls == [1]


def test_the_rows_chosen_here_keep_the_bits_and_fewer_would_not(bundle_factory):
    """On the real tiny graph, whatever this device's kernels do: the chosen count passes every check, and
    a padding row is kept only where one row really differs."""
    pipeline = Pipeline(bundle_factory())
    min_rows, compared, differ = exactness_module.fewest_exact_rows(pipeline.target)
    assert differ == [] and compared > 40 and pipeline.target.min_rows == min_rows
    if min_rows == 2:
        pipeline.target.min_rows = 1
        assert exactness_module.check_exact_rows(pipeline.target)[1] != []


def test_plain_decoding_runs_the_rows_the_verdict_chose(bundle_factory):
    """Plain and speculative decoding compare the same bits only if both run the same rows per step."""
    pipeline = Pipeline(bundle_factory(draft="ngram", tree="chain:4"))
    plain = pipeline.generate("a b c a b c", config=GenerationConfig(max_new_tokens=8), speculate=False)
    assert pipeline.target.min_rows == pipeline.exactness.min_rows
    assert plain.token_ids == pipeline.generate("a b c a b c", config=GenerationConfig(max_new_tokens=8)).token_ids


def test_the_export_records_the_rows_its_device_runs(bundle_factory):
    recorded = json.loads((bundle_factory() / MANIFEST).read_text())["exactness"]
    assert recorded["min_rows"] in (1, 2)
    assert Pipeline(bundle_factory()).exactness.min_rows == recorded["min_rows"]


def test_a_verdict_recorded_before_the_rows_were_measured_is_checked_again(elsewhere, monkeypatch):
    manifest = json.loads((elsewhere / MANIFEST).read_text())
    manifest["exactness"]["machine"] = machine_key()
    del manifest["exactness"]["min_rows"]
    (elsewhere / MANIFEST).write_text(json.dumps(manifest))
    assert Pipeline(elsewhere).exactness.reason.startswith("checked on first load")


def test_a_device_that_rounds_differently_decodes_plainly_and_says_why(elsewhere, monkeypatch):
    monkeypatch.setattr(exactness_module, "check_exact_rows", lambda runner: (48, ["row 3"]))
    pipeline = Pipeline(elsewhere)
    with pytest.warns(RuntimeWarning, match="speculation is off.*1 of 48 rows differ.*run 2 rows"):
        drafter = pipeline.make_drafter(True)
    assert isinstance(drafter, NoDrafter)
    config = GenerationConfig(max_new_tokens=12)
    with pytest.warns(RuntimeWarning):
        spec = pipeline.generate("a b c a b c", config=config, speculate=True)
    assert spec.token_ids == pipeline.generate("a b c a b c", config=config, speculate=False).token_ids
    assert spec.stats.target_passes == 0 or spec.stats.accepted_drafts == 0


def test_a_callers_own_drafter_is_held_to_the_same_rules(bundle_factory, elsewhere, monkeypatch):
    """A drafter passed in (a conversation's, which keeps its draft cache) neither overrides speculate=False
    nor speculates where the device is not exact."""
    pipeline = Pipeline(bundle_factory())
    config = GenerationConfig(max_new_tokens=6)
    with pytest.raises(ValueError, match="speculate=False"):
        pipeline.generate("a b c", config=config, speculate=False, session=pipeline.new_session())
    assert pipeline.generate("a b c", config=config, speculate=False, session=pipeline.new_session(False)).token_ids
    monkeypatch.setattr(exactness_module, "check_exact_rows", lambda runner: (48, ["row 3"]))
    inexact = Pipeline(elsewhere)
    drafter, proposed = Pipeline(bundle_factory()).make_drafter(True), []
    propose = drafter.propose
    drafter.propose = lambda *args, **kwargs: proposed.append(1) or propose(*args, **kwargs)
    with pytest.warns(RuntimeWarning, match="speculation is off"):
        spec = inexact.generate("a b c a b c", config=config, session=inexact.new_session(drafter=drafter))
    assert spec.token_ids and not proposed


def test_a_cache_that_cannot_be_written_costs_a_check_not_the_generation(elsewhere, monkeypatch):
    monkeypatch.setenv("EDGESPEC_CACHE", "/proc/edgespec-cannot-write-here")
    pipeline = Pipeline(elsewhere)
    assert pipeline.exactness.exact
    assert pipeline.generate("a b c", config=GenerationConfig(max_new_tokens=4)).token_ids
