"""Make Triton's CPU interpreter keep rlk's contract: GPU-like bf16 rounding, a fixed dot order.

The interpreter stores bfloat16 as raw uint16 (numpy has no bf16). Its fp32 -> bf16 cast
truncates instead of rounding to nearest even, and ``tl.dot`` on bf16 operands multiplies the
bit patterns (triton-lang/triton#11584). rlk's kernels only compute in fp32 (they upcast after
each load), so an exact RTNE cast (through torch) and a bf16-aware dot make CPU runs compute
what the GPU computes.

The interpreter's ``tl.dot`` is ``numpy.matmul``, i.e. the host BLAS. OpenBLAS's FMA kernels
(Haswell, Zen, ...) sum an element's K products in an order that depends on where its row falls
in the kernel's blocking, so the number of rows in a tile would change the bits, and the same
kernel would be batch-invariant on one CPU and not on another. :func:`_ordered_dot` replaces it
with elementwise numpy arithmetic in one explicit order: every product rounded to the
accumulator dtype, summed over K by a fixed pairwise tree, then added to the accumulator. Each
output element then depends on its own row of ``a`` and column of ``b`` only, on any CPU and any
BLAS. Applied once, only when the interpreter is active.

Interpreted launches are serialised by a process-wide lock (:data:`_LAUNCH_LOCK`), since the
interpreter patches module-level state for each launch: ops may be called from many threads.
"""

from __future__ import annotations

import threading

_patched = False

#: One interpreted launch at a time in the process. The interpreter runs a kernel by replacing
#: the functions of ``triton.language`` (and its builder's state) with numpy versions for the
#: launch and restoring them at its end: two launches from two threads would see each other's
#: patching (errors such as "Did you forget to add @triton.jit ?") and :func:`_patch_lang_once`
#: keeps one launch's state. The interpreter is mostly Python that holds the GIL, so the lock
#: costs little parallelism. Re-entrant, so that a launch made inside another cannot deadlock.
_LAUNCH_LOCK = threading.RLock()


def _ordered_dot(a, b, acc):
    """``a @ b + acc`` for 2-D or 3-D (batched) float arrays, in a fixed, BLAS-free order.

    Products are formed in ``acc``'s dtype (exact for fp16/bf16 operands into fp32), reduced
    over K by pairwise halving (element k with element k + K/2, an odd last element carried),
    then added to ``acc``: the same order for every element whatever the tile's shape.
    """
    import numpy as np

    dt = acc.dtype
    prod = np.multiply(
        a.astype(dt, copy=False)[..., :, :, None], b.astype(dt, copy=False)[..., None, :, :]
    )
    k = prod.shape[-2]
    if k == 0:
        return acc.copy()
    while k > 1:
        half = k // 2
        s = prod[..., :half, :] + prod[..., half : 2 * half, :]
        if k % 2:
            s = np.concatenate([s, prod[..., 2 * half :, :]], axis=-2)
        prod, k = s, s.shape[-2]
    return prod[..., 0, :] + acc


def _patch_lang_once(itp) -> None:
    """Patch ``triton.language`` once per kernel launch, not once per device-function call;
    run launches with numpy's floating-point warnings off.

    The interpreter re-patches the language modules seen by a ``@triton.jit`` helper on every
    call of that helper (and never undoes it), which is most of the host time of kernels built
    from small helpers (``tree_sum``, the GEMM's K loop). Patching is idempotent, so a helper
    whose modules the running launch has already patched skips it; the launch's own scope
    still restores everything when it ends, as before.
    """
    import numpy as np

    original = itp._patch_lang
    done: set[int] = set()

    class _Nothing:
        def restore(self) -> None:
            pass

    def patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if v is itp.tl or v is itp.tl.core}
        if langs and langs <= done:
            return _Nothing()
        scope = original(fn)
        done.update(langs)
        return scope

    grid_call = itp.GridExecutor.__call__

    def launch(self, *args, **kwargs):
        with _LAUNCH_LOCK:
            done.clear()
            try:
                # A GPU computes log(0) = -inf, 0 * inf = nan, ... without a word; so do the
                # kernels here (numpy's floating-point warnings would otherwise reach the user).
                with np.errstate(all="ignore"):
                    return grid_call(self, *args, **kwargs)
            finally:
                done.clear()

    itp._patch_lang = patch_lang
    itp.GridExecutor.__call__ = launch


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
        a, b = _as_f32(a), _as_f32(b)
        if a.data.dtype.kind != "f" or b.data.dtype.kind != "f" or d.data.dtype.kind != "f":
            # Integer or fp8 dots: not used by rlk's kernels; keep Triton's own semantics.
            return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        return itp.TensorHandle(_ordered_dot(a.data, b.data, d.data), d.dtype.scalar)

    original_fp_to_fp = builder_cls.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return cast_impl(self, src, dst_type)
        return original_fp_to_fp(self, src, dst_type, rounding_mode)

    _patch_lang_once(itp)

    builder_cls.cast_impl = cast_impl
    builder_cls.create_fp_to_fp = create_fp_to_fp
    builder_cls.create_fp_trunc = lambda self, src, dst_type: self.cast_impl(src, dst_type)
    builder_cls.create_fp_ext = lambda self, src, dst_type: self.cast_impl(src, dst_type)
    builder_cls.create_dot = create_dot
    _patched = True
