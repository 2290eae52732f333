"""`edgespec distill` on a tiny random target: data, training, resumption, export, lossless generation."""
from dataclasses import replace

import numpy as np
import pytest
from edgespec.distill.data import DataConfig, load_shard, shard_paths
from edgespec.distill.run import DistillConfig, distill
from edgespec.distill.train import TrainConfig, make_batch, read_sequences
from edgespec.distill.vocab import choose_head_tokens, coverage
from edgespec.runtime.contract.errors import ExportError

SMALL_DATA = DataConfig(batch=8, max_new_tokens=24, max_prompt_tokens=48, top_k=4, prompts_per_shard=8)
SMALL_TRAIN = TrainConfig(head_size=96, window=32, batch=4, checkpoint_s=1.0, eval_s=2.0)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "tools.py").write_text('def add(a, b):\n    """Adds two numbers and returns the sum of them, '
                                     'which is what a reader expects from a function with this name, '
                                     'and nothing more than that."""\n'
                                     + "".join(f"    x{i} = a + {i}\n" for i in range(8)) + "    return a + b\n" * 3)
    return folder


@pytest.fixture(scope="module")
def distilled(models, corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("distill") / "draft"
    # a fixed number of steps and no held-out picks: which step a timed run keeps hangs on the machine's
    # load, and one such pick (step 3604 of a 30 s run) drafted nothing the target accepted on a test prompt
    training = replace(SMALL_TRAIN, eval_s=1e9, min_steps=1000, max_steps=1000)
    config = DistillConfig(target=str(models["target"]), out=out, minutes=0.5, corpus=(str(corpus),), seed=0,
                           prompts=64, data=SMALL_DATA, training=training)
    distill(config)
    return config


def test_shards_hold_target_top_k_for_every_supervised_position(distilled):
    shard = load_shard(shard_paths(distilled.out / "data" / "chat")[0])
    supervised = sum(int(shard["starts"][i + 1] - shard["starts"][i] - shard["first"][i])
                     for i in range(len(shard["first"])))
    assert shard["topk_ids"].shape == (supervised, SMALL_DATA.top_k)
    assert np.all(np.diff(shard["topk_logp"].astype(np.float32), axis=1) <= 0)  # most likely first
    assert np.all(shard["topk_logp"] <= 0)


def test_target_greedy_tokens_are_what_it_generated(distilled):
    """Continuations are greedy: the generated token at each position is the target's top-1 there."""
    shard = load_shard(shard_paths(distilled.out / "data" / "chat")[0])
    sup = 0
    for i in range(len(shard["first"])):
        tokens = shard["tokens"][shard["starts"][i]:shard["starts"][i + 1]]
        first = int(shard["first"][i])
        generated = tokens[first:]
        assert np.array_equal(shard["topk_ids"][sup:sup + len(generated), 0], generated)
        sup += len(generated)


def test_the_draft_folder_loads_in_transformers_and_records_its_head(distilled, models):
    import json

    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_pretrained(distilled.out)
    info = json.loads((distilled.out / "edgespec_draft.json").read_text())
    assert draft.config.num_hidden_layers == 2
    assert len(info["head_tokens"]) == SMALL_TRAIN.head_size
    assert info["training"]["steps"] > 0
    assert (distilled.out / "log.txt").read_text().count("train: finished") == 1


def test_a_finished_run_resumes_to_nothing_and_refuses_other_settings(distilled):
    distill(replace(distilled, resume=True))  # finished: returns without work
    with pytest.raises(ExportError, match="--resume"):
        distill(distilled)
    with pytest.raises(ExportError, match="seed"):
        distill(replace(distilled, resume=True, seed=1))


def test_a_run_from_before_the_onnx_engine_resumes_with_the_torch_engine(distilled, tmp_path):
    import json
    import shutil

    copy = tmp_path / "old"
    shutil.copytree(distilled.out, copy)
    state = json.loads((copy / "state.json").read_text())
    del state["settings"]["engine"], state["settings"]["data_quant"]
    (copy / "state.json").write_text(json.dumps(state))
    with pytest.raises(ExportError, match="data_quant, engine"):
        distill(replace(distilled, out=copy, resume=True))
    distill(replace(distilled, out=copy, resume=True, engine="torch"))  # finished: nothing to do, no error


def test_an_interrupted_training_resumes_from_its_checkpoint(distilled, tmp_path):
    import json
    import shutil

    copy = tmp_path / "draft"
    shutil.copytree(distilled.out, copy)
    state = json.loads((copy / "state.json").read_text())
    state["finished"] = False
    state["used_s"]["train"] = distilled.shares["train"] * distilled.minutes * 60 - 3  # three seconds of training left
    (copy / "state.json").write_text(json.dumps(state))
    steps_before = json.loads((copy / "edgespec_draft.json").read_text())["training"]["steps"]
    # ten steps past the checkpoint whatever the clock says: on a busy machine three seconds can pass in set-up
    more = replace(distilled.training, min_steps=steps_before + 10, max_steps=0)
    distill(replace(distilled, out=copy, resume=True, training=more))
    steps_after = json.loads((copy / "edgespec_draft.json").read_text())["training"]["steps"]
    assert steps_after > steps_before  # continued counting from the checkpoint, not from zero


def test_distilled_draft_exports_and_generates_losslessly(distilled, models, tmp_path):
    from edgespec.exporters.export import ExportConfig, export
    from edgespec.runtime.decoding.engine import GenerationConfig
    from edgespec.runtime.pipeline import Pipeline

    bundle = export(ExportConfig(model=str(models["target"]), draft=str(distilled.out), out=tmp_path / "b",
                                 tree="topk:2x3", context=256))
    pipeline = Pipeline(bundle, threads=1)
    assert pipeline.draft.head_tokens is not None and len(pipeline.draft.head_tokens) == SMALL_TRAIN.head_size
    config = GenerationConfig(max_new_tokens=40)
    for prompt in ("def add(a, b):", "The quick brown fox"):
        plain = pipeline.generate(prompt=prompt, config=config, speculate=False)
        spec = pipeline.generate(prompt=prompt, config=config, speculate=True)
        assert spec.token_ids == plain.token_ids
        assert spec.stats.target_passes < plain.stats.target_passes  # the draft's proposals were used


def test_head_tokens_follow_target_frequency_and_keep_required_ids():
    top1 = np.array([5, 5, 5, 7, 7, 9, 1])
    head = choose_head_tokens(top1, vocab_size=12, size=3, always={11})
    assert list(head) == [5, 7, 11]
    assert coverage(head, top1) == pytest.approx(5 / 7)


def test_batches_supervise_only_positions_after_the_prompt(distilled):
    sequences = read_sequences(shard_paths(distilled.out / "data" / "chat")[:1])
    kept = np.arange(1000)
    batch = make_batch(sequences[:3], 1000, np.random.default_rng(0), kept)
    expected = sum(len(s.tokens) - s.first for s in sequences[:3])
    assert len(batch.where) == expected == len(batch.greedy)
    for (b, r), token in zip(batch.where.numpy(), batch.greedy):
        assert sequences[b].tokens[r + 1] == token  # row r predicts the next token, the target's greedy one
    np.testing.assert_allclose(batch.p.sum(dim=1).numpy(), 1.0, rtol=1e-5)
    assert batch.features_in is None  # a design without features gets none


def test_packed_draft_rebuilds_the_same_draft_against_its_target(distilled, models, tmp_path):
    import torch
    from edgespec.distill.pack import pack_draft, unpack_draft
    from edgespec.exporters.sources import resolve_source
    from transformers import AutoModelForCausalLM

    packed = pack_draft(distilled.out, tmp_path / "packed", {"command": "test"})
    target, tokenizer = resolve_source(str(models["target"]), tmp_path).load()
    rebuilt = AutoModelForCausalLM.from_pretrained(unpack_draft(packed, target, tokenizer, tmp_path / "rebuilt"))
    original = AutoModelForCausalLM.from_pretrained(distilled.out)
    for name, value in original.state_dict().items():
        expected = value if "embed" in name or "lm_head" in name else value.half().float()
        assert torch.equal(rebuilt.state_dict()[name], expected), name
    other, _ = resolve_source(str(models["qwen2"]), tmp_path).load()
    with pytest.raises(ExportError, match="does not fit"):
        unpack_draft(packed, other, tokenizer, tmp_path / "wrong")


def test_bad_distill_arguments_are_refused_before_any_work(models, tmp_path, capsys):
    from edgespec.cli import main

    target = str(models["target"])
    assert main(["distill", target, "--out", str(tmp_path / "a"), "--minutes", "0"]) == 2
    assert "--minutes must be positive" in capsys.readouterr().err
    assert main(["distill", target, "--out", str(tmp_path / "b"), "--corpus", str(tmp_path / "nowhere")]) == 2
    assert "corpus paths not found" in capsys.readouterr().err
    for flag in ("--prompts", "--train-batch", "--slots"):
        assert main(["distill", target, "--out", str(tmp_path / "b"), flag, "0"]) == 2
        assert f"{flag} must be at least 1" in capsys.readouterr().err
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("mine")
    assert main(["distill", target, "--out", str(tmp_path / "c"), "--minutes", "1"]) == 2
    assert "not a distill run folder" in capsys.readouterr().err
    assert (tmp_path / "c" / "notes.txt").read_text() == "mine"  # nothing lost
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_draft_of_a_gguf_target_is_a_float_model(models, tmp_path):
    """A GGUF target's config names how its file was stored; its draft must not inherit that."""
    from edgespec.distill.draft_model import build_draft
    from edgespec.exporters.sources import resolve_source

    target, _ = resolve_source(str(models["target"]), tmp_path).load()
    target.config.quantization_config = {"quant_method": "gguf"}
    draft, trainable = build_draft(target, "cut")
    assert not hasattr(draft.config, "quantization_config")
    assert "model.layers.0.self_attn.q_proj.weight" in trainable and "model.embed_tokens.weight" not in trainable


@pytest.fixture(scope="module")
def eagle(distilled, models, tmp_path_factory):
    """A feature-reading draft trained on the data of the `distilled` run (`--data`)."""
    out = tmp_path_factory.mktemp("eagle") / "draft"
    # no held-out checkpoints (a tiny model's held-out agreement is noise, and which step it would keep
    # would depend on the machine's speed) and a floor of steps: what it learns does not hang on the load
    training = replace(SMALL_TRAIN, lr=5e-4, eval_s=1e9, min_steps=1500)
    # the torch engine on the CPU: the code a GPU runs with --device cuda (`distilled` made its data on onnx)
    config = DistillConfig(target=str(models["target"]), out=out, minutes=0.4, seed=0, design="eagle",
                           data_from=distilled.out / "data", data=SMALL_DATA, training=training, engine="torch")
    distill(config)
    return config


def test_features_are_the_targets_final_hidden_states_at_every_token(eagle, distilled, models, tmp_path):
    import torch
    from edgespec.distill.train import feature_file
    from edgespec.exporters.sources import resolve_source

    target, _ = resolve_source(str(models["target"]), tmp_path).load()
    shard_path = shard_paths(distilled.out / "data" / "chat")[0]
    shard, features = load_shard(shard_path), np.load(feature_file(eagle.out / "data" / "features", shard_path))
    assert features.shape == (len(shard["tokens"]), target.config.hidden_size)
    start, stop = shard["starts"][1], shard["starts"][2]
    with torch.no_grad():
        hidden = target.model(input_ids=torch.from_numpy(shard["tokens"][start:stop][None].astype(np.int64)))
    np.testing.assert_allclose(features[start:stop], hidden.last_hidden_state[0].numpy(), atol=2e-3, rtol=2e-3)


def test_feature_batches_pair_each_token_with_the_previous_feature(eagle, distilled):
    shards = shard_paths(distilled.out / "data" / "chat")[:1]
    sequences = read_sequences(shards, eagle.out / "data" / "features")
    batch = make_batch(sequences[:2], 16, np.random.default_rng(1), np.arange(1000))
    for b, seq in enumerate(sequences[:2]):
        row = batch.ids[b].numpy()
        start = next(s for s in range(len(seq.tokens)) if np.array_equal(seq.tokens[s:s + len(row)], row))
        for r in range(1, int(batch.mask[b].sum())):
            np.testing.assert_array_equal(batch.features_in[b, r].numpy(), seq.features[start + r - 1].astype(np.float32))
        if start == 0:
            assert not batch.features_in[b, 0].any()
    for m, (b, r) in enumerate(batch.where.numpy()):
        assert batch.features_out[m].abs().sum() > 0


def test_an_eagle_draft_exports_packs_and_generates_losslessly(eagle, models, tmp_path):
    import json

    from edgespec.distill.pack import pack_draft, unpack_draft
    from edgespec.exporters.drafts import DRAFT_INFO
    from edgespec.exporters.export import ExportConfig, export
    from edgespec.exporters.sources import resolve_source
    from edgespec.runtime.decoding.engine import GenerationConfig
    from edgespec.runtime.pipeline import Pipeline

    info = json.loads((eagle.out / DRAFT_INFO).read_text())
    assert info["training"]["design"] == "eagle" and info["features"]["file"]
    target, tokenizer = resolve_source(str(models["target"]), tmp_path).load()
    rebuilt = unpack_draft(pack_draft(eagle.out, tmp_path / "packed", {"command": "test"}), target, tokenizer,
                           tmp_path / "rebuilt")
    bundle = export(ExportConfig(model=str(models["target"]), draft=str(rebuilt), out=tmp_path / "b",
                                 tree="chain:3", context=256))
    pipeline = Pipeline(bundle, threads=1)
    assert pipeline.draft.reads_features and pipeline.target.gives_features
    config = GenerationConfig(max_new_tokens=40)
    for prompt in ("def add(a, b):", "The quick brown fox"):
        plain = pipeline.generate(prompt=prompt, config=config, speculate=False)
        spec = pipeline.generate(prompt=prompt, config=config, speculate=True)
        assert spec.token_ids == plain.token_ids
    # What the draft learned survives export: fed the target's features by the runtime, it predicts the
    # target's answers it was trained on far above chance (1/96 here); misaligned features would not.
    # a shard training used: on a busy machine the features phase may not reach every shard, and a
    # shard without features is left out of training (distill/run.py)
    from edgespec.distill.data import feature_file
    from edgespec.quant.report import agreement

    used = [s for s in shard_paths(eagle.data_from / "chat")[:-1] if feature_file(eagle.out / "data" / "features", s).is_file()]
    assert used, "the features phase reached no training shard"
    trained = read_sequences(used[:1])[:6]
    fit = np.mean([agreement(pipeline.draft, list(s.tokens[:s.first]), list(s.tokens[s.first:]),
                             target=pipeline.target) for s in trained])
    assert fit > 0.1


def test_a_second_round_on_a_runs_data_reuses_the_features_it_made(models, corpus, tmp_path):
    """--data of an eagle run that made its own data: its feature files are linked, not made again, and
    the second round trains on them."""
    from edgespec.distill.data import feature_file

    training = replace(SMALL_TRAIN, eval_s=1e9, min_steps=20, max_steps=20)
    first = DistillConfig(target=str(models["target"]), out=tmp_path / "first", minutes=0.4, corpus=(str(corpus),),
                          seed=0, design="eagle", prompts=32, data=SMALL_DATA, training=training)
    distill(first)
    data_dir = first.out / "data"
    shards = shard_paths(data_dir / "chat") + shard_paths(data_dir / "corpus")
    made = [s for s in shards if feature_file(data_dir / "features", s).is_file()]
    assert len(made) >= 2
    second = replace(first, out=tmp_path / "second", minutes=0.1, data_from=data_dir, init=first.out)
    distill(second)
    log = (second.out / "log.txt").read_text()
    assert f"features: {len(made)} reused from {data_dir / 'features'}" in log
    assert "features: 0 new feature files" in log and "draft written" in log
    for shard in made:
        assert np.array_equal(np.load(feature_file(second.out / "data" / "features", shard)),
                              np.load(feature_file(data_dir / "features", shard)))


def test_features_are_reused_only_from_a_run_of_the_same_target_engine_and_quantization(tmp_path):
    import json

    from edgespec.distill.run import features_made_alike

    data_dir = tmp_path / "run" / "data"
    (data_dir / "features").mkdir(parents=True)
    mine = DistillConfig(target="t", out=tmp_path / "new", design="eagle", data_from=data_dir)
    assert features_made_alike(mine) is None  # no state.json: not a run's data folder
    (tmp_path / "run" / "state.json").write_text("{not json")
    assert features_made_alike(mine) is None
    for settings, reused in ((mine.settings(), True), ({**mine.settings(), "target": "other"}, False),
                             ({**mine.settings(), "data_quant": "int8"}, False),
                             ({**mine.settings(), "engine": "torch", "data_quant": None}, False)):
        (tmp_path / "run" / "state.json").write_text(json.dumps({"settings": settings}))
        assert (features_made_alike(mine) == data_dir / "features") is reused
    (tmp_path / "run" / "state.json").write_text(json.dumps({"settings": {"target": "t"}}))  # before the onnx engine
    assert features_made_alike(replace(mine, engine="torch")) == data_dir / "features"
    assert features_made_alike(replace(mine, data_from=None)) is None


def test_training_prompts_are_distinct_at_a_gpus_scale_and_never_the_evaluation_prompts(corpus):
    """A GPU run asks for tens of thousands of prompts; the composed ones alone must supply them, the same
    ones for the same seed, and none may be a benchmark prompt (those measure held-out agreement)."""
    import json
    import random
    from pathlib import Path

    from edgespec.distill.chat_prompts import chat_prompt
    from edgespec.distill.prompts import training_prompts

    many = training_prompts(25000, 1, [corpus])
    assert len(many) == len(set(many)) == 25000
    assert training_prompts(25000, 1, [corpus]) == many and training_prompts(200, 2, [corpus]) != many[:200]
    root = Path(__file__).resolve().parent.parent
    evaluation = [root / "edgespec" / "data" / "prompts.jsonl", root / "benchmarks" / "edit_prompts.jsonl",
                  root / "benchmarks" / "quote_prompts.jsonl", *sorted((root / "benchmarks" / "workloads").glob("*.jsonl"))]
    held_out = {m["content"] for f in evaluation
                for line in f.read_text().splitlines() if line.strip()
                for m in json.loads(line).get("messages", [])}
    assert held_out and not held_out & set(many)
    rng = random.Random(0)
    chat_made = {chat_prompt(rng) for _ in range(60000)}  # every short chat request the families make
    assert len(set(many) & chat_made) > 2500  # they take their share, the evaluation prompts left out


def test_a_run_whose_features_cover_only_the_held_out_shard_is_refused_before_training(tmp_path):
    """A run too short for its data: training would draw batches from no sequences at all."""
    from edgespec.distill.data import feature_file
    from edgespec.distill.run import DistillConfig, Phases
    from edgespec.runtime.contract.errors import ExportError

    config = DistillConfig(target="t", out=tmp_path / "run", design="eagle")
    phases = Phases(config, None, None, [], log=print)
    (phases.data_dir / "chat").mkdir(parents=True)
    shards = [phases.data_dir / "chat" / f"shard-{i:05d}.npz" for i in range(3)]
    for shard in shards:
        shard.write_bytes(b"")
    phases.features_dir.mkdir(parents=True, exist_ok=True)
    feature_file(phases.features_dir, shards[-1]).parent.mkdir(parents=True)
    feature_file(phases.features_dir, shards[-1]).write_bytes(b"")
    with pytest.raises(ExportError, match="only the held-out shard"):
        phases.training(deadline=0.0)


def test_a_corpus_folder_leaves_out_the_packages_installed_under_it(tmp_path):
    """The default corpus is the standard library, whose folder also holds site-packages: what this
    machine installed, under other licences, is not training text."""
    from edgespec.distill.prompts import python_files

    for name in ("mine.py", "pkg/inner.py", "site-packages/lib/x.py", "a/dist-packages/y.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    assert python_files([tmp_path]) == [tmp_path / "mine.py", tmp_path / "pkg" / "inner.py"]
    named = tmp_path / "site-packages" / "lib" / "x.py"
    assert python_files([named]) == [named]  # a file named as a root is the user's choice
    assert python_files([tmp_path / "site-packages"]) == [named]  # so is a packages folder named as one


def test_eagle_needs_data_and_refuses_an_empty_data_folder(models, tmp_path):
    with pytest.raises(ExportError, match="holds no target data"):
        distill(DistillConfig(target=str(models["target"]), out=tmp_path / "d", minutes=0.2, design="eagle",
                              data_from=tmp_path))


def test_later_drafting_steps_see_what_the_runtime_would_give_them(models, tmp_path):
    """Step s of draft_hidden_steps at row t equals drafting one token at a time: the accepted rows up to
    t - s + 1 read the target's features, each later row reads the draft's own output at the row before."""
    import torch
    from edgespec.distill.draft_model import build_draft, draft_hidden_steps
    from edgespec.exporters.sources import resolve_source
    from transformers import DynamicCache

    target, _ = resolve_source(str(models["target"]), tmp_path).load()
    draft, _ = build_draft(target, "eagle")
    torch.manual_seed(0)
    with torch.no_grad():
        draft.feature_fc.weight.normal_(std=0.05)
    # in float64: the batched and the row-by-row computations take different fp32 kernels, whose rounding
    # (2.4e-5 by the third step with AVX-512) is not what this test is about; a wrong row is off by far more
    draft.double().eval()
    hidden_size, rows = target.config.hidden_size, 9
    ids = torch.randint(0, target.config.vocab_size, (2, rows))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # right padding must not change the unpadded rows
    features = torch.randn(2, rows, hidden_size, dtype=torch.float64)
    with torch.no_grad():
        steps = draft_hidden_steps(draft, ids, mask, features, steps=3)

        def one_row(b, row, feature, cache):
            mixed = draft.feature_fc(torch.cat([draft.get_input_embeddings()(ids[b:b + 1, row:row + 1]),
                                                feature[None, None]], dim=-1))
            return draft.model(inputs_embeds=mixed, position_ids=torch.tensor([[row]]), past_key_values=cache,
                               use_cache=True).last_hidden_state[0, 0]

        for b, last in ((0, rows - 1), (1, 5)):
            accepted = last - 2  # a chain of three drafted rows ends at `last`
            cache = DynamicCache()
            for row in range(accepted + 1):
                out = one_row(b, row, features[b, row], cache)
            torch.testing.assert_close(out, steps[0][b, accepted], atol=1e-5, rtol=1e-5)
            second = one_row(b, accepted + 1, out, cache)
            torch.testing.assert_close(second, steps[1][b, accepted + 1], atol=1e-5, rtol=1e-5)
            third = one_row(b, accepted + 2, second, cache)
            torch.testing.assert_close(third, steps[2][b, accepted + 2], atol=1e-5, rtol=1e-5)


def test_a_draft_trained_on_from_another_for_two_drafting_steps(eagle, models, tmp_path):
    """--init starts from a finished draft (its head too); --drafting-steps 2 reports both steps."""
    import json

    from edgespec.exporters.drafts import DRAFT_INFO

    first = json.loads((eagle.out / DRAFT_INFO).read_text())
    config = DistillConfig(target=str(models["target"]), out=tmp_path / "two", minutes=0.2, seed=0, design="eagle",
                           data_from=eagle.data_from, init=eagle.out, data=SMALL_DATA,
                           training=replace(SMALL_TRAIN, lr=5e-4, drafting_steps=2))
    distill(config)
    info = json.loads((config.out / DRAFT_INFO).read_text())
    assert info["head_tokens"] == first["head_tokens"]
    report = info["training"]
    assert len(report["held_out_agreement_by_step"]) == 2 and report["train_config"]["drafting_steps"] == 2
    assert report["held_out_chain_tokens"] >= report["held_out_agreement"] >= 0
    with pytest.raises(ExportError, match="not a draft"):
        distill(replace(config, out=tmp_path / "three", init=tmp_path))
    with pytest.raises(ExportError, match="holds a eagle draft"):
        distill(replace(config, out=tmp_path / "four", design="cut", training=SMALL_TRAIN))
    with pytest.raises(ExportError, match="drafts every step alike"):
        distill(replace(config, out=tmp_path / "five", design="cut", init=None))
    assert not any((tmp_path / name).exists() for name in ("three", "four", "five"))


def test_a_chain_is_accepted_up_to_its_first_disagreement():
    from edgespec.distill.train import chain_acceptance

    hit = np.zeros((3, 1, 6), dtype=bool)
    hit[0, 0] = [1, 1, 0, 1, 1, 1]  # step 1 at each row
    hit[1, 0] = [0, 1, 1, 0, 1, 1]  # step 2 at row t continues the chain that started at t - 1
    hit[2, 0] = [0, 0, 1, 0, 0, 1]  # step 3 at row t continues the chain that started at t - 2
    rows, cols = np.zeros(6, int), np.arange(6)
    # step 1 agrees for the chains from rows 0, 1, 3, 4, 5; their step 2 is at rows 1, 2, 4, 5 and (out of
    # the window) 6: four go on; their step 3 is at rows 2, 3, 5 and (out) 6: the chains from 0 and 3 reach it
    np.testing.assert_array_equal(chain_acceptance(hit, rows, cols), [5, 4, 2])
