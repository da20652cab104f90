"""Every name edgeq writes into a file or branches on, in one place: kernels, tensor roles, plan actions, file
names, metadata keys and the format version.

The enums are ``StrEnum``: a member *is* its string (``Kernel.W4A8 == "amx_w4a8"``, ``json.dumps`` writes
``"amx_w4a8"``, an f-string prints ``amx_w4a8``), so files written before the enums existed read back unchanged and
a member can be passed wherever a string was.

    >>> Kernel("tinygemm_w4a16") is Kernel.W4A16
    True
    >>> f"{Role.HEAD}", Action.QUANTIZE in QUANTIZED_ACTIONS
    ('head', True)
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

VERSION = "0.1.0"  # edgeq's own version (edgeq.__version__; pyproject.toml says the same, tested)
FORMAT_VERSION = 2  # the newest manifest format_version: 2 adds packed embeddings (docs/format.md)
FORMAT_VERSION_BF16_EMBEDDINGS = 1  # what a checkpoint without packed embeddings is written as: its files are unchanged
FORMAT_VERSIONS = (FORMAT_VERSION_BF16_EMBEDDINGS, FORMAT_VERSION)  # what readers accept; any other is refused

# file names in an edgeq checkpoint directory
MANIFEST = "edgeq_manifest.json"
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
CARD = "README.md"

DATA = Path(__file__).resolve().parent / "data"  # the bundled tiny model, calibration and held-out text

QUANT_METHOD = "edgeq"  # config.json quantization_config.quant_method of every edgeq checkpoint
HEAD_MODULE = "lm_head"  # the default output head; a recipe may name another (Recipe.head)
RESIDUAL_MODULE = ".residual"  # an untied packed embedding's second level: M.residual.qweight (docs/format.md)


class Kernel(StrEnum):
    """The runtime path a checkpoint is packed for (manifest ``kernel``); one :mod:`edgeq.layouts` entry each.

    - ``W4A16`` = ``"tinygemm_w4a16"``: 4-bit weights, bf16 activations; PyTorch's ``_weight_int4pack_mm_for_cpu``
      layout (``M.qweight`` uint8 [N, K/2], ``M.scales_and_zeros`` bf16 [K/G, N, 2]).
    - ``W4A8`` = ``"amx_w4a8"``: 4-bit weights, int8 per-token activations; the AMX/VNNI ``int4_scaled_mm_cpu``
      layout (``M.qweight`` uint8 [N/32, K/bk, 16 bk + 128], ``M.scales`` fp32 / ``M.zeros`` int8 [N/32, K/G, 32]).
    """

    W4A16 = "tinygemm_w4a16"
    W4A8 = "amx_w4a8"


class Role(StrEnum):
    """What a tensor of the input checkpoint is, from its name and shape (edgeq/convert/plan.py)."""

    LINEAR = "linear"  # 2-D ``*.weight`` of a projection
    HEAD = "head"  # the output head (always quantised)
    EMBEDDING = "embedding"
    NORM = "norm"  # 1-D ``*norm*``
    BIAS = "bias"
    OTHER = "other"
    PERM = "perm"  # an output-only role: ``M.perm`` (int64 [K]) of an act-order layer, written beside its module


class EmbeddingStorage(StrEnum):
    """How ``edgeq quantize --embeddings`` stores the input embedding table (manifest ``embeddings``).

    - ``BF16``: the table as a bf16 tensor under its own name (format_version 1, as every checkpoint before 2);
    - ``PACKED``: 4-bit levels in the checkpoint's tinygemm layout, summed at lookup: level 0 is the head's own
      tensors when the head was quantised from this table, a residual level is the table's own (format_version 2).
    """

    BF16 = "bf16"
    PACKED = "packed"


class Action(StrEnum):
    """What the converter does with a tensor (edgeq/convert/plan.py)."""

    QUANTIZE = "quantize"  # float weight -> the kernel's packed tensors
    KEEP = "keep"  # a Linear a recipe keeps in bf16 (reported, never silent)
    COPY = "copy"  # cast to bf16
    REPACK = "repack"  # a 4-bit GPTQ layer mapped exactly onto tinygemm
    REQUANTIZE = "requantize"  # a GPTQ layer dequantised exactly and quantised again
    PACK_EMBEDDING = "pack-embedding"  # an embedding table -> 4-bit levels (edgeq/convert/embeddings.py); not a Linear


# actions whose output is a packed Linear (the manifest's quantized_modules); a packed embedding is not one
QUANTIZED_ACTIONS = (Action.QUANTIZE, Action.REPACK, Action.REQUANTIZE)
