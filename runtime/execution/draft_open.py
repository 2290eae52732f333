"""The draft's runner as a pipeline opens it from the bundle: a draft model's graph (a model or a text
draft), or Medusa heads' graph."""
from __future__ import annotations

from pathlib import Path

from ..contract.drafting import DrafterKind
from ..contract.errors import BundleError
from ..contract.manifest import Manifest, read_head_tokens
from .medusa_heads import MedusaHeads
from .model import ModelRunner
from .sessions import make_session


def open_draft(m: Manifest, folder: Path, placed: tuple[tuple, int], profiled: tuple[tuple, int], spin: bool,
               strict: bool, shared_arena: bool) -> ModelRunner | MedusaHeads | None:
    """None for a training-free drafter. `placed`: (providers, threads) where placement put the draft model;
    `profiled`: the profile's, which Medusa heads run on. `shared_arena`: under a budget the draft's passes
    and the target's take turns in one arena (sessions.py): the plan counts one scratch."""
    if m.drafter.has_model:
        if m.draft is None:
            raise BundleError("the manifest names a draft model but no draft graph")
        return ModelRunner(make_session(folder / m.draft.graph.file, *placed, spin=spin, role="the draft",
                                        strict=strict, shared_arena=shared_arena),
                           m.draft.facts, read_head_tokens(folder, m.draft))
    if m.drafter is DrafterKind.MEDUSA:
        if m.draft is None:
            raise BundleError("the manifest names Medusa heads but no heads graph")
        return MedusaHeads(make_session(folder / m.draft.graph.file, *profiled, role="the Medusa heads",
                                        strict=strict))
    return None
