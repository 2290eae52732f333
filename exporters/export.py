"""`edgespec export`: target (+ draft) model -> device bundle."""
from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import onnxruntime
from edgespec.quant.calibrate import calibration_text
from edgespec.quant.schemes import QuantPolicy
from edgespec.runtime.contract.coreml_package import compute_units_for
from edgespec.runtime.contract.drafting import DrafterKind
from edgespec.runtime.contract.errors import ExportError
from edgespec.runtime.contract.manifest import ProfileGraphs, write_manifest
from edgespec.runtime.decoding.exactness import fewest_exact_rows
from edgespec.runtime.execution.device import machine_key

from .architectures import builder_for
from .bundle_writer import (
    BundleContents,
    bundle_manifest,
    calibrate,
    staged_bundle,
    write_model,
    write_slots,
    write_tokenizer,
)
from .check_target import checked_target, layers_of_every_kind
from .drafts import DRAFT_HEAD_FILE, DraftInfo, draft_builder_for, draft_calibration_from, read_draft_info
from .eagle3 import is_eagle3_head, read_eagle3_head
from .eagle3_graph import Eagle3Builder
from .export_plan import ExportConfig, ExportPlan, plan_export
from .gguf_weights import kept_blocks
from .medusa import MedusaBuilder, is_medusa_head, read_medusa_head
from .memory_check import check_memory
from .quality import Written, write_quality_report
from .sources import resolve_source
from .text_draft import check_text_plan, write_draft_tokenizer


def export(config: ExportConfig) -> Path:
    """Writes the bundle `config` describes, whole or not at all."""
    say = progress()
    with staged_bundle(config.out, config.force) as folder:
        write_export(folder, config, say)
    say(f"bundle written to {config.out}")
    return Path(config.out)


def progress():
    """`say(message)`: a line on stderr with the seconds since this call."""
    started = time.perf_counter()
    return lambda message: print(f"[{time.perf_counter() - started:6.1f}s] {message}", file=sys.stderr, flush=True)


def write_export(folder: Path, config: ExportConfig, say) -> None:
    """The whole export into `folder`, in order: the plan, the models' graphs (with their quantization,
    quality and exactness), then the manifest, once."""
    plan = plan_export(config)
    target_source = resolve_source(config.model, config.cache_dir)
    training_free = DrafterKind.training_free(config.draft)
    draft_source = None if training_free is not None else resolve_source(config.draft, config.cache_dir)
    contents = _write_models(folder, config, plan, target_source, draft_source, say)
    say("writing manifest and checksums")
    write_manifest(folder, bundle_manifest(folder, contents, plan.profiles[0], plan.tree, config.prefill_chunk))


def _write_models(folder: Path, config: ExportConfig, plan: ExportPlan, target_source, draft_source,
                  say) -> BundleContents:
    """Tokenizer, target graph (+ stages), draft graph, quality report: everything the manifest lists."""
    draft_info = DraftInfo() if draft_source is None else read_draft_info(draft_source)
    eagle3 = _eagle3_head(config, plan, draft_source)
    medusa = draft_source is not None and _medusa_heads(config, plan, draft_source)
    say(f"loading target: {target_source.description}")
    target, tokenizer, weights = target_source.load_streamed()
    medusa = read_medusa_head(draft_source, target.config) if medusa else None
    # a draft that reads the target's features needs a target graph that returns them
    target_builder = builder_for(target, config.context, features_out=draft_info.feature_fc is not None or bool(medusa),
                                 lanes=plan.lanes, exact_passes=True, weights=weights,
                                 feature_taps=None if eagle3 is None else eagle3.taps_for(target.config))
    check_memory(target_builder.facts, plan.target_scheme.name, say)
    tokenizer_spec = write_tokenizer(folder, tokenizer, target)
    say(f"writing target graph ({target_builder.facts.num_layers} layers, "
        f"{target_builder.parameter_count() / 1e6:.0f}M parameters, {plan.target_scheme.name})")
    calibration = None
    if plan.target_scheme.integer_matmul:
        say("calibrating integer matmuls (activation ranges over quant/data/calibration.txt)")
        calibration = calibrate(target_builder, tokenizer(calibration_text())["input_ids"])
    static = static_dims(plan.static_nodes, config.context)
    if static:
        target_builder.rope_slack = max(target_builder.rope_slack, plan.static_nodes)
        say(f"static-shape graphs: {plan.static_nodes} nodes per pass, a KV buffer of {config.context} tokens")
    grids = _kept_blocks(config, target_source, target_builder, say)
    target_entry = write_model(folder, "target", target_builder, target_source.description, plan.target_policy,
                               stages=config.stages, calibration=calibration,
                               static=static if plan.main_static[0] else None, grids=grids)
    if config.slots:
        say(f"writing target graph with {config.slots} slots (conversations per pass)")
        target_entry = replace(target_entry, slots=write_slots(folder, target_builder, plan.target_policy, config.slots,
                                                               calibration, grids))
    draft_entry, draft_builder, draft_calibration, text_draft = None, None, None, None
    if draft_source is not None:
        say(f"loading draft: {draft_source.description}")
        if medusa:
            draft_builder = MedusaBuilder(medusa, target_builder.facts)
        elif eagle3 is not None:
            draft_builder = Eagle3Builder(eagle3, target_builder, config.context)
        else:
            draft_builder, text_draft = draft_builder_for(draft_source, draft_info, tokenizer, target_builder,
                                                          config.context)
        if text_draft is not None:
            check_text_plan(plan, config.suffix, text_draft)
            say(f"the draft's tokenizer differs from the target's ({text_draft.difference}): it drafts through text")
        draft_builder.rope_slack = target_builder.rope_slack
        say(f"writing draft graph ({plan.draft_scheme.name})")
        draft_calibration = None if not plan.draft_scheme.bits else draft_calibration_from(draft_builder, calibration) \
            if text_draft is None else calibrate(draft_builder, text_draft.tokenizer(calibration_text())["input_ids"])
        # a static draft is for an NPU: its attention in standard operators (no contrib op to compile)
        draft_builder.portable_attention = plan.main_static[1]
        draft_entry = write_model(folder, "draft", draft_builder, draft_source.description,
                                  QuantPolicy(plan.draft_scheme), calibration=draft_calibration,
                                  static=static if plan.main_static[1] else None)
        if draft_builder.head_tokens is not None:
            (folder / DRAFT_HEAD_FILE).write_text(json.dumps([int(t) for t in draft_builder.head_tokens]))
            draft_entry = replace(draft_entry, head_tokens=DRAFT_HEAD_FILE)
        if text_draft is not None:
            draft_entry = replace(draft_entry, tokenizer=write_draft_tokenizer(folder, text_draft))
    quality = None
    if plan.target_policy.quantizes() or (draft_builder is not None and plan.draft_scheme.name != "fp32"):
        say("measuring quality against the float32 model (perplexity, greedy agreement)")
        # Medusa heads, and a text draft (it reads its own tokens), have no agreement in the target's tokens here
        draft_written = None if draft_entry is None or medusa or text_draft is not None else \
            Written(draft_builder, draft_entry.graph.file, static if plan.main_static[1] else None)
        quality = {"file": "quality.json", **write_quality_report(
            folder, tokenizer_spec, Written(target_builder, target_entry.graph.file,
                                            static if plan.main_static[0] else None), draft_written)}
    coreml = ()
    if plan.coreml is not None:
        coreml = _write_coreml(folder, config, plan, target_builder, draft_builder, say)
    say("checking that this device keeps plain decoding's bits (as inspect --check-exact does)")
    exactness = _exactness(folder / target_entry.graph.file, target_builder, say)
    others = ()
    if config.also_profiles:
        others = _other_profiles(folder, config, plan, static, (target_builder, target_entry), (draft_builder, draft_entry),
                                 (calibration, draft_calibration), say)
    kind = DrafterKind.training_free(config.draft) if draft_entry is None else \
        DrafterKind.MEDUSA if medusa else DrafterKind.TEXT if text_draft is not None else DrafterKind.MODEL
    return BundleContents(tokenizer_spec, target_entry, kind, draft_entry, quality, exactness, coreml, others)


def _eagle3_head(config: ExportConfig, plan: ExportPlan, draft_source):
    """The published EAGLE-3 head --draft names, read and checked (exporters/eagle3.py); None for other drafts."""
    if draft_source is None or not is_eagle3_head(draft_source):
        return None
    if config.stages or config.slots or plan.coreml is not None:
        raise ExportError("an EAGLE-3 head reads three of the target's layers, which a target written as stages, "
                          "with slots or as CoreML packages does not return: drop --stages/--slots/--format coreml")
    return read_eagle3_head(draft_source)


def _medusa_heads(config: ExportConfig, plan: ExportPlan, draft_source) -> bool:
    """Whether --draft names Medusa heads (exporters/medusa.py), refusing what they cannot draft with."""
    if not is_medusa_head(draft_source):
        return False
    if config.stages or config.slots or plan.coreml is not None or plan.main_static[1] or any(
            roles[1] for roles in plan.shapes):
        raise ExportError("Medusa heads draft from the target's features on the ONNX CPU path: drop --stages, "
                          "--slots, --format coreml and static-shape draft profiles")
    if plan.tree.dynamic is not None or plan.tree.lookup is not None or plan.target_scheme.integer_matmul:
        raise ExportError("Medusa heads fill a fixed tree from their own top tokens: drop dynamic:N, --lookup and "
                          "--integer-matmul")
    return True


def _exactness(graph: Path, builder, say) -> dict:
    found = check_exactness(graph, builder.facts, layers_of_every_kind(list(zip(builder.windows, builder.ropes))))
    if not found["exact"]:
        say(f"warning: {found['differ']} of {found['rows']} rows of {graph.name} differ from plain decoding on this "
            "device: the bundle will decode plainly here")
    return found


def _other_profiles(folder: Path, config: ExportConfig, plan: ExportPlan, static: dict | None, target, draft,
                    calibrations, say) -> tuple[ProfileGraphs, ...]:
    """The profiles after the first: the main graphs where their shapes agree, else a second graph of that role
    in the other shapes (`target.static.onnx` beside a dynamic one, `draft.dynamic.onnx` beside a static one)."""
    (target_builder, target_entry), (draft_builder, draft_entry) = target, draft
    other = {}
    for role, builder, entry, policy, needed, main_static in (
            ("target", target_builder, target_entry, plan.target_policy, plan.other_form[0], plan.main_static[0]),
            ("draft", draft_builder, draft_entry, QuantPolicy(plan.draft_scheme), plan.other_form[1],
             plan.main_static[1])):
        if not needed or builder is None:
            continue
        form = "dynamic" if main_static else "static"
        builder.portable_attention = role == "draft" and form == "static"
        say(f"writing the {role}'s {form}-shape graph for {', '.join(config.also_profiles)}")
        other[role] = write_model(folder, f"{role}.{form}", builder, entry.source, policy,
                                  calibration=calibrations[role == "draft"],
                                  static=None if main_static else static).graph
    if "target" in other:
        other["exactness"] = _exactness(folder / other["target"].file, target_builder, say)
    found = []
    for profile, roles in zip(plan.profiles[1:], plan.shapes[1:]):
        own = {}
        if "target" in other and roles[0] != plan.main_static[0]:
            own = {"target": other["target"], "exactness": other["exactness"]}
        if "draft" in other and roles[1] != plan.main_static[1]:
            own["draft"] = other["draft"]
        found.append(ProfileGraphs(profile, **own))
    return tuple(found)


def _write_coreml(folder: Path, config: ExportConfig, plan: ExportPlan, target_builder, draft_builder, say) -> tuple:
    """CoreML packages of the target (and draft), with the compute units the profile asks for per role."""
    from .coreml import write_coreml

    profile = plan.profiles[0]
    packages = write_coreml(folder, "target", target_builder, plan.tree.topology, config.prefill_chunk, plan.coreml,
                            compute_units_for(profile.verify), say)
    if draft_builder is not None:
        packages += write_coreml(folder, "draft", draft_builder, plan.tree.topology, config.prefill_chunk,
                                 plan.coreml, compute_units_for(profile.draft), say)
    return tuple(packages)


def static_dims(nodes: int | None, context: int) -> dict[str, int] | None:
    """The symbolic dimensions of a graph (exporters/llama.py) fixed for a static-shape profile: `nodes` rows
    in as many slots, as many logit rows, and a KV buffer of the context plus the rows a pass writes past it."""
    if nodes is None:
        return None
    return {"nodes": nodes, "slots": nodes, "rows": nodes, "total": context + nodes, "capacity": context + nodes}


def check_exactness(graph: Path, facts, prefix: int | None = None) -> dict:
    """runtime/decoding/exactness.py's check on the written target graph, as the manifest records it
    (`prefix`: the first layers a streamed target's check runs, exporters/check_target.py)."""
    with checked_target(graph, facts, prefix=prefix) as runner:
        min_rows, compared, differ = fewest_exact_rows(runner)
    return {"machine": machine_key(), "onnxruntime": onnxruntime.__version__, "exact": not differ,
            "rows": compared, "differ": len(differ), "min_rows": min_rows}


def _kept_blocks(config: ExportConfig, source, builder, say) -> dict | None:
    """With --gguf-blocks, the target's matmul weights that keep the GGUF's own blocks; the others named."""
    if not config.gguf_blocks:
        return None
    if source.kind != "gguf":
        raise ExportError(f"--gguf-blocks keeps a GGUF file's blocks, and the target is {source.description}")
    kept = kept_blocks(Path(source.location), builder)
    kinds = sorted({grid.kind for grid in kept.grids.values()})
    say(f"keeping the GGUF's own blocks for {len(kept.grids)} matmul weights ({', '.join(kinds) or 'none'})")
    if kept.floats:
        say(f"float in the file, quantized as --quant {config.quant}: {', '.join(kept.floats)}")
    if kept.not_kept:
        say(f"not kept, quantized as --quant {config.quant} instead: "
            + "; ".join(f"{name} ({kinds})" for name, kinds in sorted(kept.not_kept.items())))
    return kept.grids
