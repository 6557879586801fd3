"""Where a paged rollout's decode step spends its GPU time, per kernel, against the HBM roofline.

    python scripts/profile_decode.py [--model llama3-8b-4layers] [--batch 64] [--new 128]
                                     [--no-fuse]

Runs the e2e benchmark's paged rollout (``rlk_integrations.tools.e2e_bench``: random prompts of
16-64 tokens, every request admitted at once, CUDA graphs on, one engine kept across the runs)
once to warm up, once timed, and once under ``torch.profiler`` (kernels inside graph replays are
recorded one by one). Prints

- the wall time per generated token step, the GPU kernel time per step, and their gap (time the
  GPU waited for the host, or ran nothing);
- the bytes a decode step must read (every weight once, plus the KV cache at the mean
  context) over the step time, against a copy-bandwidth ceiling measured in the same process;
- the kernels by total GPU time, with their time per step and their share.

The step count is the number of new tokens (prefill runs inside the first steps; its kernels
are in the totals).

``--padded``: the eager padded rollout instead (``rlk_integrations.engine.rollout.generate``, rlk's
ops called one by one from Python on a left-padded batch) against transformers' ``generate`` on the
unpatched model: wall and GPU kernel time per step for both, and the host functions that take
the most time in one rlk rollout (cProfile, by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
from profile_training import kernel_times  # scripts/ is on sys.path when run as a script

from rlk.bench.timing import ceilings
from rlk_integrations.engine import engines
from rlk_integrations.models.transformers import patch_model, unpatch_model
from rlk_integrations.tools import e2e_bench as e2e
from rlk_integrations.tools.consistency import random_prompts
from rlk_integrations.tools.zoo import load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b-4layers")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--new", type=int, default=e2e.NEW_TOKENS)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--padded", action="store_true", help="the eager padded rollout instead")
    p.add_argument("--no-fuse", action="store_true", help="q/k/v and gate/up as separate GEMMs")
    a = p.parse_args()
    device = torch.device("cuda")
    model = load_model(a.model, dtype=e2e.DTYPE, device=device, seed=0)
    patch_model(model)
    prompts = random_prompts(a.batch, model.config.vocab_size, *e2e.PROMPT_LEN, seed=e2e.SEED)
    if a.padded:
        padded(model, prompts, a.new, a.top)
        return

    options = engines.RolloutOptions(fuse_projections=not a.no_fuse)
    engine, seeds = engines.create("paged", options), list(range(a.batch))

    def run():  # the engine keeps its KV cache and CUDA graphs for the same model
        return engine.generate(model, prompts, a.new, seeds)

    run()  # compile, capture the graphs
    torch.cuda.synchronize()
    t = time.perf_counter()
    run()
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    gpu_s, per = kernel_times(run)
    gpu_us = gpu_s * 1e6

    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg = model.config
    kv_heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    mean_ctx = sum(len(q) for q in prompts) / len(prompts) + a.new / 2
    kv_bytes = 2 * cfg.num_hidden_layers * kv_heads * head_dim * 2 * mean_ctx * a.batch
    emb = model.get_input_embeddings().weight
    if emb is not model.get_output_embeddings().weight:
        weight_bytes -= emb.numel() * emb.element_size()  # a step reads B rows of it only
    step_s = wall / a.new
    copy = ceilings()["copy_GBps"]
    achieved = (weight_bytes + kv_bytes) / step_s / 1e9

    fuse = "separate" if a.no_fuse else "fused"
    print(f"model {a.model}  B={a.batch}  new={a.new}  prompts {e2e.PROMPT_LEN}  {fuse} q/k/v")
    print(f"{'kernel':<60} {'us/step':>9} {'calls/step':>10} {'share':>6}")
    for name, (us, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[: a.top]:
        print(f"{name:<60} {us / a.new:9.1f} {n / a.new:10.1f} {us / gpu_us:6.1%}")
    print()
    print(f"{'what':<40} {'value':>12}")
    print(f"{'wall per step (us)':<40} {step_s * 1e6:12.1f}")
    print(f"{'GPU kernels per step (us)':<40} {gpu_us / a.new:12.1f}")
    print(f"{'tokens/s':<40} {a.batch * a.new / wall:12.1f}")
    print(f"{'bytes per step (GB): weights + KV':<40} {(weight_bytes + kv_bytes) / 1e9:12.3f}")
    print(f"{'achieved read rate (GB/s)':<40} {achieved:12.1f}")
    print(f"{'copy bandwidth (GB/s)':<40} {copy:12.1f}")
    print(f"{'share of the roofline':<40} {achieved / copy:12.1%}")


def _wall(run) -> float:
    """Wall seconds of one call of ``run``, after a warm-up call."""
    run()
    return e2e._wall(run, torch.device("cuda"))[1]


def padded(model, prompts, new: int, top: int) -> None:
    """``--padded``: the eager padded rollout against transformers' ``generate``. Both wall
    times come before any profiler runs in the process (``generate`` timed after them took
    2.5x its time in ``rlk bench``)."""

    engine, seeds = engines.create("padded"), list(range(len(prompts)))

    def rlk_run():
        return engine.generate(model, prompts, new, seeds)

    def hf_run():
        return e2e._hf_generate(model, prompts, new)

    unpatch_model(model)
    hf_wall = _wall(hf_run)
    patch_model(model)
    rlk_wall = _wall(rlk_run)
    rlk_gpu = kernel_times(rlk_run)[0]
    pr = cProfile.Profile()
    pr.enable()
    rlk_run()
    pr.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(top)
    print(out.getvalue())
    unpatch_model(model)
    hf_gpu = kernel_times(hf_run)[0]
    print(f"B={len(prompts)}  new={new}  prompts {e2e.PROMPT_LEN}")
    print(f"{'impl':<14} {'wall us/step':>13} {'GPU us/step':>12} {'host-bound us/step':>19}")
    for name, wall, gpu in (("rlk padded", rlk_wall, rlk_gpu), ("hf-generate", hf_wall, hf_gpu)):
        print(f"{name:<14} {wall / new * 1e6:13.1f} {gpu / new * 1e6:12.1f} "
              f"{(wall - gpu) / new * 1e6:19.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
