"""The kit's case types and the helpers its builders and checks share: :class:`Case` (one call
of an op, with its units for batch invariance), :class:`OpCases`, the seeded generator
:class:`Gen`, :func:`call` (an op called the way ``rlk.ops`` calls a backend), the selection
of units (:func:`select`, :func:`batch_of`) and the packing of attention sequences (packed and
paged). The builders, one per op, are in :mod:`rlk.testing.cases`."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from rlk.ops import KWONLY

SEED = 1234

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@dataclass
class Seq:
    """One attention sequence: its queries are the last ``len(q)`` of its ``len(k)`` tokens."""

    q: torch.Tensor  # [nq, Hq, D]
    k: torch.Tensor  # [nk, Hk, D]
    v: torch.Tensor  # [nk, Hk, D]
    do: torch.Tensor | None = None  # cotangent of the output [nq, Hq, D]


@dataclass
class Case:
    """One call of ``op``: ``args`` in the order of the public signature.

    For batch invariance a case also describes its *units* (a row, a GRPO group, a sequence):
    ``args`` then holds a pool of units, of which the first ``batch`` are the batch and the rest
    are other random units mixed in by the check. ``rows`` names the arguments whose dim 0 runs
    over units (``unit`` entries per unit); attention cases keep their pool in ``seqs`` and
    build ``args`` with :func:`select`.
    """

    op: str
    label: str
    dtype: torch.dtype
    args: dict[str, Any]
    cot: tuple[torch.Tensor, ...] = ()  # cotangents of the differentiable outputs; () = forward
    rows: tuple[str, ...] = ()
    unit: int = 1
    batch: int = 0
    seqs: list[Seq] = field(default_factory=list)
    paged: dict[str, Any] | None = None  # paged_attention: the shared cache of the pool

    @property
    def units(self) -> int:
        if self.seqs:
            return len(self.seqs)
        return self.args[self.rows[0]].shape[0] // self.unit if self.rows else 0


@dataclass
class OpCases:
    accuracy: list[Case]
    invariance: list[Case]  # unit pools: batch invariance, determinism, tuning invariance
    path: list[Any] = field(default_factory=list)


class Gen:
    """Seeded tensors on ``device`` (float32 draws rounded once to the requested dtype)."""

    def __init__(self, name: str, device: torch.device):
        self.device = device
        self.g = torch.Generator(device=device)
        self.g.manual_seed(SEED ^ zlib.crc32(name.encode()))
        self.cpu = torch.Generator()
        self.cpu.manual_seed(SEED ^ zlib.crc32(name.encode()) ^ 0x5EED)

    def randn(self, *shape: int, dtype=FP32, scale: float = 1.0, mean: float = 0.0):
        t = torch.randn(shape, generator=self.g, device=self.device, dtype=FP32)
        if scale != 1.0:
            t.mul_(scale)
        if mean:
            t.add_(mean)
        return t.to(dtype)

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=self.g, device=self.device)

    def randint(self, low: int, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(low, high, shape, generator=self.g, device=self.device)

    def perm(self, n: int) -> list[int]:
        return torch.randperm(n, generator=self.cpu).tolist()


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


# --------------------------------------------------------------------------------------------
# Calling an op and selecting units
# --------------------------------------------------------------------------------------------


def call(fn: Callable[..., Any], op: str, args: dict[str, Any]) -> Any:
    """Call a backend op the way ``rlk.ops`` does: positional, then keyword-only by keyword."""
    kw = KWONLY.get(op, ())
    return fn(*[v for k, v in args.items() if k not in kw], **{k: args[k] for k in kw if k in args})


def _gather(t: torch.Tensor, units: Sequence[int], unit: int) -> torch.Tensor:
    idx = torch.tensor(units, dtype=torch.long, device=t.device)
    if unit == 1:
        return t.index_select(0, idx)
    return t.reshape(-1, unit, *t.shape[1:]).index_select(0, idx).reshape(-1, *t.shape[1:])


def select(case: Case, units: Sequence[int]) -> tuple[Case, dict[str, list[tuple[int, int]]]]:
    """The case made of ``units`` of the pool, in that order, and where each one's entries lie.

    Returns ``(case, spans)``: ``spans["q"][i]`` is the ``(start, end)`` of unit ``i`` in the
    outputs and the row-indexed gradients; ``spans["k"][i]`` in the key gradients (attention).
    """
    units = list(units)
    if case.op == "paged_attention":
        return _select_paged(case, units)
    if case.seqs:
        seqs = [case.seqs[i] for i in units]
        args, cot, spans = pack(seqs, case.args["causal"], case.args["scale"])
        return replace(case, args=args, cot=cot, seqs=seqs, batch=len(seqs)), spans
    args = dict(case.args)
    for name in case.rows:
        args[name] = _gather(args[name], units, case.unit)
    cot = tuple(_gather(c, units, case.unit) for c in case.cot)
    spans = [(i * case.unit, (i + 1) * case.unit) for i in range(len(units))]
    return replace(case, args=args, cot=cot, batch=len(units)), {"q": spans, "k": spans}


def batch_of(case: Case) -> Case:
    """The batch part of a pool case (the whole case when it has no units)."""
    if not case.batch:
        return case
    return select(case, range(case.batch))[0]


def _cu(lengths: Sequence[int], device: torch.device) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    offs = [0]
    for n in lengths:
        offs.append(offs[-1] + n)
    spans = list(zip(offs[:-1], offs[1:], strict=True))
    return torch.tensor(offs, dtype=torch.int32, device=device), spans


def pack(seqs: Sequence[Seq], causal: bool, scale: float):
    """Packed varlen ``attention`` arguments (and output cotangent) of ``seqs``, in order."""
    dev = seqs[0].q.device
    cu_q, q_spans = _cu([s.q.shape[0] for s in seqs], dev)
    cu_k, k_spans = _cu([s.k.shape[0] for s in seqs], dev)
    args = {
        "q": torch.cat([s.q for s in seqs]),
        "k": torch.cat([s.k for s in seqs]),
        "v": torch.cat([s.v for s in seqs]),
        "cu_seqlens_q": cu_q,
        "cu_seqlens_k": cu_k,
        "causal": causal,
        "scale": scale,
    }
    cot = (torch.cat([s.do for s in seqs]),) if all(s.do is not None for s in seqs) else ()
    return args, cot, {"q": q_spans, "k": k_spans}


def paged_cache(seqs: Sequence[Seq], page_size: int, gen: Gen) -> dict[str, Any]:
    """Write every sequence's keys/values into a shared paged cache, pages in shuffled order.

    Unused slots hold large random garbage, so a kernel reading past a sequence's end shows up.
    """
    hk, d = seqs[0].k.shape[1:]
    counts = [math.ceil(s.k.shape[0] / page_size) for s in seqs]
    total = sum(counts) + 2
    order = gen.perm(total)
    kc = gen.randn(total, page_size, hk, d, dtype=seqs[0].k.dtype, scale=30.0)
    vc = gen.randn(total, page_size, hk, d, dtype=seqs[0].k.dtype, scale=30.0)
    pages, at = [], 0
    for s, n in zip(seqs, counts, strict=True):
        ids = order[at : at + n]
        at += n
        pages.append(ids)
        pos = torch.arange(s.k.shape[0], device=s.k.device)
        slot = torch.tensor(ids, dtype=torch.long, device=s.k.device)[pos // page_size]
        flat = slot * page_size + pos % page_size
        kc.view(-1, hk, d)[flat] = s.k
        vc.view(-1, hk, d)[flat] = s.v
    spare = order[at:]
    return {"k_cache": kc, "v_cache": vc, "pages": pages, "spare": spare, "page_size": page_size}


def paged_args(seqs: Sequence[Seq], cache: dict[str, Any], which: Sequence[int], scale: float):
    """``paged_attention`` arguments for sequences ``which`` of a :func:`paged_cache`.

    Block-table entries past a sequence's pages point at spare pages (never to be read).
    """
    dev = seqs[0].q.device
    chosen = [seqs[i] for i in which]
    width = max(len(cache["pages"][i]) for i in which) + 1
    rows = []
    for i in which:
        ids = list(cache["pages"][i])
        ids += [cache["spare"][j % len(cache["spare"])] for j in range(width - len(ids))]
        rows.append(ids)
    cu_q, spans = _cu([s.q.shape[0] for s in chosen], dev)
    args = {
        "q": torch.cat([s.q for s in chosen]),
        "k_cache": cache["k_cache"],
        "v_cache": cache["v_cache"],
        "block_table": torch.tensor(rows, dtype=torch.int32, device=dev),
        "seq_lens": torch.tensor([s.k.shape[0] for s in chosen], dtype=torch.int32, device=dev),
        "cu_seqlens_q": cu_q,
        "scale": scale,
    }
    return args, spans


def _select_paged(case: Case, units: list[int]):
    args, spans = paged_args(case.seqs, case.paged, units, case.args["scale"])
    seqs = [case.seqs[i] for i in units]
    return replace(case, args=args, seqs=seqs, batch=len(units)), {"q": spans, "k": spans}
