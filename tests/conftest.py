"""Fixtures every test module can ask for by name. Shared functions and constants live in tests/helpers/ (imported
as ``helpers.*``); a test module never imports another test module (tests/test_test_layout.py)."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TQDM_DISABLE", "1")

from helpers.paths import FIXTURE  # noqa: E402  (tests/ is on sys.path from here on)


@pytest.fixture(scope="session")
def fixture_model() -> Path:
    return FIXTURE


@pytest.fixture(scope="session")
def fixture_quantized(tmp_path_factory) -> Path:
    """The bundled trained model, quantised once per session with the default scheme and method."""
    from edgeq.convert.pipeline import convert

    out = tmp_path_factory.mktemp("q") / "tiny-prose-w4a16-g128"
    convert(FIXTURE, out)
    return out
