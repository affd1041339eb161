"""Stand-in for vLLM's compiled CUDA kernels, absent from the .gpuv build (benchmarks/gpu/README.md):
build.sh installs it as ``vllm/_C_stable_libtorch.py``, which vLLM's CUDA platform imports where
the compiled library would be. Capability queries (torch.ops._C.*support*) answer False;
silu_and_mul, rms_norm, fused_add_rms_norm and apply_repetition_penalties_ run in plain torch;
every other kernel is absent, as hasattr() tells (vLLM then takes its other paths)."""
import torch
import torch.nn.functional as F

_real = torch.ops._C


def _rms(x, weight, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y.to(x.dtype) * weight) if weight is not None else y.to(x.dtype)


def silu_and_mul(out, x):
    d = x.shape[-1] // 2
    out.copy_(F.silu(x[..., :d]) * x[..., d:])


def rms_norm(out, x, weight, eps):
    out.copy_(_rms(x, weight, eps))


def fused_add_rms_norm(x, residual, weight, eps):
    residual.add_(x)
    x.copy_(_rms(residual, weight, eps))


def apply_repetition_penalties_(logits, prompt_mask, output_mask, repetition_penalties):
    """vLLM's ``_custom_ops.apply_repetition_penalties_torch``, which vLLM itself runs where the
    kernel is not used (any CUDA logits that are contiguous go to the kernel)."""
    penalties = repetition_penalties.unsqueeze(dim=1).repeat(1, logits.size(1))
    penalties = torch.where(prompt_mask | output_mask, penalties, 1.0)
    logits *= torch.where(logits > 0, 1.0 / penalties, penalties)


_NATIVE = {"silu_and_mul": silu_and_mul, "rms_norm": rms_norm, "fused_add_rms_norm": fused_add_rms_norm,
           "apply_repetition_penalties_": apply_repetition_penalties_}


class _Kernels:
    def __getattr__(self, name):
        try:
            return getattr(_real, name)
        except (AttributeError, RuntimeError):
            pass
        if name in _NATIVE:
            return _NATIVE[name]
        if "support" in name:
            return lambda *args, **kwargs: False
        raise AttributeError(f"torch.ops._C.{name}: not in this build")


torch.ops._C = _Kernels()
