"""edgespec: speculative decoding for language models on the devices people own."""
from importlib.metadata import version as _version

__version__ = _version("edgespec")  # pyproject.toml holds the one number

from edgespec.runtime.constraints import ConstraintSpec  # noqa: E402
from edgespec.runtime.engine import GenerationConfig  # noqa: E402
from edgespec.runtime.errors import EdgespecError  # noqa: E402
from edgespec.runtime.pipeline import Pipeline, load  # noqa: E402

__all__ = ["__version__", "ConstraintSpec", "EdgespecError", "GenerationConfig", "Pipeline", "load"]
