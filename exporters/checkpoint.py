"""A Hugging Face checkpoint read a tensor at a time: the exporter's source of large weights.

transformers builds the model's skeleton (config, rotary tables, generation config) without its weights;
each weight is read from the safetensors file that holds it (a sharded folder through its index) when a
graph builder asks for it, converted to float32 exactly (bf16 and fp16 widen without rounding, as
transformers' own loader does), and let go once written. The files are read, not memory-mapped: a
mapping's pages would stay in the process's resident set until the whole checkpoint had been. Nothing
holds the model in float32, so an export's memory is bounded by the tensors of one layer, whatever the
model's size.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from accelerate import init_empty_weights
from edgespec.runtime.contract.errors import ExportError
from transformers import AutoModelForCausalLM

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def checkpoint_files(folder: Path) -> dict[str, Path] | None:
    """{tensor name: the safetensors file holding it}, from the index of a sharded folder or the one
    file's header; None where the folder has no safetensors checkpoint (a .bin one: transformers loads it)."""
    if (folder / INDEX).is_file():
        try:
            weight_map = json.loads((folder / INDEX).read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not a mapping")
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ExportError(f"cannot read {folder / INDEX}: {type(err).__name__}: {err}") from err
        return {name: folder / shard for name, shard in weight_map.items()}
    if (folder / SINGLE).is_file():
        return {name: folder / SINGLE for name in read_header(folder / SINGLE)}
    return None


# safetensors' dtypes a float checkpoint holds, as stored, and how they widen to float32
DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


@dataclass(frozen=True)
class TensorPlace:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # bytes from the file's start
    nbytes: int


def read_header(path: Path) -> dict[str, TensorPlace]:
    """Where each tensor of a safetensors file lies: an 8-byte little-endian header size, a JSON header of
    {name: {dtype, shape, data_offsets}}, then the data."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > MAX_HEADER:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
        places = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            start, end = entry["data_offsets"]
            places[name] = TensorPlace(path, entry["dtype"], tuple(int(d) for d in entry["shape"]), 8 + size + start,
                                       end - start)
        return places
    except (OSError, ValueError, KeyError, TypeError, struct.error) as err:
        raise ExportError(f"cannot read {path}: {type(err).__name__}: {err} (not a safetensors file, or cut "
                          "short)") from err


MAX_HEADER = 100 << 20


class LazyWeights(Mapping):
    """A model's state as float32 numpy arrays by the model's parameter names, each read from its file when
    asked for (nothing cached); `shapes` names them without reading any. A subclass says how one is read."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self.shapes = shapes
        self.reads = 0  # tensors read so far

    def read(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def __getitem__(self, name: str) -> np.ndarray:
        array = self.read(name)  # KeyError for a name it does not hold
        self.reads += 1
        return array

    def __contains__(self, name) -> bool:  # Mapping's own would read the tensor
        return name in self.shapes

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def size_of(self, name: str) -> int:
        return int(np.prod(self.shapes[name]))


def read_span(path: Path, offset: int, dtype, count: int, what: str) -> np.ndarray:
    """`count` values of `dtype` at `offset` of `path`, read (not mapped); a file cut short or unreadable is
    an ExportError naming `what` and the file."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            raw = np.fromfile(f, dtype=dtype, count=count)
    except OSError as err:
        raise ExportError(f"cannot read {what} from {path}: {err}") from err
    if raw.size != count:
        raise ExportError(f"{path} is cut short: {what} needs {count * np.dtype(dtype).itemsize} bytes there")
    return raw


class CheckpointWeights(LazyWeights):
    """A safetensors checkpoint's tensors. Names are the model's own (`model.layers.0.self_attn.q_proj.weight`);
    a tied head's `lm_head.weight` is not one of them (builders read the embedding table for it)."""

    def __init__(self, places: dict[str, TensorPlace]):
        super().__init__({name: place.shape for name, place in places.items()})
        self.places = places

    def read(self, name: str) -> np.ndarray:
        place = self.places[name]
        raw = read_span(place.file, place.offset, DTYPES[place.dtype], int(np.prod(place.shape)), name)
        if place.dtype == "BF16":  # bf16 is float32's upper half: torch widens it exactly, on every core
            return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16).float().numpy().reshape(place.shape)
        return raw.astype(np.float32, copy=False).reshape(place.shape)


def skeleton(config) -> torch.nn.Module:
    """The model transformers would build for `config`, its parameters without storage (its buffers, the
    rotary tables among them, computed as usual)."""
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def streamed_weights(folder: Path, model: torch.nn.Module, description: str) -> CheckpointWeights | None:
    """The checkpoint in `folder` as CheckpointWeights for `model` (a skeleton), after checking that it holds
    every parameter under the model's own name, shape and a float dtype; None where it cannot be read that
    way (no safetensors, or names transformers renames on loading): transformers then loads the model whole."""
    files = checkpoint_files(folder)
    if files is None:
        return None
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    wanted = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)
              if not (tied and name == "lm_head.weight")}
    if set(wanted) - set(files):
        return None
    headers = {path: read_header(path) for path in {files[name] for name in wanted}}
    places = {}
    for name in wanted:
        if name not in headers[files[name]]:
            raise ExportError(f"cannot load {description}: its index puts {name} in {files[name].name}, which "
                              "does not hold it")
        places[name] = headers[files[name]][name]
    wrong = [f"{name} is {list(places[name].shape)}, the config makes it {list(shape)}"
             for name, shape in wanted.items() if places[name].shape != shape]
    if wrong:
        raise ExportError(f"cannot load {description}: its weights do not fit the model its config describes "
                          f"({'; '.join(wrong[:3])})")
    other = sorted({p.dtype for p in places.values()} - set(DTYPES))
    if other:
        raise ExportError(f"cannot load {description}: its checkpoint holds {', '.join(other)} tensors; edgespec "
                          f"exports float checkpoints ({', '.join(DTYPES)})")
    return CheckpointWeights(places)
