"""At export time: compare each quantized graph with its float32 source (the target: the model itself, run by
transformers a module at a time, exporters/reference.py; a draft: its fp32 export)."""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from edgespec.quant.report import quality_report
from edgespec.quant.schemes import QuantPolicy
from edgespec.runtime.contract.tokenizer import TokenizerSpec
from edgespec.runtime.decoding.text import TextCodec
from edgespec.runtime.execution.model import ModelRunner
from edgespec.runtime.execution.sessions import make_session
from edgespec.runtime.pipeline import default_threads

from .bundle_writer import save_graph
from .check_target import checked_target, streams
from .llama import LlamaBuilder
from .reference import reference_rows

# The sample: enough text for perplexity and agreement to show a scheme's cost (history.md §78), small
# enough that at 8B the check costs a minute or two of the export, not most of it
PROMPTS = 2
NEW_TOKENS = 64
# a target the checks stream (exporters/check_target.py) reads its weights again at every pass: a shorter
# answer, and the prefills in as few passes as the sample allows (history.md §80)
STREAMED_NEW_TOKENS = 16
STREAMED_CHUNK = 256
HELDOUT_TOKENS = 256


def _runner(graph: Path, builder: LlamaBuilder) -> ModelRunner:
    """A trimmed head's logits are spread over the vocabulary: agreement compares token ids."""
    session = make_session(graph, ("CPUExecutionProvider",), default_threads())
    return ModelRunner(session, builder.facts, builder.head_tokens)


@dataclass(frozen=True)
class Written:
    """A role's graph as the bundle holds it: its builder, its file, and the static sizes it was written with."""
    builder: LlamaBuilder
    file: str
    static: dict | None = None


def write_quality_report(bundle: Path, tokenizer: TokenizerSpec, target: Written, draft: Written | None) -> dict:
    """Writes quality.json into the bundle (being written) and returns it. The draft's fp32 reference is built
    in the same shapes as the bundle's graph (a static draft for an NPU runs in static passes)."""
    codec = TextCodec(bundle, tokenizer)
    data = resources.files("edgespec").joinpath("data")
    facts = target.builder.facts
    heldout = codec.encode(data.joinpath("heldout.txt").read_text(encoding="utf-8"))[: min(HELDOUT_TOKENS, facts.max_context - 1)]
    prompts = [json.loads(line)["messages"] for line in data.joinpath("prompts.jsonl").read_text().splitlines()[:PROMPTS]]
    prompt_ids = [codec.encode_chat(m) if codec.has_chat_template else codec.encode(m[0]["content"]) for m in prompts]
    context = facts.max_context
    prompt_ids = [ids[-(context // 2):] for ids in prompt_ids]  # leave room for the continuation
    streamed = streams(bundle / target.file)
    new_tokens = min(STREAMED_NEW_TOKENS if streamed else NEW_TOKENS, context - max(len(ids) for ids in prompt_ids) - 2)
    with tempfile.TemporaryDirectory(prefix="edgespec-fp32-") as scratch:
        scratch = Path(scratch)

        def reference(sequences: list[list[int]], features: bool):
            return reference_rows(target.builder.model, target.builder.weights, sequences, features,
                                  target.builder.feature_taps)

        drafts = None
        if draft is not None:  # a draft is small: its fp32 graph is written whole
            save_graph(scratch, "draft", draft.builder, QuantPolicy(), static=draft.static)
            drafts = (_runner(scratch / "draft.onnx", draft.builder), _runner(bundle / draft.file, draft.builder))
        report = quality_report(reference, lambda: checked_target(bundle / target.file, target.builder.facts),
                                heldout, prompt_ids, new_tokens, drafts, STREAMED_CHUNK if streamed else 64)
    (bundle / "quality.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    return report
