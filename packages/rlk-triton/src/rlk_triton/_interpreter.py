"""Make Triton's CPU interpreter round bf16 like the GPU does.

The interpreter stores bfloat16 as raw uint16 (numpy has no bf16). Its fp32 -> bf16 cast
truncates instead of rounding to nearest even, and ``tl.dot`` on bf16 operands multiplies the
bit patterns (triton-lang/triton#11584). rlk's kernels only compute in fp32 (they upcast after
each load), so two fixes make CPU runs compute what the GPU computes: an exact RTNE cast
(through torch) and a bf16-aware dot. Applied once, only when the interpreter is active.
"""

from __future__ import annotations

_patched = False


def patch() -> None:
    global _patched
    if _patched:
        return
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter as itp

    builder_cls = itp.InterpreterBuilder
    original_cast = builder_cls.cast_impl
    original_dot = builder_cls.create_dot

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            f = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            bits = f.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return itp.TensorHandle(bits.reshape(src.data.shape), tl.bfloat16)
        return original_cast(self, src, dst_type)

    def _as_f32(h):
        if h.dtype.scalar == tl.bfloat16:
            bits = h.data.astype(np.uint32) << 16
            return itp.TensorHandle(bits.view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original_dot(self, _as_f32(a), _as_f32(b), d, input_precision, max_num_imprecise_acc)

    original_fp_to_fp = builder_cls.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return cast_impl(self, src, dst_type)
        return original_fp_to_fp(self, src, dst_type, rounding_mode)

    builder_cls.cast_impl = cast_impl
    builder_cls.create_fp_to_fp = create_fp_to_fp
    builder_cls.create_fp_trunc = lambda self, src, dst_type: self.cast_impl(src, dst_type)
    builder_cls.create_fp_ext = lambda self, src, dst_type: self.cast_impl(src, dst_type)
    builder_cls.create_dot = create_dot
    _patched = True
