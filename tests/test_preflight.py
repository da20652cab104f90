"""load()'s refusals for the loaders that build their own modules (edgeq/runtime/preflight.py): transformers'
from_pretrained generated from a NaN scale and filled missing weights with random values; vLLM (tests/test_vllm.py)
served zeros. Each damaged copy is refused, by the runtime, by preflight and by from_pretrained, with the same line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from edgeq.errors import EdgeqError
from edgeq.io.mapped import MappedFiles
from edgeq.runtime import load
from edgeq.runtime.preflight import preflight
from edgeq.runtime.qinfo import read_checkpoint
from helpers.checkpoints import prose_checkpoint
from helpers.damage import DAMAGE


@pytest.fixture(scope="module")
def prose(tmp_path_factory) -> Path:
    return prose_checkpoint(tmp_path_factory)


@pytest.fixture(params=list(DAMAGE))
def damaged(request, prose, tmp_path):
    out = shutil.copytree(prose, tmp_path / request.param)
    damage, error, message = DAMAGE[request.param]
    damage(out)
    return out, error, message


def test_preflight_refuses_what_load_refuses(prose, damaged):
    path, error, message = damaged
    with pytest.raises(error, match=message):
        preflight(path, MappedFiles(path), read_checkpoint(path, json.loads((path / "config.json").read_text())))
    with pytest.raises(EdgeqError):  # load refuses each too (its own message where it finds it elsewhere)
        load(path)
    preflight(prose, MappedFiles(prose), read_checkpoint(prose, json.loads((prose / "config.json").read_text())))


def test_from_pretrained_refuses_instead_of_generating_from_damage(damaged):
    import edgeq  # noqa: F401 (registers the quantizer)
    from transformers import AutoModelForCausalLM

    path, error, message = damaged
    with pytest.raises(error, match=message):
        AutoModelForCausalLM.from_pretrained(str(path))
