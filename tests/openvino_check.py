"""Run by tests/test_openvino.py with the interpreter of an environment holding onnxruntime-openvino
(which replaces the `onnxruntime` module, so it cannot share the test environment): calibrates a bundle's
placement there, then decodes with every placement measured and compares with plain decoding. Prints
one JSON object. Imports only the runtime (no torch, no pytest)."""
import json
import sys

import onnxruntime as ort

from edgespec.calibrate import calibrate
from edgespec.runtime.engine import GenerationConfig
from edgespec.runtime.pipeline import Pipeline

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
    print(json.dumps({"onnxruntime": ort.__version__, "providers": ort.get_available_providers(),
                      "chosen": calibration.chosen.placement.to_dict(), "runs": runs}))


if __name__ == "__main__":
    main(sys.argv[1])
