"""Every drafter and tree mode on one bundle, in one run, against plain decoding (issue 4's table).

    python benchmarks/measure/drafter_table.py [BUNDLE] [--prompts FILE.jsonl] [--max-new-tokens 64]
                                       [--tree parents:...]   (a tuned tree to include)
                                       [--free-tree parents:...]  (a tree for the training-free rows)
                                       [--only TEXT]  (only the rows whose name contains TEXT; repeatable)
                                       [--temperature T [--seed S]]  (sampling instead of greedy)

The bundle must have a draft model; the training-free drafters run on the same target. Each row
decodes every prompt greedily; plain decoding runs first and last, so drift shows. Outputs are
checked against plain decoding. Every recycling row starts from an empty table, as a fresh pipeline
does: a table kept from an earlier row would already hold the target's answers to these prompts.

With --temperature every row samples (prompt i with seed S + i), and each prompt is decoded plainly
right before it is decoded speculatively: a row's speedup is over the plain decoding paired with it
in the same minutes, since sampled outputs cannot be compared with a reference.
"""
import argparse
from pathlib import Path

from edgespec.runtime.contract.drafting import DynamicTreeConfig, LookupConfig, NgramConfig
from edgespec.runtime.contract.topology import parse_tree_spec
from edgespec.runtime.decoding.drafters import (
    ModelDrafter,
    NgramDrafter,
    NoDrafter,
    RecyclingDrafter,
    new_recycling_table,
)
from edgespec.runtime.decoding.dynamic_tree import DynamicDrafter
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.decoding.lookup import WithLookup
from edgespec.runtime.decoding.sampling import SamplingConfig
from edgespec.runtime.pipeline import Pipeline

from edgespec.bench import load_prompts, prompt_kwargs
from edgespec.defaults import resolve_bundle

parser = argparse.ArgumentParser()
parser.add_argument("bundle", nargs="?", default="default")
parser.add_argument("--prompts", default=None)
parser.add_argument("--max-new-tokens", type=int, default=64)
parser.add_argument("--tree", action="append", default=[], help="more trees for the draft model (repeatable)")
parser.add_argument("--dynamic", type=int, default=12, help="node budget of the dynamic tree")
parser.add_argument("--free-tree", action="append", default=[], help="more trees for the training-free drafters")
parser.add_argument("--only", action="append", default=[], help="keep only the rows whose name contains this")
parser.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (0: greedy)")
parser.add_argument("--seed", type=int, default=0, help="with --temperature: prompt i samples with seed + i")
args = parser.parse_args()

pipeline = Pipeline(resolve_bundle(args.bundle))
prompts = load_prompts(Path(args.prompts) if args.prompts else None)
chunk, facts = pipeline.manifest.prefill_chunk, pipeline.manifest.target.facts


def model(spec):
    return lambda: ModelDrafter(pipeline.draft, pipeline.new_draft_cache(), parse_tree_spec(spec), chunk)


rows = [("plain", NoDrafter)]
rows += [(f"draft model, chain:{k}", model(f"chain:{k}")) for k in (1, 2, 3, 4, 5, 6)]
rows += [(f"draft model, {spec}", model(spec)) for spec in ["topk:2x3"] + args.tree]
rows += [(f"draft model, chain:1 + lookup {k}" + (f" ({q} when quoting)" if q else ""),
          lambda k=k, q=q: WithLookup(model("chain:1")(), LookupConfig(tokens=k, quote_tokens=q)))
         for k, q in ((4, 0), (4, 10), (0, 10))]
rows += [(f"draft model, dynamic:{args.dynamic}", lambda: DynamicDrafter(
    pipeline.draft, pipeline.new_draft_cache(), DynamicTreeConfig(budget=args.dynamic), chunk))]
for spec in ["chain:4", "topk:2x3"] + args.free_tree:
    rows += [(f"n-gram, {spec}", lambda spec=spec: NgramDrafter(parse_tree_spec(spec))),
             (f"token recycling, {spec}", lambda spec=spec: RecyclingDrafter(parse_tree_spec(spec), table)),
             (f"n-gram + recycling, {spec}", lambda spec=spec: RecyclingDrafter(
                 parse_tree_spec(spec), table, NgramDrafter(parse_tree_spec(spec))))]
rows += [("n-gram, chain:5, from one token (min_n 1, max_n 4)", lambda: NgramDrafter(parse_tree_spec("chain:5"), 4, 1)),
         ("n-gram, chain:11 when quoting, else chain:5, from one token (an n-gram bundle's default)",
          lambda: NgramDrafter.from_config(parse_tree_spec("chain:11"), NgramConfig()))]
rows += [("plain (again)", NoDrafter)]
if args.only:
    rows = [(name, make) for name, make in rows if name.startswith("plain") or any(o in name for o in args.only)]

sampled = args.temperature > 0
if sampled:
    rows = [(name, make) for name, make in rows if not name.startswith("plain")]  # each row has its paired plain


def config(prompt_index: int) -> GenerationConfig:
    sampling = SamplingConfig(temperature=args.temperature, seed=args.seed + prompt_index) if sampled else SamplingConfig()
    return GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling)


class Tally:
    """One drafter's decoding over the prompts."""

    def __init__(self):
        self.decoded = self.passes = self.accepted = 0
        self.seconds = 0.0
        self.outputs = []

    def add(self, result) -> None:
        self.decoded += max(0, result.stats.new_tokens - 1)  # the first token comes from prefill
        self.seconds += result.stats.decode_s
        self.passes += result.stats.target_passes
        self.accepted += result.stats.accepted_drafts
        self.outputs.append(result.token_ids)

    @property
    def speed(self) -> float:
        return self.decoded / self.seconds

    @property
    def per_pass(self) -> float:
        return (self.accepted + self.passes) / max(self.passes, 1)


pipeline.generate("Hello", config=GenerationConfig(max_new_tokens=8))  # warm-up
reference = None
print(f"{len(prompts)} prompts x {args.max_new_tokens} new tokens, {pipeline.threads} threads"
      + (f", temperature {args.temperature}, prompt i seeded {args.seed} + i" if sampled else ", greedy"))
last = "speedup" if sampled else "identical"
print(f"{'drafter and tree':50s} {'tokens/s':>9s} {'tokens/pass':>11s} {last:>9s}")
for name, make in rows:
    table = new_recycling_table(facts.vocab_size)  # shared by the row's prompts, as in one pipeline
    plain, spec = Tally(), Tally()
    for i, item in enumerate(prompts):
        if sampled:  # plain right before speculative, prompt by prompt, so noise falls on both alike
            plain.add(pipeline.generate(**prompt_kwargs(item), config=config(i), speculate=False))
        spec.add(pipeline.generate(**prompt_kwargs(item), config=config(i), session=pipeline.new_session(drafter=make())))
    reference = reference or spec.outputs
    verdict = f"{spec.speed / plain.speed:8.2f}x" if sampled else str(spec.outputs == reference)
    print(f"{name:50s} {spec.speed:9.2f} {spec.per_pass:11.2f} {verdict:>9s}", flush=True)
