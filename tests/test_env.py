"""edgeq.env: every EDGEQ_* variable read one way; bad values named with the variable."""

import re
from pathlib import Path

import pytest

from edgeq import env
from edgeq.errors import EdgeqError


def test_raw_strips_and_falls_back_on_unset_or_blank(monkeypatch):
    monkeypatch.delenv("EDGEQ_X", raising=False)
    assert env.raw("EDGEQ_X", "auto") == "auto"
    monkeypatch.setenv("EDGEQ_X", "   ")
    assert env.raw("EDGEQ_X", "auto") == "auto"
    monkeypatch.setenv("EDGEQ_X", " AVX2 ")
    assert env.raw("EDGEQ_X") == "AVX2"


@pytest.mark.parametrize("value, expected", [("1", True), ("TRUE", True), (" yes ", True), ("on", True),
                                             ("0", False), ("no", False), ("", False), ("2", False)])
def test_flag(monkeypatch, value, expected):
    monkeypatch.setenv(env.STRICT_LAYOUT, value)
    assert env.flag(env.STRICT_LAYOUT) is expected


def test_positive_int(monkeypatch):
    monkeypatch.delenv(env.PREFILL_THRESHOLD, raising=False)
    assert env.positive_int(env.PREFILL_THRESHOLD) is None
    monkeypatch.setenv(env.PREFILL_THRESHOLD, "512")
    assert env.positive_int(env.PREFILL_THRESHOLD) == 512
    for bad in ("0", "-3", "1e3", "x"):
        monkeypatch.setenv(env.PREFILL_THRESHOLD, bad)
        with pytest.raises(EdgeqError, match=re.escape(f"$EDGEQ_PREFILL_THRESHOLD={bad!r}: expected an integer >= 1 (1 = always")):
            env.positive_int(env.PREFILL_THRESHOLD, "1 = always dequantise")


def test_choice_names_its_source(monkeypatch):
    monkeypatch.setenv(env.DECODE_LOOP, "Lean")
    assert env.choice(None, "decode_loop", env.DECODE_LOOP, ("auto", "lean")) == ("lean", "$EDGEQ_DECODE_LOOP")
    assert env.choice("auto", "decode_loop", env.DECODE_LOOP, ("auto", "lean")) == ("auto", "decode_loop")
    monkeypatch.setenv(env.DECODE_LOOP, "fast")
    with pytest.raises(EdgeqError, match=re.escape("$EDGEQ_DECODE_LOOP='fast': expected one of auto, lean")):
        env.choice(None, "decode_loop", env.DECODE_LOOP, ("auto", "lean"))


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv(env.CACHE_DIR, str(tmp_path))
    assert env.cache_dir() == tmp_path
    monkeypatch.setenv(env.CACHE_DIR, "")
    assert env.cache_dir() == Path.home() / ".cache" / "edgeq"


def test_every_variable_edgeq_reads_is_in_the_table():
    """The docstring table (README "Settings" copies it) names every EDGEQ_* constant, and nothing in edgeq/ reads
    an EDGEQ_* variable from os.environ except through env.py."""
    names = {v for k, v in vars(env).items() if k.isupper() and isinstance(v, str) and v.startswith("EDGEQ_")}
    assert names and all(f"``{n}``" in env.__doc__ for n in names)
    root = Path(env.__file__).parent
    readers = [str(p.relative_to(root)) for p in root.rglob("*.py") if p.name != "env.py"
               and re.search(r"os\.environ(\.get)?\(?\[?[\"']EDGEQ_", p.read_text())]
    assert not readers, f"read EDGEQ_* through edgeq.env: {readers}"
