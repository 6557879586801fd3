#!/usr/bin/env bash
# Hardware conformance for owners of an AMD MI300X (backend rocm) or a Huawei Ascend NPU
# (backend ascend): rlk info, the full conformance kit, the benchmark harness, and a markdown
# summary to paste into docs/benchmarks/.
#
# Installs nothing: run it from the repository root in an environment where torch (ROCm build,
# or torch + the torch-npu matching your CANN) and rlk already work (docs/backends.md).
#
#   bash scripts/hw_conformance.sh rocm|ascend [--quick]
#
# --quick: quick conformance shapes and `rlk bench --quick` (a smoke run; the summary
# says so). Environment: OUT (default hw-out/<backend>-<date>), PYTHON (default python3),
# CONF_TIMEOUT / BENCH_TIMEOUT in seconds (default 7200 each).
# Writes under $OUT: info.txt/json, device.txt, conformance.txt/json/err, bench.txt/json, and
# summary.md (date, versions, device, commands, conformance summary and table, bench tables).
set -uo pipefail

usage() { echo "usage: $0 rocm|ascend [--quick]" >&2; exit 2; }
backend=${1:-}
[ "$backend" = rocm ] || [ "$backend" = ascend ] || usage
shift
quick=0
for a in "$@"; do
  case "$a" in --quick) quick=1 ;; *) usage ;; esac
done

date=$(date -u +%Y-%m-%d)
OUT=${OUT:-hw-out/$backend-$date}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 RLK_VALIDATE=1

if [ "$backend" = ascend ]; then
  device=npu
  # The "npu" device type exists only once torch_npu is imported, and the conformance kit builds
  # its inputs before rlk's loader imports it (torch's device-backend autoload may be off), so
  # run the rlk CLI with torch_npu imported first.
  rlk_cmd=("$PY" -c 'import sys, torch_npu; from rlk.cli import main; sys.exit(main(sys.argv[1:]))')
  rlk_shown="python -c 'import torch_npu; rlk.cli.main()'"
  { npu-smi info 2>&1 || echo "npu-smi not found"; } > "$OUT/device.txt"
else
  device=cuda  # ROCm builds of torch call AMD GPUs "cuda"
  rlk_cmd=(rlk)
  rlk_shown=rlk
  { rocm-smi --showproductname 2>&1 || echo "rocm-smi not found"; } > "$OUT/device.txt"
fi

mode_args=(--full)
bench_args=()
if [ "$quick" = 1 ]; then
  mode_args=()
  bench_args=(--quick)
fi

echo "== rlk info" >&2
"${rlk_cmd[@]}" info 2>&1 | tee "$OUT/info.txt"
"${rlk_cmd[@]}" info --json > "$OUT/info.json" 2>> "$OUT/info.txt"

conf_args=(conformance --backend "$backend" --device "$device" "${mode_args[@]}"
  --json "$OUT/conformance.json")
echo "== rlk ${conf_args[*]}" >&2
rm -f "$OUT/conformance.json"
timeout "${CONF_TIMEOUT:-7200}" "${rlk_cmd[@]}" "${conf_args[@]}" \
  > "$OUT/conformance.txt" 2> "$OUT/conformance.err"
conf_rc=$?
tail -25 "$OUT/conformance.txt" >&2

bench_cmd=("$PY" -m rlk.cli bench "${bench_args[@]}" --json "$OUT/bench.json")
echo "== ${bench_cmd[*]}" >&2
rm -f "$OUT/bench.json"
RLK_BACKEND=$backend timeout "${BENCH_TIMEOUT:-7200}" "${bench_cmd[@]}" > "$OUT/bench.txt" 2>&1
bench_rc=$?
tail -5 "$OUT/bench.txt" >&2

BACKEND=$backend DEVICE=$device OUTDIR=$OUT DATE=$date QUICK=$quick CONF_RC=$conf_rc \
  BENCH_RC=$bench_rc CONF_CMD="$rlk_shown ${conf_args[*]}" \
  BENCH_CMD="RLK_BACKEND=$backend ${bench_cmd[*]}" "$PY" - <<'PYEOF'
import json, os

env = os.environ
out, backend = env["OUTDIR"], env["BACKEND"]


def load(name):
    try:
        with open(os.path.join(out, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def tail(name, n=1):
    try:
        with open(os.path.join(out, name)) as f:
            lines = [line.rstrip() for line in f if line.strip()]
        return " / ".join(lines[-n:]) or "(empty)"
    except OSError:
        return "(missing)"


def device_name():
    try:
        import torch

        if backend == "ascend":
            import torch_npu  # noqa: F401

            return torch.npu.get_device_name(0)
        return torch.cuda.get_device_name(0)
    except Exception as e:  # a summary is still written without the device
        return f"unknown ({type(e).__name__}: {e})"


info = load("info.json") or {}
versions = dict(info.get("versions", {}))
try:
    import torch

    if getattr(torch.version, "hip", None):
        versions["hip"] = torch.version.hip
    if backend == "ascend":
        import torch_npu

        versions["torch_npu"] = torch_npu.__version__
except Exception:
    pass
entry = {b["name"]: b for b in info.get("backends", [])}.get(backend, {})
state = "available" if entry.get("available") else f"unavailable: {entry.get('reason', '?')}"
conf = load("conformance.json")
mode = "quick (smoke run)" if env["QUICK"] == "1" else "full"
if conf:
    s = conf["summary"]
    verdict = "ok" if conf["ok"] else "FAILED"
    conf_line = (
        f"{verdict}: {s['pass']} pass, {s['fail']} fail, {s['skip']} skip in {conf['seconds']} s"
        f" (claims: {', '.join(conf['claims'])})"
    )
else:
    conf_line = f"no report (exit {env['CONF_RC']}): {tail('conformance.err')}"
bench = load("bench.json")
if bench:
    rows = sum(len(r) for r in bench.get("results", {}).values())
    failed = ", ".join(bench.get("failed", [])) or "none"
    bench_line = f"exit {env['BENCH_RC']}: {rows} rows, failed families: {failed}"
else:
    bench_line = f"no results (exit {env['BENCH_RC']}): {tail('bench.txt')}"

dev = device_name()
md = [
    f"## rlk backend `{backend}` on {dev} ({env['DATE']})",
    "",
    "| | |",
    "|---|---|",
    f"| date | {env['DATE']} |",
    f"| device | {dev} (torch device `{env['DEVICE']}`) |",
    f"| versions | {', '.join(f'{k} {v}' for k, v in versions.items())} |",
    f"| backend | {backend}: {state} |",
    f"| delegated | {'; '.join(f'{k}: {v}' for k, v in entry.get('delegated', {}).items()) or '-'} |",
    f"| conformance command | `{env['CONF_CMD']}` |",
    f"| conformance ({mode}) | {conf_line} |",
    f"| benchmark command | `{env['BENCH_CMD']}` |",
    f"| benchmark | {bench_line} |",
    "",
]
if conf:
    checks = list(dict.fromkeys(r["check"] for r in conf["rows"] if r["check"] != "implemented"))
    md += ["| op | " + " | ".join(checks) + " |", "|---" * (len(checks) + 1) + "|"]
    by = {(r["op"], r["check"]): r for r in conf["rows"]}
    for op in dict.fromkeys(r["op"] for r in conf["rows"]):
        cells = []
        for c in checks:
            r = by.get((op, c)) or by.get((op, "implemented"))
            if r is None:
                cells.append("")
            elif r["status"] == "skip":
                cells.append("skip")
            else:
                err = r.get("max_err")
                word = "pass" if r["status"] == "pass" else "**FAIL**"
                cells.append(word if err is None else f"{word} {float(err):.1e}")
        md.append(f"| {op} | " + " | ".join(cells) + " |")
    md.append("")
if bench:
    with open(os.path.join(out, "bench.txt")) as f:
        text = f.read()
    start = text.find("\n## ")
    if start >= 0:
        tables = text[start + 1 :].rstrip().replace("## ", "#### ")
        md += ["### Benchmarks", "", tables, ""]
with open(os.path.join(out, "summary.md"), "w") as f:
    f.write("\n".join(md) + "\n")
print("\n".join(md))
PYEOF
echo "== wrote $OUT/summary.md (paste it into docs/benchmarks/)" >&2
[ "$conf_rc" = 0 ] && [ "$bench_rc" = 0 ]
