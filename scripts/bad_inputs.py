"""Run the bad-input cases of rlk.testing.bad_inputs in default mode and print a table.

    python scripts/bad_inputs.py --device cuda --logs DIR [--wrap "compute-sanitizer ..."]
    python scripts/bad_inputs.py --device cpu --logs DIR      # in-process, host checks off
    python scripts/bad_inputs.py --device cuda --case NAME    # one case (what --logs runs)
    python scripts/bad_inputs.py --summary DIR                 # the table of a finished run

On a GPU each case runs in a process of its own (optionally under ``--wrap``, the sanitizer):
an asynchronous device-side assertion ends its CUDA context, so one case must not hide the next.
Each case's log holds ``CASE <name>``, its ``RESULT <outcome>: <detail>`` line and whatever the
wrapper printed. A case passes when its outcome is the one the contract requires and the
sanitizer reports no error but the device-side assertions that report bad input (its ERROR
SUMMARY counts those too; no access error line at all). ``RLK_VALIDATE`` must
be unset: this is the path without host value checks. Exit status 0 when every case passes.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

#: Seconds per case (a cold Triton cache compiles every kernel, slower under the sanitizer).
CASE_TIMEOUT = 600

_ACCESS = re.compile(
    r"^=+ (Invalid __\w+__ (read|write)|Out-of-range|Misaligned|Malloc/Free error|"
    r"Invalid (global|shared|local) |Warp Illegal|Illegal (Address|Instruction)|"
    r"Hardware Exception)"
)
_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error")
#: The sanitizer's record of a device-side assertion (how a bad index is reported without a
#: host sync): counted in its ERROR SUMMARY, but not a memory access error.
_ASSERT = re.compile(r"^=+ Warp assert")
#: The message a device-side assertion prints; the process may end before its RESULT line
#: (the assertion poisons the CUDA context, and a destructor's failed free aborts it).
_ASSERT_MESSAGE = re.compile(r"Assertion `(.+)` failed")


def _cases() -> dict:
    from rlk.testing import bad_inputs

    return bad_inputs.CASES


def run_one(name: str, device: str) -> str:
    from rlk.testing import bad_inputs

    outcome, detail = bad_inputs.run(name, device)
    return f"RESULT {outcome}: {detail}"


def run_all(device: str, logs: Path, wrap: str) -> None:
    logs.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(_cases()):
        log = logs / f"{i:02d}.log"
        if device == "cpu":  # the interpreter: no CUDA context to lose, so in this process
            log.write_text(f"CASE {name}\n{run_one(name, device)}\n")
        else:
            cmd = [*shlex.split(wrap), sys.executable, __file__, "--device", device]
            try:
                p = subprocess.run(
                    [*cmd, "--case", name],
                    capture_output=True,
                    text=True,
                    timeout=CASE_TIMEOUT,
                    env={k: v for k, v in os.environ.items() if k != "RLK_VALIDATE"},
                )
                text = p.stdout + p.stderr + f"\nEXIT {p.returncode}\n"
            except subprocess.TimeoutExpired as e:
                text = f"{e.stdout or ''}{e.stderr or ''}\nTIMEOUT after {CASE_TIMEOUT} s\n"
            log.write_text(f"CASE {name}\n{text}")
        print(f"{name}: done ({log})", flush=True)


def summarize(logs: Path) -> list[dict]:
    """One row per case log: case, expected and observed outcome, detail, sanitizer counts."""
    cases = _cases()
    rows = []
    for log in sorted(Path(logs).glob("*.log")):
        lines = log.read_text(errors="replace").splitlines()
        name = lines[0][5:] if lines and lines[0].startswith("CASE ") else log.stem
        result = next((ln for ln in lines if ln.startswith("RESULT ")), None)
        outcome, detail = ("no result", "") if result is None else result[7:].split(": ", 1)
        summary = next((m.group(1) for ln in lines if (m := _SUMMARY.search(ln))), None)
        access = sum(bool(_ACCESS.match(ln)) for ln in lines)
        asserts = sum(bool(_ASSERT.match(ln)) for ln in lines)
        message = next((m.group(1) for ln in lines if (m := _ASSERT_MESSAGE.search(ln))), None)
        if result is None and message is not None:
            outcome, detail = "error", f"device-side assertion: {message}"
        elif result is None:
            tail = [ln for ln in lines[1:] if ln.strip()][-1:]
            detail = tail[0][:160] if tail else "empty log"
        want = cases[name][1] if name in cases else "?"
        other = None if summary is None else int(summary) - asserts  # errors besides asserts
        ok = outcome == want and access == 0 and other in (0, None)
        rows.append(
            {
                "case": name,
                "expected": want,
                "outcome": outcome,
                "detail": detail,
                "memcheck": "n/a" if summary is None else summary,
                "asserts": asserts,
                "access_errors": access,
                "verdict": "pass" if ok else "FAIL",
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    head = ("case", "expected", "outcome", "memcheck", "asserts", "access", "verdict", "detail")
    cells = [
        (
            r["case"],
            r["expected"],
            r["outcome"],
            r["memcheck"],
            str(r["asserts"]),
            str(r["access_errors"]),
            r["verdict"],
            r["detail"][:90],
        )
        for r in rows
    ]
    widths = [max(len(c[i]) for c in [head, *cells]) for i in range(len(head) - 1)]
    out = []
    for c in [head, *cells]:
        out.append("  ".join(x.ljust(w) for x, w in zip(c, widths, strict=False)) + "  " + c[-1])
    failed = sum(r["verdict"] != "pass" for r in rows)
    out.append(f"{len(rows) - failed} passed, {failed} failed")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--case", help="run this case only and print its RESULT line")
    ap.add_argument("--logs", type=Path, help="run every case, one log per case here")
    ap.add_argument("--wrap", default="", help="command prefix for each case (the sanitizer)")
    ap.add_argument("--summary", type=Path, help="print the table of the logs in this folder")
    args = ap.parse_args(argv)
    if os.environ.get("RLK_VALIDATE", "").strip():
        print("note: RLK_VALIDATE is set; the cases run with host value checks off anyway")
    if args.case:
        print(run_one(args.case, args.device), flush=True)
        return 0
    logs = args.summary or args.logs
    if logs is None:
        ap.error("give --case, --logs or --summary")
    if args.logs:
        run_all(args.device, args.logs, args.wrap)
    rows = summarize(logs)
    print(table(rows))
    return 0 if rows and all(r["verdict"] == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
