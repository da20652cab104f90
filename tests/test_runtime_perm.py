"""Act-order GPTQ layers store K permuted plus ``M.perm``; the runtime gathers x[..., perm] once for q/k/v."""

import pytest
import torch

from edgeq.errors import EdgeqError
from edgeq.runtime import load
from helpers.perm import QKV, permute


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
    permute(ckpt, perm)
    lm = load(ckpt)
    assert torch.equal(lm.model(ids).logits, ref)
    assert lm.path_counts["input_gather"] == 1  # q, k and v read the same input with the same perm
    assert sum(getattr(lm.model.get_submodule(m), "perm") is not None for m in QKV) == 3


def test_bad_perm_is_refused(ckpt):
    permute(ckpt, torch.arange(256), store=torch.zeros(256, dtype=torch.int64))
    with pytest.raises(EdgeqError, match=r"model.layers.0.self_attn.[qkv]_proj.perm: not a permutation of 0..255"):
        load(ckpt)
