"""Writes a bundle: graphs, weights, tokenizer, manifest, checksums — into a temporary folder that is
moved into place only when complete, so a failed export leaves nothing half-written."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from importlib.metadata import version
from pathlib import Path

import onnx
from edgespec.quant.apply import check_policy_names
from edgespec.quant.calibrate import Calibration, activation_maxima
from edgespec.quant.schemes import QuantPolicy
from edgespec.runtime.contract.coreml_package import CoreMLPackage
from edgespec.runtime.contract.drafting import DrafterKind, DynamicTreeConfig, LookupConfig, NgramConfig, SuffixConfig
from edgespec.runtime.contract.errors import ExportError
from edgespec.runtime.contract.graph import ATTENTION_KEY, EXACT_ROWS_KEY, MIN_ROWS, STANDARD_ATTENTION
from edgespec.runtime.contract.manifest import (
    MANIFEST,
    GraphSpec,
    Manifest,
    ModelEntry,
    ProfileGraphs,
    bundle_files,
    sha256_file,
    write_manifest,
)
from edgespec.runtime.contract.tokenizer import TokenizerSpec
from edgespec.runtime.contract.topology import Topology
from edgespec.runtime.decoding.sampling import GENERATION_CONFIG_KEYS
from edgespec.targets.profiles import DeviceProfile

from .llama import LlamaBuilder
from .weight_stream import StreamedWeights
from .weights import external_table, external_tensors


def write_model(folder: Path, role: str, builder: LlamaBuilder, source: str, policy: QuantPolicy,
                stages: int = 0, calibration: Calibration | None = None, static: dict | None = None,
                grids: dict | None = None, index: dict | None = None) -> ModelEntry:
    """Writes `role`.onnx, quantized by `policy`, and with `stages` > 0 the same model as stages (embedding,
    `stages` groups of layers, head) that a runtime short of memory loads one after another; returns the
    manifest entry. Each weight is stored once: the stages are written first, each into its own weights
    file (a runtime maps a stage's file whole), and the whole graph reads its weights from theirs, keeping a
    `role`.weights file only for what no stage holds. `calibration`: `calibrate`'s, for integer matmuls.
    `static`: the graph's symbolic dimensions fixed (a static-shape profile: export.static_dims). `grids`:
    weights that keep a GGUF's own blocks (exporters/gguf_weights.py). `index`: filled with where each
    weight was stored (StreamedWeights.index), for another graph of the same weights to read."""
    maxima = calibration.maxima if calibration is not None else None
    index = {} if index is None else index
    stage_specs = []
    for i, (layers, embed, head) in enumerate(stage_plan(builder.facts.num_layers, stages) if stages else ()):
        name = f"{role}.stage{i}"
        stage, stage_applied = save_graph(folder, name, builder, policy,
                                          dict(layers=layers, embed=embed, head=head), strict=False, maxima=maxima,
                                          grids=grids, index=index)
        stage_specs.append(replace(
            _graph_spec(name, stage, stage_applied, policy), layers=(layers.start, layers.stop),
            # a float stage: the runtime maps its weights; a table it can index itself (float or 4-bit),
            # so only the rows it reads become resident
            tensors=external_tensors(stage),
            embedding_table=external_table(stage, "embed_tokens") if embed else None))
    model, applied = save_graph(folder, role, builder, policy, maxima=maxima, static=static, grids=grids,
                                reuse=dict(index), index=index)
    return ModelEntry(facts=builder.facts, graph=_graph_spec(role, model, applied, policy), source=source,
                      stages=tuple(stage_specs))


def write_slots(folder: Path, builder: LlamaBuilder, policy: QuantPolicy, slots: int,
                calibration: Calibration | None = None, grids: dict | None = None,
                index: dict | None = None) -> GraphSpec:
    """Writes the target again as a slots graph of `slots` conversations per pass (exporters/slots.py),
    `target.slots.onnx`, its weights quantized as the target's: the same weights, the same bits per row,
    read from where the target's graph stored them (`index`, write_model's) rather than stored again."""
    maxima = calibration.maxima if calibration is not None else None
    model, applied = save_graph(folder, "target.slots", builder, policy, dict(slots=slots), maxima=maxima, grids=grids,
                                reuse=index)
    return _graph_spec("target.slots", model, applied, policy)


def stage_plan(num_layers: int, groups: int) -> list[tuple[range, bool, bool]]:
    """(layers, embedding?, head?) per stage: the embedding alone, `groups` even groups of layers, the head alone."""
    if not 1 <= groups <= num_layers:
        raise ExportError(f"--stages must be between 1 and the model's {num_layers} layers (got {groups})")
    bounds = [round(num_layers * g / groups) for g in range(groups + 1)]
    return ([(range(0, 0), True, False)] + [(range(a, b), False, False) for a, b in zip(bounds, bounds[1:])]
            + [(range(num_layers, num_layers), False, True)])


def _graph_spec(name: str, model: onnx.ModelProto, applied: dict, policy: QuantPolicy) -> GraphSpec:
    return GraphSpec(
        file=f"{name}.onnx",
        weights=weight_files(model, f"{name}.weights"),
        inputs={i.name: value_shape(i) for i in model.graph.input},
        outputs={o.name: value_shape(o) for o in model.graph.output},
        quantization={**policy.default.to_dict(any(s in ("int4", "int8") for s in applied.values())),
                      "tensors": applied},
    )


# operators whose one-row kernel rounds unlike their multi-row one (runtime/execution/model.py, MIN_ROWS)
ROW_DEPENDENT_OPS = ("MatMul", "Gemm", "MatMulNBits")


def mark_exact_rows(model: onnx.ModelProto) -> None:
    """Records in the graph the fewest rows at which its every row has the bits it has in any larger
    pass: 1 when all its matmuls accumulate in integers (quant/integer.py), else MIN_ROWS."""
    fewest = 1 if not any(node.op_type in ROW_DEPENDENT_OPS for node in model.graph.node) else MIN_ROWS
    onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, EXACT_ROWS_KEY: str(fewest)})


def calibrate(builder: LlamaBuilder, ids: list[int], features=None) -> Calibration:
    """Runs the fp32 model over `ids` for the activation ranges integer matmuls smooth (quant/calibrate.py);
    `features`: a feature-reading draft's inputs (the target's calibration features, shifted)."""
    return activation_maxima(builder.build("edgespec_calibration").to_model(), builder.facts, ids, features)


def save_graph(folder: Path, name: str, builder: LlamaBuilder, policy: QuantPolicy, parts: dict | None = None,
               strict: bool = True, maxima: dict | None = None, static: dict | None = None, grids: dict | None = None,
               reuse: dict | None = None, index: dict | None = None):
    """Builds (all of the model, or `parts` of it), quantizes and saves `name`.onnx with its weights in
    `name`.weights, a layer at a time (exporters/weight_stream.py). `strict`: a policy pattern that matches
    no weight here is an error. `static`: values for the graph's symbolic dimensions. `reuse`: weights
    another graph of this bundle stored already (StreamedWeights.index), read from there when their bytes
    are the same; `index`: filled with where this graph stored its own. A weights file left empty is removed."""
    parts = parts or {}
    layers = parts.get("layers", range(builder.facts.num_layers))
    if strict:  # before minutes of writing: the matmul weights the builder names (checked again after)
        try:
            check_policy_names(policy, set(builder.matmul_sources()) | {"embed_tokens"})
        except ValueError as err:
            raise ExportError(str(err)) from err
    weights = folder / f"{name}.weights"
    parts_count = len(layers) * (1 + builder.flushes_attention) + 1
    with StreamedWeights(weights, policy, maxima, grids, parts=parts_count, label=f"writing {name}",
                         reuse=reuse) as sink:
        model = builder.build(f"edgespec_{name.replace('.', '_')}", sink=sink, **parts).to_model()
    if index is not None:
        index.update(sink.index)
    if weights.stat().st_size == 0:
        weights.unlink()
    applied = sink.applied
    try:
        if strict:
            sink.check_policy()
        mark_exact_rows(model)
        if builder.portable_attention:
            onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props},
                                                ATTENTION_KEY: STANDARD_ATTENTION})
        if static:
            fix_dims(model, static)
    except ValueError as err:
        raise ExportError(str(err)) from err
    onnx.save_model(model, folder / f"{name}.onnx")
    onnx.checker.check_model(str(folder / f"{name}.onnx"))
    return model, applied


def weight_files(model: onnx.ModelProto, own: str) -> tuple[str, ...]:
    """The weights files `model` reads, its own (`own`) first where it has one."""
    found = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    return tuple(sorted(found, key=lambda f: (f != own, f)))


def fix_dims(model: onnx.ModelProto, values: dict[str, int]) -> None:
    """Gives the graph's inputs and outputs fixed sizes where their dimensions are named in `values`."""
    for value in list(model.graph.input) + list(model.graph.output):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in values:
                dim.dim_value = values[dim.dim_param]  # setting the value clears the name (a oneof)


def value_shape(value: onnx.ValueInfoProto) -> dict:
    dims = [d.dim_param if d.dim_param else d.dim_value for d in value.type.tensor_type.shape.dim]
    return {"dtype": onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type).name, "shape": dims}


def write_tokenizer(folder: Path, tokenizer, model) -> TokenizerSpec:
    path = folder / "tokenizer.json"
    try:
        tokenizer.backend_tokenizer.save(str(path))
    except Exception as err:  # the tokenizers library raises a bare Exception for what the system refused
        refused = re.search(r"\(os error (\d+)\)", str(err))
        if refused is None:
            raise
        raise OSError(int(refused.group(1)), os.strerror(int(refused.group(1))), str(path)) from err
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one serves chat
        template = template.get("default")
    if template:
        (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    write_sampling(folder, getattr(model, "generation_config", None))
    eos = set()
    for source in (getattr(model.generation_config, "eos_token_id", None), model.config.eos_token_id,
                   tokenizer.eos_token_id):
        if source is not None:
            eos.update(source if isinstance(source, (list, tuple)) else [source])
    # Whether the tokenizer itself prepends a BOS is read off its behaviour, not its config flags.
    probe_plain = tokenizer("a", add_special_tokens=False).input_ids
    probe_full = tokenizer("a").input_ids
    add_bos = bool(tokenizer.bos_token_id is not None and probe_full[:1] == [tokenizer.bos_token_id]
                   and probe_plain[:1] != [tokenizer.bos_token_id])
    return TokenizerSpec(file="tokenizer.json", chat_template="chat_template.jinja" if template else None,
                         bos_token=tokenizer.bos_token, eos_token_ids=tuple(sorted(int(e) for e in eos)),
                         add_bos_token=add_bos)


def write_sampling(folder: Path, generation_config) -> None:
    """The model's own sampling settings (those its generation_config sets), which conversations use where a
    request leaves them unset (Pipeline.sampling_defaults); nothing where it sets none."""
    if generation_config is None:
        return
    given = generation_config.to_diff_dict()  # what differs from transformers' defaults: what the model chose
    keys = ("do_sample", *GENERATION_CONFIG_KEYS)
    sampling = {key: given[key] for key in keys if given.get(key) is not None}
    if set(sampling) - {"do_sample"}:
        (folder / "generation_config.json").write_text(json.dumps(sampling, indent=1), encoding="utf-8")


PROBE_TEXT = "Speculative decoding: <tool_call>{\"name\": \"f\"}</tool_call> 1234 héllo 世界\n\tdef f(x):"


def tokenizer_difference(target_tok, draft_tok) -> str | None:
    """How a draft's tokenizer fails to give every text the target's token ids, special tokens included (the
    first token that differs, or the splitting of a probe text); None where it gives the same ids."""
    target_ids = {i: t for t, i in target_tok.get_vocab().items()}
    draft_ids = {i: t for t, i in draft_tok.get_vocab().items()}
    for i in sorted(set(target_ids) | set(draft_ids)):
        if target_ids.get(i) != draft_ids.get(i):
            return f"at id {i} the target has {target_ids.get(i)!r}, the draft {draft_ids.get(i)!r}"
    if target_tok(PROBE_TEXT)["input_ids"] != draft_tok(PROBE_TEXT)["input_ids"]:
        return "it splits text differently (same vocabulary, other rules)"
    return None


@dataclass(frozen=True)
class BundleContents:
    """What an export wrote into its folder: the manifest's sections that describe files."""

    tokenizer: TokenizerSpec
    target: ModelEntry
    drafter: DrafterKind
    draft: ModelEntry | None = None
    quality: dict | None = None
    exactness: dict | None = None  # the exactness check on the exporting device
    coreml: tuple[CoreMLPackage, ...] = ()
    other_profiles: tuple[ProfileGraphs, ...] = ()


@dataclass(frozen=True)
class TreeSettings:
    """The manifest's tree: its topology and the drafters' settings."""

    topology: Topology
    dynamic: DynamicTreeConfig | None = None
    lookup: LookupConfig | None = None
    ngram: NgramConfig | None = None
    suffix: SuffixConfig | None = None


@contextlib.contextmanager
def staged_bundle(out: Path, force: bool):
    """A temporary folder beside `out` to write a bundle into; when the block ends without an error it
    becomes `out` (replacing the bundle there with --force), and on any error, Ctrl-C or SIGTERM it is
    removed: a bundle appears whole or not at all."""
    out = Path(out)
    check_output(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_exports(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    (tmp / EXPORT_OWNER).write_text(str(os.getpid()))
    try:
        with _terminate_as_interrupt():
            yield tmp
            check_output(out, force)  # again: the export took a while
            (tmp / EXPORT_OWNER).unlink()
            _move_into_place(tmp, out)
    except OSError as err:  # what the system refused (no space, a file size limit, a permission): the cause, once
        where = _failed_file(err, tmp, out)
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(f"the export to {out} stopped{where}, nothing of it left behind: "
                          f"{err.strerror or err}") from err
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _failed_file(err: OSError, tmp: Path, out: Path) -> str:
    """Which file the refused operation was on, for the message: the error's own file name (an open, a
    rename), else for a refused write (write() names no file) the bundle's file written last: the export
    writes one file at a time."""
    if err.filename is not None:
        name = Path(os.fsdecode(err.filename))
        return f" at {out / name.relative_to(tmp) if name.is_relative_to(tmp) else name}"
    if err.errno not in (errno.EFBIG, errno.ENOSPC, errno.EDQUOT, errno.EIO):
        return ""
    written = [(path.stat().st_mtime_ns, path) for path in tmp.rglob("*")
               if path.is_file() and path.name != EXPORT_OWNER]
    return f" while writing {out / max(written)[1].relative_to(tmp)}" if written else ""


def bundle_manifest(folder: Path, contents: BundleContents, profile: DeviceProfile, tree: TreeSettings,
                    prefill_chunk: int) -> Manifest:
    """The manifest of what `folder` holds: the files' checksums and what the export wrote."""
    return Manifest(
        target=contents.target, draft=contents.draft, drafter=contents.drafter, tree=tree.topology,
        dynamic=tree.dynamic, lookup=tree.lookup, ngram=tree.ngram, prefill_chunk=prefill_chunk,
        tokenizer=contents.tokenizer, profile=profile,
        files={name: sha256_file(folder / name) for name in bundle_files(folder) if name != EXPORT_OWNER},
        edgespec_version=version("edgespec"), created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        quality=contents.quality, exactness=contents.exactness, coreml=contents.coreml,
        other_profiles=contents.other_profiles, suffix=tree.suffix)


def _move_into_place(tmp: Path, out: Path) -> None:
    # mkdtemp made the folder private, and coremltools writes some package files 0600: a bundle is
    # written like any other folder, by the user's umask
    mask = _umask()
    for path in [tmp, *tmp.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)
    old = out.with_name(f".{out.name}.replaced") if out.exists() else None
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    try:
        tmp.rename(out)
    except BaseException:
        if old is not None and not out.exists():
            old.rename(out)  # the bundle that was there stays where it was
        raise
    if old is not None:
        shutil.rmtree(old)


EXPORT_OWNER = ".export-pid"  # inside an export's temporary folder while it is written: whose it is


def remove_abandoned_exports(out: Path) -> None:
    """Removes the temporary folders that exports to `out` killed outright (SIGKILL, power loss) left
    beside it: those whose process is gone. A running export's folder is left alone."""
    for folder in out.parent.glob(f".{out.name}.*"):
        owner = folder / EXPORT_OWNER
        if not (folder.is_dir() and owner.is_file()):
            continue
        try:
            pid = int(owner.read_text())
        except (OSError, ValueError):
            pid = None
        if pid is None or not _running(pid):
            shutil.rmtree(folder, ignore_errors=True)


def _running(pid: int) -> bool:
    if os.name == "nt":  # os.kill(pid, 0) would terminate the process there: never guess, keep the folder
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM ends an export as Ctrl-C does, through the cleanup above (only the main thread can
    handle signals; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def check_output(out: Path, force: bool) -> None:
    """Refuses to overwrite anything but an edgespec bundle that verifies (every file listed in its
    manifest, with its checksum, and nothing else), and a bundle only with --force."""
    if not out.exists():
        return
    if not force:
        raise ExportError(f"{out} already exists; pass --force to replace it")
    if not (out.is_dir() and (out / MANIFEST).is_file()):
        raise ExportError(f"{out} exists and is not a bundle (no {MANIFEST}); --force replaces bundles only")
    try:
        listed = json.loads((out / MANIFEST).read_text(encoding="utf-8"))["files"]
        if not isinstance(listed, dict):
            raise TypeError("files is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ExportError(f"{out} is not a bundle this edgespec can verify ({err}); --force replaces bundles "
                          "only: remove it yourself if it is one") from err
    unlisted = [name for name in bundle_files(out) if name != MANIFEST and name not in listed]
    if unlisted:
        raise ExportError(f"{out} holds files its manifest does not list ({', '.join(unlisted[:5])}); --force "
                          "replaces a bundle only as it was written: move them first")
    changed = [name for name, digest in listed.items() if not (out / name).is_file() or sha256_file(out / name) != digest]
    if changed:
        raise ExportError(f"{out}: {', '.join(changed[:5])} differ from the bundle's checksums; --force replaces a "
                          "bundle only as it was written: remove it yourself if it is yours to lose")