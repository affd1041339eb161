"""Host values to the device without making the host wait for it."""

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


class StagedBuffer:
    """A persistent device buffer of ``capacity`` values, filled from host values each step
    without an allocation or a wait: on CUDA through a pinned host twin and an asynchronous
    copy. A fill overwrites the host twin while the previous step's copy may still be queued;
    that is safe where it is used, after vLLM has read the step's output (which waits for the
    device), and not in general."""

    def __init__(self, capacity: int, dtype: torch.dtype, device: torch.device | str) -> None:
        device = torch.device(device)
        self.on_cuda = device.type == "cuda"
        self.host = torch.zeros(capacity, dtype=dtype, pin_memory=self.on_cuda)
        self.device = torch.zeros(capacity, dtype=dtype, device=device) if self.on_cuda else self.host
        self._host_np = self.host.numpy()

    def fill(self, values) -> torch.Tensor:
        """The first len(values) entries, on the device, holding ``values``."""
        n = len(values)
        self._host_np[:n] = values
        if self.on_cuda:
            self.device[:n].copy_(self.host[:n], non_blocking=True)
        return self.device[:n]
