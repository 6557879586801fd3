"""What the vLLM tests share. Importing it skips the test module, saying why, without
transformers or without vLLM :data:`~rlk_integrations.adapters.vllm.TESTED_VLLM`.

:func:`write_checkpoint` writes the checkpoint of the tests that run stock vLLM beside rlk (the
negative controls): the built-in ``tiny`` Qwen2 with 2 query heads of 64 dimensions and 1
key/value head instead of 4 and 2 of 32, because stock vLLM's eager CPU attention died once with
SIGILL at head_dim 32 on a CI host and 64 is a size it takes too (vLLM's Qwen2 derives
head_dim = hidden / heads).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
import rlk_integrations.adapters.vllm as rv  # noqa: E402

try:
    rv.check_vllm()
except RuntimeError as e:
    pytest.skip(f"vLLM tests need vLLM {rv.TESTED_VLLM}: {e}", allow_module_level=True)

from rlk_integrations.models import transformers as rt  # noqa: E402
from rlk_integrations.tools import zoo  # noqa: E402

__all__ = ["ENGINE", "VOCAB", "load_trainer", "prompts", "rv", "start_engine", "write_checkpoint"]

VOCAB = zoo.CONFIGS["tiny"][1]["vocab_size"]
#: The engine arguments every test engine starts with (a module adds its own): eager (the
#: interpreter's warm-up would take minutes), small blocks, prefix caching, a seed.
ENGINE = dict(
    enforce_eager=True,
    skip_tokenizer_init=True,
    gpu_memory_utilization=0.1,  # on CPU: the share of host memory reserved for the KV cache
    max_model_len=128,
    block_size=16,
    enable_prefix_caching=True,
    seed=0,
)


def write_checkpoint(path: str, *, tokenizer: bool = False, kv_heads: int = 1) -> None:
    """The head_dim-64 tiny Qwen2 (seeded random bf16 weights, safetensors) with ``kv_heads``
    key/value heads (2: it splits over two tensor-parallel ranks); with ``tokenizer`` also a
    word-level tokenizer of its ids (``t0`` ... ``t511``), which vLLM's OpenAI server needs to
    render completions."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    fields = dict(zoo.CONFIGS["tiny"][1], num_attention_heads=2, num_key_value_heads=kv_heads)
    cfg = Qwen2Config(**dict(fields, head_dim=64))
    cfg.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(path)
    if tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
        words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0").save_pretrained(path)


def start_engine(path: str, **engine_kwargs):
    """``vllm.LLM(model=path, **ENGINE, **engine_kwargs)``, or a skip naming why it cannot
    start (a failure under RLK_REQUIRE_VLLM=1, which ``nox -s tests`` sets)."""
    from vllm import LLM

    try:
        return LLM(model=path, **{**ENGINE, **engine_kwargs})
    except Exception as e:  # noqa: BLE001 - any start failure is reported, never swallowed
        if os.environ.get("RLK_REQUIRE_VLLM") == "1":
            raise
        pytest.skip(f"vLLM's engine cannot start here: {type(e).__name__}: {e}")


def prompts(lengths, seed=0) -> list[list[int]]:
    """Seeded random token-id prompts of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def load_trainer(path: str) -> torch.nn.Module:
    """The checkpoint as the trainer holds it: bf16, patched onto rlk's ops."""
    return rt.patch_model(zoo.load_model(path, dtype=torch.bfloat16))
