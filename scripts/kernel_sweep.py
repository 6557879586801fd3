"""Launch configs of rlk's kernels on a CUDA GPU, against the peers, in GPU time.

    python3 scripts/kernel_sweep.py [--out DIR] [--parts decode,tma,rotary,attention]

Parts: ``decode`` and ``tma`` (GEMM, below), ``rotary`` (apply_rotary configs against Liger),
``attention`` (forward and backward configs of causal varlen attention against SDPA's default
backend, and the forward with 128-key tiles, a different numerics timed only to see its worth),
``logprobs`` (forward configs for each chunk-group constant ``GROUP``, with and without the
division skipped at temperature 1, against Liger's cross-entropy), ``silu`` and ``norm``
(``silu_and_mul`` and ``rms_norm`` forward configs against Liger; for ``norm`` also a copy of the
forward with a plain fp32 sum of squares, timed only, to see what the exact sum costs),
``normbwd`` (rms_norm's backward: each launch config, its pieces, other dweight row
partitions and a plain-sum copy, both timed only, against Liger and ``torch.compile``),
``fusedmem`` (linear_logprobs' peak memory and eager time under other chunk constants),
``sample`` (the launch configs of ``rlk.sample``: warps and the programs a threshold pass fills
the GPU with, at B = 1, 64 and 256; temperature alone and with top-k / top-p), ``sampleknobs``
(its module-level knobs: blocks per part of a threshold pass, the candidate step's warps),
``paged`` (``rlk.paged_attention``'s launch configs at the harness's decode shapes), ``attnbwd``
(the GPU time of each kernel of a causal forward + backward, with and without the dK/dV
kernel's early dO V^T product), ``gemm`` (every GEMM candidate at the bench's shapes below
0.9x cuBLAS, at projections no config was chosen on and at a k/v projection, M = 1-1024),
``offsets`` (attention, paged decode and packed forward and backward, with its row offsets in
int32 and in int64), ``kvsplit`` (the training forward and paged decode under each KV split
constant of :data:`KV_SPLITS`).
Every config's output is compared bitwise with the chosen config's where the numerics are the
same.

GEMM:

Three measurements, each side by side with cuBLAS (``F.linear``) in this process, bf16:

1. Per-call cost of one eager call at M=1 (host side included): ``rlk.linear``, the bare Triton
   launch of the same kernel, and ``F.linear``; each timed over a loop of many calls.
2. GPU time per product (CUDA graph of products over distinct weights, so W comes from HBM):
   cuBLAS, rlk's chosen config, and every decode candidate (BLOCK_M 64 or ``--bm``, BLOCK_N
   16-128 or ``--bn``, stages 3-8 or ``--stages``, one K tile per loop step or ``--unroll``,
   through pointers or descriptors). Every candidate's output is
   compared bitwise with the chosen config's: launch configs must never change a bit.
3. The same for a split-K variant with a fixed leaf width (K reduced per leaf by the same
   k-loop, leaves summed in ascending order by a second kernel): a different numerics, timed
   here only to see what more programs per SM would buy.

Tables are printed last; the rows also go to ``DIR/kernel_sweep.json``.
"""

from __future__ import annotations

import argparse
import json
import os

from sweeps import attention, memory
from sweeps.attention import (
    attention_bwd_part,
    attention_part,
    kv_split_part,
    offsets_part,
    paged_part,
    print_kv_split,
    print_offsets,
)
from sweeps.gemm import (
    DECODE,
    GEMM_SHAPES,
    MS,
    decode_part,
    gemm_part,
    print_gemm,
    print_tables,
    tma_part,
)
from sweeps.memory import (
    fused_memory_part,
    logprobs_part,
    norm_bwd_part,
    norm_part,
    print_memory_bound,
    rotary_part,
    sample_knobs_part,
    sample_part,
    silu_part,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--parts", default="decode,tma,rotary,attention")
    ap.add_argument("--shapes", default=None, help="decode, gemm: the shapes (o_proj,up,...)")
    ap.add_argument("--ms", default=None, help="decode: comma-separated M (default 1,16,64,256)")
    ap.add_argument("--stages", default=None, help="decode: pipeline depths (default 3,4,6,8)")
    ap.add_argument("--no-leaf", action="store_true", help="decode: skip the split-K variant")
    ap.add_argument("--unroll", default="1", help="decode: K tiles per loop iteration (1,2,4)")
    ap.add_argument("--bn", default="16,32,64,128", help="decode: BLOCK_N candidates")
    ap.add_argument("--bm", default="64", help="decode: BLOCK_M candidates (4 warps each)")
    ap.add_argument("--attn-fwd-only", action="store_true", help="attention: forward configs")
    ap.add_argument("--norm-shapes", default=None, help="norm, normbwd: TxH,TxH,...")
    ap.add_argument("--paged-shapes", default=None, help="paged: indices into DECODE (0,1,..)")
    ap.add_argument(
        "--gemm-ms", default=None, help="gemm: time rlk bench's shapes at these M instead (256,...)"
    )
    args = ap.parse_args()
    parts = args.parts.split(",")
    attention.ATTN_FWD_ONLY = args.attn_fwd_only
    if args.norm_shapes:
        memory.NORM_SHAPES = [
            tuple(int(n) for n in sh.split("x")) for sh in args.norm_shapes.split(",")
        ]
    if args.paged_shapes:
        attention.PAGED_SHAPES = {int(i) for i in args.paged_shapes.split(",")}
    DECODE.update(
        shapes=args.shapes.split(",") if args.shapes else None,
        ms=[int(m) for m in args.ms.split(",")] if args.ms else MS,
        stages=[int(t) for t in args.stages.split(",")] if args.stages else [3, 4, 6, 8],
        leaf=not args.no_leaf,
        unroll=[int(u) for u in args.unroll.split(",")],
        bn=[int(b) for b in args.bn.split(",")],
        bm=[int(b) for b in args.bm.split(",")],
    )
    if args.gemm_ms:
        from rlk.bench import gemm as bench_gemm

        ms = [int(m) for m in args.gemm_ms.split(",")]
        GEMM_SHAPES.clear()
        GEMM_SHAPES.update({name: (K, N, ms) for name, K, N in bench_gemm.SHAPES})
    rows: list[dict] = []
    runs = {
        "decode": decode_part, "tma": tma_part, "rotary": rotary_part,
        "attention": attention_part, "attnbwd": attention_bwd_part, "logprobs": logprobs_part,
        "silu": silu_part,
        "norm": norm_part, "normbwd": norm_bwd_part, "sample": sample_part,
        "fusedmem": fused_memory_part, "sampleknobs": sample_knobs_part, "paged": paged_part,
        "gemm": gemm_part, "offsets": offsets_part, "kvsplit": kv_split_part,
    }  # fmt: skip
    unknown = sorted(set(parts) - set(runs))
    if unknown:
        ap.error(f"unknown parts {unknown}; parts: {', '.join(runs)}")
    try:
        for name, part in runs.items():
            if name in parts:
                part(rows)
    finally:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "kernel_sweep.json"), "w") as f:
            json.dump(rows, f, indent=1)
    print_tables(rows)
    print_memory_bound(rows)
    print_gemm(rows)
    print_offsets(rows)
    print_kv_split(rows)


if __name__ == "__main__":
    main()
