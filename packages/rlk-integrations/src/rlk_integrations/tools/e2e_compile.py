"""The e2e family's compiled training rows (``e2e.train.compiled``, CUDA only): the training
row's step (:mod:`rlk_integrations.tools.e2e_bench`: the packed row, the log-probability of every
token after each sequence's first, their sum, backward) with ``torch.compile`` on both sides:

- ``stock compiled``: stock transformers, ``model(...).logits``, ``log_softmax`` + ``gather``
  in fp32, compiled (graph breaks allowed);
- ``stock+liger compiled``: stock transformers with Liger's kernels applied (its RMSNorm,
  SwiGLU MLP and rotary, through ``apply_liger_kernel_to_<model_type>``), the hidden states
  into Liger's fused linear cross-entropy, compiled (graph breaks allowed); skipped when Liger
  is missing or fails;
- ``rlk compiled``: :func:`rlk_integrations.engine.training.compiled_logprobs` (the patched model,
  ``fullgraph=True``);
- ``stock compiled cudagraphs``, ``rlk compiled cudagraphs``: the stock and rlk rows with
  ``mode="reduce-overhead"`` (CUDA graphs; two more untimed steps: the warm-up and the
  recording).

Each row compiles a model of its own (the same seeded weights), so that Liger's changes to the
model and to transformers' modules (restored afterwards) reach no other row. The warm-up
iterations compile; the timed ones run the compiled code.

The e2e family runs ``stock+liger compiled`` last, after every model's other rows
(:data:`LIGER`): on qwen3-0.6b (an H100, Liger 0.8.5, torch 2.11) that peer ended in an illegal
memory access, which leaves the process's CUDA context unusable, so any row after it fails.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator

import torch

from rlk.bench import timing
from rlk_integrations.engine import training
from rlk_integrations.engine.engines import Sample
from rlk_integrations.models.transformers import decoder, patch_model
from rlk_integrations.tools.e2e_common import (
    DTYPE,
    SEED,
    TRAIN_ITERS,
    free,
    say,
    train_samples,
    train_seconds,
)
from rlk_integrations.tools.zoo import load_model, make_config


@contextlib.contextmanager
def _liger_applied(model) -> Iterator[None]:
    """Liger's kernels on ``model`` (rotary, RMSNorm, SwiGLU), and transformers' modeling
    module of its architecture restored on exit (Liger replaces its names)."""
    from liger_kernel import transformers as liger

    kind = model.config.model_type
    module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    saved = dict(vars(module))
    try:
        getattr(liger, f"apply_liger_kernel_to_{kind}")(
            rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
            fused_linear_cross_entropy=False, model=model,
        )  # fmt: skip
        yield
    finally:
        for name in set(vars(module)) - set(saved):
            delattr(module, name)
        for name, value in saved.items():
            if vars(module).get(name) is not value:
                setattr(module, name, value)


def _stock(model, flce, mode) -> Callable[[list[Sample]], torch.Tensor]:
    """The stock step's log-probabilities (``flce``: through Liger's fused linear
    cross-entropy), compiled in ``mode``."""

    def logprobs(ids, pos, rows, targets):
        if flce is None:
            logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
            logp = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)
            return logp.gather(1, targets[:, None]).reshape(-1)
        hidden = decoder(model)(input_ids=ids, position_ids=pos, use_cache=False)
        head = model.get_output_embeddings()
        h = hidden.last_hidden_state[0].index_select(0, rows)
        return -flce(h, head.weight, targets, bias=head.bias, reduction="none")

    compiled = torch.compile(logprobs, mode=mode)

    def run(samples):
        return compiled(*training.pack_samples(samples, next(model.parameters()).device))

    return run


#: The rows of :func:`compiled_trainings`, in order, and the one the family runs last.
IMPLS = (
    "stock compiled",
    "stock+liger compiled",
    "rlk compiled",
    "stock compiled cudagraphs",
    "rlk compiled cudagraphs",
)
LIGER = "stock+liger compiled"


def compiled_trainings(
    name: str, n: int, length: int, device, emit, flce, impls: tuple[str, ...] = IMPLS
) -> None:
    """The ``e2e.train.compiled`` rows ``impls`` (of :data:`IMPLS`) of model ``name`` on the
    training rows' ``n`` sequences of ``length`` tokens, timed as they are."""
    samples = train_samples(make_config(name).vocab_size, n, length)
    shape, tokens = f"{name} {n}x{length}", n * length

    unknown = set(impls) - set(IMPLS)
    if unknown:
        raise ValueError(f"impls has rows {sorted(unknown)} not in {IMPLS}")
    for impl in (i for i in IMPLS if i in impls):
        liger = flce if impl == LIGER else None
        mode = "reduce-overhead" if impl.endswith("cudagraphs") else None
        if impl == LIGER and liger is None:
            continue
        torch._dynamo.reset()
        model = load_model(name, dtype=DTYPE, device=device, seed=SEED)
        try:
            with contextlib.ExitStack() as stack:
                if impl.startswith("rlk"):
                    fn = training.compiled_logprobs(patch_model(model), mode=mode)
                else:
                    if liger is not None:
                        stack.enter_context(_liger_applied(model))
                    fn = _stock(model, liger, mode)

                def step(m, s, fn=fn):
                    out = fn(s)
                    (torch.cat(out) if isinstance(out, list) else out).sum().backward()

                say(f"e2e: {shape} e2e.train.compiled {impl}")
                for _ in range(2 if mode else 0):  # CUDA graphs: the warm-up and the recording
                    step(model, samples)
                    model.zero_grad(set_to_none=True)
                seconds = train_seconds(model, step, samples, device)
        except Exception as e:
            if impl != LIGER:
                raise
            say(f"e2e: stock+liger compiled failed, row skipped ({type(e).__name__}: {e})")
            continue
        finally:
            model = fn = step = None  # the compiled code holds the model
            free(device)
            torch._dynamo.reset()
        emit(
            timing.row(
                "e2e.train.compiled", shape, "bf16", impl, seconds * 1e3,
                timing=f"wall, median of {TRAIN_ITERS}", tok_s=round(tokens / seconds, 1),
                tokens=tokens, layout=f"packed 1x{tokens}",
            )
        )  # fmt: skip
