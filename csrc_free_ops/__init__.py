"""Triton kernels and their launchers for the Qwen decoder ops.

Plain Python + Triton, no torch.library: one file per op family (forward and backward
kernels together; attention and the fused decode ops keep their launchers there and their
kernels or device building blocks in files named for them), shared building blocks in common.py. The launchers
take tensors that `qwen_ops` has already validated and return new tensors (or
write into caller-provided ones); they never autotune, never sync with the host
and never branch on tensor values, so they are safe inside CUDA graph capture.
"""
