"""A draft model whose tokenizer differs from the target's: it drafts through text (runtime/decoding/text_draft.py).

The export keeps the draft's own vocabulary and tokenizer (`draft_tokenizer.json`, the manifest's
`draft.tokenizer`), checks that both tokenizers give back the text they encode (the bridge decodes one's tokens
and encodes the text with the other), and refuses the options a chain drafted through text does not take.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgespec.runtime.contract.errors import ExportError
from edgespec.runtime.contract.tokenizer import TokenizerSpec

from .bundle_writer import PROBE_TEXT

DRAFT_TOKENIZER_FILE = "draft_tokenizer.json"
# what the bridge must carry both ways: the probe's code, markup and scripts, and chat markers as text
ROUND_TRIP_TEXTS = (PROBE_TEXT, "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n  Four.  \n\n",
                    "naïve café — “quotes” ½ 🙂")


@dataclass(frozen=True)
class ThroughText:
    """Why a draft drafts through text (`difference`: how its tokenizer differs from the target's) and with what."""
    tokenizer: object  # the draft's Hugging Face tokenizer
    eos_token_ids: tuple[int, ...]
    difference: str


def through_text(draft_model, draft_tokenizer, target_tokenizer, difference: str, trained_for_target: bool) -> ThroughText:
    """The draft as a text draft, after checking it can be one: a draft `edgespec distill` trained for a target
    (a trimmed head, the target's features) predicts that target's token ids and cannot."""
    if trained_for_target:
        raise ExportError(f"the draft's tokenizer differs from the target's ({difference}), but it was trained by "
                          "`edgespec distill` to predict its own target's token ids: distill a draft for this target")
    for role, tokenizer in (("target", target_tokenizer), ("draft", draft_tokenizer)):
        lost = round_trip_failure(tokenizer.backend_tokenizer)
        if lost is not None:
            raise ExportError(f"the draft's tokenizer differs from the target's ({difference}), so it drafts through "
                              f"text, but the {role}'s tokenizer does not give back the text it encodes ({lost}): "
                              "use a draft whose tokenizer keeps every character (byte-level BPE or byte fallback)")
    eos = set()
    for source in (getattr(draft_model.generation_config, "eos_token_id", None), draft_model.config.eos_token_id,
                   draft_tokenizer.eos_token_id):
        if source is not None:
            eos.update(source if isinstance(source, (list, tuple)) else [source])
    return ThroughText(draft_tokenizer, tuple(sorted(int(e) for e in eos)), difference)


def round_trip_failure(tokenizer) -> str | None:
    """Where `tokenizer` (a `tokenizers.Tokenizer`) does not decode its own encoding of a probe text back to it:
    the first few characters that differ, or None."""
    for text in ROUND_TRIP_TEXTS:
        back = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False).ids, skip_special_tokens=False)
        if back != text:
            at = next((i for i, (a, b) in enumerate(zip(text, back)) if a != b), min(len(text), len(back)))
            return f"{text[at:at + 12]!r} comes back as {back[at:at + 12]!r}"
    return None


def write_draft_tokenizer(folder: Path, draft: ThroughText) -> TokenizerSpec:
    draft.tokenizer.backend_tokenizer.save(str(folder / DRAFT_TOKENIZER_FILE))
    return TokenizerSpec(file=DRAFT_TOKENIZER_FILE, chat_template=None, bos_token=draft.tokenizer.bos_token,
                         eos_token_ids=draft.eos_token_ids, add_bos_token=False)


def check_text_plan(plan, suffix: bool, draft: ThroughText) -> None:
    """The options of `plan` (exporters/export.py: ExportPlan) a text draft takes: a static chain on dynamic
    ONNX graphs, drafted by the model alone."""
    tree = plan.tree
    why = f"the draft's tokenizer differs from the target's ({draft.difference}), so it drafts a chain through text"
    if tree.dynamic is not None or tree.topology.max_width > 1:
        raise ExportError(f"{why}: give --tree chain:N")
    if tree.lookup is not None or suffix:
        raise ExportError(f"{why}, alone: drop --lookup/--lookup-quote/--suffix")
    if plan.coreml is not None:
        raise ExportError(f"{why}, which the CoreML packages do not: export --format onnx")
    if any(roles[1] for roles in plan.shapes):
        raise ExportError(f"{why} on dynamic shapes; the {plan.profiles[0].name} profile's static draft graph does "
                          "not take it: export for a profile with dynamic shapes")
