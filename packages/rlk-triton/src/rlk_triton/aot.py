"""Every rlk Triton kernel compiled ahead of time for AMD CDNA and NVIDIA GPUs, on the CPU, and
the numerics contract checked in the generated code (``rlk aot``).

Triton compiles for a GPU it does not have: ``triton.compile(ASTSource(kernel, signature,
constexprs), target=GPUTarget("hip", "gfx942", 64))`` gives AMD's ``amdgcn`` assembly and an
``hsaco``; ``GPUTarget("cuda", 90, 32)`` gives PTX and a ``cubin`` (Triton's wheel brings
``ptxas`` and AMD's linker). This module

1. **records** the launches rlk makes: every op (the conformance kit's, and
   :data:`EXTRA_OPS`) is called on CPU tensors, forward and backward, on the kit's inputs and
   :data:`EXTRA_CALLS` (paths the kit's small shapes miss), once per config set of every
   installed tuning table (portable, cuda, rocm); :func:`rlk_triton._triton.jit` reports each
   launch (the kernel, its arguments, its options: ``enable_fp_fusion=False``, ``num_warps``,
   ``num_stages``, ...) and the launch is skipped, not run (no launcher reads a kernel's
   output, so this takes seconds). Each call is made twice, as on an NVIDIA and as on an AMD
   GPU (``torch.version.hip`` set, the modules' ``INTERPRET`` off), so launchers that choose by
   vendor (tensor descriptors, inline PTX, the interpreter's spin limit) choose as there;
2. **compiles** each distinct launch for :data:`TARGETS` in subprocesses with the interpreter
   off, through Triton's own binder (the specialisation a real launch gets: dtypes, 16-byte
   alignment, ints equal to 1 or divisible by 16), with the recorded options;
3. **reads** the generated code: floating-point atomics (amdgcn ``global_atomic_add_f32`` and
   ``_pk_add``, the compare-and-swap loop gfx90a builds for them, PTX ``atom``/``red`` on
   floats, LLVM ``atomicrmw`` on floats) and matrix instructions (``v_mfma_*``,
   ``mma.sync.*``, ``wgmma.mma_async.*``, ``tcgen05.mma.*``);
4. **checks** the contract on that report (:func:`violations`): every launch compiles for
   every target its table's backend claims (:data:`CLAIMED`); no floating-point atomic
   outside :data:`ORDERED_ACCUMULATIONS`; one set of matrix-instruction kinds per kernel,
   target and call across all configs (a different MFMA shape sums K in another order).

What this does not show: that the code runs, or its speed, on that hardware.

Example::

    report = run(ops=["rms_norm"], targets=["gfx942", "sm_90"])
    assert not violations(report), violations(report)

This module imports neither torch nor triton at import time (``rlk --help`` loads it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from rlk_cli import Command

#: name -> (Triton backend, arch, warp size).
TARGETS: dict[str, tuple[str, str | int, int]] = {
    "gfx90a": ("hip", "gfx90a", 64),  # CDNA 2: MI210, MI250X
    "gfx942": ("hip", "gfx942", 64),  # CDNA 3: MI300X, MI325X
    "gfx950": ("hip", "gfx950", 64),  # CDNA 4: MI350X, MI355X
    "sm_80": ("cuda", 80, 32),  # Ampere: A100
    "sm_90": ("cuda", 90, 32),  # Hopper: H100, H200
    "sm_100": ("cuda", 100, 32),  # Blackwell: B200
}

#: The targets each backend's tuning table must compile for (the portable table runs on any
#: of them). A table not named here must compile for every target.
CLAIMED: dict[str, tuple[str, ...]] = {
    "triton": tuple(TARGETS),
    "cuda": ("sm_80", "sm_90", "sm_100"),
    "rocm": ("gfx90a", "gfx942", "gfx950"),
}

#: Kernels allowed floating-point atomics, with the fixed order that serialises them (the
#: contract allows an accumulation serialised in a fixed order, and only one that is named).
#: ``"module:kernel": "how the order is fixed"``. None today.
ORDERED_ACCUMULATIONS: dict[str, str] = {}

#: Kernels that no recorded input reaches, left out of the matrix, each with why (a test fails
#: on any other kernel left out, and on any of these once reached). None today.
NOT_RECORDED: dict[str, str] = {}

#: Constexprs a launcher sets from ``tensor.is_cuda``, which a CPU recording cannot see: their
#: value on each vendor's GPU (tree_gemm's flat kernel orders its pending sums with an inline
#: PTX barrier on NVIDIA only).
DEVICE_CONSTEXPRS: dict[str, dict[str, Any]] = {"ASM_BARRIER": {"cuda": True, "hip": False}}

#: The vendors a recording emulates, and the Triton backend of each.
PLATFORMS = {"nvidia": "cuda", "amd": "hip"}

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


# ------------------------------------------------------------------------------------------
# 1. Recording launches (interpreter on)
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorArg:
    """A tensor argument as Triton specialises it: dtype and misalignment of its data pointer."""

    dtype: str
    misalign: int


@dataclasses.dataclass(frozen=True)
class DescriptorArg:
    """A ``TensorDescriptor`` argument: its base tensor, shape, strides and block shape."""

    base: TensorArg
    shape: tuple
    strides: tuple
    block_shape: tuple
    padding: str


@dataclasses.dataclass
class Launch:
    """One recorded kernel launch. ``call``: the op, its input case and the launch's rank among
    that call's launches of the same kernel (the same for every config: the unit across which
    the matrix instructions must agree); ``config``: index into the report's configs."""

    kernel: str  # "module:qualname"
    platform: str  # "nvidia" | "amd"
    call: str
    config: int
    args: tuple
    kwargs: dict


def _stand_in(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return TensorArg(str(value.dtype).removeprefix("torch."), value.data_ptr() % 16)
    if type(value).__name__ == "TensorDescriptor":
        return DescriptorArg(
            _stand_in(value.base), tuple(value.shape), tuple(value.strides),
            tuple(value.block_shape), getattr(value, "padding", "zero"),
        )  # fmt: skip
    if type(value) in (tuple, list):
        return type(value)(_stand_in(v) for v in value)
    return value


def kernel_name(kernel: Any) -> str:
    fn = kernel.fn
    return f"{fn.__module__}:{fn.__qualname__}"


@contextlib.contextmanager
def recording(sink: Callable[[Any, tuple, dict], Any]) -> Iterator[None]:
    """Every launch through :func:`rlk_triton._triton.jit` in this context calls
    ``sink(kernel, args, kwargs)`` (the launch's options included) before it runs; a true
    result skips the launch."""
    from rlk_triton import _triton

    previous = _triton.LAUNCH_RECORDER
    _triton.LAUNCH_RECORDER = sink
    try:
        yield
    finally:
        _triton.LAUNCH_RECORDER = previous


def _kernel_modules() -> list:
    """Every module of rlk_triton but the jit wrapper itself, imported (launchers import some
    lazily, e.g. attention's backward)."""
    import importlib
    import pkgutil

    import rlk_triton

    names = [m.name for m in pkgutil.iter_modules(rlk_triton.__path__) if m.name != "_triton"]
    return [importlib.import_module(f"rlk_triton.{n}") for n in sorted(names)]


@contextlib.contextmanager
def _platform(name: str) -> Iterator[None]:
    """Launchers decide as on a GPU of vendor ``name``: ``torch.version.hip`` set on "amd",
    and each rlk_triton module's ``INTERPRET`` false (a launcher may pass other arguments to
    the interpreter, such as a spin limit of 1)."""
    import torch

    hip = torch.version.hip
    mods = [m for m in _kernel_modules() if getattr(m, "INTERPRET", None) is True]
    torch.version.hip = "6.4.0" if name == "amd" else None
    for m in mods:
        m.INTERPRET = False
    try:
        yield
    finally:
        torch.version.hip = hip
        for m in mods:
            m.INTERPRET = True


def gpu_tables() -> dict[str, dict]:
    """The tuning tables a GPU launch uses, by backend name: every table of rules a kernel
    module declares (``TUNING``, tree_gemm's ``TREE_TUNING``, ...; not the interpreter's
    ``CPU_TUNING``), and each installed vendor table merged over them."""
    from rlk_triton import backend, tuning

    base: dict = {}
    for mod in backend._modules().values():
        for name, value in sorted(vars(mod).items()):
            if (name != "CPU_TUNING" and isinstance(value, dict) and value
                    and all(isinstance(r, tuning.Rule) for r in value.values())):  # fmt: skip
                base.update(value)
    tables = {"triton": base}
    for name, overrides in backend.vendor_tables().items():
        tables[name] = tuning.merge(base, overrides)
    return tables


def config_sets(op: str, tables: dict[str, dict]) -> list[tuple[dict, list[str]]]:
    """``op``'s config sets over every table (:func:`rlk_triton.tuning.op_configs`), each
    once, with the tables holding it."""
    from rlk_triton import tuning

    out: dict[str, tuple[dict, list[str]]] = {}
    for name, table in tables.items():
        for cfg in tuning.op_configs(table, op):
            key = repr(sorted((k, sorted(v.items())) for k, v in cfg.items()))
            out.setdefault(key, (cfg, []))[1].append(name)
    return list(out.values())


def _tree_inputs(op: str) -> list:
    """Inputs of the tree-reduced linears (not in the conformance kit): bf16 and fp32, four
    leaves, with a bias, forward and backward."""
    import torch

    from rlk.testing.case_tools import Case

    cases = []
    for dtype in (torch.bfloat16, torch.float32):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(5, 64, generator=g).to(dtype)
        w = torch.randn(48, 64, generator=g).to(dtype)
        b = torch.randn(48, generator=g).to(dtype)
        args = {"x": x, "weight": w, "bias": b, "leaves": 4}
        cot = (torch.randn(5, 48, generator=g),)
        cases.append(Case(op, f"{str(dtype)[6:]} M=5 K=64 N=48 leaves=4", dtype, args, cot))
    return cases


def _rms_norm_wide(fn: Callable) -> None:
    """H past one chunk (the backward's chunked path) and enough rows for a two-level dW."""
    import torch

    for t, h in ((4096, 8192), (64, 16384)):
        x = torch.zeros(t, h, dtype=torch.bfloat16, requires_grad=True)
        w = torch.ones(h, dtype=torch.bfloat16, requires_grad=True)
        fn(x, w, 1e-6, None).backward(torch.zeros(t, h, dtype=torch.bfloat16))


def _rotary_tables_grad(fn: Callable) -> None:
    """cos and sin differentiated (their gradients sum over heads)."""
    import torch

    x = torch.zeros(12, 3, 32, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = (torch.zeros(12, 32, requires_grad=True) for _ in range(2))
    fn(x, cos, sin).backward(torch.zeros(12, 3, 32, dtype=torch.bfloat16))


def _attention_long_decode(fn: Callable) -> None:
    """One query against 8192 keys: the split-KV decode path and its merge."""
    import torch

    q = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    k, v = (torch.zeros(8192, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    cu_q = torch.tensor([0, 1], dtype=torch.int32)
    cu_k = torch.tensor([0, 8192], dtype=torch.int32)
    fn(q, k, v, cu_q, cu_k, True, 0.125)


def _paged_store(fn: Callable) -> None:
    """A decode step that stores its new keys and values (``k_new``, ``v_new``, ``slots``)."""
    import torch

    q = torch.zeros(2, 4, 32, dtype=torch.bfloat16)
    kc, vc = (torch.zeros(8, 16, 2, 32, dtype=torch.bfloat16) for _ in range(2))
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    seq_lens = torch.tensor([20, 33], dtype=torch.int32)
    cu_q = torch.tensor([0, 1, 2], dtype=torch.int32)
    new = torch.zeros(2, 2, 32, dtype=torch.bfloat16)
    fn(q, kc, vc, table, seq_lens, cu_q, 0.17, k_new=new, v_new=new,
       slots=torch.tensor([19, 96], dtype=torch.int64))  # fmt: skip


def _sample_large_vocab(fn: Callable) -> None:
    """A vocabulary in several parts, with top-k and top-p (the filters' kernels), and the
    RNG's uniforms (:func:`rlk_triton.sampling.uniforms`)."""
    import torch

    from rlk_triton import sampling

    b, vocab = 2, 262144
    logits = torch.zeros(b, vocab, dtype=torch.bfloat16)
    seeds, offsets = torch.zeros(b, dtype=torch.int64), torch.zeros(b, dtype=torch.int64)
    temp = torch.ones(b)
    fn(logits, seeds, offsets, temperature=temp, top_k=torch.full((b,), 50), top_p=None)
    fn(logits, seeds, offsets, temperature=temp, top_k=None, top_p=torch.full((b,), 0.9))
    sampling.uniforms(seeds, offsets, 4096)


def _grpo_batch_std(fn: Callable) -> None:
    """Advantages normalised by the batch's standard deviation."""
    import torch

    fn(torch.zeros(36), 4, norm_std="batch")


#: Calls that reach the kernels the kit's small inputs do not (every launch recorded, none
#: run: the shapes cost nothing), by op: ``call(op's function)``.
EXTRA_CALLS: dict[str, tuple[Callable[[Callable], None], ...]] = {
    "rms_norm": (_rms_norm_wide,),
    "apply_rotary": (_rotary_tables_grad,),
    "attention": (_attention_long_decode,),
    "paged_attention": (_paged_store,),
    "sample": (_sample_large_vocab,),
    "grpo_advantages": (_grpo_batch_std,),
}

#: Ops outside the conformance kit, with their inputs.
EXTRA_OPS: dict[str, Callable[[str], list]] = {
    "tree_linear": _tree_inputs,
    "column_tree_linear": _tree_inputs,
}


def _op_inputs(op: str, quick: bool) -> list:
    """``op``'s inputs on the CPU: the conformance kit's invariance cases (their batches: the
    options that choose kernels) and, unless ``quick``, its accuracy cases (more dtypes)."""
    import torch

    from rlk import testing
    from rlk.testing import case_tools

    if op in EXTRA_OPS:
        return EXTRA_OPS[op](op)
    oc = testing._build(op, True, torch.device("cpu"))
    batches = [case_tools.batch_of(c) for c in oc.invariance]
    return batches if quick else [*oc.accuracy, *batches]


def _run_case(fn: Callable, case) -> None:
    """``case`` forward and backward (its cotangents), as the conformance kit runs it."""
    from rlk.testing import checks

    if case.op not in EXTRA_OPS:
        checks.run_case(fn, case)
        return
    args = {k: v.detach().clone().requires_grad_(True) if hasattr(v, "requires_grad") else v
            for k, v in case.args.items()}  # fmt: skip
    fn(**args).backward(case.cot[0].to(case.dtype))


def launch_of(kernel, args: tuple, kwargs: dict, platform: str, call: str, config: int) -> Launch:
    """The :class:`Launch` of a recorded ``kernel[grid](*args, **kwargs)``."""
    return Launch(kernel_name(kernel), platform, call, config,
                  tuple(_stand_in(a) for a in args),
                  {k: _stand_in(v) for k, v in kwargs.items()})  # fmt: skip


def _sink(launches: list[Launch], call: str, platform: str, config: int) -> Callable:
    """A recorder appending to ``launches`` and skipping the launch; a call's n-th launch of a
    kernel is ``#n``."""
    seen: dict[str, int] = {}

    def sink(kernel, args, kwargs):
        name = kernel_name(kernel)
        rank = seen[name] = seen.get(name, -1) + 1
        launches.append(launch_of(kernel, args, kwargs, platform, f"{call} #{rank}", config))
        return True

    return sink


def record(
    ops: Sequence[str] | None = None,
    quick: bool = False,
    platforms: Iterable[str] = PLATFORMS,
    progress: Callable[[str], None] | None = None,
) -> tuple[list[Launch], list[dict]]:
    """Run every op (default: the conformance kit's and :data:`EXTRA_OPS`) on its CPU inputs,
    forward and backward, once per config set and platform, recording each launch instead of
    running it (a launcher reads no kernel's output; the outputs stay unwritten). Returns the
    launches and the configs (``{"op", "configs", "tables"}``, indexed by
    :attr:`Launch.config`). ``quick``: the kit's invariance cases only (see
    :func:`_op_inputs`)."""
    from rlk import testing
    from rlk_triton import backend, tuning

    impl = backend.make_impl(backend.default_table())
    tables = gpu_tables()
    launches: list[Launch] = []
    configs: list[dict] = []
    for op in ops or (*testing.KIT_OPS, *EXTRA_OPS):
        t0 = time.perf_counter()
        fn = impl.ops[op]
        cases = _op_inputs(op, quick)
        for cfg, held in config_sets(op, tables) or [({}, list(tables))]:
            index = len(configs)
            configs.append({"op": op, "configs": cfg, "tables": held})
            for platform in platforms:
                for case in cases:
                    sink = _sink(launches, f"{op} / {case.label}", platform, index)
                    with recording(sink), _platform(platform), tuning.force(op, cfg):
                        _run_case(fn, case)
                for call in EXTRA_CALLS.get(op, ()):
                    sink = _sink(launches, f"{op} / {call.__name__}", platform, index)
                    with recording(sink), _platform(platform), tuning.force(op, cfg):
                        call(fn)
        if progress is not None:
            progress(f"recorded {op} ({time.perf_counter() - t0:.1f}s)")
    return launches, configs


def jit_functions(module) -> dict[str, Any]:
    """The Triton functions (kernels and device functions) defined in ``module``, by name."""
    from rlk_triton._triton import triton

    kinds = (triton.runtime.jit.JITFunction, triton.runtime.interpreter.InterpretedFunction)
    return {
        name: obj
        for name, obj in vars(module).items()
        if isinstance(obj, kinds) and getattr(obj.fn, "__module__", None) == module.__name__
    }


def launched_kernels(modules: Sequence) -> list[str]:
    """The kernels of ``modules`` (as :func:`kernel_name` writes them): their Triton functions
    that no Triton function of ``modules`` calls (those are device functions)."""
    import inspect

    funcs = [(m, name, f) for m in modules for name, f in jit_functions(m).items()]
    src = [(m, inspect.getsource(f.fn)) for m, _, f in funcs]

    def called(i: int) -> bool:
        mod, name, f = funcs[i]
        plain = re.compile(rf"\b{re.escape(name)}\s*\(")  # where the name is bound to f
        short = mod.__name__.rsplit(".", 1)[-1]
        dotted = re.compile(rf"\b{re.escape(short)}\.{re.escape(name)}\s*\(")
        return any((plain if vars(m).get(name) is f else dotted).search(body)
                   for j, (m, body) in enumerate(src) if j != i)  # fmt: skip

    return sorted(kernel_name(f) for i, (_, _, f) in enumerate(funcs) if not called(i))


def bare_kernels(modules: Iterable) -> list[str]:
    """Triton functions of ``modules`` not built by :func:`rlk_triton._triton.jit` (a bare
    ``triton.jit`` launches with Triton's fusion default, not ``enable_fp_fusion=False``)."""
    return sorted(kernel_name(f) for m in modules for f in jit_functions(m).values()
                  if not getattr(f, "rlk_jit", False))  # fmt: skip


def bare_jit_sources(paths: Iterable[str]) -> list[str]:
    """``file:line`` of every use of Triton's own ``jit`` in the Python files ``paths`` (a
    decorator or a call of ``triton.jit``, ``triton.autotune``, or ``jit`` imported from
    triton): for modules that cannot be imported here (an engine missing)."""
    import ast

    out = []
    for path in paths:
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        from_triton = {a.asname or a.name for node in ast.walk(tree)
                       if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("triton")
                       for a in node.names}  # fmt: skip
        for node in ast.walk(tree):
            target = node.func if isinstance(node, ast.Call) else node
            if isinstance(target, ast.Attribute) and target.attr in ("jit", "autotune"):
                base = target.value
                if isinstance(base, ast.Name) and base.id == "triton":
                    out.append(f"{path}:{node.lineno}")
            elif isinstance(target, ast.Name) and target.id in from_triton & {"jit", "autotune"}:
                out.append(f"{path}:{node.lineno}")
    return sorted(set(out))


# ------------------------------------------------------------------------------------------
# 2. Compiling (a subprocess, interpreter off)
# ------------------------------------------------------------------------------------------


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
                    sorted(options.__dict__.items())))  # fmt: skip
        memo["bound"] = (key, target, signature, constexprs, attrs, options)
    key, target, signature, constexprs, attrs, options = memo["bound"]
    if bind_only:
        return key, None
    try:
        src = ASTSource(kernel, signature, constexprs, attrs)
        return key, triton.compile(src, target=target, options=options.__dict__)
    except Exception as e:  # the compiler's error is the result
        lines = str(e).strip().splitlines()
        return key, f"{type(e).__name__}: {lines[-1] if lines else ''}"[:400]


def _worker() -> None:
    """Compile the pickled ``(jobs, cache)`` from stdin (``jobs``: ``[(i, Launch, targets)]``;
    ``cache``: ``{key: result}`` of earlier runs); pickle ``(results, new cache entries, cpu
    seconds)`` to stdout. A result: ``{"ok", "error", "artifacts", "float_atomics",
    "matrix"}``; its key hashes the kernel's source with its dependencies (Triton's
    ``cache_key``), the specialisation, the options, the target and Triton's version."""
    import hashlib

    import triton

    jobs, cache = pickle.load(sys.stdin.buffer)
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
    sys.stdout.buffer.write(pickle.dumps((results, new, time.process_time() - cpu)))


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
    # Whole kernels per worker (the worker compiles each specialisation once), longest first.
    by_kernel: dict[str, list[int]] = {}
    for i in todo:
        by_kernel.setdefault(launches[i].kernel, []).append(i)
    shares: list[list[int]] = [[] for _ in range(max(1, jobs))]
    for idx in sorted(by_kernel.values(), key=len, reverse=True):
        min(shares, key=len).extend(idx)
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
                work = [(i, launches[i], targets[i]) for i in share]
                pickle.dump((work, cache), f)
            with open(job, "rb") as stdin, open(job + ".out", "wb") as out, \
                    open(job + ".err", "wb") as err:  # fmt: skip
                procs.append((subprocess.Popen(
                    [sys.executable, "-c", "from rlk_triton.aot import _worker; _worker()"],
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


# ------------------------------------------------------------------------------------------
# 3. The report and the contract
# ------------------------------------------------------------------------------------------


def run(
    ops: Sequence[str] | None = None,
    targets: Sequence[str] = tuple(TARGETS),
    quick: bool = False,
    jobs: int = 1,
    cache: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict:
    """Record, compile and analyse (see the module's docstring). The report::

        {"triton": version, "targets": [...], "configs": [{"op", "configs", "tables"}],
         "rows": [{"kernel", "call", "config", "target", "ok", "error", "artifacts",
                   "float_atomics", "matrix"}],
         "seconds": {"record", "compile"}, "compiled", "cached", "cpu_seconds"}

    one row per distinct (kernel, call, config, target). ``cache``: a JSON file of earlier
    results by key (see :func:`_worker`): its entries are used, and it is rewritten with this
    run's (a run of every op and target drops the others), so that only kernels whose source
    (or Triton) changed compile again.
    """
    unknown = [t for t in targets if t not in TARGETS]
    if unknown:
        raise ValueError(f"targets: unknown {unknown}; known: {', '.join(TARGETS)}")
    t0 = time.perf_counter()
    launches, configs = record(ops, quick=quick, progress=progress)
    t1 = time.perf_counter()
    known = read_cache(cache) if cache and os.path.exists(cache) else {}
    report, entries = compile_report(launches, configs, targets, jobs=jobs, cache=known,
                                     progress=progress)  # fmt: skip
    report["seconds"]["record"] = round(t1 - t0, 1)
    if cache:
        # A run of every op and target keeps only what it used (stale keys go); a partial run
        # adds to the file.
        whole = ops is None and set(targets) == set(TARGETS)
        write_cache(cache, entries if whole else {**known, **entries})
    return report


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


def compile_report(
    launches: Sequence[Launch],
    configs: list[dict],
    targets: Sequence[str] = tuple(TARGETS),
    jobs: int = 1,
    cache: dict[str, dict] | None = None,
    progress: Callable[[str], None] | None = None,
) -> tuple[dict, dict[str, dict]]:
    """The report of :func:`run` for recorded ``launches`` and their ``configs``, and the
    compile results by key that it used (``cache``'s and new ones)."""
    from rlk_triton._triton import triton

    t0 = time.perf_counter()
    if progress is not None:
        progress(f"compiling {len(launches)} launches for {', '.join(targets)} ({jobs} jobs)")
    # Each launch on the targets of its platform that a table holding its config claims.
    per = []
    for ln in launches:
        claimed = {t for name in configs[ln.config]["tables"] for t in CLAIMED.get(name, TARGETS)}
        vendor = PLATFORMS[ln.platform]
        per.append([t for t in targets if TARGETS[t][0] == vendor and t in claimed])
    results, new, stats = compile_launches(launches, per, jobs=jobs, cache=cache)
    rows, seen, used = [], set(), dict(new)
    for i, ln in enumerate(launches):
        for t in targets:
            if (i, t) not in results or (ln.kernel, ln.call, ln.config, t) in seen:
                continue
            seen.add((ln.kernel, ln.call, ln.config, t))
            key, res = results[(i, t)]
            if key:
                used[key] = res
            rows.append({"kernel": ln.kernel, "call": ln.call, "config": ln.config,
                         "target": t, **res})  # fmt: skip
    report = {
        "triton": triton.__version__,
        "targets": list(targets),
        "configs": configs,
        "rows": rows,
        "seconds": {"record": 0.0, "compile": round(time.perf_counter() - t0, 1)},
        "compiled": stats["compiled"],
        "cached": len(used) - stats["compiled"],
        "cpu_seconds": stats["cpu_seconds"],
    }
    return report, used


def violations(report: dict) -> list[str]:
    """The contract's breaches in ``report`` (empty when it holds):

    - a launch that does not compile for a target that a table holding its config claims;
    - a floating-point atomic in a kernel not in :data:`ORDERED_ACCUMULATIONS`;
    - two sets of matrix-instruction kinds for one kernel, target and call across configs.
    """
    out = []
    configs = report["configs"]
    kinds: dict[tuple[str, str, str], dict[tuple, list[int]]] = {}
    for r in report["rows"]:
        claimed = {t for name in configs[r["config"]]["tables"]
                   for t in CLAIMED.get(name, TARGETS)}  # fmt: skip
        where = f"{r['kernel']} [{r['call']}, config {r['config']}] on {r['target']}"
        if not r["ok"]:
            if r["target"] in claimed:
                out.append(f"does not compile: {where}: {r['error']}")
            continue
        if r["float_atomics"] and r["kernel"] not in ORDERED_ACCUMULATIONS:
            out.append(f"floating-point atomics {r['float_atomics']}: {where}")
        group = kinds.setdefault((r["kernel"], r["target"], r["call"]), {})
        group.setdefault(tuple(r["matrix"]), []).append(r["config"])
    for (kernel, target, call), sets in kinds.items():
        if len(sets) > 1:
            shown = "; ".join(f"{list(k) or 'none'} in configs {v}" for k, v in sets.items())
            out.append(f"matrix instructions differ across configs: {kernel} [{call}] on "
                       f"{target}: {shown}")  # fmt: skip
    return out


def summary(report: dict) -> str:
    """Per kernel and target: configs compiled (of those recorded), float atomics, matrix
    instruction kinds; then the contract's verdict."""
    per: dict[tuple[str, str], dict] = {}
    for r in report["rows"]:
        s = per.setdefault((r["kernel"], r["target"]), {"n": 0, "ok": 0, "atomics": set(),
                                                         "matrix": set(), "configs": set()})  # fmt: skip
        s["n"] += 1
        s["ok"] += r["ok"]
        s["configs"].add(r["config"])
        if r["ok"]:
            s["atomics"].update(r["float_atomics"])
            s["matrix"].update(r["matrix"])
    lines = [f"rlk aot: Triton {report['triton']}, targets {', '.join(report['targets'])}; "
             f"{len(report['rows'])} compilations of {len(report['configs'])} config sets"]  # fmt: skip
    lines.append(f"{'kernel':58} {'target':7} {'compiled':>10} {'configs':>7}  matrix; atomics")
    for (kernel, target), s in sorted(per.items()):
        atom = ", ".join(sorted(s["atomics"])) or "none"
        mat = ", ".join(sorted(s["matrix"])) or "none"
        lines.append(f"{kernel:58} {target:7} {s['ok']:>4}/{s['n']:<5} {len(s['configs']):>7}"
                     f"  {mat}; atomics: {atom}")  # fmt: skip
    bad = violations(report)
    lines += [f"VIOLATION {v}" for v in bad[:50]]
    if len(bad) > 50:
        lines.append(f"... {len(bad) - 50} more")
    secs = report["seconds"]
    lines.append(f"{'contract holds' if not bad else f'{len(bad)} violations'} "
                 f"(record {secs['record']}s, compile {secs['compile']}s: "
                 f"{report['compiled']} compiled in {report['cpu_seconds']} CPU-s, "
                 f"{report['cached']} from the cache)")  # fmt: skip
    return "\n".join(lines)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ops", default=None, help="comma-separated ops (default: the kit's)")
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated targets")
    p.add_argument(
        "--quick", action="store_true",
        help="the kit's invariance cases only, not its accuracy cases (their other dtypes)",
    )  # fmt: skip
    p.add_argument("--jobs", type=int, default=1, help="compile subprocesses (default 1)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON")
    p.add_argument(
        "--cache", default=None, metavar="FILE",
        help="results of earlier runs by kernel source, specialisation, options, target and "
        "Triton version: used, then rewritten with this run's",
    )  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def _run_command(args: argparse.Namespace) -> int:
    ops = [o.strip() for o in args.ops.split(",") if o.strip()] if args.ops else None
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    progress = None if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    try:
        report = run(ops, targets, quick=args.quick, jobs=args.jobs, cache=args.cache,
                     progress=progress)  # fmt: skip
    except (ValueError, KeyError) as e:
        print(f"rlk: error: {e}", file=sys.stderr)
        return 2
    print(summary(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**report, "violations": violations(report)}, f, indent=1)
    return 1 if violations(report) else 0


#: ``rlk aot`` (entry-point group ``rlk.commands``).
COMMAND = Command(
    help="compile every rlk Triton kernel for gfx90a/gfx942/gfx950 and sm_80/90/100 on this "
    "machine and check the contract in the generated code",
    add_arguments=_add_arguments,
    run=_run_command,
)
