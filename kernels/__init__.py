"""Triton kernels, each beside its PyTorch reference."""
