"""Run by tests/test_openvino.py with the interpreter of an environment holding onnxruntime-openvino
(which replaces the `onnxruntime` module, so it cannot share the test environment): calibrates a bundle's
placement there, then decodes with every placement measured and compares with plain decoding; and says
which provider ran each node of every draft graph the bundle holds (onnxruntime's profile of one pass).
Prints one JSON object. Imports only the runtime (no torch, no pytest)."""
import json
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import onnxruntime as ort
from edgespec.runtime.contract.manifest import open_bundle, read_head_tokens
from edgespec.runtime.decoding.engine import GenerationConfig
from edgespec.runtime.execution.model import ModelRunner
from edgespec.runtime.pipeline import Pipeline

from edgespec.calibrate import calibrate

PROMPTS = ["def add(a, b):", "The quick brown fox", "{\"name\": \"edge"]


def main(folder: str) -> None:
    config = GenerationConfig(max_new_tokens=24, stop_at_eos=False)
    calibration = calibrate(folder, [{"prompt": p} for p in PROMPTS], cores=2, max_new_tokens=12)
    plain = Pipeline(folder, threads=2)
    expected = [plain.generate(p, config=config, speculate=False).token_ids for p in PROMPTS]
    runs = []
    for measured in calibration.measured:
        pipeline = Pipeline(folder, placement=measured.placement)
        results = [pipeline.generate(p, config=config) for p in PROMPTS]
        runs.append({"placement": measured.placement.to_dict(), "predicted": measured.tokens_per_s,
                     "draft_providers": pipeline.draft.session.get_providers(),
                     "identical": [r.token_ids for r in results] == expected,
                     "accepted": sum(r.stats.accepted_drafts for r in results),
                     "drafted_ahead": sum(r.stats.drafted_ahead for r in results)})
    with warnings.catch_warnings(record=True) as caught:  # its NPU (then GPU) is not on this machine
        warnings.simplefilter("always")
        npu = Pipeline(folder, threads=2, profile="ai-pc-intel")
    fallback = {"draft_providers": npu.draft.session.get_providers(), "warnings": [str(w.message) for w in caught],
                "identical": npu.generate(PROMPTS[0], config=config).token_ids == expected[0],
                "measured": [m.placement.to_dict() for m in calibrate(folder, [{"prompt": p} for p in PROMPTS], cores=2,
                                                                       max_new_tokens=12, profile="ai-pc-intel").measured]}
    manifest = open_bundle(folder)
    drafts = {name: manifest.for_profile(name).draft for name in manifest.profile_names}
    placed = {entry.graph.file: node_providers(Path(folder), entry) for entry in drafts.values() if entry is not None}
    print(json.dumps({"onnxruntime": ort.__version__, "providers": ort.get_available_providers(),
                      "chosen": calibration.chosen.placement.to_dict(), "runs": runs, "draft_nodes": placed,
                      "ai_pc_intel": fallback}))


def node_providers(folder: Path, entry) -> dict[str, int]:
    """How many of a draft graph's kernels each provider ran in one draft pass (onnxruntime's profile)."""
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "profile")
    session = ort.InferenceSession(str(folder / entry.graph.file), options, providers=["OpenVINOExecutionProvider", "CPUExecutionProvider"],
                                   provider_options=[{"device_type": "CPU"}, {}])
    runner = ModelRunner(session, entry.facts, read_head_tokens(folder, entry))
    features = np.zeros((1, entry.facts.hidden_size), np.float32) if runner.reads_features else None
    runner.forward(runner.new_cache(64), [5], [0], np.ones((1, 1), bool), [0], features=features, exact_rows=False)
    events = json.loads(Path(session.end_profiling()).read_text())
    return dict(Counter(e["args"]["provider"] for e in events
                        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")))


if __name__ == "__main__":
    main(sys.argv[1])
