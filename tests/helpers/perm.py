"""Input permutations written into a quantised checkpoint (the ``.perm`` tensors of act-order models)."""

from __future__ import annotations

from safetensors.torch import load_file, save_file

from edgeq.layouts import tinygemm as tg

QKV = [f"model.layers.0.self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj")]


def permute(out, perm, modules=QKV, store=None):
    """Rewrite ``modules`` in ``out``/model.safetensors so their input columns are ``perm``-ordered, storing
    ``store`` (default: ``perm``) as each module's ``.perm``: a correct ``perm`` leaves the logits unchanged."""
    t = load_file(out / "model.safetensors")
    layout = tg.probe()
    for name in modules:
        n, half = t[f"{name}.qweight"].shape
        q = tg.unpack(t[f"{name}.qweight"], n, 2 * half, layout)
        t[f"{name}.qweight"] = tg.pack(q[:, perm], layout)
        t[f"{name}.perm"] = (store if store is not None else perm).clone()
    save_file(t, out / "model.safetensors", metadata={"format": "pt"})
