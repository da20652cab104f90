"""Packed-embedding checkpoints for the runtime's tests, and the contract's formula computed independently.

``pack_by_hand`` writes what the contract (docs/format.md, "Packed embeddings") defines from an edgeq checkpoint with
a bf16 table: for a tied head, level 0 is the head and the residual ``R = float32(W) - D_0`` is quantised with
``quantize_groups(R, G1, "rtn")`` into the table module's own tensors; for an untied head both levels are the
table's own (``M`` at the head's G, ``M.residual`` at G1). ``reference_table`` is the formula, from
``tinygemm.unpack`` + ``tinygemm.dequantize`` of the whole levels (not the runtime's row decoder).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from edgeq.io.mapped import MappedFiles
from edgeq.io.safetensors import sha256_file
from edgeq.layouts import tinygemm
from edgeq.quantize.rtn import quantize_groups

TABLE = "model.embed_tokens"


def _layout(manifest: dict) -> tinygemm.TinygemmLayout:
    return tinygemm.TinygemmLayout.from_json(manifest["layout"])


def dequantized_level(files, manifest: dict, module: str, group_size: int) -> torch.Tensor:
    """fp32 [V, K] of one level: the whole table unpacked with the manifest's layout and dequantised."""
    qw = files.get(f"{module}.qweight")
    n, k = qw.shape[0], qw.shape[1] * 2
    q = tinygemm.unpack(qw, n, k, _layout(manifest))
    return tinygemm.dequantize(q, files.get(f"{module}.scales_and_zeros"), group_size, torch.float32)


def reference_table(qdir: Path) -> torch.Tensor:
    """E (bf16 [V, K]) of a packed checkpoint by the contract: the levels' fp32 dequantisations summed, one rounding."""
    manifest = json.loads((Path(qdir) / "edgeq_manifest.json").read_text())
    files = MappedFiles(qdir)
    (entry,) = manifest["embeddings"].values()
    total = None
    for lv in entry["levels"]:
        d = dequantized_level(files, manifest, lv["module"], lv["group_size"])
        total = d if total is None else total + d
    return total.to(torch.bfloat16)


def _quantize_into(tensors: dict, name: str, w: torch.Tensor, group_size: int, layout) -> None:
    qt = quantize_groups(w, group_size, "rtn", name=name)
    tensors[f"{name}.qweight"] = tinygemm.pack(qt.q, layout)
    tensors[f"{name}.scales_and_zeros"] = qt.scales_and_zeros.contiguous()


def pack_by_hand(qdir: Path, out: Path, residual_group: int | None = None) -> Path:
    """A copy of the (single-shard, bf16-table) edgeq checkpoint ``qdir`` with its input embedding packed per the
    contract, format_version 2; the residual level at ``residual_group`` (default: the scheme's base G, as the
    converter does)."""
    qdir, out = Path(qdir), Path(out)
    shutil.copytree(qdir, out)
    manifest = json.loads((qdir / "edgeq_manifest.json").read_text())
    files = MappedFiles(qdir)
    layout = _layout(manifest)
    tensors = {n: files.get(n).clone() for n in files.names()}
    w = tensors.pop(f"{TABLE}.weight").to(torch.float32)
    head, base = manifest["head"], int(manifest["scheme"].rsplit("-g", 1)[1])
    g0, residual_group = manifest.get("group_sizes", {}).get(head["name"], base), residual_group or base
    if head.get("untied"):  # tied: level 0 is the head
        levels = [{"module": head["name"], "group_size": g0}, {"module": TABLE, "group_size": residual_group}]
        residual = w - dequantized_level(files, manifest, head["name"], g0)
        _quantize_into(tensors, TABLE, residual, residual_group, layout)
    else:
        levels = [{"module": TABLE, "group_size": g0}, {"module": f"{TABLE}.residual", "group_size": residual_group}]
        _quantize_into(tensors, TABLE, w, g0, layout)
        own = tinygemm.dequantize(tinygemm.unpack(tensors[f"{TABLE}.qweight"], *w.shape, layout),
                                  tensors[f"{TABLE}.scales_and_zeros"], g0, torch.float32)
        _quantize_into(tensors, f"{TABLE}.residual", w - own, residual_group, layout)
    del files
    (shard,) = manifest["shards"]
    save_file(tensors, str(out / shard), metadata={"format": "pt"})
    manifest["format_version"] = 2
    manifest["embeddings"] = {TABLE: {"storage": "packed", "source": f"{TABLE}.weight", "levels": levels}}
    manifest["tensors"].pop(f"{TABLE}.weight", None)
    for lv in levels[1 if head.get("untied") else 0:]:
        for suffix, dtype in ((".qweight", "U8"), (".scales_and_zeros", "BF16")):
            t = tensors[f"{lv['module']}{suffix}"]
            manifest["tensors"][f"{lv['module']}{suffix}"] = {"role": "embedding", "source": f"{TABLE}.weight",
                                                             "dtype": dtype, "shape": list(t.shape)}
    manifest["shards"] = {shard: sha256_file(out / shard)}
    (out / "edgeq_manifest.json").write_text(json.dumps(manifest, indent=1))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["format_version"] = 2
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def with_table(qdir: Path, table: torch.Tensor, out: Path) -> Path:
    """A copy of the bf16-table edgeq checkpoint ``qdir`` whose ``model.embed_tokens.weight`` is ``table`` (bf16):
    with E, the packed checkpoint's embedding materialised, everything else (head, linears) byte-identical."""
    qdir, out = Path(qdir), Path(out)
    shutil.copytree(qdir, out)
    manifest = json.loads((qdir / "edgeq_manifest.json").read_text())
    files = MappedFiles(qdir)
    tensors = {n: files.get(n).clone() for n in files.names()}
    assert tensors[f"{TABLE}.weight"].shape == table.shape
    tensors[f"{TABLE}.weight"] = table.to(torch.bfloat16).contiguous()
    del files
    (shard,) = manifest["shards"]
    save_file(tensors, str(out / shard), metadata={"format": "pt"})
    manifest["shards"] = {shard: sha256_file(out / shard)}
    (out / "edgeq_manifest.json").write_text(json.dumps(manifest, indent=1))
    return out


def check_packed_table(src: Path, qdir: Path) -> torch.Tensor:
    """Assert that the packed input embedding of the edgeq checkpoint ``qdir`` is, bit for bit, what the contract's
    conversion makes from the input checkpoint ``src``: an own level 0 is ``quantize_groups(W, G0, "rtn")``; the
    residual is ``quantize_groups(float32(W) - D_0, G1, "rtn")`` with D_0 the level 0 as stored (a tied level 0 is
    the head: its own bits are the caller's to check); the float table is not written; each own level's tensors are
    recorded with role "embedding". Returns E (bf16 [V, K]), which is closer to W than level 0 alone."""
    from edgeq.io.hf import open_checkpoint

    manifest = json.loads((Path(qdir) / "edgeq_manifest.json").read_text())
    (entry,) = manifest["embeddings"].values()
    assert entry["storage"] == "packed" and manifest["format_version"] == 2, entry
    ref, got, files = open_checkpoint(src), open_checkpoint(qdir), MappedFiles(qdir)
    source, layout = entry["source"], _layout(manifest)
    w = ref.read(source)
    assert source not in got.tensors  # the bf16 table is replaced by its levels
    first, residual = entry["levels"][0], entry["levels"][-1]
    head, base = manifest["head"]["name"], int(manifest["scheme"].rsplit("-g", 1)[1])
    # level 0 at the head's group size (the recipe's, e.g. g32), the residual at the scheme's base group size
    assert len(entry["levels"]) == 2 and residual["group_size"] == base
    assert first["group_size"] == manifest.get("group_sizes", {}).get(head, base)
    if first["module"] == head:  # tied: the head, quantised from this very table
        assert manifest["head"]["source"] == source
        own = entry["levels"][1:]
    else:
        own = entry["levels"]
        qt = quantize_groups(w, first["group_size"], "rtn")
        assert torch.equal(tinygemm.unpack(files.get(f"{first['module']}.qweight"), *w.shape, layout), qt.q)
        assert torch.equal(files.get(f"{first['module']}.scales_and_zeros"), qt.scales_and_zeros)
    d0 = dequantized_level(files, manifest, first["module"], first["group_size"])
    qt = quantize_groups(w.to(torch.float32) - d0, residual["group_size"], "rtn")
    assert torch.equal(tinygemm.unpack(files.get(f"{residual['module']}.qweight"), *w.shape, layout), qt.q)
    assert torch.equal(files.get(f"{residual['module']}.scales_and_zeros"), qt.scales_and_zeros)
    for lv in own:
        for suffix in (".qweight", ".scales_and_zeros"):
            rec = manifest["tensors"][lv["module"] + suffix]
            assert rec["role"] == "embedding" and rec["source"] == source, rec
    table = reference_table(qdir)
    wf = w.to(torch.float32)
    assert float((table.float() - wf).norm()) < float((d0.to(torch.bfloat16).float() - wf).norm())
    return table
