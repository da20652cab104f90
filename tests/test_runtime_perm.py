"""Act-order GPTQ layers store K permuted plus ``M.perm``; the runtime gathers x[..., perm] once for q/k/v."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from edgeq.errors import EdgeqError
from edgeq.layouts import tinygemm as tg
from edgeq.runtime import load

QKV = [f"model.layers.0.self_attn.{m}" for m in ("q_proj", "k_proj", "v_proj")]


def _permute(out, perm, modules=QKV, store=None):
    t = load_file(out / "model.safetensors")
    layout = tg.probe()
    for name in modules:
        n, half = t[f"{name}.qweight"].shape
        q = tg.unpack(t[f"{name}.qweight"], n, 2 * half, layout)
        t[f"{name}.qweight"] = tg.pack(q[:, perm], layout)
        t[f"{name}.perm"] = (store if store is not None else perm).clone()
    save_file(t, out / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture
def ckpt(tmp_path, fixture_quantized):
    import shutil

    out = tmp_path / "perm"
    shutil.copytree(fixture_quantized, out)
    return out


def test_permuted_layers_give_identical_logits_with_one_gather(ckpt, fixture_quantized):
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    ref = load(fixture_quantized).model(ids).logits
    # a permutation inside each group of 32 (the finest group; q/k/v are g32 under the llama recipe) keeps every
    # group's scale and zero valid
    g = torch.Generator().manual_seed(1)
    perm = torch.cat([32 * i + torch.randperm(32, generator=g) for i in range(8)])
    _permute(ckpt, perm)
    lm = load(ckpt)
    assert torch.equal(lm.model(ids).logits, ref)
    assert lm.path_counts["input_gather"] == 1  # q, k and v read the same input with the same perm
    assert sum(getattr(lm.model.get_submodule(m), "perm") is not None for m in QKV) == 3


def test_bad_perm_is_refused(ckpt):
    _permute(ckpt, torch.arange(256), store=torch.zeros(256, dtype=torch.int64))
    with pytest.raises(EdgeqError, match=r"model.layers.0.self_attn.[qkv]_proj.perm: not a permutation of 0..255"):
        load(ckpt)
