"""Steps 2 and 3 of ``rlk aot`` (:mod:`rlk_triton.aot`): recorded launches compiled for AMD
and NVIDIA targets on the CPU, and their generated code read.

:func:`compile_launches` compiles each distinct launch (:class:`rlk_triton.aot_record.Launch`)
for :data:`TARGETS` in subprocesses with the interpreter off, through Triton's own binder (the
specialisation a real launch gets: dtypes, 16-byte alignment, ints equal to 1 or divisible by
16), with the recorded options. :func:`analyse` reads the code: floating-point atomics (amdgcn
``global_atomic_add_f32`` and ``_pk_add``, the compare-and-swap loop gfx90a builds for them,
PTX ``atom``/``red`` on floats, LLVM ``atomicrmw`` on floats) and matrix instructions
(``v_mfma_*``, ``mma.sync.*``, ``wgmma.mma_async.*``, ``tcgen05.mma.*``). Results are cached by
key (:func:`read_cache`, :func:`write_cache`).

Example::

    analyse({"amdgcn": "v_mfma_f32_32x32x8_bf16 a[0:15]"})
    # {"float_atomics": [], "matrix": ["v_mfma_f32_32x32x8_bf16"]}

This module imports neither torch nor triton at import time.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from rlk_triton.aot_record import DescriptorArg, Launch, TensorArg

#: name -> (Triton backend, arch, warp size).
TARGETS: dict[str, tuple[str, str | int, int]] = {
    "gfx90a": ("hip", "gfx90a", 64),  # CDNA 2: MI210, MI250X
    "gfx942": ("hip", "gfx942", 64),  # CDNA 3: MI300X, MI325X
    "gfx950": ("hip", "gfx950", 64),  # CDNA 4: MI350X, MI355X
    "sm_80": ("cuda", 80, 32),  # Ampere: A100
    "sm_90": ("cuda", 90, 32),  # Hopper: H100, H200
    "sm_100": ("cuda", 100, 32),  # Blackwell: B200
}

#: Constexprs a launcher sets from ``tensor.is_cuda``, which a CPU recording cannot see: their
#: value on each vendor's GPU (tree_gemm's flat kernel orders its pending sums with an inline
#: PTX barrier on NVIDIA only).
DEVICE_CONSTEXPRS: dict[str, dict[str, Any]] = {"ASM_BARRIER": {"cuda": True, "hip": False}}

_FLOAT_ATOMIC_ISA = re.compile(
    # amdgcn: global/buffer/flat atomics on floats (add_f32, pk_add_bf16, fmin/fmax...).
    r"\b(?:global|buffer|flat|ds)_atomic_(?:\w*f(?:16|32|64)\w*|pk_add\w*|fmin\w*|fmax\w*)"
    # PTX: atom/red whose type is a float.
    r"|\b(?:atom|red)(?:\.[\w:]+)*?\.(?:add|min|max|exch)(?:\.noftz)?\.(?:v\d\.)?(?:f16x2|bf16x2|f16|bf16|f32|f64)\b"
)
_CAS_ISA = re.compile(r"\b(?:global|buffer|flat)_atomic_cmpswap\w*|\batom(?:\.[\w:]+)*\.cas\.\w+")
_FLOAT_ATOMIC_IR = re.compile(
    r"\batomicrmw\s+(?:volatile\s+)?(\w+)\s+ptr[^,]*,\s*((?:<\d+ x )?(?:float|double|half|bfloat))"
)
_MATRIX = re.compile(
    r"\b(v_mfma_\w+|v_smfmac_\w+|v_wmma_\w+|mma\.sync\.aligned\.[\w.]+"
    r"|wgmma\.mma_async\.sync\.aligned\.[\w.]+|tcgen05\.mma(?:\.[\w:]+)*)"
)


def matrix_kind(instruction: str) -> str:
    """An instruction's kind for the one-kind rule: wgmma's N follows the tile (each output
    column is summed the same way), so it is written ``nN``; everything else (MFMA's M x N x K,
    mma.sync's m16n8k16, the operand types) is kept."""
    return re.sub(r"(wgmma\.\S*\.m\d+)n\d+(k\d+)", r"\1nN\2", instruction)


def analyse(asm: dict[str, Any]) -> dict[str, list[str]]:
    """Floating-point atomics and matrix instructions in one compiled kernel's code
    (``CompiledKernel.asm``): ``{"float_atomics": [...], "matrix": [...]}``, each sorted and
    distinct. A compare-and-swap loop counts as a float atomic where the LLVM IR holds a
    float ``atomicrmw`` (gfx90a builds ``global_atomic_add_f32`` that way)."""
    isa = asm.get("amdgcn") or asm.get("ptx") or ""
    llir = asm.get("llir") or ""
    if isinstance(isa, bytes):
        isa = isa.decode(errors="replace")
    ir = {f"llir: atomicrmw {op} {ty}" for op, ty in _FLOAT_ATOMIC_IR.findall(llir)}
    found = set(_FLOAT_ATOMIC_ISA.findall(isa))
    if ir:
        found |= set(_CAS_ISA.findall(isa)) | ir
    return {
        "float_atomics": sorted(found),
        "matrix": sorted({matrix_kind(m) for m in _MATRIX.findall(isa)}),
    }


def _real(value: Any) -> Any:
    import torch

    if isinstance(value, TensorArg):
        dtype = getattr(torch, value.dtype)
        size = torch.empty((), dtype=dtype).element_size()
        buf = torch.empty(64, dtype=dtype)
        return buf[value.misalign // size :]
    if isinstance(value, DescriptorArg):
        from triton.tools.tensor_descriptor import TensorDescriptor

        return TensorDescriptor(_real(value.base), list(value.shape), list(value.strides),
                                list(value.block_shape), padding=value.padding)  # fmt: skip
    if type(value) in (tuple, list):
        return type(value)(_real(v) for v in value)
    return value


def _kernel(name: str):
    import importlib

    module, _, qualname = name.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _compile_one(kernel, args: tuple, kwargs: dict, target_name: str, memo: dict | None = None,
                 bind_only: bool = False) -> tuple[str, Any]:  # fmt: skip
    """Bind ``args``/``kwargs`` as a launch would (Triton's binder for ``target_name``), then
    compile: ``(key, CompiledKernel or the compiler's error)``; the key names what Triton
    compiles. ``bind_only``: ``(key, None)``; ``memo`` keeps the binding for a later call."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    memo = {} if memo is None else memo
    if "bound" not in memo:
        vendor, arch, warp = TARGETS[target_name]
        target = GPUTarget(vendor, arch, warp)
        backend = make_backend(target)
        kw = {k: DEVICE_CONSTEXPRS[k][vendor] if k in DEVICE_CONSTEXPRS else _real(v)
              for k, v in kwargs.items()}  # fmt: skip
        kw.setdefault("debug", False)
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, spec, options = binder(*[_real(a) for a in args], **kw)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kw, bound, spec,
                                                                  options)  # fmt: skip
        key = repr((signature, sorted(constexprs.items(), key=repr), sorted(attrs.items()),
                    portable_options(options)))  # fmt: skip
        memo["bound"] = (key, target, signature, constexprs, attrs, options)
    key, target, signature, constexprs, attrs, options = memo["bound"]
    if bind_only:
        return key, None
    try:
        src = ASTSource(kernel, signature, constexprs, attrs)
        return key, triton.compile(src, target=target, options=options.__dict__)
    except Exception as e:  # the compiler's error is the result
        return key, _error_text(e)


def portable_options(options: Any) -> list[tuple[str, Any]]:
    """Triton's compile ``options`` as a cache key holds them: sorted, and the libraries Triton
    bundles (``extern_libs``: libdevice, ocml, ockl) named by file, not by the path of the
    Triton installation, so that a cache written in one checkout answers in another (CI's)."""
    items = dict(options.__dict__)
    if items.get("extern_libs"):
        items["extern_libs"] = tuple((n, os.path.basename(p)) for n, p in items["extern_libs"])
    return sorted(items.items())


def _error_text(e: BaseException) -> str:
    """What failed, in one line: the root of the exception's causes (a ``CompilationError``
    shows the source with a caret; its cause says what is wrong), and of a message over
    several lines those that say what failed (ptxas's ends with a repro command)."""
    root = e
    while root.__cause__ is not None:
        root = root.__cause__
    lines = [ln.strip() for ln in str(root).splitlines() if ln.strip()]
    said = [ln for ln in lines if re.search(r"error|fatal|failed", ln, re.I)] or lines[-1:]
    head = "" if root is e else f"{type(e).__name__} {str(e).split(chr(10), 1)[0]} "
    return f"{head}{type(root).__name__}: {' | '.join(said[:3])}"[:400]


def _worker() -> None:
    """Compile the pickled ``(jobs, cache)`` from stdin (``jobs``: ``[(i, Launch, targets)]``;
    ``cache``: ``{key: result}`` of earlier runs); pickle ``(results, new cache entries, cpu
    seconds)`` to stdout. A result: ``{"ok", "error", "artifacts", "float_atomics",
    "matrix"}``; its key hashes the kernel's source with its dependencies (Triton's
    ``cache_key``), the specialisation, the options, the target and Triton's version."""
    import hashlib

    import triton

    jobs, cache = pickle.load(sys.stdin.buffer)
    # The results go to stdout; everything else written there (Triton prints a failed ptxas
    # run's PTX to stdout, ptxas writes to its inherited descriptor) goes to stderr instead.
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    results, new = {}, {}
    cpu = time.process_time()
    for i, launch, targets in jobs:
        try:
            kernel = _kernel(launch.kernel)
        except Exception as e:  # e.g. its source changed since the recording
            error = f"kernel not importable: {type(e).__name__}: {e}"[:400]
            for t in targets:
                results[(i, t)] = (None, {"ok": False, "error": error})
            continue
        for t in targets:
            try:
                key, compile_it = _binding(kernel, launch.args, launch.kwargs, t)
            except Exception as e:  # binding failed: the launch cannot be reproduced
                error = f"bind: {type(e).__name__}: {e}"[:400]
                results[(i, t)] = (None, {"ok": False, "error": error})
                continue
            full = repr((launch.kernel, kernel.cache_key, key, t, triton.__version__))
            h = hashlib.sha256(full.encode()).hexdigest()[:24]
            if h not in cache and h not in new:
                ck = compile_it()
                if isinstance(ck, str):
                    new[h] = {"ok": False, "error": ck}
                else:
                    arts = sorted(k for k in ("hsaco", "cubin") if ck.asm.get(k))
                    new[h] = {"ok": True, "error": "", "artifacts": arts, **analyse(ck.asm)}
            results[(i, t)] = (h, cache.get(h) or new[h])
    with out:
        out.write(pickle.dumps((results, new, time.process_time() - cpu)))


def _binding(kernel, args: tuple, kwargs: dict, target_name: str):
    """``(key, compile)``: what a launch with ``args``/``kwargs`` specialises to on
    ``target_name`` (Triton's binder), and a function compiling it (see :func:`_compile_one`)."""
    key_and = {}

    def compile_it():
        return _compile_one(kernel, args, kwargs, target_name, key_and)[1]

    key, _ = _compile_one(kernel, args, kwargs, target_name, key_and, bind_only=True)
    return key, compile_it


def compile_launches(
    launches: Sequence[Launch],
    targets: Sequence[Sequence[str]],
    jobs: int = 1,
    cache: dict[str, dict] | None = None,
) -> tuple[dict[tuple[int, str], tuple], dict[str, dict], dict[str, float]]:
    """Compile launch ``i`` for each of ``targets[i]``, in ``jobs`` subprocesses with the
    interpreter off. Returns ``{(i, target): (key, result)}``, the new compile results by key
    (``cache`` answers the keys it holds) and ``{"compiled", "cpu_seconds"}``."""
    cache = cache or {}
    # Launches identical but for their call and config compile once (same kernel, arguments).
    unique: dict[str, int] = {}
    alias: dict[int, int] = {}
    for i, ln in enumerate(launches):
        key = repr((ln.kernel, ln.platform, ln.args, sorted(ln.kwargs.items()), targets[i]))
        alias[i] = unique.setdefault(key, i)
    todo = sorted(set(alias.values()))
    # Each kernel's launches for one target go to one worker (a result's key holds both, so no
    # worker compiles another's), the largest groups first: a table's many GEMM configs spread
    # over the workers by target.
    groups: dict[tuple[str, str], list[tuple[int, str]]] = {}
    for i in todo:
        for t in targets[i]:
            groups.setdefault((launches[i].kernel, t), []).append((i, t))
    shares: list[list[tuple[int, str]]] = [[] for _ in range(max(1, jobs))]
    for items in sorted(groups.values(), key=len, reverse=True):
        min(shares, key=len).extend(items)
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    results: dict[tuple[int, str], dict] = {}
    entries: dict[str, dict] = {}
    cpu = 0.0
    with tempfile.TemporaryDirectory(prefix="rlk-aot-") as tmp:
        # Triton's own cache in a fresh directory: every result here comes from a compile
        # (and thousands of kernels do not land in the user's cache).
        env["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton")
        procs = []
        for w, share in enumerate(s for s in shares if s):
            job = os.path.join(tmp, f"job{w}")
            with open(job, "wb") as f:
                work = [(i, launches[i], [t]) for i, t in share]
                pickle.dump((work, cache), f)
            with open(job, "rb") as stdin, open(job + ".out", "wb") as out, \
                    open(job + ".err", "wb") as err:  # fmt: skip
                procs.append((subprocess.Popen(
                    [sys.executable, "-c", "from rlk_triton.aot_compile import _worker; _worker()"],
                    stdin=stdin, stdout=out, stderr=err, env=env,
                ), job))  # fmt: skip
        try:
            for p, job in procs:
                if p.wait():
                    with open(job + ".err", "rb") as f:
                        tail = f.read()[-4000:].decode(errors="replace")
                    raise RuntimeError(
                        f"rlk aot: a compile worker failed ({p.returncode}):\n{tail}"
                    )
                with open(job + ".out", "rb") as f:
                    got, new, seconds = pickle.load(f)
                results.update(got)
                entries.update(new)
                cpu += seconds
        finally:
            for p, _ in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    out = {(i, t): results[(alias[i], t)] for i in range(len(launches)) for t in targets[i]}
    stats = {"compiled": len(entries), "cpu_seconds": round(cpu, 1)}
    return out, entries, stats


def read_cache(path: str) -> dict[str, dict]:
    """The results of a cache file written by :func:`write_cache`, by key."""
    with open(path) as f:
        data = json.load(f)
    return {key: data["results"][i] for key, i in data["entries"].items()}


def write_cache(path: str, entries: dict[str, dict]) -> None:
    """Write ``{key: result}`` compactly: the distinct results once, and an index per key."""
    distinct: dict[str, int] = {}
    index = {}
    for key, res in sorted(entries.items()):
        index[key] = distinct.setdefault(json.dumps(res, sort_keys=True), len(distinct))
    with open(path, "w") as f:
        f.write('{"results": [\n' + ",\n".join(distinct) + '\n],\n"entries": {\n')
        f.write(",\n".join(f'"{k}": {i}' for k, i in index.items()) + "\n}}\n")
