"""The text of generated token ids, as a whole and token by token.

**In context.** Generated ids are decoded behind the prompt's last :data:`CONTEXT` ids, and the text those decode
to is cut off again. Decoding them alone loses text: SentencePiece tokenizers (Llama-2, Mistral v0.1, Phi-3) strip
the first space of whatever they decode, so ``▁can`` alone is ``"can"``, after ``"The function returns"`` it is
``" can"``. (vLLM and TGI do the same; for byte-level BPE both ways give the same text.)

**Per token.** A token's *piece* is the text it adds to the decode of the ids before it; a character whose UTF-8
bytes are split over tokens decodes to U+FFFD until its last byte arrives, and belongs to the token that completes
it (the ones before add ``""``). The pieces join to the text. Example (byte-level BPE): ``" ․"`` (U+2024, bytes
``e2 80 a4``) as ids 1373 (bytes ``20 e2 80``) + 99 (``a4``): pieces ``""`` and ``" ․"``, bytes ``[32, 226, 128]``
and ``[164]``.

**Bytes.** A token's own bytes, where the tokenizer's decoder says how to get them: ByteLevel (GPT-2's byte <->
printable character table) and SentencePiece's byte fallback (``<0xE2>``, ``▁`` for a space); otherwise the UTF-8
of its piece (so joined bytes always decode to the text).
"""

from __future__ import annotations

import json
import re

CONTEXT = 6  # prompt ids decoded in front of the generated ones
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _printable_bytes() -> dict[str, int]:
    """GPT-2's ByteLevel table, inverted: a character of a token string -> the byte it stands for. Bytes that are
    printable Latin-1 (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) stand for themselves; the other 68 are moved, in
    order, to U+0100 onwards (a space is ``Ġ``, U+0120)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, moved = {chr(b): b for b in keep}, 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + moved)] = b
            moved += 1
    return table


def _decoder_types(tokenizer) -> set[str]:
    """The types of the fast tokenizer's decoder and of those it chains (``{"ByteLevel"}``, ``{"Sequence",
    "ByteFallback", ...}``); empty when it is not a fast tokenizer."""
    try:
        node = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder")
    except (AttributeError, ValueError, TypeError):
        return set()
    types, todo = set(), [node]
    while todo:
        d = todo.pop()
        if isinstance(d, dict):
            types.add(d.get("type", ""))
            todo.extend(d.get("decoders") or [])
    return types


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _undecided(text: str) -> int:
    """Trailing U+FFFD: bytes of a character still incomplete."""
    return len(text) - len(text.rstrip("\ufffd"))


class Detokenizer:
    """Generated ids -> text: :meth:`add` one id, get its piece; :attr:`text` is the text so far (in context)."""

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self.tok = tokenizer
        ctx = list(prompt_ids[-CONTEXT:])
        head = self._decode(ctx)
        if head.endswith("\ufffd"):  # the prompt ends inside a character: its bytes stay the prompt's
            ctx, head = [], ""
        self.ctx, self.head = ctx, head
        self.ids: list[int] = []
        self.text = ""
        self.decided = 0  # characters of text that later ids cannot change
        types = _decoder_types(tokenizer)
        self._table = _printable_bytes() if "ByteLevel" in types else None
        self._fallback = "ByteFallback" in types

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def _after(self, ids: list[int], head: str) -> str:
        """The text ``ids`` decode to after ``head`` (what ``ids[:-k]`` decodes to); the common prefix is cut, not
        ``len(head)``, so a decoder that rewrites the seam (a clean-up of spaces) cannot shift the text."""
        full = self._decode(ids)
        return full[_common_prefix(full, head):]

    def add(self, token: int) -> str:
        """Append ``token``; its piece: the characters it decides (``""`` while a split character is incomplete)."""
        self.ids.append(token)
        self.text = self._after(self.ctx + self.ids, self.head)
        end = max(len(self.text) - _undecided(self.text), self.decided)
        piece, self.decided = self.text[self.decided:end], end
        return piece

    def tail(self) -> str:
        """What no piece holds yet: the U+FFFD of a character the generation ended inside."""
        return self.text[self.decided:]

    def alternatives(self, ids) -> tuple[tuple[str, ...], tuple[bytes, ...]]:
        """Each of ``ids`` as it would read in place of the last added token: its piece in the context of the ids
        before that token (a partial character shown by its bytes, ``" \\xe2\\x80"``), and its bytes."""
        before = (self.ctx + self.ids[:-1])[-CONTEXT:]
        head = self._decode(before)
        texts, raw = [], []
        for i in ids:
            t, b = self._after(before + [int(i)], head), self.token_bytes(int(i))
            if "\ufffd" in t and b is not None:
                t = b.decode("utf-8", "backslashreplace")
            texts.append(t)
            raw.append(b if b is not None else t.encode())
        return tuple(texts), tuple(raw)

    def token_bytes(self, token: int) -> bytes | None:
        """The token's own bytes, when the decoder says how to get them (ByteLevel, byte fallback); else None."""
        s = self.tok.convert_ids_to_tokens(token)
        if not isinstance(s, str) or token in getattr(self.tok, "all_special_ids", ()):
            return b"" if isinstance(s, str) else None
        if self._table is not None and all(c in self._table for c in s):
            return bytes(self._table[c] for c in s)
        if self._fallback:
            m = _BYTE_TOKEN.fullmatch(s)
            return bytes([int(m.group(1), 16)]) if m else s.replace("\u2581", " ").encode()
        return None
