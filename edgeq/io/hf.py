"""Open a Hugging Face checkpoint directory from headers alone: config, shards, tensor index. No weight data read.

Accepted: ``config.json`` plus ``model.safetensors``, or ``model.safetensors.index.json`` and the shards it names,
or any set of ``*.safetensors`` files. Pickle checkpoints (``*.bin``, ``*.pt``, ``*.pth``, ``*.ckpt``) are refused:
edgeq never unpickles anything, and the message says how to convert them.

:func:`weight_files` and :func:`add_tensors` are the one place that finds a directory's shards and indexes their
tensors; the runtime's mapped reader (edgeq.io.mapped) uses them too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from edgeq.io.safetensors import TensorInfo, read_header, read_tensor
from edgeq.errors import EdgeqError
from edgeq.keys import WEIGHTS, WEIGHTS_INDEX

# Any one of these lets transformers load a tokenizer from a checkpoint directory (convert warns without them, the
# runtime then has no tokenizer).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
CONVERT_HINT = (
    "convert it once with transformers: python -c \"from transformers import AutoModelForCausalLM as M; "
    "M.from_pretrained('{src}').save_pretrained('{src}-safetensors')\" (this unpickles: only for files you trust)"
)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint's config and tensor index. ``tensors`` maps each name to where its bytes are."""

    root: Path
    config: dict
    tensors: dict[str, TensorInfo]
    files: tuple[Path, ...]
    index: dict | None = None

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        return read_tensor(self.tensors[name], rows)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def quantization_config(self) -> dict | None:
        q = self.config.get("quantization_config")
        return q if isinstance(q, dict) else None


def load_config(root: Path) -> dict:
    path = root / "config.json"
    if not path.is_file():
        raise EdgeqError(f"{root}: no config.json; point edgeq at a Hugging Face model directory")
    try:
        config = json.loads(path.read_text())
    except (ValueError, RecursionError) as e:  # ValueError covers bad UTF-8, bad JSON and over-long integers
        raise EdgeqError(f"{path}: not valid JSON ({str(e)[:100]}); restore the file from the model's source") from e
    if not isinstance(config, dict):
        raise EdgeqError(f"{path}: expected a JSON object")
    return config


def open_checkpoint(path: str | Path) -> Checkpoint:
    root = Path(path)
    if not root.is_dir():
        raise EdgeqError(f"{root}: not a directory; give a local Hugging Face model directory")
    config = load_config(root)
    files, index = weight_files(root)
    tensors: dict[str, TensorInfo] = {}
    for f in files:
        add_tensors(tensors, read_header(f)[0])
    if index is not None:
        for name, shard in index["weight_map"].items():
            if name not in tensors or tensors[name].file.name != shard:
                raise EdgeqError(f"{root / WEIGHTS_INDEX}: lists {name} in {shard}, which does not contain it")
    if not tensors:
        raise EdgeqError(f"{root}: the safetensors files hold no tensors")
    return Checkpoint(root=root, config=config, tensors=tensors, files=tuple(files), index=index)


def add_tensors(tensors: dict[str, TensorInfo], found: dict[str, TensorInfo]) -> None:
    """Add one shard's tensors to a checkpoint's index; a name already there (from another shard) is refused."""
    for name, info in found.items():
        if name in tensors:
            raise EdgeqError(f"{info.file}: tensor {name} also appears in {tensors[name].file.name}; "
                             "the checkpoint is inconsistent")
        tensors[name] = info


def weight_files(root: Path, any_name: bool = True) -> tuple[list[Path], dict | None]:
    """The safetensors files of a checkpoint directory, and its index (None without one).

    ``model.safetensors.index.json``, when present, names the shards. Without it: every ``*.safetensors`` file
    (``any_name``, a Hugging Face directory), or only ``model.safetensors`` (the runtime: an edgeq checkpoint is
    that file or indexed shards, and a stray copy beside it is no shard). Pickle weights alone are refused with how
    to convert them."""
    index_path = root / WEIGHTS_INDEX
    if index_path.is_file():
        index = _read_index(index_path)
        files = []
        for shard in sorted(set(index["weight_map"].values())):
            p = root / shard
            if not p.is_file():
                raise EdgeqError(f"{index_path}: points at missing shard {shard}; download it again")
            files.append(p)
        return files, index
    files = sorted(root.glob("*.safetensors")) if any_name else [p for p in [root / WEIGHTS] if p.exists()]
    if files:
        return files, None
    pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_SUFFIXES) if root.is_dir() else []
    if pickles:
        raise EdgeqError(f"{root}: only pickle weights ({', '.join(pickles[:3])}); edgeq never unpickles. " + CONVERT_HINT.format(src=root))
    raise EdgeqError(f"{root}: no *.safetensors weights found" if any_name else f"{root}: no {WEIGHTS} or {WEIGHTS_INDEX}")


def _read_index(index_path: Path) -> dict:
    try:
        index = json.loads(index_path.read_text())
        weight_map = index["weight_map"]
    except (ValueError, RecursionError, KeyError, TypeError) as e:
        raise EdgeqError(f"{index_path}: malformed index (needs a weight_map object); restore it from the model's source") from e
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise EdgeqError(f"{index_path}: malformed index (weight_map must map tensor names to shard file names); "
                         "restore it from the model's source")
    return index
