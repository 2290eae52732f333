"""The bundle's manifest, one typed contract: the exporter builds a `Manifest` and writes its `to_dict`,
`tune` replaces its tree and writes it again, the runtime reads it with `from_dict`. It is the only
description of the graphs the runtime trusts: every file's sha256 is checked before a byte of it is
used; an unknown schema version is refused.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from edgespec.targets.profiles import DeviceProfile, get_profile

from .coreml_package import CoreMLPackage, package_files
from .drafting import LEGACY_NGRAM, DrafterKind, DynamicTreeConfig, LookupConfig, NgramConfig, SuffixConfig
from .errors import BundleError, InputError
from .facts import ModelFacts
from .graph import FEATURES_OUT
from .tokenizer import TokenizerSpec
from .topology import Topology

SCHEMA_VERSION = 3  # 3: GroupQueryAttention over per-layer KV buffers bound as past and present (lanes)
MANIFEST = "manifest.json"
MAX_PREFILL_CHUNK = 1 << 16  # tokens per prefill pass a manifest may ask for


@dataclass(frozen=True)
class GraphSpec:
    file: str
    weights: tuple[str, ...]
    inputs: dict
    outputs: dict
    quantization: dict
    # an embedding stage's table when stored as plain floats: {file, offset, shape, dtype}
    embedding_table: dict | None = None
    # every weight of a float32 graph in its one weights file: ({name, offset, shape, dtype}, ...), so a
    # runtime can map the file and hand the session the weights in place
    tensors: tuple[dict, ...] | None = None
    layers: tuple[int, int] | None = None  # a stage's layers [start, stop)

    @property
    def static(self) -> bool:
        """Whether every input has fixed sizes (a static-shape profile's graph)."""
        return all(isinstance(d, int) for spec in self.inputs.values() for d in spec.get("shape", ["?"]))

    @classmethod
    def from_dict(cls, data: dict) -> "GraphSpec":
        if not isinstance(data, dict) or not isinstance(data.get("file"), str) or not isinstance(data.get("inputs"), dict) \
                or not isinstance(data.get("outputs"), dict) \
                or not all(isinstance(w, str) for w in data.get("weights", ())):
            raise InputError(f"a graph entry needs a file name, weight file names, inputs and outputs (got "
                             f"{sorted(data) if isinstance(data, dict) else repr(data)[:40]})")
        return cls(file=data["file"], weights=tuple(data.get("weights", ())), inputs=data["inputs"],
                   outputs=data["outputs"], quantization=data.get("quantization", {"scheme": "fp32"}),
                   embedding_table=data.get("embedding_table"),
                   tensors=tuple(data["tensors"]) if data.get("tensors") else None,
                   layers=tuple(data["layers"]) if data.get("layers") is not None else None)

    def to_dict(self) -> dict:
        return {"file": self.file, "weights": list(self.weights), "inputs": self.inputs, "outputs": self.outputs,
                "quantization": self.quantization,
                **({"layers": list(self.layers)} if self.layers is not None else {}),
                **({"tensors": list(self.tensors)} if self.tensors else {}),
                **({"embedding_table": self.embedding_table} if self.embedding_table is not None else {})}


@dataclass(frozen=True)
class ModelEntry:
    """The target, or a draft model."""

    facts: ModelFacts
    graph: GraphSpec
    source: str
    head_tokens: str | None = None  # a draft's trimmed head: JSON file of the vocabulary ids its logits cover
    stages: tuple[GraphSpec, ...] = ()  # the same model as stages run in order (embedding, layer groups, head)
    # the target again as a slots graph (exporters/slots.py): several conversations per pass, each with its bits
    slots: GraphSpec | None = None
    tokenizer: TokenizerSpec | None = None  # a draft's own tokenizer, when it drafts through text (kind "text")

    @property
    def lanes(self) -> int:
        """Root-to-leaf paths a pass of this model's graph attends in: its KV buffers hold lanes x kv heads."""
        graphs = (self.graph, *self.stages)
        shapes = [spec["shape"] for g in graphs for name, spec in g.inputs.items() if name.startswith("past_key_")]
        if not shapes or not isinstance(shapes[0][1], int) or shapes[0][1] % self.facts.num_kv_heads:
            raise BundleError("the manifest's graph has no KV buffers of lanes x kv heads: re-export the bundle")
        return shapes[0][1] // self.facts.num_kv_heads

    @property
    def feature_size(self) -> int:
        """Width of the feature row the model's cache keeps: its hidden size when its graph returns features."""
        return self.facts.hidden_size if FEATURES_OUT in self.graph.outputs else 0

    @classmethod
    def from_dict(cls, data: dict, kv: bool = True) -> "ModelEntry":
        entry = cls(facts=ModelFacts.from_dict(data["facts"]), graph=GraphSpec.from_dict(data["graph"]),
                    source=data.get("source", ""), head_tokens=data.get("head_tokens"),
                    stages=tuple(GraphSpec.from_dict(s) for s in data.get("stages", ())),
                    slots=GraphSpec.from_dict(data["slots"]) if data.get("slots") is not None else None,
                    tokenizer=TokenizerSpec.from_dict(data["tokenizer"]) if data.get("tokenizer") is not None else None)
        entry.check_graphs(kv)
        return entry

    def check_graphs(self, kv: bool = True) -> None:
        """The model facts agree with the graphs' own inputs and outputs (checked before anything is sized
        from them): a KV buffer per layer of [1, lanes x kv heads, rows, head dim] (none where not `kv`: Medusa
        heads), logits as wide as the vocabulary (or the trimmed head)."""
        f = self.facts
        layers = [int(name.removeprefix("past_key_")) for name in self.graph.inputs if name.startswith("past_key_")]
        if sorted(layers) != (list(range(f.num_layers)) if kv else []):
            raise InputError(f"the graph has KV inputs for layers {sorted(layers)[:8]}... but the facts say "
                             f"{f.num_layers} layers")
        for graph in (self.graph, *self.stages):
            for name, spec in graph.inputs.items():
                shape = spec.get("shape") if isinstance(spec, dict) else None
                if not isinstance(shape, list):
                    raise InputError(f"{graph.file}: input {name} has no shape")
                if name.startswith(("past_key_", "past_value_")) and (
                        len(shape) != 4 or not isinstance(shape[1], int) or shape[1] % f.num_kv_heads
                        or shape[3] != f.head_dim):
                    raise InputError(f"{graph.file}: {name} {shape} is not [1, lanes x {f.num_kv_heads} kv heads, "
                                     f"rows, {f.head_dim}]")
        logits = self.graph.outputs.get("logits")
        shape = logits.get("shape") if isinstance(logits, dict) else None
        if not isinstance(shape, list) or not shape:
            raise ValueError(f"{self.graph.file}: the logits output has no shape")
        width = shape[-1]
        if self.head_tokens is not None and not isinstance(self.head_tokens, str):
            raise ValueError(f"head_tokens must name a file (got {self.head_tokens!r})")
        if self.head_tokens is None and isinstance(width, int) and width != f.vocab_size:
            raise InputError(f"{self.graph.file}: logits are {width} wide but the vocabulary has {f.vocab_size} tokens")

    def to_dict(self) -> dict:
        return {"facts": self.facts.to_dict(), "source": self.source, "graph": self.graph.to_dict(),
                **({"stages": [stage.to_dict() for stage in self.stages]} if self.stages else {}),
                **({"slots": self.slots.to_dict()} if self.slots is not None else {}),
                **({"head_tokens": self.head_tokens} if self.head_tokens is not None else {}),
                **({"tokenizer": self.tokenizer.to_dict()} if self.tokenizer is not None else {})}


@dataclass(frozen=True)
class ProfileGraphs:
    """Another device profile the bundle was exported for, with its own graphs where its shapes differ from the
    main ones (static beside dynamic, or the reverse); without them it runs the main graphs."""

    profile: DeviceProfile
    target: GraphSpec | None = None
    draft: GraphSpec | None = None
    exactness: dict | None = None  # the exactness check of its own target graph at export

    def to_dict(self) -> dict:
        return {"profile": self.profile.to_dict(),
                **({"target": self.target.to_dict()} if self.target is not None else {}),
                **({"draft": self.draft.to_dict()} if self.draft is not None else {}),
                **({"exactness": self.exactness} if self.exactness is not None else {})}

    @classmethod
    def from_dict(cls, data: dict) -> "ProfileGraphs":
        graph = lambda key: GraphSpec.from_dict(data[key]) if data.get(key) is not None else None  # noqa: E731
        return cls(DeviceProfile.from_dict(data["profile"]), graph("target"), graph("draft"),
                   data.get("exactness") if isinstance(data.get("exactness"), dict) else None)


@dataclass(frozen=True)
class Manifest:
    target: ModelEntry
    draft: ModelEntry | None  # None: a training-free drafter
    drafter: DrafterKind
    tree: Topology
    dynamic: DynamicTreeConfig | None  # set: a draft model grows each step's tree within a node budget
    lookup: LookupConfig | None  # set: a prompt-lookup chain is grafted onto the draft model's tree
    ngram: NgramConfig | None  # an n-gram drafter's settings; None: no n-gram drafter
    prefill_chunk: int
    tokenizer: TokenizerSpec
    profile: DeviceProfile
    files: dict[str, str]  # file name -> sha256, every file of the bundle but the manifest
    edgespec_version: str = ""
    created: str = ""  # UTC, ISO 8601
    quality: dict | None = None  # quality.json's figures, as measured at export
    # the exactness check at export: {"machine": runtime/device.machine_key(), "exact": bool, "onnxruntime": version,
    # "rows", "differ", "min_rows": the rows a one-token step runs on that machine (runtime/decoding/exactness.py)}
    exactness: dict | None = None
    coreml: tuple[CoreMLPackage, ...] = ()  # CoreML packages beside the ONNX graphs (runtime/execution/coreml.py)
    # `export --profile A --profile B ...`: the profiles after the first (`profile`, whose graphs are `target`'s
    # and `draft`'s), each with its own graphs where it needs other shapes
    other_profiles: tuple[ProfileGraphs, ...] = ()
    # set: suffix drafting beside the drafter, and each step's tree chosen by the step controller (runtime/decoding/controller.py)
    suffix: SuffixConfig | None = None

    @property
    def profile_names(self) -> tuple[str, ...]:
        return (self.profile.name, *(p.profile.name for p in self.other_profiles))

    def for_profile(self, name: str) -> "Manifest":
        """The manifest as the runtime reads it for device profile `name`: that profile's providers, graphs
        and exactness verdict. A profile the bundle was not exported for runs the main graphs
        where their shapes suit it (a dynamic profile on dynamic graphs); else the error says how to export."""
        if name == self.profile.name:
            return self
        found = next((p for p in self.other_profiles if p.profile.name == name), None)
        if found is None:
            try:
                profile = get_profile(name)
            except ValueError as err:
                raise InputError(str(err)) from None
            for role, entry in (("verify", self.target), ("draft", self.draft)):
                if entry is not None and profile.static_for(role) != entry.graph.static:
                    shapes = "static" if profile.static_for(role) else "dynamic"
                    raise InputError(f"this bundle was exported for {', '.join(self.profile_names)} and has no "
                                     f"{shapes}-shape {'target' if role == 'verify' else 'draft'} graph for the {name} "
                                     f"profile: export it with --profile {name}")
            found = ProfileGraphs(profile)

        def swap(entry: ModelEntry | None, graph: GraphSpec | None) -> ModelEntry | None:
            return entry if entry is None or graph is None else replace(entry, graph=graph, stages=())

        return replace(self, profile=found.profile, target=swap(self.target, found.target),
                       draft=swap(self.draft, found.draft),
                       exactness=found.exactness if found.target is not None else self.exactness, other_profiles=())

    @classmethod
    def from_dict(cls, data: dict) -> "Manifest":
        version = data.get("schema_version")
        if isinstance(version, int) and version < SCHEMA_VERSION:
            raise BundleError(f"this bundle has schema version {version}, written by an older edgespec; this one "
                              f"reads version {SCHEMA_VERSION} (graphs on onnxruntime's fused attention, with the "
                              "KV cache bound in place): export it again with `edgespec export`")
        if version != SCHEMA_VERSION:
            raise BundleError(f"unknown bundle schema version {version!r}: this edgespec reads version "
                              f"{SCHEMA_VERSION}; re-export the bundle or upgrade edgespec")
        try:
            draft = data.get("draft")
            drafter = _drafter_kind(draft)
            if data["tree"].get("lookup") and drafter is not DrafterKind.MODEL:
                raise BundleError("the manifest adds prompt lookup to a training-free drafter: it is for a draft model")
            if drafter is DrafterKind.SUFFIX and not data["tree"].get("suffix"):
                raise BundleError("the manifest names the suffix drafter but gives no tree.suffix settings")
            if data["tree"].get("suffix") and data["tree"].get("lookup"):
                raise BundleError("the manifest gives both prompt lookup and suffix drafting: suffix drafting replaces it")
            if drafter is DrafterKind.TEXT and (not draft.get("tokenizer") or data["tree"].get("dynamic")):
                raise BundleError("the manifest's text draft needs its own tokenizer and drafts a chain, not a dynamic tree")
            if drafter is not DrafterKind.TEXT and draft and draft.get("tokenizer"):
                raise BundleError(f"the manifest gives the {drafter.value!r} drafter a tokenizer of its own: only a "
                                  "text draft has one")
            if data["tree"].get("ngram") and not drafter.looks_up_ngrams:
                raise BundleError(f"the manifest gives n-gram settings to the {drafter.value!r} drafter, which has no "
                                  "n-grams")
            manifest = cls(
                target=ModelEntry.from_dict(data["target"]),
                draft=ModelEntry.from_dict(draft, kv=drafter is not DrafterKind.MEDUSA) if draft and draft.get("graph")
                else None,
                drafter=drafter,
                tree=Topology(tuple(data["tree"]["parents"])),
                dynamic=DynamicTreeConfig(**data["tree"]["dynamic"]) if data["tree"].get("dynamic") else None,
                lookup=LookupConfig(**data["tree"]["lookup"]) if data["tree"].get("lookup") else None,
                ngram=_ngram_config(drafter, data["tree"].get("ngram")),
                prefill_chunk=_prefill_chunk(data["steps"]["prefill_chunk"]),
                tokenizer=TokenizerSpec.from_dict(data["tokenizer"]),
                profile=DeviceProfile.from_dict(data["profile"]),
                files=_files(data["files"]),
                edgespec_version=str(data.get("edgespec_version", "")),
                created=str(data.get("created", "")),
                quality=data.get("quality"),
                exactness=data.get("exactness") if isinstance(data.get("exactness"), dict) else None,
                coreml=tuple(CoreMLPackage.from_dict(p) for p in data.get("coreml", {}).get("packages", ())),
                other_profiles=_other_profiles(data.get("other_profiles", [])),
                suffix=SuffixConfig(**data["tree"]["suffix"]) if data["tree"].get("suffix") else None,
            )
            for other in manifest.other_profiles:  # their graphs agree with the models' facts too
                view = manifest.for_profile(other.profile.name)
                for entry, kv in ((view.target, True), (view.draft, drafter is not DrafterKind.MEDUSA)):
                    if entry is not None:
                        entry.check_graphs(kv)
            return manifest
        except (KeyError, TypeError, ValueError, AttributeError, LookupError, ArithmeticError) as err:
            raise BundleError(f"the manifest is malformed ({type(err).__name__}: {err}): re-export the bundle") from err

    def to_dict(self) -> dict:
        tree = {**self.tree.to_dict(),
                **({"dynamic": self.dynamic.to_dict()} if self.dynamic is not None else {}),
                **({"lookup": self.lookup.to_dict()} if self.lookup is not None else {}),
                **({"ngram": self.ngram.to_dict()} if self.ngram is not None else {}),
                **({"suffix": self.suffix.to_dict()} if self.suffix is not None else {})}
        draft = {"kind": self.drafter.value, **(self.draft.to_dict() if self.draft is not None else {})}
        return {"schema_version": SCHEMA_VERSION, "edgespec_version": self.edgespec_version, "created": self.created,
                "profile": self.profile.to_dict(), "tree": tree, "steps": {"prefill_chunk": self.prefill_chunk},
                "tokenizer": self.tokenizer.to_dict(), "target": self.target.to_dict(), "draft": draft,
                **({"quality": self.quality} if self.quality is not None else {}),
                **({"exactness": self.exactness} if self.exactness is not None else {}),
                **({"coreml": {"packages": [p.to_dict() for p in self.coreml]}} if self.coreml else {}),
                **({"other_profiles": [p.to_dict() for p in self.other_profiles]} if self.other_profiles else {}),
                "files": dict(self.files)}


def _other_profiles(data) -> tuple[ProfileGraphs, ...]:
    if not isinstance(data, list):
        raise ValueError("other_profiles must be a list")
    found = tuple(ProfileGraphs.from_dict(p) for p in data)
    names = [p.profile.name for p in found]
    if len(set(names)) != len(names):
        raise ValueError(f"other_profiles names a profile twice ({', '.join(names)})")
    return found


def _files(files) -> dict[str, str]:
    if not isinstance(files, dict) or not all(
            isinstance(name, str) and isinstance(digest, str) and re.fullmatch("[0-9a-f]{64}", digest)
            for name, digest in files.items()):
        raise ValueError("files must map each file name to its sha256 (64 lowercase hex digits)")
    return dict(files)


def _prefill_chunk(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 2 <= value <= MAX_PREFILL_CHUNK:
        raise ValueError(f"steps.prefill_chunk = {value!r}: expected an integer from 2 to {MAX_PREFILL_CHUNK}")
    return value


def _drafter_kind(draft: dict | None) -> DrafterKind:
    try:
        return DrafterKind.named(draft["kind"]) if draft else DrafterKind.NGRAM
    except ValueError as err:
        raise BundleError(f"the manifest names an {err}") from err


def _ngram_config(drafter: DrafterKind, settings: dict | None) -> NgramConfig | None:
    if not drafter.looks_up_ngrams:
        return None
    return LEGACY_NGRAM if settings is None else NgramConfig(**settings)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(folder: Path) -> Manifest:
    folder = Path(folder)
    if not folder.is_dir():
        raise BundleError(f"no bundle at {folder}: expected a folder holding {MANIFEST}")
    path = folder / MANIFEST
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BundleError(f"{folder} is not a bundle: it has no {MANIFEST}") from None
    except (OSError, ValueError, RecursionError) as err:
        # ValueError covers bad JSON, bad UTF-8 and an integer past Python's digit limit; RecursionError
        # is JSON nested deeper than the decoder's stack.
        raise BundleError(f"cannot read {path}: {_reason(err)}") from None
    if not isinstance(data, dict):
        raise BundleError(f"{path} does not hold a JSON object")
    return Manifest.from_dict(data)


def _reason(err: BaseException) -> str:
    """An error's message on one line and of bounded length (a decoder's message may quote the input)."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def used_files(manifest: Manifest) -> list[str]:
    """Every file the runtime will read."""
    names = [manifest.tokenizer.file] + ([manifest.tokenizer.chat_template] if manifest.tokenizer.chat_template else [])
    for entry in (manifest.target, manifest.draft):
        if entry is not None:
            names += [entry.graph.file, *entry.graph.weights] + ([entry.head_tokens] if entry.head_tokens else [])
            names += [name for stage in entry.stages for name in (stage.file, *stage.weights)]
            names += [entry.slots.file, *entry.slots.weights] if entry.slots is not None else []
            names += [entry.tokenizer.file] if entry.tokenizer is not None else []
    for other in manifest.other_profiles:
        names += [name for graph in (other.target, other.draft) if graph is not None
                  for name in (graph.file, *graph.weights)]
    return names


def read_head_tokens(folder: Path, entry: ModelEntry) -> np.ndarray | None:
    """A trimmed head's vocabulary ids, checked against the graph's logits width and the vocabulary."""
    if entry.head_tokens is None:
        return None
    try:
        ids = np.array(json.loads((Path(folder) / entry.head_tokens).read_text(encoding="utf-8")), dtype=np.int64)
    except (OSError, ValueError, TypeError, RecursionError, OverflowError) as err:
        raise BundleError(f"cannot read the draft's head tokens {entry.head_tokens}: {_reason(err)}") from None
    width = entry.graph.outputs.get("logits", {}).get("shape", [None])[-1]
    if ids.ndim != 1 or len(ids) < 2 or ids.min() < 0 or ids.max() >= entry.facts.vocab_size \
            or len(np.unique(ids)) != len(ids) or (isinstance(width, int) and width != len(ids)):
        raise BundleError(f"{entry.head_tokens} does not describe the draft graph's head "
                          f"({len(ids)} ids for logits of width {width}, vocabulary {entry.facts.vocab_size})")
    return ids


def bundle_files(folder: Path) -> list[str]:
    """Every file under `folder` (CoreML packages are folders), as the manifest names them: relative, with /."""
    root = Path(folder)
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def verify_files(folder: Path, manifest: Manifest) -> None:
    """Checks that every file the runtime uses has a recorded sha256, is present, and matches it."""
    unchecked = [name for name in used_files(manifest) if name not in manifest.files]
    for package in manifest.coreml:  # a package is a folder: each of its files must be listed
        unchecked += [name for name in package_files(folder, package) if name not in manifest.files]
        if not any(name.startswith(package.file + "/") for name in manifest.files):
            unchecked.append(package.file)
    if unchecked:
        raise BundleError(f"the manifest gives no checksum for {', '.join(unchecked)}: refusing to load it")
    for name, expected in manifest.files.items():
        path = Path(folder) / name
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise BundleError(f"the manifest names a file outside the bundle: {name}")
        if not path.is_file():
            raise BundleError(f"the bundle is incomplete: {name} is missing")
        actual = sha256_file(path)
        if actual != expected:
            raise BundleError(f"checksum mismatch for {name}: the file is corrupted or was modified "
                              f"(expected sha256 {expected[:12]}..., found {actual[:12]}...)")


def write_manifest(folder: Path, manifest: Manifest) -> None:
    """Writes the manifest into `folder`, atomically: a reader sees the old one or the new one."""
    path = Path(folder) / MANIFEST
    data = manifest.to_dict()
    Manifest.from_dict(data)  # what the reader would refuse is never written
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(data, indent=2), encoding="utf-8")
    partial.replace(path)


def open_bundle(folder, profile: str | None = None) -> Manifest:
    """Reads and verifies a bundle, as read for device `profile` (Manifest.for_profile; None: the profile
    it was exported for first); nothing is loaded before this returns."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    verify_files(folder, manifest)
    return manifest if profile is None else manifest.for_profile(profile)
