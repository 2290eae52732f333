"""More target answers for an earlier `edgespec distill` run's data folder: continues its chat shards.

    python benchmarks/make_data/more_target_answers.py DATA_DIR --minutes 44 [--seed 0] [--prompts 6000]

The run's prompt list is rebuilt from the same seed and prompt count (it does not depend on the time
budget), and generation resumes with the first prompt no shard holds yet, exactly as the run's chat
phase would have gone on with more minutes. Shards already there are never rewritten. This is how the
data of the second eagle draft was made (benchmarks/history.md §23).
"""
import argparse
import time
from pathlib import Path

from edgespec.distill import data, prompts
from edgespec.exporters.sources import resolve_source

from edgespec.defaults import cache_dir

parser = argparse.ArgumentParser()
parser.add_argument("data_dir", type=Path, help="the `data` folder of an earlier distill run")
parser.add_argument("--target", default="default")
parser.add_argument("--minutes", type=float, required=True)
parser.add_argument("--seed", type=int, default=0, help="the run's --seed")
parser.add_argument("--prompts", type=int, default=6000, help="the run's prompt count")
args = parser.parse_args()

import torch  # noqa: E402  (after argument parsing: --help should not wait for torch)

torch.manual_seed(args.seed)
chat = args.data_dir / "chat"
if not data.shard_paths(chat):
    raise SystemExit(f"{args.data_dir} holds no chat shards of an earlier run")
model, tokenizer = resolve_source(args.target, cache_dir()).load()
texts = prompts.training_prompts(args.prompts, args.seed, prompts.default_corpus())
before = len(data.shard_paths(chat))
written = data.generate_shards(model, tokenizer, texts, chat, data.DataConfig(), time.time() + args.minutes * 60)
print(f"{written} new chat shards after the {before} there were")
