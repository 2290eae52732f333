#!/bin/bash
# The sizes table (benchmarks/measure/sizes.py) on a lent device machine's 16 CPU cores (issue 54, history.md
# §78), run from the repository root there in one call that carries the wheels its python lacks and the bodies'
# tokenizer (its python has torch, transformers and onnx, but onnxruntime 1.30 and no way to the package index):
#   here:  echo /.whl/ >> .git/info/exclude; echo /.devtok/ >> .git/info/exclude
#          pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#              --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 -d .whl \
#              onnxruntime==1.32.0 onnxruntime-genai==0.18.0 llguidance==1.9.1 gguf==0.19.0
#          mkdir .devtok; cp BODY/tokenizer.json BODY/tokenizer_config.json BODY/chat_template.jinja .devtok/   (any body sizes.py made here)
#   call (carry .whl .devtok):  bash benchmarks/measure/device_sizes.sh 2>&1 | tee $OUT/log.txt
# Each stage is skipped where it would end past DEAD seconds.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
T0=$(date +%s); DEAD=${DEAD:-560}; W=/tmp/sizes; SIZES="python3 benchmarks/measure/sizes.py"
left() { echo $(( DEAD - ($(date +%s) - T0) )); }
stamp() { echo "=== $(( $(date +%s) - T0 )) s: $* (load $(cut -d' ' -f1-3 /proc/loadavg))"; }

mkdir -p /tmp/site $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > /tmp/pip.log 2>&1 || { tail -20 /tmp/pip.log; exit 3; }
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-compile . >> /tmp/pip.log 2>&1 || { tail -20 /tmp/pip.log; exit 4; }
echo "nproc $(nproc)"; lscpu | grep -i "model name"; free -g | head -2
(cd /tmp && python3 -c "import onnxruntime, torch, transformers; print('onnxruntime', onnxruntime.__version__,
'torch', torch.__version__, 'transformers', transformers.__version__)")

stamp "1B: edgespec export (int4) and genai's builder (int4)"
$SIZES export --size 1b --work $W --genai --tokenizer .devtok 2>&1 | grep -v "it/s\]\|part/s\]\|s/part\]\|quantiz"
stamp "1B: plain greedy decoding, alternating in one process"
$SIZES decode --size 1b --work $W --rounds 3 --max-new-tokens 64 2>&1 | grep "round\|median"
if [ "$(left)" -gt 300 ]; then
  stamp "3B: edgespec export (int4) and genai's builder (int4)"
  $SIZES export --size 3b --work $W --genai --tokenizer .devtok 2>&1 | grep -v "it/s\]\|part/s\]\|s/part\]\|quantiz"
fi
if [ "$(left)" -gt 60 ]; then
  stamp "3B: plain greedy decoding, alternating in one process"
  $SIZES decode --size 3b --work $W --rounds 2 --max-new-tokens 48 2>&1 | grep "round\|median"
fi
stamp done
