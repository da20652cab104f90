"""``edgeq demo``: the whole pipeline on the bundled trained model, offline, in one command.

quantize (into a temporary directory) -> inspect (headers) -> fidelity (vs the bf16 original, bundled held-out
text) -> a short greedy generation -> one summary. Every figure comes from the same functions the individual
commands run.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
DEMO_MODEL = DATA / "tiny-prose"
DEMO_PROMPT = "The module"


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


def run_demo(scheme: str = "w4a16-g128", method: str | None = None, keep: Path | None = None,
             max_tokens: int = 32, fidelity_tokens: int | None = 4096) -> DemoReport:
    from edgeq.convert import convert
    from edgeq.fidelity import run_fidelity
    from edgeq.report import inspect_checkpoint
    from edgeq.runtime import load
    from edgeq.runtime.generate import SamplingParams, generate
    from edgeq.scheme import Scheme

    with tempfile.TemporaryDirectory(prefix="edgeq-demo-") as tmp:
        out = Path(keep) if keep else Path(tmp) / f"tiny-prose-{scheme}"
        conv = convert(DEMO_MODEL, out, scheme=Scheme.parse(scheme), method=method, force=keep is not None)
        info = inspect_checkpoint(out)
        fid = run_fidelity(DEMO_MODEL, out, max_tokens=fidelity_tokens)
        lm = load(out)
        gen = generate(lm, DEMO_PROMPT, SamplingParams(max_tokens=max_tokens))
        return DemoReport(
            model=str(DEMO_MODEL), scheme=conv.scheme, method=conv.method, bytes_in=conv.bytes_in,
            bytes_out=conv.bytes_out, convert_seconds=conv.seconds,
            head_quantized=bool(info.edgeq and info.edgeq.head_quantized),
            layout_matches=bool(info.edgeq and info.edgeq.layout_matches),
            effective_bits=info.effective_bits,
            projected_total_bytes=info.memory.total if info.memory else None,
            kld_mean=fid.kld_mean, kld_mean_err=fid.kld_mean_err, top1_agreement=fid.top1_agreement,
            ppl_ref=fid.ppl_ref, ppl_quant=fid.ppl_quant, tokens_scored=fid.tokens_scored,
            prompt=DEMO_PROMPT, completion=gen.text, decode_path=lm.settings.decode_path,
            decode_tokens_per_s=gen.decode_tokens_per_s, prefill_tokens_per_s=gen.prefill_tokens_per_s,
            kept=str(out) if keep else None,
        )


def render(r: DemoReport, console) -> None:
    mib = lambda n: f"{n / 2**20:.2f} MiB"  # noqa: E731
    console.print(f"[bold]edgeq demo[/bold]: bundled tiny-prose model (trained Llama, 4 layers, tied head) -> {r.scheme} ({r.method})")
    console.print(f"  quantize  {mib(r.bytes_in)} -> {mib(r.bytes_out)} ({r.bytes_in / r.bytes_out:.2f}x) in {r.convert_seconds:.1f} s; "
                  f"head quantised: {r.head_quantized}; {r.effective_bits:.2f} bits/weight")
    console.print(f"  inspect   layout matches this machine: {r.layout_matches}; projected serving memory "
                  f"{mib(r.projected_total_bytes or 0)}")
    err = f" +- {r.kld_mean_err:.5f}" if r.kld_mean_err is not None else ""
    console.print(f"  fidelity  mean KLD {r.kld_mean:.5f}{err}; same top-1 {r.top1_agreement * 100:.1f}%; "
                  f"PPL {r.ppl_ref:.3f} -> {r.ppl_quant:.3f} over {r.tokens_scored} held-out tokens")
    console.print(f"  generate  {r.prompt!r} -> {r.completion!r}")
    console.print(f"            decode path {r.decode_path}: {r.decode_tokens_per_s:.1f} tok/s, prefill {r.prefill_tokens_per_s:.1f} tok/s")
    if r.kept:
        console.print(f"  checkpoint kept in {r.kept}")
