"""A GGUF file read a tensor at a time, each decoded as transformers decodes it.

transformers' GGUF loader dequantizes every tensor of the file into one float32 state (8B parameters: 32 GB)
before the model is built. Here its own pieces do the same a tensor at a time: gguf's `dequantize`, the
architecture's tensor processor (llama.cpp's rotary row order undone for Llama's q/k, Gemma's norms, ...)
and its name map from the file's tensors to the model's parameters. The file is read, not memory-mapped,
for the same reason as exporters/checkpoint.py: a mapping's pages would stay resident.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from edgespec.runtime.contract.errors import ExportError

from .checkpoint import LazyWeights, read_span


class GgufWeights(LazyWeights):
    """The model's state, each tensor decoded from the GGUF file when asked for."""

    def __init__(self, path: Path, processor, places: dict[str, object], key_map: dict[str, str],
                 shapes: dict[str, tuple[int, ...]]):
        super().__init__(shapes)
        self.path, self.processor = path, processor
        self.places, self.key_map = places, key_map  # model name -> the file's tensor; the file's names -> model's

    def read(self, name: str) -> np.ndarray:
        from gguf import dequantize

        tensor = self.places[name]
        raw = read_span(self.path, int(tensor.data_offset), np.uint8, int(tensor.n_bytes), tensor.name)
        data = raw.view(tensor.data.dtype).reshape(tensor.data.shape)
        # only the processors that split tensors across the file read `parsed_parameters`; those load whole
        result = self.processor.process(weights=dequantize(data, tensor.tensor_type), name=tensor.name,
                                        tensor_key_mapping=self.key_map, parsed_parameters={})
        # as transformers' loader: a torch tensor of the decoded values, then the model's float32
        return torch.from_numpy(np.copy(result.weights)).to(torch.float32).numpy().reshape(self.shapes[name])


def gguf_weights(path: Path, model: torch.nn.Module) -> GgufWeights | None:
    """The GGUF file's tensors for `model` (a skeleton), by the model's parameter names; None where some
    parameter has no tensor a processor maps to it without looking at others (transformers then loads the
    whole model, as before)."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        Gemma2TensorProcessor,
        LlamaTensorProcessor,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    reader = gguf.GGUFReader(str(path))
    # the processor transformers' loader picks, by the file's own architecture name
    architecture = str(bytes(reader.fields["general.architecture"].parts[-1]), encoding="utf-8")
    processor_class = TENSOR_PROCESSORS.get(architecture, TensorProcessor)
    if processor_class not in (TensorProcessor, LlamaTensorProcessor, Gemma2TensorProcessor):
        return None  # a processor that renames or splits tensors across the file (MoE): the whole load
    processor = processor_class(config=model.config.to_dict())  # the head counts its row order needs
    key_map = get_gguf_hf_weights_map(model, processor)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    wanted = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)
              if not (tied and name == "lm_head.weight")}
    places = {key_map[t.name]: t for t in reader.tensors if key_map.get(t.name) in wanted}
    if set(wanted) - set(places):
        return None
    wrong = [f"{name} has {int(np.prod(wanted[name]))} values, the config makes it {list(wanted[name])}"
             for name, t in places.items() if int(t.n_elements) != int(np.prod(wanted[name]))]
    if wrong:
        raise ExportError(f"GGUF file {path}: its tensors do not fit the model its metadata describes "
                          f"({'; '.join(wrong[:3])})")
    return GgufWeights(Path(path), processor, places, key_map, wanted)
