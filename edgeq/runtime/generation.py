"""edgeq's own generation loop: one prefill, then one token at a time through the static KV cache.

No transformers ``generate`` in the hot loop: the prompt is one forward with ``logits_to_keep=1`` (the head, the
largest matmul, runs only for the last position), then each token is one ``lm.decode_step`` (the lean decoder of
``edgeq.runtime.lean`` when ``settings.decode_loop == "lean"``, else the model's forward), then sampling on the fp32
logits:

- temperature 0: greedy (argmax);
- otherwise ``softmax(logits / T)``, restricted by top-p to the smallest set of most likely tokens whose
  probability reaches ``top_p`` (the most likely token is always kept), sampled with a ``torch.Generator`` seeded
  by ``seed`` (reproducible) or from the OS;
- logprobs are always of the model's distribution (``log_softmax(logits)``, before temperature and top-p).

Text is streamed by decoding all generated ids behind the prompt's last ids (:mod:`edgeq.runtime.detok`) and
emitting the new suffix; text that could still be the start of a stop string, or that ends in an incomplete UTF-8
sequence (U+FFFD), is held back until it is decided.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import torch

from edgeq.errors import DamagedCheckpointError, EdgeqError
from edgeq.runtime import crossover, native
from edgeq.runtime.detok import Detokenizer


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: off; k >= 0: the chosen token's logprob plus the k most likely alternatives
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):  # one stop string, as OpenAI's API allows: not its characters
            object.__setattr__(self, "stop", (self.stop,))
        if self.max_tokens < 1:
            raise EdgeqError(f"max_tokens={self.max_tokens}: must be at least 1")
        if not 0 <= self.temperature < float("inf"):  # NaN fails too
            raise EdgeqError(f"temperature={self.temperature}: must be a finite number >= 0")
        if not 0 < self.top_p <= 1:
            raise EdgeqError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise EdgeqError(f"logprobs={self.logprobs}: must be between 0 and 20")
        if any(not s for s in self.stop):
            raise EdgeqError("stop strings must not be empty")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:  # torch.Generator.manual_seed's range
            raise EdgeqError(f"seed={self.seed}: must be in [-2^63, 2^64)")


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's logprob and its ``top`` (id, logprob) alternatives, with their text (:mod:`.detok`):
    ``piece``, what the token adds to the text (the pieces join to it); ``token`` and ``top_tokens``, how each reads
    in place (a partial character by its bytes, ``"\\xe2\\x80"``); ``bytes`` and ``top_bytes``, their own bytes."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    piece: str = ""
    token: str = ""
    bytes: bytes = b""
    top_tokens: tuple[str, ...] = ()
    top_bytes: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class Delta:
    """One streamed step: the new text (may be empty while held back) and the token(s) it completes."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass
class GenerationResult:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    finish_reason: str = "length"  # "stop" (EOS or a stop string) | "length" | "cancelled"
    logprobs: list[TokenLogprob] = field(default_factory=list)
    eos_token: int | None = None  # the EOS id that ended it: in neither token_ids nor text, yet generated (usage counts it)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        n = len(self.token_ids) - 1  # the first token comes out of the prefill
        return n / self.decode_seconds if n > 0 and self.decode_seconds else 0.0


def eos_ids(lm) -> set[int]:
    ids: set[int] = set()
    for src in (getattr(lm.model, "generation_config", None), lm.config, lm.tokenizer):
        v = getattr(src, "eos_token_id", None) if src is not None else None
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return ids


def greedy(logits: torch.Tensor) -> int:
    """The id of the first largest logit (``torch.argmax``'s choice), or -1 when any logit is NaN or infinite. One
    native pass where edgeq's library runs (``native.argmax_finite``: 79 us where torch's ``isfinite().all()`` +
    ``argmax`` took 0.53 ms on fp32 and 1.08 ms on bf16 logits, 151,936 of them), else those two torch ops."""
    if native.available():
        return native.argmax_finite(logits.contiguous())
    return int(torch.argmax(logits)) if bool(torch.isfinite(logits).all()) else -1


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """One token id from fp32 logits [V].

    The largest logit is subtracted before dividing by the temperature: ``(logits - max) / T`` is <= 0 with a 0 at
    the most likely token, so any T > 0 (down to 5e-324, below fp32's range, where ``logits / T`` overflows to
    inf - inf = NaN) gives a distribution, the greedy one in the limit."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    temperature = max(params.temperature, torch.finfo(torch.float32).tiny)  # a T fp32 cannot hold: the same limit
    probs = torch.softmax((logits - logits.max()) / temperature, dim=-1)
    if params.top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True, stable=True)  # ties: the lowest id first, as argmax
        before = torch.cumsum(sorted_p, 0) - sorted_p  # mass of strictly more likely tokens
        cut = before >= params.top_p  # keeps the smallest prefix reaching top_p
        cut[0] = False  # and always the first, even for a top_p that rounds to 0 in fp32 (1e-300)
        sorted_p[cut] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=gen))


def _logprob(logits: torch.Tensor, token: int, k: int, detok: Detokenizer, piece: str) -> TokenLogprob:
    """``token``'s logprob and the ``k`` most likely alternatives, after ``detok`` added it as ``piece``."""
    lp = torch.log_softmax(logits, dim=-1)
    top = torch.topk(lp, k) if k else None
    pairs = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
    (text, *texts), (raw, *raws) = detok.alternatives([token, *(i for i, _ in pairs)])
    return TokenLogprob(token, float(lp[token]), pairs, piece, text, raw, tuple(texts), tuple(raws))


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters might still turn into a stop string or a complete UTF-8 character: a trailing
    U+FFFD run (an incomplete character) and the longest stop prefix ending just before it, which that character
    may continue (``"e ․"`` over ``"the time \ufffd"`` holds back ``"e \ufffd"``)."""
    partial = len(text) - len(text.rstrip("\ufffd"))
    body, hold = text[: len(text) - partial], 0
    for s in stops:
        for n in range(min(len(s) - 1, len(body)), 0, -1):
            if body.endswith(s[:n]):
                hold = max(hold, n)
                break
    return hold + partial


class Generation:
    """Iterate to stream :class:`Delta` values; ``.result`` holds the totals once iteration ends."""

    def __init__(self, lm, prompt_ids: list[int], params: SamplingParams, cancel: Callable[[], bool] | None = None):
        if lm.tokenizer is None:
            raise EdgeqError(f"{lm.path}: no tokenizer files; cannot generate text")
        if not prompt_ids:
            raise EdgeqError("the prompt is empty (0 tokens)")
        self.lm, self.prompt_ids, self.params, self.cancel = lm, list(prompt_ids), params, cancel
        _check_fits(lm, len(prompt_ids), params.max_tokens)
        self.result = GenerationResult(prompt_tokens=len(prompt_ids))

    def __iter__(self) -> Iterator[Delta]:
        lm, p, r = self.lm, self.params, self.result
        gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
        if gen is None and p.temperature > 0:
            gen = torch.Generator()
            gen.seed()
        eos = set() if p.ignore_eos else eos_ids(lm)
        detok = Detokenizer(lm.tokenizer, self.prompt_ids)
        lm.cache.reset()
        emitted = 0
        t0 = time.perf_counter()
        logits = lm.forward(torch.tensor([self.prompt_ids]), logits_to_keep=1)[0, -1]
        r.prefill_seconds = time.perf_counter() - t0
        t_decode = time.perf_counter()
        while True:
            top = greedy(logits)  # also the finiteness check, every step; the diagnosis runs only on failure
            if top < 0:
                raise non_finite_error(lm, self.prompt_ids + r.token_ids, len(r.token_ids))
            f32 = logits.float() if p.temperature > 0 or p.logprobs is not None else None  # greedy needs no cast
            token = top if f32 is None or p.temperature == 0 else sample(f32, p, gen)
            if token in eos:
                r.finish_reason, r.eos_token = "stop", token
                break
            r.token_ids.append(token)
            piece = detok.add(token)
            lp = (_logprob(f32, token, p.logprobs, detok, piece),) if p.logprobs is not None else ()
            r.logprobs.extend(lp)
            text = detok.text
            cut = min((text.find(s) for s in p.stop if s in text), default=-1)
            if cut >= 0:
                r.text = text[:cut]
                r.finish_reason = "stop"
                yield Delta(text[emitted:cut] if cut > emitted else "", (token,), lp)
                emitted = max(emitted, cut)
                break
            r.text = text
            safe = len(text) - _held_back(text, p.stop)
            yield Delta(text[emitted:safe] if safe > emitted else "", (token,), lp)
            emitted = max(emitted, safe)
            if len(r.token_ids) >= p.max_tokens:
                r.finish_reason = "length"
                break
            if self.cancel is not None and self.cancel():
                r.finish_reason = "cancelled"
                break
            logits = lm.decode_step(token)
        if r.logprobs and detok.tail():  # ended inside a character: its U+FFFD belong to the last token
            r.logprobs[-1] = replace(r.logprobs[-1], piece=r.logprobs[-1].piece + detok.tail())
        if len(r.text) > emitted:  # text held back for a stop string that never came
            yield Delta(r.text[emitted:], (), ())
        r.decode_seconds = time.perf_counter() - t_decode


def non_finite_error(lm, ids: list[int], step: int) -> DamagedCheckpointError:
    """The error for non-finite logits at generation ``step`` (0: the prefill's logits), naming the first module
    whose output is not finite: ``ids`` (prompt + tokens so far) are recomputed without the cache through the
    model's forward with a hook on every module. Forward hooks fire when a module returns, so the first to see
    NaN/Inf is the innermost, earliest module that produced it (a damaged projection, not the layer around it)."""
    first: list[str] = []

    def hook(name):
        def check(_module, _inputs, output):
            out = output[0] if isinstance(output, (tuple, list)) and output else output
            if not first and isinstance(out, torch.Tensor) and out.is_floating_point() and not bool(torch.isfinite(out).all()):
                first.append(name)
        return check

    handles = [m.register_forward_hook(hook(n)) for n, m in lm.model.named_modules() if n]
    try:
        lm.forward(torch.tensor([ids]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    where = (f"first non-finite output: {first[0]}" if first else
             "no module output is non-finite when recomputed through the model's forward (the fault is in the decode loop)")
    return DamagedCheckpointError(
        f"{lm.path}: the logits of generated token {step + 1} are not finite (NaN/Inf); {where}. The checkpoint is "
        f"damaged or its scales overflow bf16: check it with `edgeq inspect --verify {lm.path}` and re-quantise")


def _check_fits(lm, n_prompt: int, max_tokens: int) -> None:
    need = n_prompt + max_tokens
    limit = min(lm.settings.max_model_len, lm.cache.capacity)
    if need > limit:
        raise EdgeqError(
            f"request needs {need} tokens (prompt {n_prompt} + max_tokens {max_tokens}) but the "
            f"context holds {limit} (max_model_len={lm.settings.max_model_len}, KV cache {lm.cache.capacity} "
            f"tokens); shorten the prompt, lower max_tokens, or raise --max-model-len/--kv-cache-bytes"
        )


def generate_ids(lm, prompt_ids: list[int], max_tokens: int, ignore_eos: bool = True) -> tuple[list[int], float, float, float]:
    """Greedy ids from token ids, no tokenizer: ``(ids, prefill_s, ttft_s, decode_s)``.

    The runtime's own hot loop, for benchmarks: reset the cache; the prompt in one forward (``prefill_s``); argmax
    is the first id (``ttft_s`` = prefill + that argmax); then ``max_tokens - 1`` steps of ``lm.decode_step`` +
    argmax (``decode_s``), so decode tokens/s = ``(len(ids) - 1) / decode_s``. With ``ignore_eos=False`` it stops
    before an EOS id (not included). ``lm.path_counts`` and ``lm.loop_counts`` count every call, as for
    :class:`Generation`. Example: ``generate_ids(lm, ids, 129)`` times 128 decode steps after a prefill (tg128).
    """
    if not prompt_ids:
        raise EdgeqError("the prompt is empty (0 tokens)")
    if max_tokens < 1:
        raise EdgeqError(f"max_tokens={max_tokens}: must be at least 1")
    _check_fits(lm, len(prompt_ids), max_tokens)
    eos = frozenset() if ignore_eos else frozenset(eos_ids(lm))
    lm.cache.reset()
    prompt = torch.tensor([list(prompt_ids)])
    t0 = time.perf_counter()
    logits = lm.forward(prompt, logits_to_keep=1)
    t1 = time.perf_counter()
    token = greedy(logits[0, -1])
    t2 = time.perf_counter()
    ids: list[int] = []
    step = lm.decode_step
    while token >= 0 and token not in eos:
        ids.append(token)
        if len(ids) == max_tokens:
            break
        token = greedy(step(token))
    t3 = time.perf_counter()
    if token < 0:
        raise non_finite_error(lm, list(prompt_ids) + ids, len(ids))
    return ids, t1 - t0, t2 - t0, t3 - t2


def encode_prompt(lm, prompt: str | list[dict], chat: bool) -> list[int]:
    """Token ids of a plain prompt (with the tokenizer's special tokens) or of chat messages via the chat template."""
    tok = lm.tokenizer
    if tok is None:
        raise EdgeqError(f"{lm.path}: no tokenizer files; cannot encode a prompt")
    if not chat:
        return list(tok(prompt)["input_ids"])
    if not getattr(tok, "chat_template", None):
        raise EdgeqError(f"{lm.path}: the tokenizer has no chat template (tokenizer_config.json chat_template or "
                         f"chat_template.jinja); run without --chat")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def generate(lm, prompt: str, params: SamplingParams | None = None, chat: bool = False) -> GenerationResult:
    g = Generation(lm, encode_prompt(lm, prompt, chat), params or SamplingParams())
    for _ in g:
        pass
    return g.result


def describe_paths(s) -> str:
    """``w4a16-g128, decode native_decode, prefill dequant_prefill (M >= 16)`` from RuntimeSettings; a bf16 model
    has no crossover, so none is printed; a packed embedding is named (``, embeddings packed 4-bit (...)``), and a
    head that sums the table's residual level too (``, head levels 2``)."""
    xover = f" ({crossover.describe(s.prefill_crossover)})" if s.prefill_crossover is not None else ""
    emb = f", embeddings {s.embeddings}" if s.embeddings != "bf16" else ""
    emb += f", head levels {s.head_levels}" if s.head_levels != 1 else ""
    return f"{s.scheme or 'bf16'}, decode {s.decode_path}, prefill {s.prefill_path}{xover}{emb}"


def generation_record(path, lm, r: GenerationResult, load_seconds: float) -> dict:
    """``edgeq generate --json``: the text, its token ids, the timings and the compute paths that ran (calls per
    path and per decode loop, counted by the runtime, not echoed settings)."""
    s = lm.settings
    return {
        "model": str(path), "text": r.text, "token_ids": list(r.token_ids), "prompt_tokens": r.prompt_tokens,
        "finish_reason": r.finish_reason,
        "timings": {"load_s": load_seconds, "prefill_s": r.prefill_seconds, "decode_s": r.decode_seconds,
                    "prefill_tokens_per_s": r.prefill_tokens_per_s, "decode_tokens_per_s": r.decode_tokens_per_s},
        "paths": {"scheme": s.scheme or "bf16", "decode_path": s.decode_path, "prefill_path": s.prefill_path,
                  "prefill_crossover": s.prefill_crossover, "decode_loop": s.decode_loop,
                  "calls": dict(lm.path_counts), "loop_calls": dict(lm.loop_counts)},
        "settings": {"max_model_len": s.max_model_len, "max_cached_tokens": s.max_cached_tokens, "threads": s.threads,
                     "embeddings": s.embeddings, "head_levels": s.head_levels},
    }
