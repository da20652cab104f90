"""The ``--save-ref`` file: writing it, and reading it back with every defect refused (docs/fidelity.md, "Format").

A safetensors file whose metadata key ``edgeq_fidelity_ref`` holds a JSON header (format, tokenizer and text
sha256, ctx, score, k, vocab size, BOS id, windows, positions) and whose tensors are the scored windows
(``input_ids`` int32 [W, ctx]) and the :class:`~edgeq.fidelity.topk.RefRows` of every scored position.
Size: ``12 k + 40`` bytes per position plus ``4 ctx`` per window; k = 32 on the bundled text (6,120 positions,
24 windows of 512): 6,120 * 424 + 24 * 2,048 = 2.64 MB.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

import torch

from edgeq.errors import EdgeqError
from edgeq.io.writer import as_created
from edgeq.fidelity.metrics import TOP5
from edgeq.fidelity.text import Windowing, plan_counts
from edgeq.fidelity.topk import RefRows

REF_FORMAT = "edgeq.fidelity-ref/1"
DEFAULT_REF_TOPK = 32


@dataclass(frozen=True)
class ReferenceFile:
    """A loaded ``--save-ref`` file: its JSON header, the windows it scored and the per-position :class:`RefRows`."""

    header: dict
    windows: torch.Tensor
    rows: RefRows
    path: str = "--ref"

    @property
    def counts(self) -> list[int]:
        """Scored positions per stored window, as the run that wrote the file counted them."""
        w = Windowing(self.header["ctx"], self.header["score"])
        return plan_counts(self.windows.shape[0], w.per_window, self.header["positions"])


def check_save_target(path: str | os.PathLike) -> None:
    """Before any scoring: ``--save-ref FILE`` may replace an earlier reference file, nothing else (not the --text
    it reads, not a directory), and its directory must exist."""
    path = Path(path)
    if not path.parent.is_dir():
        raise EdgeqError(f"--save-ref {path}: {path.parent} is not a directory; create it or choose another path")
    if path.exists() and not _is_reference_file(path):
        raise EdgeqError(f"--save-ref {path}: exists and is not an edgeq reference file; edgeq replaces only its own "
                         f"reference files: choose another path")


def _is_reference_file(path: Path) -> bool:
    from safetensors import safe_open

    if not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            return "edgeq_fidelity_ref" in (f.metadata() or {})
    except Exception:  # not safetensors at all (a text file): not a reference file, and refused as such
        return False


def write_reference(path: str | os.PathLike, windows: torch.Tensor, rows: list[RefRows], win: Windowing, *, k: int,
                    vocab: int, bos: Optional[int], tokenizer_sha: Optional[str], text_sha: Optional[str]) -> None:
    """Write the reference file atomically (``FILE.tmp``, then renamed): the windows scored and their rows."""
    from safetensors.torch import save_file

    from edgeq.keys import VERSION as __version__

    data = RefRows.cat(rows)
    header = {"format": REF_FORMAT, "created_by": f"edgeq {__version__}", "tokenizer_sha256": tokenizer_sha,
              "text_sha256": text_sha, "ctx": win.ctx, "score": win.score, "k": int(data.topk_ids.shape[1]),
              "requested_k": k, "vocab_size": vocab, "bos_id": bos, "windows": int(windows.shape[0]),
              "positions": int(data.target_logprob.shape[0])}
    tensors = {"input_ids": windows.int().contiguous(), **{f.name: getattr(data, f.name).contiguous() for f in fields(RefRows)}}
    header["data_sha256"] = data_sha256(tensors)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file(tensors, str(tmp), metadata={"edgeq_fidelity_ref": json.dumps(header)})
        as_created(tmp)
        os.replace(tmp, path)  # a crash never leaves a half-written reference behind under the real name
    finally:
        tmp.unlink(missing_ok=True)


def data_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of the tensors' bytes, by name: the reference file's own check (a flipped byte in its logprobs would
    otherwise give a plausible, wrong KLD)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def load_reference_file(path: str | os.PathLike) -> ReferenceFile:
    """Read and validate a ``--save-ref`` file; every defect is an EdgeqError naming the file."""
    from safetensors import safe_open

    path = Path(path)
    fix = "re-create it with edgeq fidelity REF QUANT --save-ref FILE"
    if path.is_dir():
        raise EdgeqError(f"{path}: is a directory; --ref takes the file --save-ref wrote")
    if not path.is_file():
        raise EdgeqError(f"{path}: reference file not found; {fix}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if "edgeq_fidelity_ref" not in meta:
                raise EdgeqError(f"{path}: not an edgeq fidelity reference file (no edgeq_fidelity_ref header); {fix}")
            tensors = {n: f.get_tensor(n) for n in f.keys()}
    except EdgeqError:
        raise
    except Exception as e:  # safetensors reports truncation as "incomplete metadata, file not fully covered" etc.
        raise EdgeqError(f"{path}: unreadable or truncated reference file ({e}); {fix}") from None
    header = json.loads(meta["edgeq_fidelity_ref"])
    if header.get("format") != REF_FORMAT:
        raise EdgeqError(f"{path}: reference format {header.get('format')!r}, this edgeq reads {REF_FORMAT!r}; {fix}")
    names = ["input_ids"] + [f.name for f in fields(RefRows)]
    missing = [n for n in names if n not in tensors]
    if missing:
        raise EdgeqError(f"{path}: reference file lacks tensor(s) {', '.join(missing)}; {fix}")
    P, k, W, ctx = header["positions"], header["k"], header["windows"], header["ctx"]
    n5 = min(TOP5, header["vocab_size"])
    want = {"input_ids": (W, ctx), "topk_ids": (P, k), "topk_logprobs": (P, k), "target_logprob": (P,),
            "tail_logmass": (P,), "top1": (P,), "top5": (P, n5)}
    for n, shape in want.items():
        if tuple(tensors[n].shape) != shape:
            raise EdgeqError(f"{path}: tensor {n} has shape {tuple(tensors[n].shape)}, the header says {shape}; {fix}")
    if "data_sha256" in header and data_sha256({n: tensors[n] for n in names}) != header["data_sha256"]:
        raise EdgeqError(f"{path}: its data does not match the sha256 in its header (the file changed after it was "
                         f"written); {fix}")
    ref = ReferenceFile(header, tensors["input_ids"].long(), RefRows(*(tensors[f.name] for f in fields(RefRows))),
                        str(path))
    if sum(ref.counts) != P:
        raise EdgeqError(f"{path}: {P} positions do not fit {W} windows of ctx {ctx} ({header['score']}); {fix}")
    return ref
