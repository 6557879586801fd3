"""Training side: recompute the rollout's log-probabilities in packed micro-batches, and the
GRPO and PPO updates on them (:func:`grpo_step`, :func:`ppo_step`).

A micro-batch packs whole sequences (prompt + response) into one ``[1, T]`` row whose
``position_ids`` restart at 0 for each sequence (no padding). With a model patched by
:func:`rlk_integrations.models.transformers.patch_model`, the decoder runs on rlk ops and the
log-probabilities come from :func:`rlk.linear_logprobs` on the final hidden states and the
``lm_head`` weight, so they equal the rollout's bit for bit whatever the micro-batch composition.
The stock path (``use_rlk=False``) takes ``model(...).logits`` and an fp32 ``log_softmax``.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

import rlk
from rlk import validate
from rlk.parallel import vocab_parallel_linear_logprobs
from rlk_integrations.engine.critic import ValueHead
from rlk_integrations.engine.engines import Sample, logprob_temperature
from rlk_integrations.models.transformers import decoder, graph_reads, is_patched


def micro_batches(n: int, size: int, order: list[int] | None = None) -> list[list[int]]:
    """Split sample indices (in ``order``, default ``0..n-1``) into groups of ``size``."""
    order = list(range(n)) if order is None else list(order)
    return [order[i : i + size] for i in range(0, len(order), size)]


def _pack_lists(samples: list[Sample]) -> tuple[list[int], ...]:
    """``samples`` packed into one row, as host lists: token ids, positions (0 up per sample),
    offsets (``[0, end_1, ...]``), the rows whose hidden state predicts a response token, and
    those tokens."""
    ids, pos, cu, rows, targets = [], [], [0], [], []
    for s in samples:
        p, n = len(s.prompt), len(s.tokens)
        if p < 1:  # its first row would be the previous sequence's last token
            raise ValueError("every sample needs a prompt token (its first logprob's context)")
        # The hidden state at position j predicts the token at j + 1.
        rows += range(cu[-1] + p - 1, cu[-1] + n - 1)
        targets += s.response
        ids += s.tokens
        pos += range(n)
        cu.append(cu[-1] + n)
    return ids, pos, cu, rows, targets


def pack_samples(samples: list[Sample], device: torch.device):
    """``samples`` packed into one row on ``device``: int64 ``ids [1, T]`` and ``positions
    [1, T]`` (0 up per sample), the ``rows [R]`` whose hidden state predicts a response token
    and those ``targets [R]`` (R: the responses' tokens). The layout every packed recompute
    (transformers, the value head, Megatron) reads.

    Example::

        ids, pos, rows, targets = pack_samples(samples, torch.device("cpu"))
    """
    ids, pos, _, rows, targets = _pack_lists(samples)
    as_long = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
    return as_long(ids)[None], as_long(pos)[None], as_long(rows), as_long(targets)


def _rlk_logprobs(
    model: torch.nn.Module,
    ids: torch.Tensor,
    pos: torch.Tensor,
    rows: torch.Tensor,
    targets: torch.Tensor,
    temperature: float,
    logits_dtype: torch.dtype | None,
    return_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The packed rows' hidden states from the decoder, then ``rlk.linear_logprobs`` with the
    ``lm_head`` weight: ``[len(rows)]`` float32 (and the rows' entropies with
    ``return_entropy``)."""
    hidden = decoder(model)(input_ids=ids, position_ids=pos, use_cache=False)
    hidden = hidden.last_hidden_state.squeeze(0)  # one packed row (a view's gradient: no copy)
    head = model.get_output_embeddings()
    tp = getattr(model, "_rlk_tp", None)
    fn, extra = rlk.linear_logprobs, {}
    if tp is not None:  # rlk_integrations.models.tp: this rank holds a vocabulary slice of lm_head
        fn, extra = vocab_parallel_linear_logprobs, {"group": tp[2]}
    return fn(
        hidden.index_select(0, rows),
        head.weight,
        targets,
        bias=head.bias,
        temperature=temperature,
        return_entropy=return_entropy,
        logits_dtype=logits_dtype,
        **extra,
    )


def packed_logprobs(
    model: torch.nn.Module,
    samples: list[Sample],
    *,
    temperature: float = 1.0,
    use_rlk: bool = True,
    logits_dtype: torch.dtype | None = None,
    return_entropy: bool = False,
) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Log-probabilities of each sample's response tokens from one packed forward.

    Returns one float32 tensor ``[len(response)]`` per sample (differentiable when grad is on);
    with ``return_entropy`` (rlk only) a pair of such lists: the log-probabilities and the
    entropies of the tempered distributions that gave them.
    ``logits_dtype``: the dtype the rollout's logits had (default: the model's dtype).
    """
    if return_entropy and not use_rlk:
        raise ValueError("return_entropy=True needs use_rlk=True")
    device = next(model.parameters()).device
    ids, pos, rows, targets = pack_samples(samples, device)
    temperature = logprob_temperature(temperature)
    sizes = [len(s.response) for s in samples]
    if use_rlk:
        # A model sharded by shard_model runs this as an FSDP forward method (its root
        # parameters gathered around it); an unsharded model runs the same function directly.
        forward = getattr(model, FSDP_FORWARD, None) or types.MethodType(_rlk_logprobs, model)
        out = forward(ids, pos, rows, targets, temperature, logits_dtype, return_entropy)
        lp, entropy = out if return_entropy else (out, None)
        if hasattr(model, FSDP_FORWARD) and not lp.requires_grad:
            # FSDP2 keeps the root's parameters gathered after its forward, for the backward;
            # without one coming, shard them again (else model.parameters() are the gathered
            # tensors, and an optimizer built from them would miss the sharded ones).
            model.reshard()
    else:
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
        logp = torch.log_softmax(logits.index_select(0, rows).float() / temperature, dim=-1)
        lp, entropy = logp.gather(1, targets[:, None]).reshape(-1), None
    if entropy is not None:
        return list(lp.split(sizes)), list(entropy.split(sizes))
    return list(lp.split(sizes))


def compiled_logprobs(
    model: torch.nn.Module,
    *,
    temperature: float = 1.0,
    logits_dtype: torch.dtype | None = None,
    **compile_kwargs: Any,
):
    """:func:`packed_logprobs`' rlk pass under ``torch.compile(fullgraph=True)`` (and
    ``compile_kwargs``, e.g. ``mode="reduce-overhead"`` for CUDA graphs): returns a function
    ``samples -> [len(response)] float32 per sample``, differentiable, bitwise the eager pass.

    The packed offsets and the longest sequence go to attention (``cu_seq_lens_q/k``,
    ``max_length_q/k``), so the compiled graph reads nothing on the host; the rotary table is
    extended to the longest sequence before each call, outside the graph. ``model`` is a model
    patched by :func:`rlk_integrations.models.transformers.patch_model`.
    """
    base = decoder(model)

    def packed(ids, pos, cu, rows, targets, longest):
        hidden = base(
            input_ids=ids,
            position_ids=pos,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=longest,
            max_length_k=longest,
            use_cache=False,
        ).last_hidden_state.squeeze(0)
        head = model.get_output_embeddings()
        return rlk.linear_logprobs(
            hidden.index_select(0, rows),
            head.weight,
            targets,
            bias=head.bias,
            temperature=logprob_temperature(temperature),
            logits_dtype=logits_dtype,
        )

    compiled = torch.compile(packed, fullgraph=True, **compile_kwargs)

    def run(samples: list[Sample]) -> list[torch.Tensor]:
        device = next(model.parameters()).device
        ids, pos, cu, rows, targets = _pack_lists(samples)
        longest = max(len(s.tokens) for s in samples)
        base.rotary_emb._rlk_table.reserve(longest)
        as_long = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
        lp = compiled(
            as_long(ids)[None],
            as_long(pos)[None],
            torch.tensor(cu, dtype=torch.int32, device=device),
            as_long(rows),
            as_long(targets),
            longest,
        )
        return list(lp.split([len(s.response) for s in samples]))

    return run


def bucket_of(batches: list[list[Sample]]) -> dict[str, int]:
    """The smallest :class:`GraphedLogprobs` bucket that holds each of ``batches``:
    ``max_tokens``, ``max_seqs``, ``max_seq_len`` and ``max_rows``."""
    if not batches or not all(batches):
        raise ValueError("batches must hold at least one non-empty micro-batch")
    return {
        "max_tokens": max(sum(len(s.tokens) for s in b) for b in batches),
        "max_seqs": max(len(b) for b in batches),
        "max_seq_len": max(len(s.tokens) for b in batches for s in b),
        "max_rows": max(max(1, sum(len(s.response) for s in b)) for b in batches),
    }


@contextlib.contextmanager
def _capture_leaves(
    model: torch.nn.Module, params: list[torch.nn.Parameter]
) -> Iterator[list[torch.nn.Parameter]]:
    """``params`` replaced in ``model``, for the duration, by new Parameters on the same memory
    (tied weights by one), which it yields in order.

    Why: autograd runs a leaf's gradient on the stream its AccumulateGrad node was made on. A
    node the eager code made on the default stream, and that something still references (an
    earlier call's output the caller keeps), would make a captured backward wait on the
    default stream, which a capture cannot do (``cudaErrorStreamCaptureImplicit``). New leaves
    get their nodes on the capture's stream. The graphs read the same addresses."""
    alias = {id(p): torch.nn.Parameter(p.detach(), requires_grad=True) for p in params}
    swapped = [
        (module, name, p)
        for module in model.modules()
        for name, p in module._parameters.items()
        if p is not None and id(p) in alias
    ]
    for module, name, p in swapped:
        module._parameters[name] = alias[id(p)]
    try:
        yield [alias[id(p)] for p in params]
    finally:
        for module, name, p in swapped:
            module._parameters[name] = p


class GraphedLogprobs:
    """:func:`packed_logprobs` (rlk) with its forward, and its backward to the model's trainable
    parameters, each replayed as one CUDA graph.

    A small model's eager training step is bound by the host: it launches hundreds of kernels
    per layer pass, each costing the CPU more than the GPU. A graph replays them all for the
    cost of one launch. A graph has one shape, so every call packs its samples into a fixed
    bucket: ``max_tokens`` tokens in at most ``max_seqs`` sequences, each at most
    ``max_seq_len`` tokens, with at most ``max_rows`` response tokens in all (default
    ``max_tokens``). ``temperature``, ``logits_dtype`` and ``return_entropy`` are
    :func:`packed_logprobs`'s. The tokens left over form padding sequences of their own (of at most
    ``max_seq_len`` tokens, position 0 up), and the rows left over read the last token.

    Bits: rlk's ops are batch invariant and attention stays within a sequence, so the padding
    changes no real token: the log-probs are those of :func:`packed_logprobs`, bit for bit.
    Padding rows get a zero gradient, so they add exact zeros to the weights' gradients.

    The first call captures (after two eager warm-up passes on a side stream, which compile the
    kernels); its shape is every later call's. The graphs own the activations of one pass, and
    the parameters' gradients of one backward, in a private memory pool. So:

    - run a call's backward before the next call, and once: the next forward replay overwrites
      the saved activations, and so may the backward itself; a backward after the next call,
      or a second one, raises ``RuntimeError`` (no stale gradient);
    - the graphs read the parameters where they were at capture: an in-place update (an
      optimizer step, ``load_state_dict``) is fine; when a parameter, a buffer or the rotary
      table has moved, or a parameter's ``requires_grad`` has changed, the next call captures
      again;
    - ``RLK_VALIDATE`` reads values on the host, which a capture cannot: it raises.

    ``capture=False`` runs the same padded pass eagerly (any device): the bucket without the
    graphs, which is how the CPU tests check the bits.

    Example::

        graphed = GraphedLogprobs(model, max_tokens=4096, max_seqs=8, max_seq_len=512)
        for batch in micro_batches:
            lps = graphed(batch)                     # one float32 [len(response)] per sample
            loss_of(lps).backward()                  # before the next call
        optimizer.step()
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_tokens: int,
        max_seqs: int,
        max_seq_len: int | None = None,
        max_rows: int | None = None,
        temperature: float = 1.0,
        logits_dtype: torch.dtype | None = None,
        return_entropy: bool = False,
        capture: bool = True,
    ) -> None:
        max_seq_len = max_tokens if max_seq_len is None else max_seq_len
        max_rows = max_tokens if max_rows is None else max_rows
        for name, v in (
            ("max_tokens", max_tokens),
            ("max_seqs", max_seqs),
            ("max_seq_len", max_seq_len),
            ("max_rows", max_rows),
        ):
            validate.positive_int(name, v)
        if max_seq_len > max_tokens:
            raise ValueError(f"max_seq_len = {max_seq_len} exceeds max_tokens = {max_tokens}")
        if getattr(model, "_rlk_tp", None) is not None or hasattr(model, FSDP_FORWARD):
            raise ValueError("GraphedLogprobs takes an unsharded model (no TP, no FSDP)")
        if not is_patched(model):
            raise ValueError("the model is not patched by rlk: patch_model(model) first")
        self.rotary = decoder(model).rotary_emb._rlk_table
        self.device = next(model.parameters()).device
        if capture and self.device.type != "cuda":
            raise ValueError(
                f"CUDA graphs need a model on a CUDA device, got {self.device}; "
                "capture=False runs the padded pass eagerly"
            )
        if capture and validate.validate_requested():
            raise RuntimeError(
                "RLK_VALIDATE reads values on the host, which a CUDA graph capture cannot"
            )
        self.model, self.capture = model, capture
        self.tokens, self.seqs, self.seq_len, self.rows = (
            max_tokens,
            max_seqs,
            max_seq_len,
            max_rows,
        )
        self.temperature = logprob_temperature(temperature)
        self.logits_dtype = logits_dtype
        self.entropy = validate.flag("return_entropy", return_entropy)
        # Offsets: the real sequences, then padding sequences of at most max_seq_len tokens,
        # then empty ones up to a fixed count.
        self.n_offsets = max_seqs + -(-max_tokens // max_seq_len) + 1
        n = 2 * max_tokens + self.n_offsets + 2 * max_rows
        self.inputs = torch.zeros(n, dtype=torch.long, device=self.device)
        self.params: list[torch.nn.Parameter] = []
        self.state: tuple = ()  # what the graphs read and differentiate (see _state)
        self.replays = 0  # forward passes run: a backward belongs to the latest one only
        self.backed = 0  # the replay whose backward ran (it may reuse the activations' memory)
        self.fwd_graph: torch.cuda.CUDAGraph | None = None
        self.bwd_graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        self.grad_out: torch.Tensor | None = None
        self.grads: tuple[torch.Tensor | None, ...] = ()

    @classmethod
    def for_batches(
        cls, model: torch.nn.Module, batches: list[list[Sample]], **kwargs: Any
    ) -> GraphedLogprobs:
        """The smallest bucket that holds each of ``batches`` (micro-batches of samples,
        :func:`bucket_of`); ``kwargs`` are the constructor's other arguments."""
        return cls(model, **bucket_of(batches), **kwargs)

    @property
    def bucket(self) -> dict[str, int]:
        """The bucket, in the constructor's names (what :func:`bucket_of` returns)."""
        return {
            "max_tokens": self.tokens,
            "max_seqs": self.seqs,
            "max_seq_len": self.seq_len,
            "max_rows": self.rows,
        }

    def _views(self) -> tuple[torch.Tensor, ...]:
        t, r = self.tokens, self.rows
        ids, pos, cu, rows, targets = self.inputs.split([t, t, self.n_offsets, r, r])
        return ids[None], pos[None], cu, rows, targets

    def pack(self, samples: list[Sample]) -> torch.Tensor:
        """The bucket's int64 inputs (ids, positions, offsets, rows, targets) of ``samples``,
        on the CPU; ``ValueError`` when they do not fit."""
        lens = [len(s.tokens) for s in samples]
        n_rows = sum(len(s.response) for s in samples)
        if not samples:
            raise ValueError("samples is empty")
        for what, got, cap in (
            ("sequences", len(samples), self.seqs),
            ("tokens", sum(lens), self.tokens),
            ("response tokens", n_rows, self.rows),
            ("tokens in one sequence", max(lens), self.seq_len),
        ):
            if got > cap:
                raise ValueError(f"the samples have {got} {what}, the bucket holds {cap}")
        ids, pos, cu, rows, targets = _pack_lists(samples)
        while cu[-1] < self.tokens:  # padding sequences (token 0, positions from 0)
            n = min(self.seq_len, self.tokens - cu[-1])
            ids += [0] * n
            pos += range(n)
            cu.append(cu[-1] + n)
        cu += [self.tokens] * (self.n_offsets - len(cu))
        rows += [self.tokens - 1] * (self.rows - len(rows))
        targets += [0] * (self.rows - len(targets))
        return torch.tensor(ids + pos + cu + rows + targets, dtype=torch.long)

    def _pass(self) -> torch.Tensor:
        """The bucket's forward from ``self.inputs``: float32 ``[1, max_rows]`` log-probs, or
        ``[2, max_rows]`` log-probs and entropies (one output buffer for the graph)."""
        ids, pos, cu, rows, targets = self._views()
        cu32 = cu.to(torch.int32)
        hidden = decoder(self.model)(
            input_ids=ids,
            position_ids=pos,
            use_cache=False,
            cu_seq_lens_q=cu32,
            cu_seq_lens_k=cu32,
            max_length_q=self.seq_len,
            max_length_k=self.seq_len,
        ).last_hidden_state.squeeze(0)
        head = self.model.get_output_embeddings()
        out = rlk.linear_logprobs(
            hidden.index_select(0, rows),
            head.weight,
            targets,
            bias=head.bias,
            temperature=self.temperature,
            return_entropy=self.entropy,
            logits_dtype=self.logits_dtype,
        )
        return torch.stack(out) if self.entropy else out[None]

    def _state(self) -> tuple:
        """The addresses the graphs read besides their own buffers (parameters, buffers, the
        rotary table) and which parameters they differentiate: a change means capturing
        again (an in-place update, an optimizer step, changes nothing)."""
        grads = tuple(p.requires_grad for p in self.model.parameters())
        return graph_reads(self.model, self.device), grads

    @torch.enable_grad()  # the forward graph saves what the backward needs, whatever the call
    def _capture(self) -> None:
        # The old graphs, their pool and buffers go first: one bucket's memory at a time.
        self.fwd_graph = self.bwd_graph = self.out = self.grad_out = None
        self.grads = ()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.rotary.reserve(self.seq_len)  # a capture cannot extend it (that reads positions)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), _capture_leaves(self.model, self.params) as leaves:
            for _ in range(2):  # compiles every kernel, and warms the allocator
                out = self._pass()
                if leaves:
                    torch.autograd.grad(out, leaves, torch.ones_like(out), allow_unused=True)
            del out
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.fwd_graph, self.bwd_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        # Fresh leaves again: none of their nodes can come from the warm-up's stream.
        with _capture_leaves(self.model, self.params) as leaves:
            with torch.cuda.graph(self.fwd_graph):
                out = self._pass()
            if leaves:  # else a forward-only pass: nothing to differentiate
                self.grad_out = torch.empty_like(out)
                with torch.cuda.graph(self.bwd_graph, pool=self.fwd_graph.pool()):
                    self.grads = torch.autograd.grad(out, leaves, self.grad_out, allow_unused=True)
        self.out = out.detach()
        self.state = self._state()

    def __call__(
        self, samples: list[Sample]
    ) -> list[torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each sample's response log-probs, float32 ``[len(response)]`` (differentiable in the
        model's parameters when grad is on); with ``return_entropy`` a pair of such lists, the
        log-probs and the entropies, as :func:`packed_logprobs` returns them."""
        host = self.pack(samples)
        self.inputs.copy_(host.pin_memory() if self.capture else host, non_blocking=True)
        sizes = [len(s.response) for s in samples]
        n_rows = sum(sizes)
        if not self.capture:
            out = self._pass()
        else:
            if self.fwd_graph is None or self._state() != self.state:
                self._capture()
            grad = torch.is_grad_enabled() and bool(self.params)
            out = _GraphReplay.apply(self, *self.params) if grad else self._replay().clone()
        lps = list(out[0, :n_rows].split(sizes))
        return (lps, list(out[1, :n_rows].split(sizes))) if self.entropy else lps

    def _replay(self) -> torch.Tensor:
        self.fwd_graph.replay()
        self.replays += 1
        return self.out


class _GraphReplay(torch.autograd.Function):
    """The forward graph's replay as an autograd node whose backward replays the backward
    graph; the parameters are its inputs, so autograd accumulates their gradients (and runs
    their hooks) as for the eager pass."""

    @staticmethod
    def forward(ctx, graphed: GraphedLogprobs, *params: torch.Tensor) -> torch.Tensor:
        ctx.graphed = graphed
        out = graphed._replay().clone()  # the graph's output buffer is overwritten by a replay
        ctx.replay = graphed.replays
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        graphed = ctx.graphed
        if graphed.replays != ctx.replay:
            raise RuntimeError(
                "GraphedLogprobs: this backward's activations were overwritten by a later call; "
                "run each call's backward before the next call"
            )
        if graphed.backed == ctx.replay:
            # The backward graph frees saved activations as it goes, and its later kernels may
            # write into that memory: a second run would read garbage.
            raise RuntimeError("GraphedLogprobs: a call's backward runs once (no retain_graph)")
        graphed.grad_out.copy_(grad)
        graphed.bwd_graph.replay()
        graphed.backed = ctx.replay
        # The graph's gradient buffers: autograd copies them into fresh .grad tensors (it does
        # not steal a tensor held elsewhere) or adds them into existing ones.
        return (None, *graphed.grads)


def recompute_logprobs(
    model: torch.nn.Module,
    samples: list[Sample],
    micro_batch_size: int,
    *,
    order: list[int] | None = None,
    temperature: float = 1.0,
    use_rlk: bool = True,
    logits_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """:func:`packed_logprobs` over micro-batches of ``micro_batch_size`` samples taken in
    ``order``; returns the per-sample tensors in the samples' original order."""
    out: list[torch.Tensor | None] = [None] * len(samples)
    for group in micro_batches(len(samples), micro_batch_size, order):
        lps = packed_logprobs(
            model,
            [samples[i] for i in group],
            temperature=temperature,
            use_rlk=use_rlk,
            logits_dtype=logits_dtype,
        )
        for i, lp in zip(group, lps):
            out[i] = lp
    return out  # type: ignore[return-value]


def pad_rows(
    rows: list[torch.Tensor], width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D tensors into ``[B, L]`` (zero padded) and a bool mask of the real entries."""
    width = max((r.numel() for r in rows), default=0) if width is None else width
    out = torch.stack([torch.nn.functional.pad(r.float(), (0, width - r.numel())) for r in rows])
    idx = torch.arange(width, device=out.device)
    mask = torch.stack([idx < r.numel() for r in rows])
    return out, mask


def grpo_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: list[Sample],
    rewards: torch.Tensor,
    group_size: int,
    micro_batch_size: int,
    *,
    order: list[int] | None = None,
    temperature: float = 1.0,
    logits_dtype: torch.dtype | None = None,
    graphed: GraphedLogprobs | None = None,
) -> dict[str, float]:
    """One GRPO update on rlk: recompute log-probs in packed micro-batches (with grad),
    ``grpo_advantages`` per group, ``policy_loss`` against the rollout's log-probs, backward,
    optimizer step. Gradients of the micro-batches are accumulated (each scaled by its share of
    the tokens, so the sum is the token mean over the whole batch).

    ``graphed``: a :class:`GraphedLogprobs` of ``model`` (built with the same ``temperature``
    and ``logits_dtype``) that recomputes each micro-batch, its bucket holding one; the same
    bits, replayed as CUDA graphs.

    Returns ``loss``, ``max_abs_dlogp`` (rollout vs the recompute, 0 with rlk) and metrics.
    """
    if graphed is not None:
        if graphed.model is not model:
            raise ValueError("graphed is built on another model")
        if graphed.entropy:
            raise ValueError(
                "graphed returns entropies (return_entropy=True); grpo_step's does not"
            )
        # logits_dtype None is the hidden states' dtype: lm_head's.
        head_dtype = model.get_output_embeddings().weight.dtype
        have = (graphed.temperature, graphed.logits_dtype or head_dtype)
        want = (logprob_temperature(temperature), logits_dtype or head_dtype)
        if have != want:
            raise ValueError(
                f"graphed has temperature {have[0]} and logits_dtype {have[1]}; "
                f"this step asks for {want[0]} and {want[1]}"
            )
        recompute = graphed
    else:

        def recompute(batch: list[Sample]) -> list[torch.Tensor]:
            return packed_logprobs(model, batch, temperature=temperature, logits_dtype=logits_dtype)

    device = next(model.parameters()).device
    stats, _ = grpo_update(
        recompute, optimizer, samples, rewards, group_size, micro_batch_size, order=order,
        device=device,
    )  # fmt: skip
    return stats


def grpo_update(
    recompute: Callable[[list[Sample]], list[torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    samples: list[Sample],
    rewards: torch.Tensor,
    group_size: int,
    micro_batch_size: int,
    *,
    order: list[int] | None = None,
    device: torch.device | str = "cpu",
) -> tuple[dict[str, float], list[torch.Tensor]]:
    """:func:`grpo_step`'s update with any trainer: ``recompute(batch)`` gives the float32
    ``[len(response)]`` log-probabilities (with grad) of a micro-batch of samples on
    ``device`` (the transformers model's :func:`packed_logprobs`, Megatron's
    ``rlk_integrations.adapters.megatron.packed_logprobs``). Per micro-batch: GRPO advantages
    of ``rewards`` (float ``[len(samples)]``, groups of ``group_size`` consecutive samples),
    :func:`rlk.policy_loss` against the rollout's ``Sample.logprobs``, backward scaled by the
    micro-batch's share of the tokens; then one ``optimizer.step()``.

    Returns ``({"loss", "max_abs_dlogp"}, the recomputed log-probabilities per sample, detached,
    in the samples' order)``."""
    adv_all = rlk.grpo_advantages(
        rewards.to(device=device, dtype=torch.float32).contiguous(), group_size
    )
    total_tokens = sum(len(s.response) for s in samples)
    optimizer.zero_grad(set_to_none=True)
    max_d, loss_sum = 0.0, 0.0
    width = max(len(s.response) for s in samples)
    out: list[torch.Tensor | None] = [None] * len(samples)
    for group in micro_batches(len(samples), micro_batch_size, order):
        batch = [samples[i] for i in group]
        lps = recompute(batch)
        for i, lp in zip(group, lps):
            out[i] = lp.detach()
        new_p, mask = pad_rows(lps, width)
        old_p, _ = pad_rows([s.logprobs.to(device) for s in batch], width)
        max_d = max(max_d, float(((new_p.detach() - old_p).abs() * mask).max()))
        loss, _ = rlk.policy_loss(new_p, old_p, adv_all[group], mask, agg="token-mean")
        share = int(mask.sum()) / max(total_tokens, 1)
        (loss * share).backward()
        loss_sum += float(loss.detach()) * share
    optimizer.step()
    return {"loss": loss_sum, "max_abs_dlogp": max_d}, out  # type: ignore[return-value]


def packed_logprobs_and_values(
    model: torch.nn.Module,
    samples: list[Sample],
    *,
    value_head: ValueHead | None = None,
    temperature: float = 1.0,
    logits_dtype: torch.dtype | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each sample's response log-probabilities and values from one packed forward (rlk):
    two lists of float32 ``[len(response)]`` tensors, differentiable when grad is on.
    ``value_head`` defaults to ``model.rlk_value_head``. An unsharded model only (no TP, no
    FSDP)."""
    if not is_patched(model):
        raise ValueError("the model is not patched by rlk: patch_model(model) first")
    if getattr(model, "_rlk_tp", None) is not None or hasattr(model, FSDP_FORWARD):
        raise ValueError("packed_logprobs_and_values takes an unsharded model (no TP, no FSDP)")
    head = getattr(model, "rlk_value_head", None) if value_head is None else value_head
    if head is None:
        raise ValueError("no value head: pass value_head or add_value_head(model) first")
    ids, pos, rows, targets = pack_samples(samples, next(model.parameters()).device)
    hidden = decoder(model)(input_ids=ids, position_ids=pos, use_cache=False)
    hidden = hidden.last_hidden_state.squeeze(0).index_select(0, rows)
    lm_head = model.get_output_embeddings()
    lp = rlk.linear_logprobs(
        hidden,
        lm_head.weight,
        targets,
        bias=lm_head.bias,
        temperature=logprob_temperature(temperature),
        logits_dtype=logits_dtype,
    )
    sizes = [len(s.response) for s in samples]
    return list(lp.split(sizes)), list(head(hidden).split(sizes))


def ppo_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: list[Sample],
    rewards: torch.Tensor,
    micro_batch_size: int,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    clip: float = 0.2,
    value_clip: float | None = 0.5,
    value_coef: float = 0.5,
    epochs: int = 1,
    order: list[int] | None = None,
    temperature: float = 1.0,
    logits_dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """One PPO update on rlk, with a critic that is a value head on ``model``
    (:func:`rlk_integrations.engine.critic.add_value_head`) and samples from
    ``rollout.generate(..., value_head=model.rlk_value_head)``.

    ``rewards [N]``: one outcome reward per sample, put on its response's last token (verl's
    token-level rewards of an outcome reward). :func:`rlk.gae_advantages` turns them and the
    rollout's values into whitened advantages and returns, once, over the whole batch. Then
    ``epochs`` times: recompute log-probabilities and values in packed micro-batches of
    ``micro_batch_size`` samples taken in ``order`` (with grad), ``rlk.policy_loss`` (the ratio
    to the rollout's log-probabilities clipped to ``1 -/+ clip``) plus ``value_coef`` times
    ``rlk.value_loss`` (clipped at ``value_clip`` around the rollout's values), both token
    means over the whole batch (``num_tokens``: the micro-batches' losses add up to the
    batch's), backward, one optimizer step per epoch.

    Returns ``loss``, ``policy_loss``, ``value_loss`` and ``value_clip_fraction`` of the first
    epoch, and ``max_abs_dlogp`` / ``max_abs_dvalue``: rollout vs the first epoch's recompute
    (0 with rlk: the first ratio is exactly 1, the critic's old values are its values).
    """
    if any(s.values is None for s in samples):
        raise ValueError("every sample needs its rollout values: generate(..., value_head=)")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"epochs must be an int >= 1, got {epochs!r}")
    if tuple(rewards.shape) != (len(samples),):
        raise ValueError(f"rewards must be [N] = [{len(samples)}], got {tuple(rewards.shape)}")
    device = next(model.parameters()).device
    width = max(len(s.response) for s in samples)
    old_v, mask = pad_rows([s.values.to(device) for s in samples], width)
    old_p, _ = pad_rows([s.logprobs.to(device) for s in samples], width)
    token_r = torch.zeros_like(old_v)
    for i, s in enumerate(samples):
        if s.response:
            token_r[i, len(s.response) - 1] = rewards[i].float()
    adv, ret = rlk.gae_advantages(token_r, old_v, mask, gamma=gamma, lam=lam)
    total = float(max(int(mask.sum()), 1))
    first: dict[str, float] = {}
    for epoch in range(epochs):
        optimizer.zero_grad(set_to_none=True)
        out = dict.fromkeys(("loss", "policy_loss", "value_loss", "value_clip_fraction"), 0.0)
        max_p = max_v = 0.0
        for group in micro_batches(len(samples), micro_batch_size, order):
            lps, vals = packed_logprobs_and_values(
                model, [samples[i] for i in group], temperature=temperature,
                logits_dtype=logits_dtype,
            )  # fmt: skip
            new_p, m = pad_rows(lps, width)
            new_v, _ = pad_rows(vals, width)
            max_p = max(max_p, float(((new_p.detach() - old_p[group]).abs() * m).max()))
            max_v = max(max_v, float(((new_v.detach() - old_v[group]).abs() * m).max()))
            pg, _ = rlk.policy_loss(new_p, old_p[group], adv[group], m, clip_low=clip,
                                    clip_high=clip, num_tokens=total)  # fmt: skip
            vf, vm = rlk.value_loss(new_v, old_v[group], ret[group], m, clip=value_clip,
                                    num_tokens=total)  # fmt: skip
            loss = pg + value_coef * vf
            loss.backward()
            share = float(m.sum()) / total
            for k, v in (("loss", loss), ("policy_loss", pg), ("value_loss", vf)):
                out[k] += float(v.detach())
            out["value_clip_fraction"] += float(vm["clip_fraction"]) * share
        optimizer.step()
        if epoch == 0:
            first = {**out, "max_abs_dlogp": max_p, "max_abs_dvalue": max_v}
    return first


# --------------------------------------------------------------------------------------------
# FSDP2
# --------------------------------------------------------------------------------------------

# The name under which shard_model registers the packed log-prob forward on the root module.
FSDP_FORWARD = "_rlk_fsdp_logprobs"


def shard_model(model: torch.nn.Module, **fsdp_kwargs: Any) -> torch.nn.Module:
    """Shard a (patched) causal LM with FSDP2 for data-parallel training; in place, returns it.

    Calls ``torch.distributed.fsdp.fully_shard`` on each decoder layer, then on the root (the
    embeddings, final norm and ``lm_head``, tied or not, are the root's group), passing
    ``fsdp_kwargs`` (``mesh``, ``reshard_after_forward``, ``mp_policy``, ...) to every call. It
    needs an initialised process group; apply
    :func:`~rlk_integrations.models.transformers.patch_model` first. Then :func:`packed_logprobs`,
    :func:`recompute_logprobs` and :func:`grpo_step` work unchanged on each rank's own samples.

    FSDP2 gathers a group's parameters into plain contiguous tensors before its forward, so the
    rlk ops see the same weights as on one device: a sequence's log-probs are the same bits as
    unsharded (the model's ``model.model(...)`` + ``lm_head`` path is registered as a FSDP
    forward method of the root, so the root's parameters are gathered around it). Gradients are
    reduce-scattered and averaged over the ranks by the collective, in its own summation order:
    deterministic for a fixed world size and collective, but not bitwise the one-device sum.
    ``grpo_step`` scales each rank's loss to its own token mean, so the update is the global
    token mean when every rank holds the same number of response tokens.

    ``mp_policy`` with a ``param_dtype`` casts the gathered weights: the log-probs are then those
    of a rollout engine that holds the weights in that dtype.
    """
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    for layer in decoder(model).layers:
        fully_shard(layer, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)
    setattr(model, FSDP_FORWARD, types.MethodType(_rlk_logprobs, model))
    register_fsdp_forward_method(model, FSDP_FORWARD)
    return model
