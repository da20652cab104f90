import pytest

from edgeq.errors import EdgeqError
from edgeq.scheme import Scheme, valid_schemes


@pytest.mark.parametrize("text", valid_schemes())
def test_roundtrip(text):
    assert str(Scheme.parse(text)) == text


def test_fields_and_kernel():
    s = Scheme.parse("W4A16-G64")
    assert (s.activation_bits, s.group_size, s.kernel) == (16, 64, "tinygemm_w4a16")
    assert Scheme.parse("w4a8-g128").kernel == "amx_w4a8"


@pytest.mark.parametrize("text", ["w4a16-g16", "w4a16-g512", "w8a16-g128", "w4a8-g256", "int4", ""])
def test_unknown_lists_valid(text):
    with pytest.raises(EdgeqError, match="valid: w4a16-g32, w4a16-g64, w4a16-g128, w4a16-g256"):
        Scheme.parse(text)
