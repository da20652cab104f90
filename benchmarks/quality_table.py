"""Quality per byte on the bundled model: edgeq's arms and (with the ``llama`` extra) llama.cpp's, one table.

    python benchmarks/quality_table.py                      # every edgeq arm; llama.cpp's when importable
    python benchmarks/quality_table.py --arms default,family-rtn --max-tokens 2000   # a quick look
    python benchmarks/quality_table.py --llama-sdist /tmp/llamadl/llama_cpp_python-0.3.36.tar.gz
    python benchmarks/quality_table.py --model DIR --text DIR/heldout.txt   # another trained model (its held-out text)
    python benchmarks/quality_table.py --arms '' --llama Q4_K_M,Q4_K_M+imatrix --llama-tools BUILD/bin   # llama.cpp's
                                                            # calibrated Q4_K_M too (its imatrix on edgeq's calib text)

Every arm is scored by :func:`edgeq.fidelity.compare` against the same bf16 reference (``edgeq.runtime.load`` of
edgeq/data/tiny-prose) on the same windows of the bundled held-out text (ctx 512, second half of each window
scored). "bytes" is the same sum for every arm: the quantised linears + the head + the embedding table(s) (edgeq: the
``qweight``/``scales_and_zeros``/``perm`` tensors and the embedding table, bf16 or with ``--embeddings packed`` its
own 4-bit level (a tied table's first level is the head, counted once), from the manifest; llama.cpp: the GGUF's
``token_embd``, ``output`` and ``blk.*`` attention/FFN weights, a tied model has no ``output``; norms are left out of
both). "weights file(s)" is the whole file: the GGUF, or the edgeq checkpoint's ``*.safetensors`` (norms included).

llama.cpp's side (needs ``llama_cpp`` and ``gguf``): its own ``convert_hf_to_gguf.py`` (from the llama-cpp-python
sdist, ``vendor/llama.cpp``, with its own ``gguf-py``) writes a BF16 GGUF, ``llama_cpp.llama_model_quantize`` makes
Q4_K_M / Q4_K_S / Q4_0 (no imatrix), and each window's logits come from llama.cpp fed the very token ids edgeq scores
(a scoring function side of ``compare``). ``TYPE+imatrix`` rows are llama.cpp calibrated as its users calibrate it:
``llama-imatrix`` (defaults: 512-token chunks, no data for the output/tied table) on the text edgeq's calibrated arms
use (edgeq/data/calib-prose.txt unless ``--imatrix-text``), then ``llama-quantize --imatrix``. Those two tools are not
in the Python package; ``--llama-tools`` names the directory of a build of the same sdist's llama.cpp::

    tar xzf llama_cpp_python-0.3.36.tar.gz && cd llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -S . -B BUILD -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \\
          -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
    cmake --build BUILD -j2 --target llama-imatrix llama-quantize     # BUILD/bin; ~6 min on 2 cores

The "BF16" row scores the converted file itself: a check of the conversion
and of the scoring path (its KLD should be near 0), not a quantisation.

The bundled tokenizer is not in the converter's list of known pre-tokenizers (it identifies one by hashing the ids of
a probe string, ``get_vocab_base_pre``), so the first conversion stops with "BPE pre-tokenizer was not recognized".
The script then does what llama.cpp's ``convert_hf_to_gguf_update.py`` does for a listed model: it registers that
hash in the extracted copy with the type llama.cpp uses for this pre-tokenizer, and converts again. The type is
"gpt-2" exactly when tokenizer.json is a byte-level BPE with GPT-2's pre-tokenizer (``ByteLevel``, ``use_regex``, no
prefix space, no normalizer; the tokenizer.json of openai-community/gpt2, whose hash the converter maps to "gpt-2");
anything else is refused. The weights path is untouched, and since every arm is fed edgeq's token ids the GGUF's
tokenizer only has to load (the run also checks it tokenises the held-out text to the same ids, see --json).

Deterministic statistics, no timings; output: a markdown table on stdout, --json the raw reports and provenance.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path


def _keep_amx_for_ggml() -> None:
    """On an AMX CPU, keep oneDNN's and edgeq's kernels off AMX in this process, llama.cpp's ggml being the one AMX
    user: ggml loads its tile configuration once per thread (``ggml_tile_config_init``, a thread_local flag) and
    runs tile instructions on it later, while oneDNN's and edgeq's AMX kernels release the tiles after each call on
    the same OpenMP threads, so ggml's next ``tilezero`` is an invalid opcode (SIGILL, exit 132: seen 2026-12-05 on an
    Intel Xeon with AMX, with ggml's gcc 12 fix of docs/methodology.md in place). Set before torch loads; the KLD
    statistics do not depend on the ISA beyond rounding. A variable already set is left alone."""
    from edgeq import cpu  # the CPU's flags, read once (no torch import)

    if "amx_tile" in cpu.flags():
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
        os.environ.setdefault("EDGEQ_NATIVE_ISA", "avx512")


_keep_amx_for_ggml()

from edgeq import fidelity as F  # noqa: E402 (after the ISA choice above)
from edgeq.convert.calibrated import DEFAULT_CALIB, GPTQOptions  # noqa: E402
from edgeq.convert.default import default_choice  # noqa: E402
from edgeq.convert.pipeline import convert  # noqa: E402
from edgeq.convert.recipe import find_recipe  # noqa: E402
from edgeq.errors import EdgeqError  # noqa: E402
from edgeq.fidelity.text import DEFAULT_TEXT  # noqa: E402
from edgeq.fidelity.tokens import encode  # noqa: E402
from edgeq.keys import DATA  # noqa: E402
from edgeq.runtime import load  # noqa: E402
from edgeq.scheme import Scheme  # noqa: E402

FIXTURE = DATA / "tiny-prose"
# label -> (scheme, method, recipe: "family" (the llama recipe, its group_sizes), "uniform" (the same, without) or a
#           named recipe (`edgeq recipes`: "quality"), --embeddings: None (the recipe's choice) / "bf16" / "packed" (the table
#           as 4-bit levels, tied: level 0 = the head), --calib: None (the bundled text for gptq) or "self" (ids sampled
#           from the model itself: no data), --head-levels: None (the recipe's) or 2 (the head adds the residual level));
#           method "gptq:minmax" is --method gptq --gptq-params minmax
#           recipe "default": what `edgeq quantize MODEL` chooses (edgeq.convert.default: since 2026-12-05 the quality
#           recipe on ids sampled from the model); the family-rtn arms were named default* before that
EDGEQ_ARMS = {
    "default": (None, None, "default", None, None, None),
    "family-rtn": ("w4a16-g128", "rtn", "family", None, None, None),  # `--method rtn`: the quick conversion
    "family-rtn-bf16": ("w4a16-g128", "rtn", "family", "bf16", None, None),
    "rtn-g128": ("w4a16-g128", "rtn", "uniform", "bf16", None, None),
    "clip-g128": ("w4a16-g128", "clip", "uniform", "bf16", None, None),
    "family-rtn-g64": ("w4a16-g64", "rtn", "family", "bf16", None, None),
    "rtn-g32": ("w4a16-g32", "rtn", "uniform", "bf16", None, None),
    "gptq": ("w4a16-g128", "gptq", "family", "bf16", None, None),
    "gptq-g32": ("w4a16-g32", "gptq", "uniform", "bf16", None, None),
    "family-rtn-packed": ("w4a16-g128", "rtn", "family", "packed", None, None),
    "gptq-packed": ("w4a16-g128", "gptq", "family", "packed", None, None),
    "head2": ("w4a16-g128", None, "family", "packed", None, 2),
    "gptq-self": ("w4a16-g128", "gptq", "family", "packed", "self", None),
    "gptq-head2": ("w4a16-g128", "gptq", "family", "packed", None, 2),
    "quality-bytes": ("w4a16-g256", "gptq", "quality", "packed", "self", 2),
    "quality-bytes-text": ("w4a16-g256", "gptq", "quality", "packed", None, 2),
    # GPTQ with its original min/max group parameters (--gptq-params minmax; the default before 2026-12-02)
    "gptq-packed-minmax": ("w4a16-g128", "gptq:minmax", "family", "packed", None, None),
    "gptq-head2-minmax": ("w4a16-g128", "gptq:minmax", "family", "packed", None, 2),
    "quality-bytes-minmax": ("w4a16-g256", "gptq:minmax", "quality", "packed", "self", 2),
    # GPTQ fitted to each Linear's own float weights (--gptq-target layer; the default before 2026-12-04)
    "gptq-self-layer": ("w4a16-g128", "gptq", "family", "packed", "self", None),
    "gptq-head2-layer": ("w4a16-g128", "gptq", "family", "packed", None, 2),
    "quality-bytes-layer": ("w4a16-g256", "gptq", "quality", "packed", "self", 2),
    "quality-bytes-text-layer": ("w4a16-g256", "gptq", "quality", "packed", None, 2),
}
GPTQ_TARGET = {label: "layer" for label in EDGEQ_ARMS if label.endswith("-layer")}  # --gptq-target; else the default
# label -> llama_cpp's ftype constant; BF16: the converted file, scored as it is (no quantisation)
LLAMA_FTYPES = {"Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q4_K_S": "LLAMA_FTYPE_MOSTLY_Q4_K_S",
                "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "BF16": None}
_ITEMSIZE = {"U8": 1, "I8": 1, "BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8}
_GGUF_COUNTED = ("token_embd.weight", "output.weight")
_GGUF_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


# ------------------------------------------------------------------------------------------------------- edgeq arms
def uniform_recipe(path: Path) -> Path:
    """The llama recipe without its group_sizes (every module at the scheme's group size), as a TOML file."""
    r = find_recipe(None, "llama")
    lines = [f"name = {json.dumps(r.name + '-uniform')}", "model_types = []", f"scheme = {json.dumps(r.scheme)}",
             f"method = {json.dumps(r.method)}", f"head = {json.dumps(r.head)}",
             f"embeddings = {json.dumps(list(r.embeddings))}", f"keep_bf16 = {json.dumps(list(r.keep_bf16))}"]
    path.write_text("\n".join(lines) + "\n")
    return path


def edgeq_bytes(out: Path) -> int:
    """Quantised linears + head (qweight, scales_and_zeros, perm) + embeddings, from the manifest's tensor records.

    A packed embedding's tensors have the role "embedding" (its own level); its tied level 0 is the head's tensors.
    """
    tensors = json.loads((out / "edgeq_manifest.json").read_text())["tensors"]
    roles = ("linear", "head", "embedding", "perm")
    return sum(math.prod(t["shape"]) * _ITEMSIZE[t["dtype"]] for t in tensors.values() if t["role"] in roles)


def edgeq_arm(label: str, tmp: Path, ref, ctx: int, max_tokens: int | None, model: Path = FIXTURE,
              text: str | None = None) -> tuple[int, int, F.FidelityReport]:
    """(counted bytes, bytes of the checkpoint's *.safetensors, report) of one edgeq arm."""
    scheme, method, recipe, embeddings, calib, head_levels = EDGEQ_ARMS[label]
    if recipe == "default":  # the command's own choice for this model (or the family recipe, rtn)
        chosen = default_choice(model, None)
        scheme, recipe, calib = (str(chosen.scheme) if chosen.scheme else None, chosen.recipe or "family", chosen.calib)
        method = "gptq" if chosen.recipe else "rtn"
    out = tmp / label
    recipe_arg = (str(uniform_recipe(tmp / "uniform.toml")) if recipe == "uniform"
                  else None if recipe == "family" else recipe)  # else a named recipe (edgeq recipes)
    method, _, params = (method or "").partition(":")
    method = method or None
    own = {"group_params": params} if params else {}
    if label in GPTQ_TARGET:
        own["target"] = GPTQ_TARGET[label]
    gptq = GPTQOptions(**({"calib": calib} if calib else {}), **own) if method == "gptq" else None
    extra = {"embeddings": embeddings} if embeddings else {}  # only then: runs on an edgeq without --embeddings too
    if head_levels:
        extra["head_levels"] = head_levels
    convert(model, out, scheme=Scheme.parse(scheme) if scheme else None, method=method, recipe=recipe_arg, gptq=gptq, **extra)
    files = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    return edgeq_bytes(out), files, F.compare(ref, load(out), text=text, ctx=ctx, max_tokens=max_tokens)


# --------------------------------------------------------------------------------------------------- llama.cpp arms
def llama_available() -> str | None:
    """None when llama.cpp's side can run; else why not."""
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"{e.name} is not importable (pip install 'edgeq[llama]')"
    return None


def converter(sdist: Path, tmp: Path) -> Path:
    """llama.cpp's convert_hf_to_gguf.py: the sdist's vendored copy, extracted (with its sibling modules)."""
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name and
                   (m.name.endswith("convert_hf_to_gguf.py") or "/vendor/llama.cpp/gguf-py/" in m.name
                    or "/vendor/llama.cpp/conversion/" in m.name)]  # the converter's per-architecture modules
        if not members:
            raise SystemExit(f"{sdist}: no vendor/llama.cpp/convert_hf_to_gguf.py inside")
        tar.extractall(tmp / "sdist", members=members, filter="data")
    return next((tmp / "sdist").rglob("convert_hf_to_gguf.py"))


def llama_pre_tokenizer(model: Path) -> str:
    """The llama.cpp pre-tokenizer type of ``model``'s tokenizer.json: "gpt-2" for GPT-2's byte-level BPE, else exit."""
    tok = json.loads((model / "tokenizer.json").read_text())
    pre, kind = tok.get("pre_tokenizer") or {}, (tok.get("model") or {}).get("type")
    if (kind == "BPE" and tok.get("normalizer") is None and pre.get("type") == "ByteLevel" and pre.get("use_regex")
            and not pre.get("add_prefix_space")):
        return "gpt-2"  # llama-vocab.cpp: LLAMA_VOCAB_PRE_TYPE_GPT2, GPT-2's regex ('s|'t|...| ?\\p{L}+|...)
    raise SystemExit(f"{model}/tokenizer.json: pre-tokenizer {pre} ({kind}) is not GPT-2's byte-level BPE; this "
                     f"script only knows which llama.cpp pre-tokenizer type that one is")


def register_pre_tokenizer(root: Path, chkhsh: str, pre: str) -> Path:
    """Map ``chkhsh`` to ``pre`` in the extracted converter's get_vocab_base_pre (the line its update script writes)."""
    anchor = "        if res is None:\n"
    for py in [root / "convert_hf_to_gguf.py", *sorted((root / "conversion").glob("*.py"))]:
        src = py.read_text() if py.exists() else ""
        if "def get_vocab_base_pre" in src and src.count(anchor) == 1:
            py.write_text(src.replace(anchor, f'        if chkhsh == "{chkhsh}":\n'
                                              f'            # edgeq benchmarks/quality_table.py: the bundled tokenizer\n'
                                              f'            res = "{pre}"\n' + anchor))
            return py
    raise SystemExit(f"{root}: no get_vocab_base_pre with one 'if res is None:' to register the tokenizer in")


def convert_bf16(script: Path, model: Path, out: Path) -> dict:
    """llama.cpp's converter, model -> BF16 GGUF; an unknown pre-tokenizer hash is registered once (module doc)."""
    cmd = [sys.executable, str(script), str(model), "--outtype", "bf16", "--outfile", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True)
    info = {"pre_tokenizer_registered": None}
    if run.returncode != 0 and "BPE pre-tokenizer was not recognized" in run.stderr:
        chkhsh = re.search(r"chkhsh:\s+([0-9a-f]{64})", run.stderr).group(1)
        pre = llama_pre_tokenizer(model)
        where = register_pre_tokenizer(script.parent, chkhsh, pre)
        info["pre_tokenizer_registered"] = {"chkhsh": chkhsh, "type": pre, "in": str(where.relative_to(script.parent))}
        run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed ({run.returncode}):\n{run.stderr[-3000:]}")
    return info


def gguf_bytes(path: Path) -> tuple[int, dict[str, int]]:
    """Bytes of token_embd + output + blk.* attention/FFN weights, and those bytes per ggml type (e.g. Q4_K, Q6_K)."""
    from gguf import GGUFReader

    def counted(name: str) -> bool:
        return name in _GGUF_COUNTED or (name.startswith("blk.") and name.split(".")[2] in _GGUF_LINEARS)

    per_type: dict[str, int] = {}
    for t in GGUFReader(str(path)).tensors:
        if counted(t.name):
            per_type[t.tensor_type.name] = per_type.get(t.tensor_type.name, 0) + int(t.n_bytes)
    return sum(per_type.values()), per_type


IMATRIX = "+imatrix"  # a --llama type suffix: that type quantised with llama.cpp's importance matrix


def imatrix(tools: Path, bf16: Path, text: Path, out: Path) -> Path:
    """llama.cpp's importance matrix of ``bf16`` over ``text`` (llama-imatrix at its defaults, 2 threads) -> ``out``."""
    if not out.exists():
        _tool(tools, "llama-imatrix", "-m", str(bf16), "-f", str(text), "-o", str(out), "-t", "2")
    return out


def _tool(tools: Path, name: str, *args: str) -> None:
    exe = tools / name
    if not exe.is_file():
        raise SystemExit(f"{exe}: not found; build it (module docstring) and pass its directory as --llama-tools")
    r = subprocess.run([str(exe), *args], capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output on stderr"])[-1]
        raise SystemExit(f"{name} failed ({r.returncode}): {last}")


def quantize_gguf(src: Path, out: Path, ftype: str, tools: Path | None = None, imat: Path | None = None) -> None:
    if imat is not None:  # the Python binding cannot pass an imatrix: llama-quantize does, as its users run it
        _tool(tools, "llama-quantize", "--imatrix", str(imat), str(src), str(out), ftype, "2")
        return
    import llama_cpp as L

    params = L.llama_model_quantize_default_params()
    params.ftype = getattr(L, LLAMA_FTYPES[ftype])
    params.nthread = 2
    rc = L.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize {ftype} failed with {rc}")


class LlamaScorer:
    """A scoring function for :func:`edgeq.fidelity.compare`: llama.cpp's logits for exactly the given token ids."""

    def __init__(self, path: Path, ctx: int):
        import llama_cpp as L

        self.llm = L.Llama(model_path=str(path), n_ctx=ctx, n_batch=ctx, logits_all=True, n_threads=2, verbose=False)

    def __call__(self, ids):
        import numpy as np
        import torch

        tokens = ids[0].tolist()
        self.llm.reset()
        self.llm.eval(tokens)
        return torch.from_numpy(np.array(self.llm.scores[: len(tokens)], dtype=np.float32)).unsqueeze(0)


def llama_arms(ftypes, tmp: Path, sdist: Path, ref, ctx: int, max_tokens: int | None, model: Path = FIXTURE,
               text: str | None = None, tools: Path | None = None, imatrix_text: Path = DEFAULT_CALIB) -> tuple[list, dict]:
    """llama.cpp's rows, and what made them (sdist hash, versions, the registered pre-tokenizer, a tokeniser check)."""
    import llama_cpp

    script = converter(sdist, tmp)
    bf16 = tmp / f"{model.name}-bf16.gguf"
    info = {"sdist": str(sdist), "sdist_sha256": hashlib.sha256(sdist.read_bytes()).hexdigest(),
            "llama_cpp_python": llama_cpp.__version__, **convert_bf16(script, model, bf16)}
    rows = []
    for ftype in ftypes:
        base = ftype.removesuffix(IMATRIX)
        path = bf16 if LLAMA_FTYPES[base] is None else tmp / f"{model.name}-{ftype}.gguf"
        if path != bf16:
            imat = imatrix(tools, bf16, imatrix_text, tmp / "imatrix.gguf") if ftype.endswith(IMATRIX) else None
            if imat is not None:
                info["imatrix_text"] = str(imatrix_text)
            quantize_gguf(bf16, path, base, tools, imat)
        scorer = LlamaScorer(path, ctx)
        if "same_ids_as_edgeq" not in info:  # the GGUF's tokenizer only has to load; say whether it also agrees
            probe = text if text is not None else DEFAULT_TEXT.read_text(encoding="utf-8")
            info["same_ids_as_edgeq"] = scorer.llm.tokenize(probe.encode(), add_bos=False) == encode(ref.tokenizer, probe)
        rep = F.compare(ref, scorer, tokenizer=ref.tokenizer, text=text, ctx=ctx, max_tokens=max_tokens)
        counted, per_type = gguf_bytes(path)
        print(f"  llama.cpp {ftype}: {counted} bytes counted ({per_type}), file {path.stat().st_size} bytes, "
              f"mean KLD {rep.kld_mean:.5f}", file=sys.stderr)
        label = f"llama.cpp {base}" + (" (the converted file, unquantised)" if path == bf16 else
                                        f" (imatrix: {imatrix_text.name})" if ftype.endswith(IMATRIX) else " (no imatrix)")
        rows.append((label, counted, path.stat().st_size, rep, {"gguf_bytes_by_type": per_type}))
    return rows, info


# ----------------------------------------------------------------------------------------------------------- table
def table(rows) -> str:
    """Rows (label, counted bytes, weights file bytes, report, extra) as markdown; MiB = 2**20 bytes."""
    lines = ["| arm | linears + head + embeddings | weights file(s) | mean KLD (± se) | same top-1 | PPL ratio |",
             "|---|---|---|---|---|---|"]
    for label, nbytes, fbytes, r, _ in rows:
        lines.append(f"| {label} | {nbytes / 2**20:.2f} MiB | {fbytes / 2**20:.2f} MiB | {r.kld_mean:.5f} ± "
                     f"{r.kld_mean_err:.5f} | {100 * r.top1_agreement:.1f}% | {r.ppl_ratio:.4f} |")
    if not rows:
        return "\n".join(lines + ["\nNo arm scored."])
    r = rows[0][3]
    lines.append(f"\n{r.tokens_scored} tokens scored ({r.windows} windows of ctx {r.ctx}, scored {r.score}).")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default=",".join(EDGEQ_ARMS), help=f"edgeq arms, from {', '.join(EDGEQ_ARMS)}")
    ap.add_argument("--llama", default=",".join(LLAMA_FTYPES), help="llama.cpp types ('' to skip)")
    ap.add_argument("--llama-sdist", type=Path, default=Path("/tmp/llamadl/llama_cpp_python-0.3.36.tar.gz"),
                    help="the llama-cpp-python sdist whose vendor/llama.cpp/convert_hf_to_gguf.py converts the model")
    ap.add_argument("--llama-tools", type=Path, default=None,
                    help="directory with llama-imatrix and llama-quantize (module docstring), for TYPE+imatrix rows")
    ap.add_argument("--imatrix-text", type=Path, default=DEFAULT_CALIB,
                    help="llama-imatrix's text [default: edgeq's bundled calibration text]")
    ap.add_argument("--ctx", type=int, default=F.DEFAULT_CTX)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write the raw reports here")
    ap.add_argument("--model", type=Path, default=FIXTURE, help="the bf16 reference model [default: the bundled one]")
    ap.add_argument("--text", type=Path, default=None, help="evaluation text [default: the bundled held-out text]")
    a = ap.parse_args(argv)
    arms = [x for x in a.arms.split(",") if x]
    unknown = [x for x in arms if x not in EDGEQ_ARMS]
    if unknown:
        ap.error(f"unknown arms {unknown}; valid: {', '.join(EDGEQ_ARMS)}")
    ftypes = [x for x in a.llama.split(",") if x]
    if [x for x in ftypes if x.removesuffix(IMATRIX) not in LLAMA_FTYPES or x == "BF16" + IMATRIX]:
        ap.error(f"unknown llama.cpp types in {ftypes}; valid: {', '.join(LLAMA_FTYPES)}, each but BF16 with {IMATRIX}")
    if any(x.endswith(IMATRIX) for x in ftypes) and a.llama_tools is None:
        ap.error(f"{IMATRIX} types need --llama-tools (the directory of llama-imatrix and llama-quantize)")
    ref = load(a.model)
    text = a.text.read_text(encoding="utf-8") if a.text else None
    rows, info, not_scored = [], None, {}
    with tempfile.TemporaryDirectory(prefix="edgeq-quality-") as td:
        tmp = Path(td)
        for label in arms:
            try:
                nbytes, fbytes, rep = edgeq_arm(label, tmp, ref, a.ctx, a.max_tokens, a.model, text)
            except EdgeqError as e:  # a packed-embedding arm on an edgeq that cannot write or load one yet
                if EDGEQ_ARMS[label][3] in (None, "bf16"):
                    raise
                not_scored[f"edgeq {label}"] = str(e)
                print(f"  {label}: not scored: {e}", file=sys.stderr)
                continue
            print(f"  {label}: {nbytes} bytes, mean KLD {rep.kld_mean:.5f}", file=sys.stderr)
            rows.append((f"edgeq {label}", nbytes, fbytes, rep, {}))
        why = llama_available() if ftypes else "skipped (--llama '')"
        if why is None:
            llama_rows, info = llama_arms(ftypes, tmp, a.llama_sdist, ref, a.ctx, a.max_tokens, a.model, text,
                                          a.llama_tools, a.imatrix_text)
            rows += llama_rows
        else:
            print(f"llama.cpp arms not run: {why}", file=sys.stderr)
    print(table(rows) + "".join(f"\nNot scored: {k}: {v}" for k, v in not_scored.items()))
    if a.json:
        out = [{"arm": l, "bytes": b, "file_bytes": f, **x, "report": r.to_dict()} for l, b, f, r, x in rows]
        a.json.write_text(json.dumps({"rows": out, "not_scored": not_scored, "llama_cpp": info}, indent=2))


if __name__ == "__main__":
    main()
