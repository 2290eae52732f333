"""Which of a profile's execution providers run in this onnxruntime build, and what is said when one does not."""
from __future__ import annotations

import warnings

import onnxruntime as ort
from edgespec.targets.profiles import CPU, Provider

from ..contract.errors import InputError


def usable_providers(wanted: tuple[Provider, ...] | tuple[str, ...], role: str = "",
                     strict: bool = False) -> list[tuple[str, dict]]:
    """The wanted providers this onnxruntime build offers, in order, with their options; the CPU is
    always last resort. A wanted provider that is missing is a warning naming what runs instead, or
    with `strict` an error."""
    wanted = tuple(Provider(p) if isinstance(p, str) else p for p in wanted)
    available = set(ort.get_available_providers())
    chosen = [(p.name, dict(p.options)) for p in wanted if p.name in available]
    missing = sorted({p.name for p in wanted if p.name not in available})
    if CPU not in [name for name, _ in chosen]:
        chosen.append((CPU, {}))
    if missing and chosen[0][0] != wanted[0].name:
        fall_back(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not in this onnxruntime build "
                  f"({ort.__version__}); {role or 'the model'} runs on {chosen[0][0]} instead", strict, stacklevel=3)
    return chosen


def provider_label(choice: tuple[str, dict]) -> str:
    """A (provider, options) pair as usable_providers returns it, for people."""
    name, options = choice
    return name + (f" ({', '.join(f'{k}={v}' for k, v in sorted(options.items()))})" if options else "")


def fall_back(message: str, strict: bool, stacklevel: int) -> None:
    """What a profile asked for is not what runs: a warning that says so (`stacklevel` above the caller), or
    with `strict` an error."""
    if strict:
        raise InputError(message + " (--strict)")
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)
