"""Compiled (CUDA) twins of gpu_kernels.reference, as torch.autograd.Functions.

Every function here takes CUDA tensors only; gpu_kernels.dispatch decides when to call them.
"""
