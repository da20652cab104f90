"""Do the two models tokenise alike? Vocabulary and tokenizer checks, and the tokenizer hash a ``--ref`` file keeps."""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any, Optional

from edgeq.errors import EdgeqError

if TYPE_CHECKING:
    from edgeq.fidelity.sides import Side


def id_to_token(tok: Any) -> list[Optional[str]]:
    """The token string of every id (``None`` for ids the vocabulary skips): the table both checks compare."""
    vocab = tok.get_vocab()
    table: list[Optional[str]] = [None] * (max(vocab.values(), default=-1) + 1)
    for t, i in vocab.items():
        table[i] = t
    return table


def tokenizer_sha256(tok: Any) -> str:
    """sha256 of the id->token table, the BOS/EOS ids and (for fast tokenizers) the normalizer, pre-tokenizer and
    model sections of tokenizer.json (the merges): equal hashes mean equal tokenisation."""
    h = hashlib.sha256()
    h.update(json.dumps({"vocab": id_to_token(tok), "bos": getattr(tok, "bos_token_id", None),
                         "eos": getattr(tok, "eos_token_id", None)}, ensure_ascii=False).encode())
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        h.update(json.dumps({k: spec.get(k) for k in ("normalizer", "pre_tokenizer", "model")},
                            sort_keys=True, ensure_ascii=False).encode())
    return h.hexdigest()


def check_same_vocabulary(ref: Side, quant: Side) -> None:
    """Refuse two models that do not share a vocabulary: config vocab size, then tokenizer size, then the first
    token id whose string differs, then BOS/EOS ids."""
    if ref.vocab_size is not None and quant.vocab_size is not None and ref.vocab_size != quant.vocab_size:
        raise EdgeqError(f"vocab size differs: reference {ref.vocab_size}, quantised {quant.vocab_size}; "
                         f"compare a quantised model only with the model it was made from")
    if ref.tokenizer is None or quant.tokenizer is None:
        return
    a, b = id_to_token(ref.tokenizer), id_to_token(quant.tokenizer)
    if len(a) != len(b):
        raise EdgeqError(f"tokenizer differs: reference has {len(a)} token ids, quantised {len(b)}; "
                         f"use the tokenizer files of the reference checkpoint")
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            raise EdgeqError(f"tokenizer differs at token id {i}: reference {x!r}, quantised {y!r}; "
                             f"use the tokenizer files of the reference checkpoint")
    for attr in ("bos_token_id", "eos_token_id"):
        x, y = getattr(ref.tokenizer, attr, None), getattr(quant.tokenizer, attr, None)
        if x != y:
            raise EdgeqError(f"tokenizer differs: {attr} is {x} in the reference, {y} in the quantised model")


def encode(tok: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (windows add the BOS themselves)."""
    return list(tok.encode(text, add_special_tokens=False))


def check_same_encoding(ids: list[int], other: list[int]) -> None:
    """Refuse two tokenisations of the same text that differ, naming the first token where they part."""
    if ids == other:
        return
    i = next((j for j, (x, y) in enumerate(zip(ids, other)) if x != y), min(len(ids), len(other)))
    x = ids[i] if i < len(ids) else None
    y = other[i] if i < len(other) else None
    raise EdgeqError(f"tokenizer differs: the text tokenises differently at token {i} (reference id {x}, quantised "
                     f"id {y}, {len(ids)} vs {len(other)} tokens); use the tokenizer files of the reference checkpoint")
