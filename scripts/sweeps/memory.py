"""``scripts/kernel_sweep.py``'s memory-bound parts: ``rotary``, ``logprobs``, ``silu``,
``norm``, ``normbwd``, ``fusedmem``, ``sample`` and ``sampleknobs``, against Liger and
``torch.compile``."""

from __future__ import annotations

import json

import torch

import rlk
from rlk.bench import timing as _timing
from rlk.selection import backend_impl
from rlk_triton import tuning
from rlk_triton._triton import jit, tl, triton
from sweeps.common import _config_sweep, _liger_ms, products_ms

ROTARY_SHAPES = [(16384, 32, 8, 128), (65536, 14, 2, 64)]


def rotary_part(rows) -> None:
    """apply_rotary launch configs (tokens and heads per program, warps) for q and k as a model
    rotates them; bits must not move, GB/s against Liger's fused q/k rotation."""

    for shape in ROTARY_SHAPES:
        _rotary_shape(rows, *shape)


def _rotary_shape(rows, T: int, Hq: int, Hk: int, D: int) -> None:
    from rlk.bench import norm
    from rlk.bench._peers import liger

    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(T, Hq, D, device=dev, dtype=dt)
    k = torch.randn(T, Hk, D, device=dev, dtype=dt)
    cos, sin = norm._rope_cos_sin(T, D)
    nbytes = 2 * T * (Hq + Hk) * D * 2 + 2 * T * D * 2
    ref = rlk.apply_rotary(q, cos, sin, k=k)

    def both():
        return rlk.apply_rotary(q, cos, sin, k=k)

    base = products_ms(lambda x, w: both(), None, [None])
    best, equal = (float("inf"), None), True
    for tok in (1, 2, 4, 8, 16):
        for hd in (8, 16, 32):
            for wp in (2, 4, 8):
                cf = {"tokens": tok, "heads": hd, "num_warps": wp}
                with tuning.force("apply_rotary", {"apply_rotary.fwd": cf}):
                    got = both()
                    equal &= torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
                    t = products_ms(lambda x, w: both(), None, [None])
                if t < best[0]:
                    best = (t, cf)
    lig = float("nan")
    Fn = liger("LigerRopeFunction")
    if Fn is not None:
        ql, kl = q.clone(), k.clone()
        try:
            lig = products_ms(
                lambda x, w: Fn.apply(norm._hf_layout(ql), norm._hf_layout(kl), cos, sin),
                None,
                [None],
            )
        except Exception as e:  # a peer that cannot be captured in a graph
            print("liger rope:", type(e).__name__, str(e)[:200])
    r = {
        "part": "rotary", "shape": f"T={T} Hq={Hq} Hk={Hk} D={D}",
        "chosen_us": round(base * 1e3, 2), "best_us": round(best[0] * 1e3, 2),
        "best_cfg": best[1], "liger_us": round(lig * 1e3, 2),
        "best_GBps": round(nbytes / best[0] / 1e6), "bits_equal": bool(equal),
    }  # fmt: skip
    rows.append(r)
    print(json.dumps(r), flush=True)


def logprobs_part(rows) -> None:
    for T, V in ((16384, 151936), (8192, 128256)):
        _logprobs_shape(rows, T, V)


def _logprobs_shape(rows, T: int, V: int) -> None:
    from rlk_triton import logprobs as lpmod

    logits = torch.randn(T, V, device="cuda", dtype=torch.bfloat16)
    targets = torch.randint(0, V, (T,), device="cuda")
    args = (logits.clone(), targets, None, -100, 0.0, 0.0, "none")
    peer = _liger_ms("LigerCrossEntropyFunction", lambda Fn: Fn.apply(*args)[0])
    configs = [
        {"ROWS": r, "num_warps": w} for r, w in ((1, 4), (2, 4), (2, 8), (4, 8), (4, 16), (8, 16))
    ]
    chosen = [dict(tuning.config(lpmod.TUNING, "logprobs.fwd", T=T, V=V))]
    group0, unit0 = lpmod.GROUP, lpmod._unit
    try:
        for group in (1, 2, 4):
            lpmod.GROUP = group
            for unit in (True, False):
                lpmod._unit = unit0 if unit else (lambda temperature: False)
                _config_sweep(
                    rows, "logprobs", f"T={T} V={V} GROUP={group} unit={unit}",
                    lambda: rlk.logprobs(logits, targets), "logprobs.fwd",
                    configs if unit else chosen, T * V * 2, peer,
                )  # fmt: skip
    finally:
        lpmod.GROUP, lpmod._unit = group0, unit0


def silu_part(rows) -> None:
    for T, I in ((32768, 4864), (16384, 14336)):
        _silu_shape(rows, T, I)


def _silu_shape(rows, T: int, I: int) -> None:
    gate = torch.randn(T, I, device="cuda", dtype=torch.bfloat16)
    up = torch.randn(T, I, device="cuda", dtype=torch.bfloat16)
    peer = _liger_ms("LigerSiLUMulFunction", lambda Fn: Fn.apply(gate, up))
    configs = [{"block": 512, "num_warps": 2}] + [
        {"block": b, "num_warps": w} for b in (1024, 2048, 4096) for w in (4, 8)
    ]
    _config_sweep(
        rows, "silu", f"T={T} I={I}", lambda: rlk.silu_and_mul(gate, up), "silu_and_mul.fwd",
        configs, 3 * T * I * 2, peer,
    )  # fmt: skip


#: The (T, H) shapes of the norm and normbwd parts (--norm-shapes).
NORM_SHAPES = [(16384, 4096), (65536, 2048), (65536, 896), (32768, 896), (4096, 8192)]


def norm_part(rows) -> None:
    for T, H in NORM_SHAPES:
        _norm_shape(rows, T, H)


@jit
def _plain_norm_kernel(X, W, Y, n_rows, H, eps, BLOCK_H: tl.constexpr, ROWS: tl.constexpr):
    # rms_norm's forward with a plain fp32 tl.sum for the sum of squares: a numerics whose bits
    # follow the layout, timed only to see what the exact sum costs.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < n_rows)[:, None] & (cols < H)[None, :]
    offs = rows.to(tl.int64)[:, None] * H + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / H + eps)
    w = tl.load(W + cols, mask=cols < H, other=0.0).to(tl.float32)
    tl.store(Y + offs, (x * rstd[:, None] * w[None, :]).to(Y.dtype.element_ty), mask=mask)


def _plain_norm_us(x, w, cfg) -> float:
    from rlk_triton import norm as normmod

    T, H = x.shape
    block = normmod._block(H)
    rows = max(1, cfg["tile"] // block)
    y = torch.empty_like(x)

    def run():
        _plain_norm_kernel[(triton.cdiv(T, rows),)](
            x, w, y, T, H, 1e-6, BLOCK_H=block, ROWS=rows, num_warps=cfg["num_warps"]
        )

    return products_ms(lambda a, b: run(), None, [None]) * 1e3


def _norm_shape(rows, T: int, H: int) -> None:
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(H, device="cuda", dtype=torch.bfloat16)
    peer = _liger_ms("LigerRMSNormFunction", lambda Fn: Fn.apply(x, w, 1e-6, 0.0, "gemma", False))
    configs = [{"tile": t, "num_warps": nw} for t in (2048, 4096, 8192) for nw in (4, 8, 16)]
    configs += [{"tile": t, "num_warps": nw} for t in (1024, 2048, 4096) for nw in (1, 2)]
    if H >= 8192:  # two rows per program
        configs += [{"tile": 16384, "num_warps": nw} for nw in (8, 16, 32)]
    _config_sweep(
        rows, "norm", f"T={T} H={H}", lambda: rlk.rms_norm(x, w, 1e-6), "rms_norm.fwd",
        configs, 2 * T * H * 2, peer,
    )  # fmt: skip
    from rlk_triton import norm as normmod

    chosen = tuning.config(normmod.TUNING, "rms_norm.fwd", rows=T, hidden=H)
    r = {"part": "norm_plain_sum", "shape": f"T={T} H={H}", "cfg": dict(chosen),
         "us": round(_plain_norm_us(x, w, chosen), 2), "peer_us": round(peer * 1e3, 2)}  # fmt: skip
    rows.append(r)
    print(json.dumps(r), flush=True)


def norm_bwd_part(rows) -> None:
    for T, H in NORM_SHAPES:
        _norm_bwd_shape(rows, T, H)


@jit
def _plain_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DWP, n_rows, H, BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
    DW_ROWS: tl.constexpr,
):  # fmt: skip
    # rms_norm's backward with plain fp32 tl.sum row and column sums: a numerics whose bits
    # follow the layout, timed only to see what the exact sums cost.
    block = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    col_ok = cols < H
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    acc = tl.zeros([ROWS, BLOCK_H], dtype=tl.float32)
    for i in range(DW_ROWS // ROWS):
        r = block * DW_ROWS + i * ROWS + tl.arange(0, ROWS)
        mask = (r < n_rows)[:, None] & col_ok[None, :]
        offs = r.to(tl.int64)[:, None] * H + cols[None, :]
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + r, mask=r < n_rows, other=0.0)
        x_hat = x * rstd[:, None]
        g = dy * w[None, :]
        c = tl.sum(g * x_hat, 1) / H
        tl.store(DX + offs, ((g - x_hat * c[:, None]) * rstd[:, None]).to(DX.dtype.element_ty),
                 mask=mask)  # fmt: skip
        acc += dy * x_hat
    tl.store(DWP + block.to(tl.int64) * H + cols, tl.sum(acc, 0), mask=col_ok)


def _norm_bwd_shape(rows, T: int, H: int) -> None:
    """rms_norm's backward at one shape, GPU time: the whole backward under each launch config
    (bits compared), its pieces (the dx kernel alone, the dweight partial sums), other row
    partitions of dweight (other numerics, timed only) and a plain-sum copy (timing only);
    Liger's and torch.compile's forward+backward beside it."""
    from rlk.bench import norm as bnorm
    from rlk.bench._peers import compiled, fwd_bwd_step
    from rlk_triton import norm as normmod

    table = backend_impl(torch.device("cuda")).ops["rms_norm"].keywords["table"]
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(H, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    _, _, rstd = normmod._forward(x, w, 1e-6, None, table)
    shape = f"T={T} H={H}"

    def emit(variant, us, equal=None, **extra):
        r = {"part": "norm_bwd", "shape": shape, "variant": variant, "us": round(us, 2),
             "bits_equal": equal, **extra}  # fmt: skip
        rows.append(r)
        print(json.dumps(r), flush=True)

    def us(fn):
        return products_ms(lambda a, b: fn(), None, [None]) * 1e3

    def bwd(need_dw=True):
        return normmod._backward(dy, None, x, w, rstd, need_dw, table)

    ref = bwd()
    emit("backward (chosen)", us(bwd), True,
         cfg=dict(tuning.config(table, "rms_norm.bwd", rows=T, hidden=H)))  # fmt: skip
    emit("dx kernel only", us(lambda: bwd(False)))
    block = normmod._block(H)
    part = torch.randn(-(-T // normmod._dw_rows(block)), H, device="cuda")
    emit(
        "dweight partial sums only",
        us(lambda: normmod._sum_partials(part, w.dtype, table)),
        cfg=dict(tuning.config(table, "rms_norm.dw", partials=part.shape[0], hidden=H)),
    )
    for cf in normmod.TUNING["rms_norm.dw"].configs:
        with tuning.force("rms_norm", {"rms_norm.dw": cf}):
            emit(f"partial sums {cf}", us(lambda: normmod._sum_partials(part, w.dtype, table)))
    for nw in (1, 2, 4, 8, 16):
        with tuning.force("rms_norm", {"rms_norm.bwd": {"num_warps": nw}}):
            got = bwd()
            equal = all(torch.equal(a, b) for a, b in zip(got, ref))
            emit(f"num_warps={nw}", us(bwd), equal)
    dw_rows0 = normmod._dw_rows
    try:
        for dw_rows in (16, 32, 64, 128):
            normmod._dw_rows = lambda b, n=dw_rows: n
            for nw in (1, 2, 4, 8, 16):
                with tuning.force("rms_norm", {"rms_norm.bwd": {"num_warps": nw}}):
                    emit(f"dweight rows={dw_rows} num_warps={nw}", us(bwd))
    finally:
        normmod._dw_rows = dw_rows0
    dx = torch.empty_like(x)
    for dw_rows, r, nw in ((16, max(1, 4096 // block), 4), (64, max(1, 4096 // block), 8)):
        plain_part = torch.empty(-(-T // dw_rows), H, device="cuda")

        def plain(dw_rows=dw_rows, r=r, nw=nw, plain_part=plain_part):
            _plain_norm_bwd_kernel[(-(-T // dw_rows),)](
                dy, x, w, rstd, dx, plain_part, T, H, BLOCK_H=block, ROWS=min(r, dw_rows),
                DW_ROWS=dw_rows, num_warps=nw,
            )  # fmt: skip

        emit(f"plain sums, dx + partials, DW_ROWS={dw_rows} num_warps={nw}", us(plain))
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    emit("rlk fwd+bwd", us(fwd_bwd_step(lambda: rlk.rms_norm(xs, ws, 1e-6), [xs, ws])))
    cf = compiled(bnorm._rms_norm_ref)
    xc, wc = x.clone(), w.clone()
    emit("compile fwd+bwd", us(fwd_bwd_step(lambda: cf(xc, wc), [xc, wc])))
    emit("compile fwd", us(lambda: cf(x, w)))
    from rlk.bench._peers import liger

    Fn = liger("LigerRMSNormFunction")
    if Fn is not None:
        xl, wl = x.clone(), w.clone()
        step = fwd_bwd_step(lambda: Fn.apply(xl, wl, 1e-6, 0.0, "gemma", False), [xl, wl])
        emit("liger fwd+bwd", us(step))


def fused_memory_part(rows) -> None:
    for T, H, V in ((16384, 896, 151936), (16384, 4096, 128256), (32768, 4096, 128256)):
        _fused_memory_shape(rows, T, H, V)


def _fused_memory_shape(rows, T: int, H: int, V: int) -> None:
    """linear_logprobs at one shape under other chunk constants (none changes a bit): the peak
    memory of the forward and of the backward beyond what is allocated before each (GiB, the
    gradients included), and their times (CUDA events over eager calls: host included)."""
    from rlk_triton import fused_logprobs as fl

    hid = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(V, H, device="cuda") * H**-0.5).to(torch.bfloat16)
    tgt = torch.randint(0, V, (T,), device="cuda")
    g = torch.randn(T, device="cuda")
    hr, wr = hid.clone().requires_grad_(), w.clone().requires_grad_()
    keys = ("BWD_TOKENS", "BWD_ELEMS", "DH_TOKENS", "DW_SLICE", "DW_TOKENS", "_FWD_SLICE_ELEMS")
    base = {k: getattr(fl, k) for k in keys}
    variants = [{}, {"BWD_TOKENS": 1024}, {"BWD_TOKENS": 4096}, {"DH_TOKENS": 16384},
                {"_FWD_SLICE_ELEMS": 1 << 25},
                {"DW_SLICE": 4096}, {"DW_TOKENS": 16384},
                {"BWD_TOKENS": 10**9, "BWD_ELEMS": 10**12}]  # fmt: skip

    def ms(fn, n=3):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n

    def fwd():
        return rlk.linear_logprobs(hr, wr, tgt)

    def bwd():
        return torch.autograd.grad(fwd(), (hr, wr), g)

    for v in variants:
        for k, x in {**base, **v}.items():
            setattr(fl, k, x)
        fwd_gib = _timing.extra_memory_gib(fwd)
        step_gib = _timing.extra_memory_gib(bwd)
        r = {"part": "fused_memory", "shape": f"T={T} H={H} V={V}", "variant": v or "defaults",
             "fwd_GiB": round(fwd_gib, 3), "step_GiB": round(step_gib, 3),
             "fwd_ms": round(ms(fwd), 2), "step_ms": round(ms(bwd), 2)}  # fmt: skip
        rows.append(r)
        print(json.dumps(r), flush=True)
    for k, x in base.items():
        setattr(fl, k, x)


def sample_part(rows) -> None:
    for B in (1, 64, 256, 1024):
        _sample_shape(rows, B, 151936)


#: Launch configs tried beside the table's (more or fewer programs per threshold pass).
SAMPLE_EXTRA = (
    {"num_warps": 2, "programs": 4096},
    {"num_warps": 1, "programs": 4096},
    {"num_warps": 2, "programs": 1024},
    {"num_warps": 4, "programs": 2048},
)


def _sample_shape(rows, B: int, V: int) -> None:
    logits = torch.randn(B, V, device="cuda") * 3
    seeds = torch.arange(B, device="cuda")
    offsets = torch.zeros(B, dtype=torch.int64, device="cuda")
    from rlk_triton import sampling

    configs = list(sampling.TUNING["sample.fwd"].configs)
    configs += [c for c in SAMPLE_EXTRA if c not in configs]
    for name, kw in (
        ("temperature", dict(temperature=0.8)),
        ("top_k_top_p", dict(temperature=0.8, top_k=50, top_p=0.9)),
    ):
        _config_sweep(
            rows, "sample", f"{name} B={B} V={V}",
            lambda kw=kw: rlk.sample(logits, seeds, offsets, **kw), "sample.fwd",
            configs, B * V * 4, float("nan"),
        )  # fmt: skip


#: sampling's module-level launch knobs (no bit depends on them): blocks per part of a threshold
#: pass, and the candidate step's warps; the first pair is the module's own.
SAMPLE_KNOBS = ((16, 4), (32, 4), (8, 4), (16, 8), (32, 8), (16, 2))


def sample_knobs_part(rows) -> None:
    """``rlk.sample`` under each (PART_BLOCKS, FEW_WARPS) of SAMPLE_KNOBS, the table's config."""
    from rlk_triton import sampling

    own = (sampling.PART_BLOCKS, sampling.FEW_WARPS)
    V = 151936
    for B in (1, 64, 256):
        logits = torch.randn(B, V, device="cuda") * 3
        seeds = torch.arange(B, device="cuda")
        offsets = torch.zeros(B, dtype=torch.int64, device="cuda")
        for name, kw in (
            ("top_k_top_p", dict(temperature=0.8, top_k=50, top_p=0.9)),
            ("top_p", dict(temperature=0.8, top_p=0.9)),
            ("top_k_1000", dict(temperature=0.8, top_k=1000)),
        ):
            ref = None
            for pb, fw in (own,) + tuple(k for k in SAMPLE_KNOBS if k != own):
                sampling.PART_BLOCKS, sampling.FEW_WARPS = pb, fw
                try:
                    out = rlk.sample(logits, seeds, offsets, **kw)
                    ref = out if ref is None else ref
                    args = (logits, seeds, offsets)
                    t = products_ms(lambda x, w, a=args, kw=kw: rlk.sample(*a, **kw), None, [None])
                finally:
                    sampling.PART_BLOCKS, sampling.FEW_WARPS = own
                r = {"part": "sample_knobs", "shape": f"{name} B={B} V={V}", "PART_BLOCKS": pb,
                     "FEW_WARPS": fw, "us": round(t * 1e3, 2),
                     "bits_equal": bool(torch.equal(out, ref))}  # fmt: skip
                rows.append(r)
                print(json.dumps(r), flush=True)


def print_memory_bound(rows) -> None:
    """Per part and shape: the chosen config, the fastest one, and the peer, in us."""
    groups: dict = {}
    for r in rows:
        if r["part"] in ("logprobs", "silu", "norm", "sample", "paged"):
            groups.setdefault((r["part"], r["shape"]), []).append(r)
    if groups:
        print(f"\n{'part':8} {'shape':36} {'chosen':>8} {'best':>8} {'peer':>8} bits  best cfg")
    for (part, shape), rs in groups.items():
        best = min(rs, key=lambda r: r["us"])
        ok = all(r["bits_equal"] for r in rs)
        print(
            f"{part:8} {shape:36} {rs[0]['chosen_us']:>8} {best['us']:>8} {best['peer_us']:>8} "
            f"{'ok' if ok else 'DIFF'}  {best['cfg']}"
        )
    for r in rows:
        if r["part"] == "fused_memory":
            print(
                f"linear_logprobs {r['shape']:24} {str(r['variant']):28} fwd {r['fwd_GiB']:6.3f}"
                f" GiB {r['fwd_ms']:8.2f} ms  fwd+bwd {r['step_GiB']:6.3f} GiB"
                f" {r['step_ms']:8.2f} ms"
            )
    for r in rows:
        if r["part"] == "norm_bwd":
            eq = {None: "", True: "bits ok", False: "DIFF"}[r["bits_equal"]]
            print(f"norm bwd {r['shape']:16} {r['variant']:52} {r['us']:>8} us {eq}")
    for r in rows:
        if r["part"] == "sample_knobs":
            ok = "ok" if r["bits_equal"] else "DIFF"
            print(f"sample {r['shape']:30} PART_BLOCKS {r['PART_BLOCKS']:>2} FEW_WARPS "
                  f"{r['FEW_WARPS']} {r['us']:>8} us {ok}")  # fmt: skip
    for r in rows:
        if r["part"] == "norm_plain_sum":
            print(f"norm, plain fp32 sum (timing only) {r['shape']:22} {r['us']:>8} us")
