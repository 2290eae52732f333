#!/bin/bash
# Serve's modes at 1/4/16 clients on a lent device machine's CPU (issue 42, history.md §73), run from the
# repository root there. A call carries 64 MiB with the working tree, so the reference GGUF and the wheels the
# device's python lacks (onnxruntime 1.32, llguidance, starlette, uvicorn, gguf) travel over three calls of one
# warm machine (it is given back after ~30 s idle: make each call at once after the last):
#   here:  D=.gpu73; mkdir -p $D/whl; echo /$D/ >> .git/info/exclude; pip download the wheels into $D/whl;
#          split the GGUF: head -c 22000000 G > $D/p1; tail -c +22000001 G | head -c 53000000 > $D/p2;
#          tail -c +75000001 G > $D/p3
#   call 1 (carry $D/whl $D/p1):  bash benchmarks/measure/device_serve.sh setup
#   call 2 (carry $D/p2):         bash benchmarks/measure/device_serve.sh keep p2
#   call 3 (carry $D/p3):         DEAD=540 bash benchmarks/measure/device_serve.sh run 2>&1 | tee $OUT/log.txt
# `run` exports the default recipe's slots bundle, picks serve's thread count by one client's tokens/s, runs
# serve_modes.py and slot_passes.py, and skips stages that would end past DEAD seconds. `long` instead: 256-token
# answers at 1 and 4 clients, then the pass level over 24 steps.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
D=${D:-.gpu73}; PY=${PY:-python3}; R=$PWD; W=/tmp/r73; T0=$(date +%s); DEAD=${DEAD:-505}
REQ=${REQ:-16}; MAXTOK=${MAXTOK:-64}; CLIENTS=${CLIENTS:-1,4,16}; ROUNDS=${ROUNDS:-2}; PROBE=${PROBE:-"16 8 4"}
SUM=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
left() { echo $(( DEAD - ($(date +%s) - T0) )); }
stamp() { echo "=== $(( $(date +%s) - T0 )) s: $* (load $(cut -d' ' -f1-3 /proc/loadavg))"; }

setup() {
  mkdir -p /tmp/m /tmp/site && cp $D/p1 /tmp/m/p1 || exit 2
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $D/whl/*.whl \
      > $OUT/pip.log 2>&1 || { tail -20 $OUT/pip.log; exit 3; }
  export PYTHONPATH=/tmp/site
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile . >> $OUT/pip.log 2>&1 || { tail -20 $OUT/pip.log; exit 4; }
  {
    echo "nproc $(nproc)"; lscpu | grep -i "model name\|^CPU(s)\|thread\|core\|socket\|NUMA node(s)\|L2\|L3"
    grep -o "avx512[a-z_]*\|avx_vnni\|amx[a-z_]*" /proc/cpuinfo | sort -u | tr '\n' ' '; echo; python3 --version
    cd /tmp && python3 -c "
import onnxruntime, numpy, tokenizers, starlette, uvicorn, llguidance, torch, transformers, onnx
print('onnxruntime', onnxruntime.__version__, onnxruntime.__file__, 'numpy', numpy.__version__, 'torch', torch.__version__)
import edgespec.serve, edgespec.runtime.pipeline, edgespec.exporters.export
print('edgespec imports ok')"
  } > $OUT/env.txt 2>&1
  cat $OUT/env.txt
}

prepare() {  # the GGUF reassembled and checked, the slots bundle exported once
  if [ -z "$LOCAL" ]; then
    export EDGESPEC_CACHE=/tmp/esc PYTHONPATH=/tmp/site
    G=$EDGESPEC_CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf; mkdir -p $EDGESPEC_CACHE/models
    [ -f $G ] || cat /tmp/m/p1 /tmp/m/p2 $D/p3 > $G
    sha256sum $G | grep -q $SUM || { echo "gguf checksum differs"; exit 3; }
  fi
  cd $R/benchmarks/measure
  stamp export
  timeout $(left) $PY -c "from slot_passes import slots_bundle; print(slots_bundle(4))" 2>&1 | tr '\r' '\n' \
      | grep -v "it/s\]$\|^\s*$" | tail -15
  stamp exported
}

run() {
  mkdir -p $W; prepare
  best=${BEST:-8}
  if [ $(left) -gt 300 ]; then
    for t in $PROBE; do
      [ $(left) -gt 280 ] || break
      stamp "probe threads $t"
      timeout 90 $PY serve_modes.py --modes alone --rounds 1 --clients 1 --requests 8 --max-tokens $MAXTOK --threads $t \
          --json $W/probe$t.json 2>&1 | grep "clients:\|exited\|Error" | head -3
    done
    best=$($PY -c "
import json, sys
rows = []
for t in sys.argv[1:]:
    try: rows.append((json.load(open(f'$W/probe{t}.json'))['rounds'][0]['alone']['load'][0]['tokens_per_s'], int(t)))
    except OSError: pass
print(max(rows)[1] if rows else $best)" $PROBE)
  fi
  stamp "main, threads $best"
  timeout $(( $(left) - 10 )) $PY serve_modes.py --modes alone,batch --rounds $ROUNDS --clients $CLIENTS --requests $REQ \
      --max-tokens $MAXTOK --threads $best --json $OUT/modes.json 2>&1 | grep -v "^\s*$"
  if [ $(left) -gt 110 ]; then
    stamp "slot_passes, threads $best"
    timeout $(( $(left) - 10 )) $PY slot_passes.py --steps 4 --generate ${GEN:-128} --threads $best \
        --json $OUT/slot_passes.json 2>&1 | tail -30
  fi
  other=${OTHER:-$([ "$best" = 16 ] && echo 8 || echo 16)}
  if [ $(left) -gt 90 ]; then
    stamp "second thread count $other"
    timeout $(( $(left) - 8 )) $PY serve_modes.py --modes alone,batch --rounds 1 --clients 1,4 --requests $REQ \
        --max-tokens $MAXTOK --threads $other --json $OUT/modes_t$other.json 2>&1 | grep "clients:\|exited\|Error"
  fi
  stamp end
  tar czf $OUT/extra.tgz -C $W . 2>/dev/null
}

long() {
  prepare
  stamp "serve, ${LONG:-256} tokens"
  timeout $(( $(left) - 5 )) $PY serve_modes.py --modes alone,batch --rounds 1 --clients 1,4 --requests 8 \
      --max-tokens ${LONG:-256} --threads ${BEST:-16} --json $OUT/modes_long.json 2>&1 | grep -v "^\s*$"
  if [ $(left) -gt 30 ]; then
    stamp "slot_passes --steps ${STEPS:-24}"
    timeout $(( $(left) - 3 )) $PY slot_passes.py --steps ${STEPS:-24} --threads ${BEST:-16} \
        --json $OUT/slot_passes24.json 2>&1 | tail -5
  fi
  stamp end
}

case "$1" in
  setup) setup ;;
  keep) mkdir -p /tmp/m && cp $D/$2 /tmp/m/$2 && ls -la /tmp/m ;;
  run) run ;;
  long) long ;;
  *) echo "usage: device_serve.sh setup | keep PART | run | long (history.md §73)"; exit 1 ;;
esac
