"""Host arrays to the device without making the host wait for it."""

from __future__ import annotations

import numpy as np
import torch


def to_device(array, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host array as a tensor on ``device``. On CUDA through pinned memory and an
    asynchronous copy: a plain ``.to("cuda")`` of pageable memory waits for the stream (PyTorch
    synchronises after a blocking host-to-device copy), which the tree step must not do. The
    pinned block comes from PyTorch's caching host allocator, which keeps it until the copy is
    done."""
    tensor = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
    if torch.device(device).type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
