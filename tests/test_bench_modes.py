"""`edgespec bench --prompt TEXT` (one prompt, a chat message where the bundle has a chat template) and
`--plain-only` (plain decoding's figures alone, no speculative run)."""
import json

import pytest
from edgespec.bench import one_prompt
from edgespec.runtime.contract.errors import InputError
from edgespec.runtime.pipeline import Pipeline

from edgespec.cli import main


@pytest.fixture
def asked(monkeypatch):
    """What each generation bench ran was asked: its prompt or messages, and whether it speculated."""
    calls = []
    real = Pipeline.generate

    def recording(self, *args, **kwargs):
        calls.append({key: kwargs.get(key) for key in ("prompt", "messages", "speculate")})
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Pipeline, "generate", recording)
    return calls


def test_one_prompt_is_a_chat_message_where_the_bundle_has_a_template(bundle_factory, asked, capsys):
    bundle = str(bundle_factory())
    assert Pipeline(bundle, threads=1).codec.has_chat_template  # the tiny tokenizer's template is exported
    assert main(["bench", bundle, "--threads", "1", "--prompt", "The quick brown", "--max-new-tokens", "6",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prompts"] == 1 and report["plain"]["tokens"] == 6 and report["speculative"]["tokens"] == 6
    measured = asked[1:]  # the first is the warm-up
    assert [c["messages"] for c in measured] == [[{"role": "user", "content": "The quick brown"}]] * 2
    assert [c["speculate"] for c in measured] == [False, True]


def test_one_prompt_is_plain_text_without_a_template():
    assert one_prompt("def add", chat=False) == {"prompt": "def add"}
    assert one_prompt("hi", chat=True) == {"messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(InputError, match="--prompt is empty"):
        one_prompt("  ", chat=True)


def test_an_empty_prompt_or_both_prompt_forms_are_refused(bundle_factory, tmp_path, capsys):
    bundle = str(bundle_factory())
    assert main(["bench", bundle, "--prompt", " "]) == 2
    assert "--prompt is empty" in capsys.readouterr().err
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add"}\n')
    with pytest.raises(SystemExit):
        main(["bench", bundle, "--prompt", "a", "--prompts", str(prompts)])
    assert "not allowed with argument" in capsys.readouterr().err


def test_plain_only_runs_no_speculative_generation(bundle_factory, asked, tmp_path, capsys):
    bundle = str(bundle_factory(draft="draft"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add"}\n{"prompt": "The quick brown fox"}\n')
    assert main(["bench", bundle, "--threads", "1", "--prompts", str(prompts), "--max-new-tokens", "6",
                 "--rounds", "2", "--plain-only", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [c["speculate"] for c in asked[1:]] == [False] * 4  # 2 prompts x 2 rounds, after the warm-up
    assert report["plain_only"] is True and report["speculative"] is None and report["speedup"] is None
    assert report["speedup_by_round"] == [] and report["identical_greedy"] is None
    assert report["plain"]["tokens"] == 2 * 2 * 6 and report["plain"]["tokens_per_s"] > 0
    asked.clear()
    assert main(["bench", bundle, "--threads", "1", "--prompt", "def add", "--max-new-tokens", "6",
                 "--plain-only"]) == 0
    out = capsys.readouterr().out
    assert "plain decoding only" in out and "speculative" not in out and "speedup" not in out
    assert [c["speculate"] for c in asked[1:]] == [False]


def test_without_plain_only_both_modes_still_run(bundle_factory, capsys):
    assert main(["bench", str(bundle_factory()), "--threads", "1", "--prompt", "def add", "--max-new-tokens", "6",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["plain_only"] is False and report["speculative"]["tokens"] == 6 and report["speedup"] > 0
