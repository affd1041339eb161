"""What can be checked of the .gpuv build on a machine without a GPU: with an extracted copy of
its vLLM first on the path, vLLM's CUDA platform is put in place by hand (compute capability
9.0, an H200's) and Triton's NVIDIA driver reported active, then:

- ``import vllm`` is the build's, and the compiled kernels are the stub's (``kernels_stub.py``);
- vLLM's GPU worker, GPU model runner (V1), the Llama and Qwen2 models and TRITON_ATTN import;
- attention chosen with no backend given is TRITON_ATTN (FLASH_ATTN refused, FlashInfer absent);
- an eager engine's config, without and with ``{"method": "recycling"}`` (the plugin loaded),
  has ``custom_ops`` "none", the V1 model runner, and with recycling TRITON_ATTN and the
  ``custom_class`` proposer.

    make gpu-vllm   (or: python benchmarks/gpu/import_check.py [SITE_DIR] after build.sh)

SITE_DIR defaults to a fresh extraction of .gpuv/vllm-py.tar.xz in a temporary folder. It
runs under .venv's Python (vLLM's dependencies are there); nothing runs on a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHECK = r"""
import os, sys
import triton.backends
triton.backends.backends["nvidia"].driver.is_active = staticmethod(lambda: True)
import vllm
assert vllm.__file__.startswith(os.environ["GPUV_SITE"]), vllm.__file__
import vllm.platforms as platforms
from vllm.platforms.cuda import CudaPlatform
from vllm.platforms.interface import DeviceCapability
CudaPlatform.get_device_capability = classmethod(lambda cls, device_id=0: DeviceCapability(9, 0))
platforms.current_platform = CudaPlatform()
import torch
import vllm._C_stable_libtorch  # the stub, where the compiled library would be
assert type(torch.ops._C).__name__ == "_Kernels", torch.ops._C
assert not hasattr(torch.ops._C, "rotary_embedding") and torch.ops._C.cutlass_scaled_mm_supports_fp8(90) is False
import vllm.v1.attention.backends.fa_utils, vllm.v1.attention.backends.triton_attn
import vllm.v1.worker.gpu_worker, vllm.v1.worker.gpu_model_runner
import vllm.model_executor.models.llama, vllm.model_executor.models.qwen2
print("imports: vllm from", os.path.dirname(vllm.__file__), "| GPU worker, GPU model runner, llama, qwen2, TRITON_ATTN")
from vllm.v1.attention.selector import AttentionSelectorConfig
chosen = CudaPlatform.get_attn_backend_cls(None, AttentionSelectorConfig(64, torch.bfloat16, "auto", None), num_heads=9)
assert chosen.endswith("TritonAttentionBackend"), chosen
print("attention with no backend given:", chosen)
from vllm.engine.arg_utils import EngineArgs
from vllm.plugins import load_general_plugins
load_general_plugins()
for spec in (None, {"method": "recycling", "matrix_init": "empty"}):
    c = EngineArgs(model=sys.argv[1], enforce_eager=True, speculative_config=spec).create_engine_config()
    line = dict(custom_ops=c.compilation_config.custom_ops, v2_runner=c.use_v2_model_runner,
                backend=str(c.attention_config.backend), spec=c.speculative_config and c.speculative_config.method,
                async_scheduling=c.scheduler_config.async_scheduling)
    assert line["custom_ops"] == ["none"] and not line["v2_runner"], line
    assert spec is None or (line["backend"].endswith("TRITON_ATTN") and line["spec"] == "custom_class"), line
    print("engine config,", "recycling:" if spec else "no speculation:", line)
print("import check: OK")
"""


def main() -> int:
    site = sys.argv[1] if len(sys.argv) > 1 else None
    with tempfile.TemporaryDirectory() as tmp:
        if site is None:
            site = tmp
            subprocess.run(["tar", "-xJf", str(ROOT / ".gpuv/vllm-py.tar.xz"), "-C", site], check=True)
        model = subprocess.run([sys.executable, "-m", "vllm_recycling.cli", "model", "tiny-random"],
                               capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
        env = {**os.environ, "PYTHONPATH": site, "GPUV_SITE": site, "HF_HUB_OFFLINE": "1"}
        return subprocess.run([sys.executable, "-c", CHECK, model], env=env, cwd=tmp).returncode


if __name__ == "__main__":
    sys.exit(main())
