"""``edgeq demo``: the whole pipeline on the bundled trained model, offline, in one command.

quantize (into a temporary directory) -> inspect (headers) -> fidelity (vs the bf16 original, bundled held-out
text) -> a short greedy generation -> one summary. Every figure comes from the same functions the individual
commands run; the summary is printed by edgeq/cli/demo.py.

Each step is announced through ``progress`` as it starts (and fidelity window by window), so a slow machine is never
silent. The speeds are single-shot: one timed generation after one untimed warm-up generation of the same length
(the first run pays one-time costs: kernel selection, first-touch of the weights and caches); medians over fresh
processes are what ``edgeq bench`` measures.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from edgeq.keys import DATA

DEMO_MODEL = DATA / "tiny-prose"
DEMO_PROMPT = "The module"
SPEED_BASIS = "single shot: one timed generation after one untimed warm-up; edgeq bench reports medians"
STEPS = 5


@dataclass(frozen=True)
class DemoReport:
    model: str
    scheme: str
    method: str
    bytes_in: int
    bytes_out: int
    convert_seconds: float
    head_quantized: bool
    layout_matches: bool
    effective_bits: float | None
    projected_total_bytes: int | None
    kld_mean: float
    kld_mean_err: float | None
    top1_agreement: float
    ppl_ref: float
    ppl_quant: float
    tokens_scored: int
    prompt: str
    completion: str
    decode_path: str
    decode_tokens_per_s: float
    prefill_tokens_per_s: float
    kept: str | None
    prompt_tokens: int = 0
    speed_basis: str = SPEED_BASIS
    recipe: str = ""


def run_demo(scheme: str | None = None, method: str | None = None, keep: Path | None = None,
             max_tokens: int = 32, fidelity_tokens: int | None = 4096,
             progress: Callable[[str], None] | None = None) -> DemoReport:
    """The whole pipeline on the bundled model; ``progress(line)`` hears each step as it starts. Without ``method`` it
    converts as the plain ``edgeq quantize`` does (edgeq/convert/default.py: the ``quality`` recipe on ids sampled
    from the model, w4a16-g256 for this model; ``scheme`` the base group if given)."""
    from edgeq.convert.calibrated import GPTQOptions
    from edgeq.convert.default import default_choice
    from edgeq.convert.pipeline import convert
    from edgeq.fidelity.checkpoints import run_fidelity
    from edgeq.inspect.report import inspect_checkpoint
    from edgeq.runtime.loader import load
    from edgeq.runtime.generation import SamplingParams, generate
    from edgeq.scheme import Scheme

    say = progress or (lambda _line: None)
    parsed = Scheme.parse(scheme) if scheme is not None else None  # before any step: a typo fails at once
    chosen = default_choice(DEMO_MODEL, parsed) if method is None else None
    recipe, gptq = (chosen.recipe, GPTQOptions(calib=chosen.calib)) if chosen and chosen.recipe else (None, None)
    parsed = chosen.scheme if recipe else parsed
    with tempfile.TemporaryDirectory(prefix="edgeq-demo-") as tmp:
        out = Path(keep) if keep else Path(tmp) / f"tiny-prose-{parsed or 'recipe'}"
        say(f"[1/{STEPS}] quantize {DEMO_MODEL.name} -> {parsed or 'the recipe scheme'} "
            f"({f'recipe {recipe}, ' if recipe else ''}{out})")
        conv = convert(DEMO_MODEL, out, scheme=parsed, method=method, recipe=recipe, gptq=gptq,
                       force=keep is not None)
        say(f"[2/{STEPS}] inspect {out.name}")
        info = inspect_checkpoint(out)
        say(f"[3/{STEPS}] fidelity vs the bf16 original on up to {fidelity_tokens or 'all'} held-out tokens")
        fid = run_fidelity(DEMO_MODEL, out, max_tokens=fidelity_tokens,
                           progress=lambda done, total, _eta: say(f"        window {done}/{total}"))
        say(f"[4/{STEPS}] load {out.name} and warm up ({max_tokens} tokens, untimed)")
        lm = load(out)
        params = SamplingParams(max_tokens=max_tokens)
        generate(lm, DEMO_PROMPT, params)  # warm-up: the timed run below measures the steady state
        say(f"[5/{STEPS}] generate {max_tokens} tokens (timed)")
        gen = generate(lm, DEMO_PROMPT, params)
        return DemoReport(
            model=str(DEMO_MODEL), scheme=conv.scheme, method=conv.method, recipe=conv.recipe, bytes_in=conv.bytes_in,
            bytes_out=conv.bytes_out, convert_seconds=conv.seconds,
            head_quantized=bool(info.edgeq and info.edgeq.head_quantized),
            layout_matches=bool(info.edgeq and info.edgeq.layout_matches),
            effective_bits=info.effective_bits,
            projected_total_bytes=info.memory.total if info.memory else None,
            kld_mean=fid.kld_mean, kld_mean_err=fid.kld_mean_err, top1_agreement=fid.top1_agreement,
            ppl_ref=fid.ppl_ref, ppl_quant=fid.ppl_quant, tokens_scored=fid.tokens_scored,
            prompt=DEMO_PROMPT, completion=gen.text, decode_path=lm.settings.decode_path,
            decode_tokens_per_s=gen.decode_tokens_per_s, prefill_tokens_per_s=gen.prefill_tokens_per_s,
            kept=str(out) if keep else None, prompt_tokens=gen.prompt_tokens,
        )
