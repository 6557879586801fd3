"""The benchmark harness: every op family against its strongest public peer, in one process.

    python benchmarks/run.py [--quick] [--only gemm,norm,...] [--json FILE]

Prints the measured ceilings (copy bandwidth, cuBLAS) and one table per op family; results go
to docs/benchmarks/<gpu>.md together with this command.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ceilings, format_rows, require_cuda  # noqa: E402

FAMILIES = ["norm", "logprobs", "gemm", "attention", "fused_logprobs", "tree_gemm"]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="fewer shapes")
    p.add_argument("--only", default="", help="comma-separated families: " + ",".join(FAMILIES))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    require_cuda()
    import triton

    meta = {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "command": "python benchmarks/run.py " + " ".join(sys.argv[1:]),
    }
    meta.update(ceilings())
    print(json.dumps(meta, indent=1), flush=True)
    families = [f for f in (args.only.split(",") if args.only else FAMILIES) if f]
    results, failed = {}, []
    for fam in families:
        try:
            mod = importlib.import_module(f"bench_{fam}")
        except ModuleNotFoundError as e:
            print(f"\n## {fam}: no benchmark ({e})", flush=True)
            continue
        try:
            rows = mod.run(quick=args.quick)
        except Exception:
            traceback.print_exc()
            failed.append(fam)
            continue
        results[fam] = rows
        print(f"\n## {fam}\n" + format_rows(rows), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results, "failed": failed}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
