"""Every architecture family edgespec exports, tested the same way against transformers itself (tiny random
models whose configs exercise what each family adds: tests/tiny.py's FAMILY_CONFIGS)."""
import numpy as np
import pytest
import torch
from edgespec.exporters.architectures import FAMILIES
from edgespec.exporters.export import ExportConfig, export
from edgespec.runtime.contract.manifest import open_bundle
from edgespec.runtime.contract.topology import parse_tree_spec
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.execution.kvcache import KVCache
from edgespec.runtime.execution.model import ModelRunner, commit
from edgespec.runtime.execution.sessions import make_session
from edgespec.runtime.pipeline import Pipeline
from tiny import CORPUS, FAMILY_CONFIGS, WINDOW, make_model

TOLERANCE = 1e-4
PROMPT = 200  # longer than every tiny config's sliding window
TYPES = sorted(t for family in FAMILIES for t in family.model_types)


def test_every_family_has_a_tiny_config():
    assert sorted(FAMILY_CONFIGS) == TYPES


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    made = {}

    def make(model_type: str):
        if model_type not in made:
            folder = root / model_type
            made[model_type] = (folder, make_model(folder, model_type, seed=7, random_norms=True,
                                                   **FAMILY_CONFIGS[model_type]))
        return made[model_type]
    return make


def _export(folder, out, **options):
    export(ExportConfig(model=str(folder), out=out, context=320, cache_dir=out.parent / "cache", **options))
    return out


@pytest.mark.parametrize("model_type", TYPES)
def test_family_logits_match_transformers(model_type, family_models, tmp_path):
    """fp32 logits within 1e-4 of transformers at every row: prefill chunks, one-token steps, tree nodes."""
    folder, model = family_models(model_type)
    _check_logits(_export(folder, tmp_path / "b", draft="ngram", tree="topk:2x2"), model)


def _check_logits(bundle, model):
    manifest = open_bundle(bundle)
    facts = manifest.target.facts
    runner = ModelRunner(make_session(bundle / manifest.target.graph.file, ("CPUExecutionProvider",), 1), facts)
    ids = [int(t) for t in np.random.default_rng(3).integers(3, facts.vocab_size, PROMPT)]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    cache = KVCache(facts, 320, lanes=runner.lanes)
    spans = [(s, min(s + 37, PROMPT - 8)) for s in range(0, PROMPT - 8, 37)] + [(p, p + 1) for p in range(PROMPT - 8, PROMPT)]
    for start, end in spans:  # chunks of 37 rows, then one-token steps past the window
        n = end - start
        out = runner.forward(cache, ids[start:end], range(start, end), np.tril(np.ones((n, n), bool)), range(n))
        commit(cache, out, range(n))
        worst = np.abs(out.logits - expected[start:end]).max()
        assert worst <= TOLERANCE, f"rows {start}..{end - 1}: {worst}"
    topo = parse_tree_spec("topk:2x2")
    tokens = [int(t) for t in np.random.default_rng(4).integers(3, facts.vocab_size, topo.size)]
    out = runner.forward(cache, tokens, PROMPT + topo.depths, topo.ancestor_mask, range(topo.size))
    for node in range(topo.size):
        path = ids + [tokens[i] for i in topo.path_to(node)]
        with torch.no_grad():
            row = model(torch.tensor([path])).logits[0, -1].numpy()
        assert np.abs(out.logits[node] - row).max() <= TOLERANCE, f"tree node {node}"


@pytest.mark.parametrize("model_type, layer_type", [("gemma3_text", "sliding_attention"),
                                                    ("gemma3_text", "full_attention"), ("olmo3", "sliding_attention")])
def test_a_model_whose_layers_are_all_of_one_type_exports_and_matches_transformers(model_type, layer_type, tmp_path):
    """A rotary module with a table per layer type takes the type even when every layer has the same one:
    the export reads that one table (local rope for sliding layers), and the sliding KV policy keeps its
    rope frequencies."""
    folder = tmp_path / "m"
    model = make_model(folder, model_type, seed=7, random_norms=True,
                       **{**FAMILY_CONFIGS[model_type], "layer_types": [layer_type] * 2})
    bundle = _export(folder, tmp_path / "b", draft="ngram", tree="topk:2x2")
    _check_logits(bundle, model)
    facts = open_bundle(bundle).target.facts
    assert facts.rope_frequencies is not None and (facts.sliding_window == WINDOW) == (layer_type == "sliding_attention")
    pipeline, ids = Pipeline(bundle), list(range(3, 3 + 2 * WINDOW))
    with torch.no_grad():
        reference = model.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                   pad_token_id=0)[0, len(ids):].tolist()
    config = GenerationConfig(max_new_tokens=16, stop_at_eos=False)
    assert pipeline.generate(ids=ids, config=config, speculate=False).token_ids == reference


@pytest.mark.parametrize("model_type", TYPES)
def test_family_greedy_output_and_int4_speculation(model_type, family_models, tmp_path):
    """Greedy output equals transformers' generate after a prompt longer than the window; the int4 export
    decodes speculatively with output identical to its own plain decoding."""
    folder, model = family_models(model_type)
    config = GenerationConfig(max_new_tokens=32, stop_at_eos=False)
    fp32 = Pipeline(_export(folder, tmp_path / "fp32", draft="ngram", tree="chain:4"))
    prompt = " ".join(CORPUS[2:] + CORPUS[:2])
    ids = fp32.encode(prompt)
    assert len(ids) > WINDOW
    with torch.no_grad():
        reference = model.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                   pad_token_id=0)[0, len(ids):].tolist()
    assert fp32.generate(prompt, config=config, speculate=False).token_ids == reference
    int4 = Pipeline(_export(folder, tmp_path / "int4", draft="ngram", tree="topk:2x2", quant="int4"))
    for text in (prompt, CORPUS[0]):  # the second repeats itself: something for the n-gram drafter to find
        plain = int4.generate(text, config=config, speculate=False)
        spec = int4.generate(text, config=config, speculate=True)
        assert spec.token_ids == plain.token_ids


def test_a_draft_with_padded_vocabulary_rows_drafts_for_the_target(tmp_path):
    """Models of one family pad their embedding rows differently (Qwen2.5 0.5B against 7B): the draft is
    exported to predict the ids both have, and speculation stays exact."""
    target, _ = tmp_path / "t", make_model(tmp_path / "t", "qwen2", seed=1)
    make_model(tmp_path / "d", "qwen2", seed=2, layers=1, vocab_size=_vocab(tmp_path / "t") + 64)
    bundle = _export(target, tmp_path / "b", draft=str(tmp_path / "d"), tree="topk:2x2")
    pipeline = Pipeline(bundle)
    assert pipeline.manifest.draft.facts.vocab_size == pipeline.manifest.target.facts.vocab_size
    config = GenerationConfig(max_new_tokens=24, stop_at_eos=False)
    for text in CORPUS[:2]:
        assert (pipeline.generate(text, config=config, speculate=True).token_ids
                == pipeline.generate(text, config=config, speculate=False).token_ids)


def test_a_draft_whose_tokenizer_differs_drafts_through_text_naming_the_token(tmp_path, capsys):
    """Two ids swapped: no longer the target's ids, so the draft drafts through text (tests/test_text_draft.py),
    the export saying where they differ, and speculation stays exact."""
    import json

    from edgespec.runtime.contract.drafting import DrafterKind

    make_model(tmp_path / "t", "llama", seed=1)
    make_model(tmp_path / "d", "llama", seed=2, layers=1)
    data = json.loads((tmp_path / "d" / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = (t for t, i in vocab.items() if i in (100, 101))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tmp_path / "d" / "tokenizer.json").write_text(json.dumps(data))
    pipeline = Pipeline(_export(tmp_path / "t", tmp_path / "b", draft=str(tmp_path / "d")))
    assert "differs from the target's (at id 100" in capsys.readouterr().err
    assert pipeline.manifest.drafter is DrafterKind.TEXT
    config = GenerationConfig(max_new_tokens=24, stop_at_eos=False)
    assert (pipeline.generate(CORPUS[0], config=config).token_ids
            == pipeline.generate(CORPUS[0], config=config, speculate=False).token_ids)


def _vocab(folder) -> int:
    import json

    return json.loads((folder / "config.json").read_text())["vocab_size"]


def test_the_readme_and_docs_list_the_families_the_table_holds():
    from pathlib import Path

    from edgespec.exporters.architectures import families_line, families_markdown

    root = Path(__file__).parent.parent
    assert families_line() in (root / "README.md").read_text().replace("\n", " ")
    assert families_markdown() in (root / "docs" / "models.md").read_text()


@pytest.mark.parametrize("model_type", TYPES)
def test_family_static_draft_profile(model_type, family_models, tmp_path):
    """A profile that drafts on an NPU (static shapes, attention in standard operators) exports every family;
    the model drafting for itself stays exact and is mostly accepted."""
    import warnings

    folder, _ = family_models(model_type)
    bundle = _export(folder, tmp_path / "b", draft=str(folder), tree="chain:3", profile="ai-pc-intel")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no NPU here: the CPU runs the draft
        pipeline = Pipeline(bundle, threads=1)
    assert pipeline.draft.static is not None
    config = GenerationConfig(max_new_tokens=24, stop_at_eos=False)
    plain = pipeline.generate(CORPUS[1], config=config, speculate=False)
    spec = pipeline.generate(CORPUS[1], config=config, speculate=True)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.mean_accepted_per_pass > 2.0
