"""edgespec: speculative decoding for language models on the devices people own."""
from importlib.metadata import version as _version

__version__ = _version("edgespec")  # pyproject.toml holds the one number

from edgespec.runtime.contract.errors import EdgespecError
from edgespec.runtime.decoding.constraints import ConstraintSpec
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.pipeline import Pipeline, load

__all__ = ["__version__", "ConstraintSpec", "EdgespecError", "GenerationConfig", "Pipeline", "load"]
