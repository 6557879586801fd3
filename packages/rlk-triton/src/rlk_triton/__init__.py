"""rlk_triton: the portable Triton kernels of rlk and their autograd Functions.

On machines without a GPU the kernels run under Triton's CPU interpreter (the same kernel
source), which is how CI checks them. Kernel modules import triton through
:mod:`rlk_triton._triton`, which turns the interpreter on first when there is no GPU.
Importing this package itself imports neither triton nor any kernel.
"""
