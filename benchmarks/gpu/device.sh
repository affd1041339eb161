#!/usr/bin/env bash
# On the GPU machine, from the checkout's root (with .gpuv carried): put vLLM's Python and the
# missing wheels in /tmp/site beside the machine's own torch (once per machine), then run the
# command given with PYTHONPATH=/tmp/site.   usage: bash benchmarks/gpu/device.sh COMMAND...
# SITE=DIR installs elsewhere. See benchmarks/gpu/README.md.
set -u
site=${SITE:-/tmp/site}
if [ ! -f "$site/.installed" ]; then
  [ -f .gpuv/vllm-py.tar.xz ] || { echo "device.sh: no .gpuv/ here (make gpu-vllm, then carry .gpuv)" >&2; exit 1; }
  mkdir -p "$site"
  tar -xJf .gpuv/vllm-py.tar.xz -C "$site" || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .gpuv/whl/*.whl || exit 1
  touch "$site/.installed"
fi
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import torch, vllm; from vllm.platforms import current_platform as p; print('torch', torch.__version__, '| vllm', vllm.__version__, type(p).__name__)"
"$@"
