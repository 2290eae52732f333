"""The `spin` setting: whether onnxruntime's threads spin between a pass's operators, from load() and the
command line down to the sessions' options, and refused in one line when it names no setting."""
import pytest
from edgespec.runtime.contract.errors import InputError
from edgespec.runtime.execution import sessions
from edgespec.runtime.execution.shared_passes import open_shared
from edgespec.runtime.pipeline import Pipeline, load

from edgespec import cli

ENTRY = "session.intra_op.allow_spinning"


def _spins(runner) -> str:
    """What onnxruntime was told, read back from the session itself."""
    return runner.session.get_session_options().get_session_config_entry(ENTRY)


@pytest.mark.parametrize("spin, expected", [("auto", "1"), ("on", "1"), ("off", "0")])
def test_the_setting_reaches_both_sessions(bundle_factory, spin, expected):
    pipeline = Pipeline(bundle_factory(draft="draft"), threads=1, spin=spin)
    assert pipeline.spin == spin
    assert (_spins(pipeline.target), _spins(pipeline.draft)) == (expected, expected)


def test_load_takes_it_and_the_default_spins(bundle_factory):
    bundle = bundle_factory(draft="draft")
    assert _spins(load(bundle, threads=1, spin="off").target) == "0"
    assert _spins(load(bundle, threads=1).target) == "1"


@pytest.mark.parametrize("bad", ["yes", "", None, True, "OFF"])
def test_a_bad_setting_is_one_line_naming_it(bundle_factory, bad):
    with pytest.raises(InputError) as err:
        load(bundle_factory(), spin=bad)
    message = str(err.value)
    assert message.startswith("spin must be one of auto, on, off") and repr(bad) in message and "\n" not in message


def test_beside_a_streamed_targets_loader_auto_leaves_the_draft_still():
    """auto keeps today's choice: a draft beside a streamed target's loader thread does not spin; on and off
    are what they say."""
    assert [sessions.spins(s) for s in sessions.SPIN_SETTINGS] == [True, True, False]
    assert [sessions.spins(s, beside_loader=True) for s in sessions.SPIN_SETTINGS] == [False, True, False]
    with pytest.raises(InputError, match="spin must be"):
        sessions.spins("sometimes")


def test_a_slots_graph_spins_as_the_target_does(models, tmp_path_factory):
    from edgespec.exporters.export import ExportConfig, export

    root = tmp_path_factory.mktemp("spin_slots")
    export(ExportConfig(model=str(models["target"]), draft="ngram", out=root / "b", tree="chain:3", context=128,
                        slots=2, cache_dir=root / "cache"))
    for spin, expected in (("off", "0"), ("on", "1")):
        pipeline = Pipeline(root / "b", threads=1, spin=spin)
        shared = open_shared(pipeline.folder, pipeline.manifest.target, pipeline.target, 1)
        assert shared is not None and _spins(shared.slots) == expected


@pytest.fixture
def made(monkeypatch):
    """The `spin` each session the command line makes is given."""
    given = []
    real = sessions.make_session

    def recording(*args, **kwargs):
        given.append((kwargs.get("role"), kwargs.get("spin")))
        return real(*args, **kwargs)

    for opener in ("edgespec.runtime.pipeline", "edgespec.runtime.execution.draft_open"):  # the target, the draft
        monkeypatch.setattr(f"{opener}.make_session", recording)
    return given


def _serve_records(monkeypatch):
    served = []
    pytest.importorskip("edgespec.serve")
    monkeypatch.setattr("edgespec.serve.serve", lambda pipeline, config: served.append(pipeline))
    return served


@pytest.mark.parametrize("command", ["generate", "chat", "bench", "serve"])
def test_every_decoding_command_passes_spin(bundle_factory, made, monkeypatch, command):
    bundle = str(bundle_factory(draft="draft"))
    args = {"generate": ["--prompt", "a", "--max-new-tokens", "2"], "chat": ["--max-new-tokens", "2"],
            "bench": ["--prompt", "a", "--max-new-tokens", "2"], "serve": []}[command]
    served = _serve_records(monkeypatch) if command == "serve" else []
    monkeypatch.setattr("builtins.input", lambda prompt="": (_ for _ in ()).throw(EOFError))  # chat: no turns
    assert cli.main([command, bundle, "--threads", "1", "--spin", "off", *args]) == 0
    assert made == [("the target", False), ("the draft", False)]
    assert served == [] or served[0].spin == "off"
    made.clear()
    assert cli.main([command, bundle, "--threads", "1", *args]) == 0  # auto: both spin (a resident target)
    assert made == [("the target", True), ("the draft", True)]


def test_the_command_line_refuses_another_word(bundle_factory, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", str(bundle_factory()), "--prompt", "a", "--spin", "always"])
    assert exit_.value.code == 2 and "--spin: invalid choice: 'always'" in capsys.readouterr().err
