"""Step 1 of ``rlk aot`` (:mod:`rlk_triton.aot`): the launches rlk makes, recorded on the CPU.

Every op (the conformance kit's, and :data:`EXTRA_OPS`) is called on CPU tensors, forward and
backward, on the kit's inputs and :data:`EXTRA_CALLS` (paths the kit's small shapes miss),
once per config set of every installed tuning table (portable, cuda, rocm);
:func:`rlk_triton._triton.jit` reports each launch (the kernel, its arguments, its options:
``enable_fp_fusion=False``, ``num_warps``, ``num_stages``, ...) and the launch is skipped, not
run. Each call is made twice, as on an NVIDIA and as on an AMD GPU (:func:`_platform`). Also
here: the kernels a module defines and launches, and those built outside rlk's ``jit``
(:func:`bare_kernels`, :func:`bare_jit_sources`).

Example::

    launches, configs = record(["rms_norm"], quick=True)
    assert all(ln.kwargs["enable_fp_fusion"] is False for ln in launches)

This module imports neither torch nor triton at import time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

#: Kernels that no recorded input reaches, left out of the matrix, each with why (a test fails
#: on any other kernel left out, and on any of these once reached). None today.
NOT_RECORDED: dict[str, str] = {}

#: The vendors a recording emulates, and the Triton backend of each.
PLATFORMS = {"nvidia": "cuda", "amd": "hip"}


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
    leaves, with a bias, forward and backward; ``tree_linear`` also bf16 at 1 and 2 leaves,
    where the fused kernel's largest tiles launch (they do not fit 4 leaves:
    ``tree_gemm._fits_tree``)."""
    import torch

    from rlk.testing.case_tools import Case

    cases = []
    runs = [(torch.bfloat16, 4), (torch.float32, 4)]
    if op == "tree_linear":
        runs += [(torch.bfloat16, 1), (torch.bfloat16, 2)]
    for dtype, leaves in runs:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(5, 64, generator=g).to(dtype)
        w = torch.randn(48, 64, generator=g).to(dtype)
        b = torch.randn(48, generator=g).to(dtype)
        args = {"x": x, "weight": w, "bias": b, "leaves": leaves}
        cot = (torch.randn(5, 48, generator=g),)
        label = f"{str(dtype)[6:]} M=5 K=64 N=48 leaves={leaves}"
        cases.append(Case(op, label, dtype, args, cot))
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
    oc = testing.build_cases(op, True, torch.device("cpu"))
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
