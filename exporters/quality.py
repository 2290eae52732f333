"""At export time: compare each quantized graph with the fp32 export of the same weights."""
from __future__ import annotations

import json
import tempfile
from importlib import resources
from pathlib import Path

from edgespec.quant.report import quality_report
from edgespec.quant.schemes import QuantPolicy
from edgespec.runtime.model import ModelRunner
from edgespec.runtime.pipeline import default_threads
from edgespec.runtime.sessions import make_session
from edgespec.runtime.tokenizer import TextCodec, TokenizerSpec

from .bundle_writer import save_graph
from .llama import LlamaBuilder

PROMPTS = 2
NEW_TOKENS = 128


def _runner(folder: Path, role: str, builder: LlamaBuilder) -> ModelRunner:
    """A trimmed head's logits are spread over the vocabulary: agreement compares token ids."""
    session = make_session(folder / f"{role}.onnx", ("CPUExecutionProvider",), default_threads())
    return ModelRunner(session, builder.facts, builder.head_tokens)


def write_quality_report(bundle: Path, tokenizer: TokenizerSpec, target: LlamaBuilder, draft: LlamaBuilder | None) -> dict:
    """Writes quality.json into the bundle (being written) and returns it."""
    codec = TextCodec(bundle, tokenizer)
    data = resources.files("edgespec").joinpath("data")
    heldout = codec.encode(data.joinpath("heldout.txt").read_text(encoding="utf-8"))[: target.facts.max_context - 1]
    prompts = [json.loads(line)["messages"] for line in data.joinpath("prompts.jsonl").read_text().splitlines()[:PROMPTS]]
    prompt_ids = [codec.encode_chat(m) if codec.has_chat_template else codec.encode(m[0]["content"]) for m in prompts]
    context = target.facts.max_context
    prompt_ids = [ids[-(context // 2):] for ids in prompt_ids]  # leave room for the continuation
    new_tokens = min(NEW_TOKENS, context - max(len(ids) for ids in prompt_ids) - 2)
    with tempfile.TemporaryDirectory(prefix="edgespec-fp32-") as scratch:
        scratch = Path(scratch)
        save_graph(scratch, "target", target, QuantPolicy())
        drafts = None
        if draft is not None:
            save_graph(scratch, "draft", draft, QuantPolicy())
            drafts = (_runner(scratch, "draft", draft), _runner(bundle, "draft", draft))
        report = quality_report(_runner(scratch, "target", target), _runner(bundle, "target", target),
                                heldout, prompt_ids, new_tokens, drafts)
    (bundle / "quality.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    return report
