"""A draft of another tokenizer on the reference model: what drafting through text yields and costs per step.

No small model with another tokenizer is at hand offline, so the draft is the reference model itself (its first
`--draft-layers` layers) with its vocabulary's ids shuffled: a tokenizer that differs id for id and splits text as
the target's does. With every layer it is the target over text (acceptance's upper bound, and the bridge's cost);
with fewer it is a weak draft. Greedy output is compared with plain decoding of the same bundle, prompt by prompt.

    python benchmarks/measure/text_draft.py [--draft-layers 30] [--tree chain:4] [--prompts 6] [--tokens 96]
"""
import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM
from edgespec.exporters.export import ExportConfig, export
from edgespec.exporters.sources import resolve_source
from edgespec.runtime.decoding import text_draft
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.execution.paths import cache_dir
from edgespec.runtime.pipeline import Pipeline

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--draft-layers", type=int, default=30, help="the reference model's first layers the draft keeps")
parser.add_argument("--tree", default="chain:4")
parser.add_argument("--quant", default="fp32", help="both models' weights")
parser.add_argument("--workload", default="benchmarks/workloads/chat.jsonl")
parser.add_argument("--prompts", type=int, default=6)
parser.add_argument("--tokens", type=int, default=96)
parser.add_argument("--work", default="/tmp/edgespec-text-draft", help="where the draft and the bundle are written")
args = parser.parse_args()
work = Path(args.work)
shutil.rmtree(work, ignore_errors=True)
work.mkdir(parents=True)

# 1. the draft: the reference model cut to its first layers, its ids shuffled (special tokens kept)
gguf_model, tokenizer = resolve_source("default", cache_dir()).load()
config = gguf_model.config
config.quantization_config = None  # transformers marks a model read from GGUF as quantized: not saved as such
config.num_hidden_layers = args.draft_layers
model = AutoModelForCausalLM.from_config(config)
model.load_state_dict(gguf_model.state_dict(), strict=False)  # the layers past the cut are left out
data = json.loads(tokenizer.backend_tokenizer.to_str())
specials = {t["id"] for t in data["added_tokens"]}
ids = sorted(i for i in data["model"]["vocab"].values() if i not in specials)
perm = dict(zip(ids, np.random.default_rng(0).permutation(ids).tolist()))
data["model"]["vocab"] = {t: perm.get(i, i) for t, i in data["model"]["vocab"].items()}
with torch.no_grad():
    embed = model.get_input_embeddings().weight
    moved = embed.clone()
    moved[list(perm.values())] = embed[list(perm.keys())]
    embed.copy_(moved)
model.save_pretrained(work / "draft")
tokenizer.save_pretrained(work / "draft")
(work / "draft" / "tokenizer.json").write_text(json.dumps(data))

# 2. the bundle: the reference model verifies, the draft drafts through text
export(ExportConfig(model="default", draft=str(work / "draft"), out=work / "bundle", tree=args.tree,
                    quant=args.quant, cache_dir=cache_dir()))
pipeline = Pipeline(work / "bundle")
assert pipeline.manifest.drafter.value == "text"

# 3. plain and speculative, alternating per prompt; the drafter's time split into the draft's passes and the rest
drafting = {"seconds": 0.0, "steps": 0}
propose = text_draft.TextDrafter.propose


def timed(self, *a, **k):
    started = time.perf_counter()
    try:
        return propose(self, *a, **k)
    finally:
        drafting["seconds"] += time.perf_counter() - started
        drafting["steps"] += 1


text_draft.TextDrafter.propose = timed
prefill = text_draft.prefill


def timed_prefill(*a, **k):  # the draft's passes, with the Python that feeds them
    started = time.perf_counter()
    try:
        return prefill(*a, **k)
    finally:
        drafting["passes"] += time.perf_counter() - started


drafting["passes"] = 0.0
text_draft.prefill = timed_prefill
config = GenerationConfig(max_new_tokens=args.tokens, stop_at_eos=False)
items = [json.loads(line) for line in Path(args.workload).read_text().splitlines()[: args.prompts]]
same, passes, tokens, plain_s, spec_s = 0, 0, 0, 0.0, 0.0
draft_run_before = pipeline.draft.run_seconds
for item in items:
    plain = pipeline.generate(messages=item["messages"], config=config, speculate=False)
    spec = pipeline.generate(messages=item["messages"], config=config)
    same += plain.token_ids == spec.token_ids
    passes, tokens = passes + spec.stats.target_passes, tokens + spec.stats.new_tokens - 1
    plain_s, spec_s = plain_s + plain.stats.decode_s, spec_s + spec.stats.decode_s
draft_runs = pipeline.draft.run_seconds - draft_run_before
steps = max(drafting["steps"], 1)
print(f"draft: reference model's first {args.draft_layers} layers, ids shuffled; tree {args.tree}; {args.quant}; "
      f"{len(items)} prompts of {args.workload}, {args.tokens} tokens each", file=sys.stderr)
print(json.dumps({"identical_to_plain": f"{same}/{len(items)}", "tokens_per_target_pass": round(tokens / passes, 3),
                  "speculative_over_plain_decode_time": round(spec_s / plain_s, 3),
                  "drafting_ms_per_step": round(1e3 * drafting["seconds"] / steps, 2),
                  "draft_passes_ms_per_step": round(1e3 * draft_runs / steps, 2),
                  "draft_passes_with_their_python_ms_per_step": round(1e3 * drafting["passes"] / steps, 2),
                  "text_bridge_ms_per_step": round(1e3 * (drafting["seconds"] - drafting["passes"]) / steps, 2),
                  "plain_ms_per_token": round(1e3 * plain_s / max(tokens, 1), 2)}))
