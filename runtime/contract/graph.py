"""What a bundle's graphs promise the runtime beyond their inputs' names: the names of the feature tensors
a feature-reading draft exchanges with its target, the metadata keys the exporter writes, and the rows
every pass must hold."""

FEATURES = "features"  # the draft graph's input, in the manifest's graph specs
FEATURES_OUT = "features_out"  # the output of a graph that returns its final hidden states

# onnxruntime's CPU matmuls (MLAS sgemm, and MatMulNBits at every accuracy level) take a separate
# single-row (GEMV) path whose rounding differs from the multi-row kernel (measured: up to ~8e-5 in
# SmolLM2's fp32 logits, more in int4). Every matmul therefore sees at least two rows — a one-token
# step gets one masked padding row, a one-row logits request a duplicate row for the head — so a
# token's logits are the same bits alone, in a prefill chunk or inside a verified tree.
# A draft's passes need no such care: their rows need not match anything, and one row is the fastest.
# A graph whose matmuls all accumulate in integers (quant/integer.py) has the same bits at one row; the
# exporter records that in the graph's metadata under EXACT_ROWS_KEY. (Its attention still takes two
# slots: pass_feed.) Which kernels a CPU takes differs by instruction set: where the device's one-row
# kernels round as its multi-row ones, runtime/decoding/exactness.py's check proves it and the runner's
# `min_rows` drops to 1 for plain and speculative decoding alike (history.md §49).
MIN_ROWS = 2
EXACT_ROWS_KEY = "edgespec.exact_min_rows"
# a graph whose attention is written in standard operators (a static draft for an NPU) masks nothing by
# itself: its passes' attention bias carries the causal mask and hides the buffer's unwritten columns
ATTENTION_KEY = "edgespec.attention"
STANDARD_ATTENTION = "standard"
ATTENTION_BIAS = "attention_bias"

# Rows a pass may write past `capacity`: a one-token step's padding row (the runner, MIN_ROWS).
KV_SLACK = 2
