"""The in-place gated MLP (edgeq/runtime/fused.py): same logits bit for bit as transformers' MLP forward, on the
quantised fixture (kernel and dequant prefill paths) and a bf16 tiny Qwen3; other MLPs are left alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edgeq.runtime import fused, load
from helpers.checkpoints import prose_checkpoint
from helpers.models import save_hf, tiny_model

PROMPT = torch.tensor([list(range(5, 45))])


def _unfused(model: nn.Module) -> int:
    n = 0
    for m in model.modules():
        if "forward" in m.__dict__:  # the instance attribute fuse_mlps set: back to the class's forward
            del m.forward
            n += 1
    return n


def _logits(lm) -> torch.Tensor:
    lm.cache.reset()
    with torch.inference_mode():
        return lm.forward(PROMPT).float()


@pytest.fixture(scope="module")
def prose(tmp_path_factory):
    return prose_checkpoint(tmp_path_factory)


@pytest.mark.parametrize("threshold", [1, 10_000], ids=["dequant-prefill", "kernel-prefill"])
def test_same_logits_as_transformers_mlp(prose, threshold):
    lm = load(prose, prefill_threshold=threshold, kv_cache_bytes="2MiB")
    assert lm.settings.fused_mlps == lm.config.num_hidden_layers
    a = _logits(lm)
    assert _unfused(lm.model) == lm.config.num_hidden_layers
    b = _logits(lm)
    assert torch.equal(a, b)


def test_bf16_qwen3(tmp_path):
    src = save_hf(tiny_model("qwen3"), tmp_path / "q3")
    lm = load(src, kv_cache_bytes="2MiB")
    assert lm.settings.fused_mlps == lm.config.num_hidden_layers
    a = _logits(lm)
    _unfused(lm.model)
    assert torch.equal(a, _logits(lm))


def test_other_mlps_untouched():
    class GeluMLP(nn.Module):  # a Llama-named MLP with another activation keeps its own forward
        def __init__(self):
            super().__init__()
            self.gate_proj = self.up_proj = self.down_proj = nn.Linear(4, 4)
            self.act_fn = nn.GELU()

    GeluMLP.__name__ = "LlamaMLP"
    m = nn.Sequential(GeluMLP(), nn.Linear(4, 4))
    assert fused.fuse_mlps(m) == 0 and "forward" not in m[0].__dict__
