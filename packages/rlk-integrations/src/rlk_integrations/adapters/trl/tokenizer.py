"""A character-level tokenizer built locally, for the examples and tests of the TRL trainers
with the random-weight models of :mod:`rlk_integrations.tools.zoo` (nothing downloaded)."""

from __future__ import annotations

from typing import Any

#: The characters of :func:`char_tokenizer`, ids 3.. in this order (0 pad, 1 eos, 2 unk).
CHARS = "".join(chr(c) for c in range(32, 127))


def char_tokenizer(vocab_size: int) -> Any:
    """A character-level ``PreTrainedTokenizerFast`` built locally (nothing downloaded), for
    examples and tests with the random-weight models of :mod:`rlk_integrations.tools.zoo`.

    Ids: 0 ``<pad>``, 1 ``<eos>``, 2 ``<unk>``, then the printable ASCII characters
    (:data:`CHARS`), then placeholders ``<x{id}>`` up to ``vocab_size`` so that every id the
    model can sample decodes. Left padding, as TRL requires. Example::

        tok = char_tokenizer(512)
        tok("1+2=")["input_ids"]  # [20, 14, 21, 32]
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<unk>"]
    if vocab_size < len(specials) + len(CHARS):
        raise ValueError(f"vocab_size must be >= {len(specials) + len(CHARS)}, got {vocab_size}")
    names = specials + list(CHARS)
    names += [f"<x{i}>" for i in range(len(names), vocab_size)]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )
