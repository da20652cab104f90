"""Damaged copies of an edgeq checkpoint, each with the error and message every loader must refuse it with
(tests/test_preflight.py, tests/test_vllm.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from edgeq.errors import DamagedCheckpointError, EdgeqError
from edgeq.io.mapped import MappedFiles

SCALES = "model.layers.1.mlp.up_proj.scales_and_zeros"


def poke(directory: Path, name: str, fn) -> None:
    """Rewrite tensor ``name`` in place in its shard (the header and every other byte unchanged): ``fn`` edits a
    copy of the tensor, which is written back at the same offset."""
    info = MappedFiles(directory).tensors[name]
    with open(info.file, "r+b") as f:
        f.seek(info.start)
        t = torch.frombuffer(bytearray(f.read(info.nbytes)), dtype=info.torch_dtype).view(info.shape).clone()
        fn(t)
        f.seek(info.start)
        f.write(t.contiguous().view(torch.uint8).numpy().tobytes())


def _drop(directory: Path, *prefixes: str) -> None:
    path = directory / "model.safetensors"
    tensors = {k: v for k, v in load_file(path).items() if not k.startswith(prefixes)}
    save_file(tensors, path, metadata={"format": "pt"})


def _json(directory: Path, name: str, fn) -> None:
    data = json.loads((directory / name).read_text())
    fn(data)
    (directory / name).write_text(json.dumps(data))


def _unlist(manifest: dict, module: str) -> None:
    manifest["quantized_modules"] = [m for m in manifest["quantized_modules"] if m != module]


DAMAGE = {
    "nan-scale": (lambda d: poke(d, SCALES, lambda t: t.view(-1).__setitem__(0, float("nan"))),
                  DamagedCheckpointError, rf"tensor {SCALES}: 1 NaN/Inf value"),
    "negative-scale": (lambda d: poke(d, SCALES, lambda t: t[0, 0].__setitem__(0, -t[0, 0, 0])),
                       DamagedCheckpointError, r"1 scale\(s\) zero or negative"),
    "head-dropped": (lambda d: _drop(d, "lm_head."), EdgeqError, r"lacks 2 tensors .*'lm_head.qweight'"),
    "up-proj-dropped": (lambda d: _drop(d, "model.layers.1.mlp.up_proj."), EdgeqError,
                        r"lacks 2 tensors .*'model.layers.1.mlp.up_proj.qweight'"),
    "one-layer-more": (lambda d: _json(d, "config.json", lambda c: c.update(num_hidden_layers=c["num_hidden_layers"] + 1)),
                       EdgeqError, r"lacks \d+ tensors .*'model.layers.4."),
    "module-unlisted": (lambda d: _json(d, "edgeq_manifest.json", lambda m: _unlist(m, "model.layers.1.mlp.up_proj")),
                        EdgeqError, r"lacks 1 tensors .*'model.layers.1.mlp.up_proj.weight'"),
}
