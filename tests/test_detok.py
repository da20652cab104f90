"""Generated ids -> text (edgeq.runtime.detok) through the real generation loop and the server's response shapes.

The model is scripted (its logits pick a fixed id sequence), so the texts are exact on every CPU; the tokenizers
are a SentencePiece-style one built here (Llama-2's decoder: ``▁`` -> space, byte fallback, strip the first space)
and the bundled model's byte-level BPE."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, decoders
from tokenizers.models import WordLevel
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from edgeq.runtime.detok import Detokenizer
from edgeq.runtime.generation import Generation, SamplingParams, _held_back
from edgeq.runtime.serve.responses import ChatShape, CompletionShape

PROSE = Path(__file__).resolve().parents[1] / "edgeq" / "data" / "tiny-prose"
WORDS = ["<unk>", "<s>", "</s>", "▁The", "▁function", "▁returns", "▁can", "▁s", "m", "▁x"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]


def sp_tokenizer():
    vocab = {t: i for i, t in enumerate(WORDS + BYTES)}
    tk = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def sp(*tokens):
    tok = sp_tokenizer()
    return tok.convert_tokens_to_ids(list(tokens))


class Scripted:
    """An lm whose logits pick ``script`` one id after another (then EOS), with ``tokenizer``."""

    def __init__(self, tokenizer, script, eos):
        self.tokenizer, self.script, self.vocab = tokenizer, list(script), len(tokenizer)
        self.model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=eos))
        self.config = SimpleNamespace(eos_token_id=eos)
        self.settings = SimpleNamespace(max_model_len=256)
        self.cache = SimpleNamespace(capacity=256, reset=self.reset)
        self.path = Path("scripted")

    def reset(self):
        self.step = 0

    def _logits(self):
        i = self.script[self.step] if self.step < len(self.script) else self.config.eos_token_id
        self.step += 1
        logits = torch.full((self.vocab,), -4.0)
        logits[i] = 4.0
        logits[(i + 1) % self.vocab] = 3.0  # a runner-up, so top-2 logprobs have two distinct ids
        return logits

    def forward(self, ids, logits_to_keep=1):
        return self._logits()[None, None]

    def decode_step(self, token):
        return self._logits()


def run(lm, prompt_ids, **kw):
    g = Generation(lm, prompt_ids, SamplingParams(max_tokens=kw.pop("max_tokens", 16), **kw))
    deltas = list(g)
    return g.result, deltas


def test_sentencepiece_text_keeps_the_space_the_decoder_strips_alone():
    tok = sp_tokenizer()
    gen = sp("▁can", "▁s", "m", "<0xE2>", "<0x80>", "<0xA4>", "▁x")
    assert tok.decode(gen) == "can sm․ x"  # alone: the first space stripped, what the text used to be
    lm = Scripted(tok, gen, eos=2)
    r, deltas = run(lm, sp("▁The", "▁function", "▁returns"))
    assert r.text == " can sm․ x" and "".join(d.text for d in deltas) == r.text and r.finish_reason == "stop"
    r, deltas = run(lm, sp("▁The", "▁function", "▁returns"), stop=" can")  # a stop starting with the space
    assert r.text == "" and r.finish_reason == "stop" and "".join(d.text for d in deltas) == ""


def test_pieces_offsets_and_bytes_of_a_character_split_over_tokens():
    tok = sp_tokenizer()
    gen = sp("▁can", "<0xE2>", "<0x80>", "<0xA4>", "▁x")
    r, deltas = run(Scripted(tok, gen, eos=2), sp("▁returns"), logprobs=2)
    assert r.text == " can․ x"
    assert [lp.piece for lp in r.logprobs] == [" can", "", "", "․", " x"]
    assert [lp.bytes for lp in r.logprobs] == [b" can", b"\xe2", b"\x80", b"\xa4", b" x"]
    assert [lp.token for lp in r.logprobs] == [" can", "\\xe2", "\\x80", "․", " x"]  # the last byte completes it
    whole = CompletionShape("m", False).whole(r)["choices"][0]["logprobs"]
    assert "".join(whole["tokens"]) == r.text and whole["text_offset"] == [0, 4, 4, 4, 5]
    assert all(len(t) == 2 for t in whole["top_logprobs"])  # two distinct ids keep two entries
    chat = ChatShape("m", False).whole(r)["choices"][0]["logprobs"]["content"]
    assert bytes(b for e in chat for b in e["bytes"]).decode() == r.text


def test_byte_level_split_character_stop_and_stream_agree():
    tok = AutoTokenizer.from_pretrained(PROSE)
    assert tok.decode([1373, 99]) == " ․" and tok.convert_ids_to_tokens(1373) == "ĠâĢ"  # bytes 20 e2 80 | a4
    time_ids = tok("the time", add_special_tokens=False)["input_ids"]
    lm = Scripted(tok, time_ids + [1373, 99] + time_ids, eos=tok.eos_token_id)
    r, deltas = run(lm, tok("Once", add_special_tokens=False)["input_ids"], stop="e ․")
    assert r.text == "the tim" and r.finish_reason == "stop"
    assert "".join(d.text for d in deltas) == r.text  # the stream used to send "e " before the character completed
    r, deltas = run(lm, tok("Once", add_special_tokens=False)["input_ids"], logprobs=1)
    assert [lp.bytes for lp in r.logprobs][-len(time_ids) - 2:-len(time_ids)] == [b" \xe2\x80", b"\xa4"]
    stream = CompletionShape("m", False)
    chunks = [c for d in deltas if (c := stream.chunk(d)) is not None]
    offsets = [o for c in chunks if c["choices"][0]["logprobs"] for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == CompletionShape("m", False).whole(r)["choices"][0]["logprobs"]["text_offset"]


def test_a_generated_special_token_adds_no_text_and_no_offset():
    tok = AutoTokenizer.from_pretrained(PROSE)
    ids = tok("the time", add_special_tokens=False)["input_ids"]
    r, _ = run(Scripted(tok, [ids[0], tok.bos_token_id, ids[1]], eos=tok.eos_token_id), ids[:1], logprobs=0)
    whole = CompletionShape("m", False).whole(r)["choices"][0]["logprobs"]
    assert r.text == "the time" and whole["tokens"][1] == "" and whole["text_offset"] == [0, 3, 3]


def test_a_prompt_ending_inside_a_character_is_decoded_without_context():
    tok = AutoTokenizer.from_pretrained(PROSE)
    d = Detokenizer(tok, [1373])
    assert d.ctx == [] and d.add(99) == "" and d.text == d.tail() == "\ufffd"  # a lone byte a4: undecided


@pytest.mark.parametrize("text, stops, held", [
    ("the time \ufffd", ("e ․",), 3),  # a stop prefix just before an incomplete character
    ("the time \ufffd", (), 1),
    ("the time e", ("e ․",), 1),
    ("abc", ("xyz",), 0),
    ("ab\ufffd\ufffd", ("b\u2024",), 3),
])
def test_held_back(text, stops, held):
    assert _held_back(text, stops) == held


def test_one_stop_string_is_not_its_characters():
    assert SamplingParams(stop="on o").stop == ("on o",)


def test_stream_chunks_carry_null_usage_when_usage_is_asked_for():
    shape = CompletionShape("m", True)
    r, deltas = run(Scripted(sp_tokenizer(), sp("▁can"), eos=2), sp("▁The"))
    chunks = [c for d in deltas if (c := shape.chunk(d)) is not None] + shape.final(r)
    assert [c["usage"] for c in chunks[:-1]] == [None] * (len(chunks) - 1) and chunks[-1]["usage"] == {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}  # "▁can", EOS
    assert "usage" not in CompletionShape("m", False).chunk(deltas[0])
    assert r.token_ids == sp("▁can") and r.eos_token == 2 and r.finish_reason == "stop"
    r, _ = run(Scripted(sp_tokenizer(), sp("▁can"), eos=2), sp("▁The"), max_tokens=1)  # ended by the limit: no EOS
    assert r.eos_token is None and CompletionShape("m", False).whole(r)["usage"]["completion_tokens"] == 1
