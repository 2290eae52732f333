"""A distilled draft in the form the project ships: only what training changed, in float16.

A draft folder from `edgespec distill` repeats the target's embedding table (most of its bytes); the
packed form keeps the trained layers and norm, the head tokens and how the draft was made, and is
turned back into a Hugging Face folder against the same target by `unpack_draft`.

    draft.json          design, head tokens, the training report, provenance (command, data, seed)
    weights.safetensors the trained tensors in float16
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from edgespec.distill.draft_model import build_draft
from edgespec.distill.train import draft_state, write_draft
from edgespec.runtime.contract.errors import ExportError
from safetensors.torch import load_file, save_file

PACKED_INFO = "draft.json"
PACKED_WEIGHTS = "weights.safetensors"


def pack_draft(draft_folder: Path, out: Path, provenance: dict) -> Path:
    info, state = draft_state(draft_folder)
    shared = ("model.embed_tokens.weight", "lm_head.weight")
    trained = {k: v.to(torch.float16).contiguous() for k, v in state.items() if k not in shared}
    out.mkdir(parents=True, exist_ok=True)
    save_file(trained, out / PACKED_WEIGHTS)
    (out / PACKED_INFO).write_text(json.dumps({"design": info["training"]["design"], "head_tokens": info["head_tokens"],
                                               "training": info["training"], "provenance": provenance}, indent=1))
    return out


def unpack_draft(packed: Path, target, tokenizer, out: Path) -> Path:
    """Rebuilds the draft folder: the target's shared tensors plus the packed trained ones."""

    info = json.loads((packed / PACKED_INFO).read_text())
    draft, trainable = build_draft(target, info["design"])
    trained = load_file(packed / PACKED_WEIGHTS)
    if set(trained) != set(trainable):
        raise ExportError(f"{packed} does not fit this target: its tensors differ from the {info['design']} design's")
    try:
        draft.load_state_dict({k: v.float() for k, v in trained.items()}, strict=False)
    except RuntimeError as err:
        raise ExportError(f"{packed} does not fit this target: {err}") from err
    write_draft(draft, tokenizer, np.array(info["head_tokens"]), info["training"], out)
    return out


def main(argv=None) -> None:
    """python -m edgespec.distill.pack RUN_DIR OUT --command "edgespec distill ..." [--note TEXT]"""

    parser = argparse.ArgumentParser(prog="python -m edgespec.distill.pack", description=main.__doc__)
    parser.add_argument("run", type=Path, help="a finished `edgespec distill` folder")
    parser.add_argument("out", type=Path)
    parser.add_argument("--command", required=True, help="the exact command(s) that produced the run")
    parser.add_argument("--note", default="", help="data, seed, machine: whatever a reader needs to redo it")
    args = parser.parse_args(argv)
    state = json.loads((args.run / "state.json").read_text())
    if not state.get("finished"):
        raise SystemExit(f"{args.run} is not a finished distill run")
    pack_draft(args.run, args.out, {"command": args.command, "settings": state["settings"],
                                    "seconds_by_phase": {k: round(v) for k, v in state["used_s"].items()},
                                    "note": args.note})


if __name__ == "__main__":
    main()
