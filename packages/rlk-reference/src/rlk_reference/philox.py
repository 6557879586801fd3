"""Philox-4x32-10 (Salmon et al., Random123), written with int64 torch arithmetic.

This is the bit-exact specification of the random numbers :func:`rlk.sample` uses; the Triton
kernel must reproduce it. Every 32-bit word is held in an int64 tensor and masked after each
operation, so no unsigned dtype is needed.

Per (row b, vocabulary index v): key ``(seed & 0xffffffff, (seed >> 32) & 0xffffffff)`` (the
uint64 bits of the int64 seed), counter ``(v, offset & 0xffffffff, offset >> 32, 0)``; the first
output word ``x0`` gives ``u = (2 * (x0 >> 9) + 1) * 2**-24``, exact in float32 and in (0, 1).
"""

from __future__ import annotations

import torch

__all__ = ["philox4x32_10", "philox_uniform"]

M0 = 0xD2511F53
M1 = 0xCD9E8D57
W0 = 0x9E3779B9
W1 = 0xBB67AE85
MASK32 = 0xFFFFFFFF
ROUNDS = 10


def _mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of the 64-bit product ``a * b`` of two 32-bit values.

    The full product can exceed int64, so ``b`` is split into 16-bit halves: each partial
    product has at most 48 bits.
    """
    p_lo = a * (b & 0xFFFF)
    p_hi = a * (b >> 16)
    low = ((p_hi & 0xFFFF) << 16) + p_lo
    hi = (p_hi >> 16) + (low >> 32)
    return hi & MASK32, low & MASK32


def philox4x32_10(
    counter: tuple[torch.Tensor, ...] | list[torch.Tensor],
    key: tuple[torch.Tensor, ...] | list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox-4x32 with 10 rounds on broadcastable int64 tensors holding 32-bit words.

    ``counter``: four words ``(c0, c1, c2, c3)``; ``key``: two words ``(k0, k1)``.
    Returns the four output words as int64 tensors in ``[0, 2**32)``.
    """
    c0, c1, c2, c3 = (torch.as_tensor(c, dtype=torch.int64) & MASK32 for c in counter)
    k0, k1 = (torch.as_tensor(k, dtype=torch.int64) & MASK32 for k in key)
    for _ in range(ROUNDS):
        hi0, lo0 = _mulhilo32(M0, c0)
        hi1, lo1 = _mulhilo32(M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + W0) & MASK32
        k1 = (k1 + W1) & MASK32
    return c0, c1, c2, c3


def philox_uniform(seeds: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """The uniforms of :func:`rlk.sample`: float32 ``[B, vocab]`` in (0, 1).

    ``seeds``/``offsets``: int64 ``[B]``. Element ``[b, v]`` is Philox-4x32-10 with key
    ``seeds[b]`` and counter ``(v, offsets[b])``, its first word mapped to
    ``(2 * (x0 >> 9) + 1) * 2**-24``.
    """
    seeds = seeds.to(torch.int64).reshape(-1, 1)
    offsets = offsets.to(torch.int64).reshape(-1, 1)
    v = torch.arange(vocab, dtype=torch.int64, device=seeds.device).reshape(1, -1)
    zero = torch.zeros((), dtype=torch.int64, device=seeds.device)
    x0, _, _, _ = philox4x32_10(
        (v, offsets & MASK32, (offsets >> 32) & MASK32, zero),
        (seeds & MASK32, (seeds >> 32) & MASK32),
    )
    # 2 * (x0 >> 9) + 1 < 2**24, so both the float64 product and the float32 cast are exact.
    u = (2 * (x0 >> 9) + 1).to(torch.float64) * 2.0**-24
    return u.to(torch.float32)
