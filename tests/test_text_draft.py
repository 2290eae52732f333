"""A draft of another tokenizer, drafting through text (runtime/decoding/text_draft.py, text_bridge.py,
exporters/text_draft.py): the bridge's boundaries, a scripted draft, and tiny models end to end, greedy bit for
bit against plain decoding and sampled by the chi-square test of test_sampling_engine.py."""
from collections import Counter

import numpy as np
import pytest
from edgespec.runtime.contract.drafting import DrafterKind
from edgespec.runtime.contract.errors import BundleError, ExportError
from edgespec.runtime.contract.manifest import MANIFEST
from edgespec.runtime.decoding import text_draft
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.sampling import SamplingConfig
from edgespec.runtime.decoding.text_bridge import WINDOW, DraftView, TargetText, target_proposal
from edgespec.runtime.pipeline import Pipeline
from test_sampling_engine import assert_same_distribution
from text_drafts import make_bytes_model, make_other_draft, permuted_copy, train_tokenizer
from tiny import CORPUS, make_model, make_tokenizer

TEXT = "The quick brown fox jumps over the lazy dog. def add(a, b):\n    return a + b\n héllo 世界 " * 3
ASCII = TEXT.replace(" héllo 世界", "")  # a target token is whole text: the scripted tests compare text


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """(target, draft): tests/tiny.py's tokenizer and one trained on other text with other ids."""
    root = tmp_path_factory.mktemp("tok")
    target = make_tokenizer(root / "t").backend_tokenizer
    draft = train_tokenizer(root / "d", 400, corpus=[t.upper() + t for t in CORPUS]).backend_tokenizer
    return target, draft


def test_the_committed_text_is_decoded_incrementally_and_rewinds(tokenizers):
    target, _ = tokenizers
    ids = target.encode(TEXT).ids
    text = TargetText(target)
    for n in (5, 17, 17, len(ids)):
        text.sync(ids[:n])
    assert text.text == TEXT
    assert text.sync(ids[:40] + [7, 8]) == len(target.decode(ids[:40]))  # another continuation: what stays
    assert text.text == target.decode(ids[:40] + [7, 8])
    text.rewind(10)
    assert text.ids == ids[:10] and text.text == target.decode(ids[:10])


def test_the_drafts_tokens_are_its_own_encoding_of_the_text_whatever_the_anchors(tokenizers):
    _, draft = tokenizers
    view, expected = DraftView(draft), draft.encode(TEXT).ids
    kept_before = 0
    for end in range(7, len(TEXT) + 1, 23):
        kept = view.update(TEXT[:end], end - 23 if end > 7 else 0)
        assert view.ids == draft.encode(TEXT[:end]).ids
        assert kept >= kept_before - 3  # appending text changes at most the last few tokens
        kept_before = len(view.ids)
    view.update(TEXT, len(TEXT) - 23)
    assert view.ids == expected and len(view.anchors) > 1  # settled: later updates re-encode a window
    assert all(len(expected) - start < 2 * WINDOW for _, start in view.anchors[-1:])
    assert view.update("The quick brown", 9) <= len(draft.encode("The quick brown").ids)  # an edit before the
    assert view.ids == draft.encode("The quick brown").ids and view.anchors == [(0, 0)]  # anchors drops them


def test_drafted_text_continues_the_committed_tokens_at_their_boundary(tokenizers):
    target, _ = tokenizers
    text = TargetText(target)
    committed = target.encode("The quick brown").ids
    text.sync(committed)
    assert target_proposal(target, text, " fox jumps") == target.encode(" fox jumps").ids
    # the committed text ends inside what the encoding would merge: the rest starts at the boundary
    text.sync(target.encode("The quick bro").ids)
    proposal = target_proposal(target, text, "wn fox")
    assert target.decode(text.ids + proposal) == "The quick brown fox"


class ScriptedDraft:
    """A draft that knows the text: after tokens whose text begins `script` it predicts the first of its tokens for
    the rest (`unknown` anywhere else). Checks that the cache holds what the drafter fed it."""

    def __init__(self, tokenizer, script: str, unknown: int):
        self.tokenizer, self.script, self.unknown = tokenizer, script, unknown
        self.fed: list[int] = []

    def prefill(self, runner, cache, tokens, chunk):
        assert cache.length <= len(self.fed) and cache.length + len(tokens) <= cache.capacity
        self.fed = self.fed[: cache.length] + list(tokens)
        cache.length = len(self.fed)
        text = self.tokenizer.decode(self.fed, skip_special_tokens=False)
        logits = np.zeros(self.tokenizer.get_vocab_size())
        rest = self.tokenizer.encode(self.script[len(text):]).ids if self.script.startswith(text) else []
        logits[rest[0] if rest else self.unknown] = 1.0
        return logits


class ListCache:
    def __init__(self, capacity):
        self.capacity, self.length = capacity, 0

    def trim(self, length):
        self.length = length


@pytest.mark.parametrize("start", [19, 20, 23])  # after a word, after its space, inside a word
def test_a_scripted_draft_proposes_the_script_in_target_tokens_and_keeps_its_rows(tokenizers, monkeypatch, start):
    target, draft = tokenizers
    script = ScriptedDraft(draft, ASCII, draft.token_to_id("<|endoftext|>"))
    monkeypatch.setattr(text_draft, "prefill", script.prefill)
    drafter = text_draft.TextDrafter(None, ListCache(512), 4, 64, target, draft, (2,))
    committed = target.encode(ASCII[:start]).ids
    for _ in range(12):
        tree = drafter.propose(committed, 16, None)
        proposal = tree.tokens[1:].tolist()
        assert tree.tokens[0] == committed[-1] and 0 < len(proposal) <= 4
        before, after = target.decode(committed), target.decode(committed + proposal)
        assert ASCII.startswith(after) and len(after) > len(before)  # the script's next text: nothing lost or doubled
        committed = committed + proposal[:2]  # two accepted, and the bonus: the target's next token of the text
        committed.append(target.encode(ASCII[len(target.decode(committed)):]).ids[0])
        fed = len(script.fed)
        drafter.propose(committed, 16, None)
        assert len(script.fed) - fed <= 6  # the accepted drafted rows were kept, not fed again


def test_drafting_stops_before_the_drafts_unknown_token(tokenizers, monkeypatch):
    target, draft = tokenizers
    script = ScriptedDraft(draft, ASCII, draft.token_to_id("<|endoftext|>"))
    monkeypatch.setattr(text_draft, "prefill", script.prefill)
    drafter = text_draft.TextDrafter(None, ListCache(512), 4, 64, target, draft, (2,))
    drafter.unknown = draft.encode(ASCII[19:]).ids[1]  # its second drafted token: no text to re-encode
    tree = drafter.propose(target.encode(ASCII[:19]).ids, 16, None)
    assert tree.tokens[1:].tolist() == target.encode(ASCII[19:]).ids[:1] or tree.size == 1


@pytest.fixture(scope="module")
def text_bundles(tmp_path_factory):
    """Bundles of a target and a draft of another tokenizer: `other` (a random draft, other merges), `self` (the
    target itself, its ids shuffled) and `bytes` (the same over a tokenizer of bytes alone)."""
    from edgespec.exporters.export import ExportConfig, export

    root = tmp_path_factory.mktemp("text")
    make_model(root / "t", "llama", seed=0)
    make_other_draft(root / "other")
    permuted_copy(root / "t", root / "self")
    make_bytes_model(root / "tb")
    permuted_copy(root / "tb", root / "bytes")
    bundles = {}
    for name, target in (("other", "t"), ("self", "t"), ("bytes", "tb")):
        bundles[name] = root / f"b-{name}"
        export(ExportConfig(model=str(root / target), draft=str(root / name), out=bundles[name], tree="chain:4",
                            context=256, cache_dir=root / "cache"))
    bundles["models"] = root
    return bundles


@pytest.mark.parametrize("name", ["other", "self", "bytes"])
def test_a_draft_of_another_tokenizer_decodes_as_plain_decoding(name, text_bundles):
    pipeline = Pipeline(text_bundles[name])
    m = pipeline.manifest
    assert m.drafter is DrafterKind.TEXT and m.draft.tokenizer.file in m.files
    assert m.draft.facts.vocab_size != m.target.facts.vocab_size or name != "other"
    config = GenerationConfig(max_new_tokens=40, stop_at_eos=False)
    passes = tokens = 0
    for text in CORPUS:
        spec = pipeline.generate(text, config=config)
        assert spec.token_ids == pipeline.generate(text, config=config, speculate=False).token_ids
        passes, tokens = passes + spec.stats.target_passes, tokens + spec.stats.new_tokens - 1
    if name == "bytes":  # one tokenization per text, the target's own model: (nearly) every draft accepted
        assert tokens / passes > 4.5


def test_a_conversation_of_several_turns_rewinds_the_drafts_text(text_bundles):
    pipeline = Pipeline(text_bundles["bytes"])
    config = GenerationConfig(max_new_tokens=30, stop_at_eos=False)
    session, plain = pipeline.new_session(), pipeline.new_session(False)
    messages = [{"role": "user", "content": "Hello there"}]
    for turn in ("Tell me more", "And again"):
        spec = pipeline.generate(messages=messages, config=config, session=session)
        assert spec.token_ids == pipeline.generate(messages=messages, config=config, session=plain).token_ids
        messages += [{"role": "assistant", "content": spec.text}, {"role": "user", "content": turn}]
        assert spec.stats.mean_accepted_per_pass > 3


@pytest.mark.parametrize("name", ["bytes", "other"])
def test_sampling_through_text_has_the_plain_distribution(name, text_bundles):
    """Point-mass proposals accepted by the target's own probability (often, for `bytes`: its greedy choice)."""
    pipeline = Pipeline(text_bundles[name], threads=1)

    def first_tokens(speculate):
        counts = Counter()
        for seed in range(1200):
            config = GenerationConfig(max_new_tokens=3, stop_at_eos=False,
                                      sampling=SamplingConfig(temperature=1.0, top_k=3, seed=seed))
            counts[tuple(pipeline.generate("The quick", config=config, speculate=speculate).token_ids)] += 1
        return counts

    assert_same_distribution(first_tokens(False), first_tokens(True))


def test_a_draft_whose_tokenizer_loses_text_is_refused_in_one_line(tmp_path):
    from edgespec.exporters.export import ExportConfig, export

    make_model(tmp_path / "t", "llama", seed=0)
    make_other_draft(tmp_path / "d", vocab=200, byte_level=False)
    with pytest.raises(ExportError, match="the draft's tokenizer does not give back the text it encodes") as err:
        export(ExportConfig(model=str(tmp_path / "t"), draft=str(tmp_path / "d"), out=tmp_path / "b", context=256,
                            cache_dir=tmp_path / "cache"))
    assert "\n" not in str(err.value) and not (tmp_path / "b").exists()


@pytest.mark.parametrize("options,says", [({"tree": "topk:2x2"}, "give --tree chain:N"),
                                          ({"lookup": 2}, "drop --lookup"), ({"suffix": True}, "drop --lookup")])
def test_what_a_text_draft_does_not_take_is_refused(options, says, text_bundles, tmp_path):
    from edgespec.exporters.export import ExportConfig, export

    models = text_bundles["models"]
    with pytest.raises(ExportError, match=says):
        export(ExportConfig(model=str(models / "t"), draft=str(models / "other"), out=tmp_path / "b", context=256,
                            cache_dir=tmp_path / "cache", **options))


def test_the_manifest_holds_a_text_drafts_tokenizer_and_only_its(text_bundles, tmp_path):
    import json
    import shutil

    from edgespec.runtime.contract.manifest import Manifest

    data = json.loads((text_bundles["other"] / MANIFEST).read_text())
    assert data["draft"]["kind"] == "text" and data["draft"]["tokenizer"]["file"] == "draft_tokenizer.json"
    without = json.loads(json.dumps(data))
    del without["draft"]["tokenizer"]
    with pytest.raises(BundleError, match="needs its own tokenizer"):
        Manifest.from_dict(without)
    as_model = json.loads(json.dumps(data))
    as_model["draft"]["kind"] = "model"
    with pytest.raises(BundleError, match="only a text draft has one"):
        Manifest.from_dict(as_model)
    copy = tmp_path / "b"
    shutil.copytree(text_bundles["other"], copy)
    (copy / "draft_tokenizer.json").write_text("{}")
    with pytest.raises(BundleError, match="draft_tokenizer.json"):
        Pipeline(copy)


def test_inspect_names_the_drafts_tokenizer_and_tune_keeps_its_chain(text_bundles, capsys):
    from edgespec.cli import main

    assert main(["inspect", str(text_bundles["other"])]) == 0
    assert "drafter: text (the draft's own tokenizer draft_tokenizer.json" in capsys.readouterr().out
    assert main(["tune", str(text_bundles["other"])]) == 2
    assert "drafts a chain through text" in capsys.readouterr().err
