"""GPTQ's target: the float model's outputs (``--gptq-target float``) vs the Linear's own weights (``layer``).

    python benchmarks/gptq_target.py kld [--nsamples 4,8,32] [--seeds 0] [--ridge K/n,0.01] [--recipe quality]
    python benchmarks/gptq_target.py kld --calib edgeq/data/calib-prose.txt --targets float,layer
    python benchmarks/gptq_target.py cost DIR [--windows 16x512] [--passes 2] [--layers N] [--dtype fp32|bf16|auto]

``kld``: real conversions of MODEL (default the bundled one) with ``--method gptq`` through
``edgeq.convert.pipeline.convert`` (``--recipe``, default ``quality``; ``--calib self`` unless ``--calib FILE``), one
per target x window count x seed x ridge, each scored by ``edgeq.fidelity.compare`` (mean KLD over the second
halves of ctx-512 windows of TEXT, default the bundled held-out prose). ``--ridge`` applies to the float target:
``K/n`` is what ships (``max(damp, K / n)`` of the mean Hessian diagonal, :func:`edgeq.quantize.hessian.asymmetric_shift`);
a number r fixes the ridge at r instead (the driver's call is wrapped, nothing else changes). Statistics, not timings.

``cost``: the GPTQ driver alone (``gptq_model``: no sampling, no packing) on DIR, e.g. the two-layer Llama-3.2-1B
shape ``python benchmarks/synthetic.py llama-3.2-1b DIR --layers 2`` writes, with seeded random token windows, fp32
compute (``--dtype``: ``auto`` is what ``edgeq quantize`` picks on this CPU, bf16 where it has bf16 dot products), the
family recipe's g32 head; each pass runs every target in a fresh process, targets interleaved, and
prints its wall time, the decoder layers' and the head's shares of it (from the driver's progress calls) and peak
RSS (ru_maxrss); ``--layers N`` stops after N decoder layers (a deep model's per-layer time without converting
it all). Needs a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's edgeq
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

TARGETS = ("float", "layer")


def _ridge_patch(ridge: str):
    """A context in which the driver's shifts use a fixed ridge ``r`` (a number) or the shipped ``K/n`` rule."""
    from contextlib import nullcontext
    from unittest import mock

    import edgeq.convert.calibrate as drv
    from edgeq.quantize import hessian

    if ridge == "K/n":
        return nullcontext()
    r = float(ridge)
    return mock.patch.object(drv, "asymmetric_shift",
                             lambda H, C, damp, tokens, name="weight": hessian.asymmetric_shift(H, C, r, 1 << 62, name=name))


def kld(a) -> None:
    from edgeq import fidelity as F
    from edgeq.convert.calibrated import GPTQOptions
    from edgeq.convert.pipeline import convert
    from edgeq.runtime import load
    from quality_table import edgeq_bytes

    ref = load(a.model)
    text = a.text.read_text(encoding="utf-8") if a.text else None
    print("| target | ridge | windows | seed | bytes | mean KLD (± se) | same top-1 |\n|---|---|---|---|---|---|---|")
    for ns in [int(x) for x in a.nsamples.split(",")] if a.nsamples else [None]:
        for seed in [int(x) for x in a.seeds.split(",")]:
            for target in a.targets.split(","):
                for ridge in (a.ridge.split(",") if target == "float" else ["-"]):
                    opts = GPTQOptions(calib=a.calib, target=target, **({"nsamples": ns} if ns else {}),
                                       **({"seed": seed} if a.calib == "self" else {}))
                    with tempfile.TemporaryDirectory() as tmp, _ridge_patch(ridge if target == "float" else "K/n"):
                        out = Path(tmp) / "q"
                        convert(a.model, out, method="gptq", recipe=a.recipe, gptq=opts)
                        r = F.compare(ref, load(out), text=text)
                        nbytes = edgeq_bytes(out)
                    print(f"| {target} | {ridge} | {ns or 'default'} | {seed} | {nbytes:,} | {r.kld_mean:.5f} ± "
                          f"{r.kld_mean_err:.5f} | {100 * r.top1_agreement:.1f}% |", flush=True)


def _one_driver_run(model: str, target: str, s: int, t: int, layers: int = 0, dtype: str = "fp32") -> dict:
    """One driver run; with ``layers`` > 0 it stops after that many decoder layers (no head)."""
    from edgeq.convert.calibrate import gptq_model
    from edgeq.convert.calibrated import compute_dtype
    from edgeq.scheme import Scheme

    compute = compute_dtype() if dtype == "auto" else {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    windows = torch.randint(0, 2**31 - 1, (s, t), generator=torch.Generator().manual_seed(0))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    windows %= vocab
    marks = {}  # progress step -> seconds since the start: 0 the embeddings, 1..L the layers, L + 1 the head
    t0 = time.perf_counter()
    for _ in gptq_model(model, windows, Scheme.parse("w4a16-g128"), compute_dtype=compute, target=target,
                        group_sizes={"lm_head": 32},
                        progress=lambda done, total, label: marks.__setitem__(done, time.perf_counter() - t0)):
        if layers and max(marks) >= layers:
            break  # the generator is closed here: the layer is released, nothing else runs
    last, head = max(marks), None
    if not layers:
        last, head = last - 1, marks[last] - marks[last - 1]
    return {"target": target, "dtype": str(compute).removeprefix("torch."), "seconds": time.perf_counter() - t0,
            "layers": marks[last] - marks[0], "head": head,
            "n_layers": last, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def cost(a) -> None:
    s, t = (int(x) for x in a.windows.split("x"))
    print(f"{a.model}: {s} x {t} windows, {torch.get_num_threads()} threads, compute dtype {a.dtype}\n\n"
          "| pass | target | driver time | decoder layers | head | peak RSS |\n|---|---|---|---|---|---|")
    for p in range(a.passes):
        for target in a.targets.split(","):
            run = subprocess.run([sys.executable, __file__, "_one", str(a.model), target, str(s), str(t), str(a.layers), a.dtype],
                                 capture_output=True, text=True, check=True)
            r = json.loads(run.stdout.strip().splitlines()[-1])
            head = "-" if r["head"] is None else f"{r['head']:.0f} s"
            print(f"| {p + 1} | {target} ({r['dtype']}) | {r['seconds']:.0f} s | {r['layers']:.0f} s ({r['n_layers']}: "
                  f"{r['layers'] / r['n_layers']:.1f} s each) | {head} | {r['peak_mib']:,.0f} MiB |", flush=True)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_one"]:  # a cost pass's child process
        print(json.dumps(_one_driver_run(argv[1], argv[2], int(argv[3]), int(argv[4]), int(argv[5]), *argv[6:7])))
        return
    from edgeq.keys import DATA

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    k = sub.add_parser("kld")
    k.add_argument("--model", type=Path, default=DATA / "tiny-prose")
    k.add_argument("--text", type=Path, help="evaluation text (default: the bundled held-out prose)")
    k.add_argument("--recipe", default="quality")
    k.add_argument("--calib", default="self")
    k.add_argument("--nsamples", help="comma-separated window counts (default: the calibration's own)")
    k.add_argument("--seeds", default="0")
    k.add_argument("--targets", default=",".join(TARGETS))
    k.add_argument("--ridge", default="K/n", help="float target: 'K/n' (shipped) or fixed values, comma-separated")
    c = sub.add_parser("cost")
    c.add_argument("model", type=Path)
    c.add_argument("--windows", default="16x512")
    c.add_argument("--passes", type=int, default=2)
    c.add_argument("--targets", default=",".join(TARGETS))
    c.add_argument("--layers", type=int, default=0, help="stop after this many decoder layers (no head); 0: the whole model")
    c.add_argument("--dtype", choices=("fp32", "bf16", "auto"), default="fp32",
                   help="the driver's compute dtype (auto: edgeq quantize's choice on this CPU)")
    a = ap.parse_args(argv)
    (kld if a.what == "kld" else cost)(a)


if __name__ == "__main__":
    main()
