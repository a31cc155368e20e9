"""One module per op, each beside its plain-torch reference and its kernel:

    csrc/<op>.cu           the CUDA kernel (clip, cross_entropy, lora, norm_act, rope)
    ops/<op>.py            its torch.autograd.Function; CUDA tensors only
    ops/<op>_reference.py  the same math in plain torch: the CPU path and the test oracle

lora_multi and varlen have no kernel of their own (cuBLAS GEMMs, PyTorch's flash attention).
gpu_kernels.dispatch decides per call which of the two runs; tests/gpu_kernels/test_op_<op>.py
compares them.
"""
