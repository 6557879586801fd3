"""The packed rlk recompute replayed as CUDA graphs: :class:`GraphedLogprobs` (its forward, and
its backward to the model's trainable parameters, each one graph over a fixed bucket),
:func:`bucket_of` (the smallest bucket that holds some micro-batches), and the autograd node and
parameter aliasing its capture needs (``_GraphReplay``, ``_capture_leaves``).

The bits are those of :func:`rlk_integrations.engine.training.packed_logprobs` (rlk); the
samples are packed by :mod:`rlk_integrations.engine.packing`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

import rlk
from rlk import validate
from rlk_integrations.engine.engines import Sample, logprob_temperature
from rlk_integrations.engine.packing import FSDP_FORWARD, _pack_lists
from rlk_integrations.models.transformers import decoder, graph_reads, is_patched


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
