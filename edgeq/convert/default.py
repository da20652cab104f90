"""What ``edgeq quantize MODEL`` converts with when neither ``--recipe`` nor ``--method`` is given (docs/format.md,
"The default conversion").

A float checkpoint of a family edgeq's GPTQ calibrates (llama, mistral, qwen2, qwen3) gets the ``quality`` recipe
calibrated on ids sampled from the model itself (``--recipe quality --calib self``): the arm that beats llama.cpp's
Q4_K_M on mean KLD at no more bytes without data (docs/results.md, "Quality per byte"), at a longer conversion (GPTQ:
~6.7-8x ``rtn``'s time on 2 AMX cores, ~18-20x on 2 Zen 4 cores for a 1B model). Everything else keeps its family
recipe: GPTQ input (repacked exactly), W4A8 schemes, families GPTQ cannot calibrate, and configs with no token to
start sampling from; :attr:`DefaultChoice.why` says which, for one line on stderr. ``--method rtn`` is the quick
conversion.

The base group is 256 (the recipe's) where every 2-D weight's K divides by 256, else 128: tinygemm takes no group
larger than K's divisors, and Qwen2.5-0.5B's hidden 896 = 7 x 128 is one such model. E.g. hidden 2048 -> w4a16-g256;
hidden 896 -> w4a16-g128 (the same recipe's finer first-layer groups on top).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgeq.convert.calibrate import SUPPORTED_MODEL_TYPES
from edgeq.convert.selfcal import SELF
from edgeq.io.hf import Checkpoint, open_checkpoint
from edgeq.keys import Kernel
from edgeq.scheme import Scheme

QUALITY = "quality"  # recipes/quality.toml
BASE_GROUPS = (256, 128)  # the first that divides every 2-D weight's K


@dataclass(frozen=True)
class DefaultChoice:
    """The default command's choice. ``recipe`` None: the family recipe (as before the quality default), with
    ``why`` saying why the quality recipe does not apply (empty for GPTQ input, which is repacked, not converted)."""

    recipe: str | None
    scheme: Scheme | None
    calib: str | None
    why: str


def default_choice(src: str | Path, scheme: Scheme | None) -> DefaultChoice:
    """The recipe, base scheme and calibration for ``edgeq quantize`` without ``--recipe`` and ``--method``;
    ``scheme`` is ``--scheme`` (None: chosen here). Reads config.json and the safetensors headers only."""
    ckpt = open_checkpoint(Path(src))
    if ckpt.quantization_config is not None:  # GPTQ input is repacked; other formats are refused by prepare()
        return DefaultChoice(None, scheme, None, "")
    model_type = ckpt.config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        return _family(scheme, f"model_type {model_type!r}: GPTQ calibrates {', '.join(SUPPORTED_MODEL_TYPES)} only")
    if scheme is not None and scheme.kernel != Kernel.W4A16:
        return _family(scheme, f"{scheme}: the quality recipe writes W4A16 (tinygemm) only")
    if ckpt.config.get("bos_token_id") is None and ckpt.config.get("eos_token_id") in (None, []):
        return _family(scheme, f"{ckpt.root / 'config.json'} has no bos_token_id or eos_token_id to start sampling "
                               "calibration ids from; pass --calib TEXT --recipe quality to calibrate on a text")
    return DefaultChoice(QUALITY, scheme or Scheme(16, base_group(ckpt)), SELF, "")


def base_group(ckpt: Checkpoint) -> int:
    """The largest of :data:`BASE_GROUPS` dividing every 2-D tensor's K (shape[1]); the last one otherwise, whose
    plan then names the tensors that do not fit. E.g. K in {2048, 8192} -> 256; K in {896, 4864} -> 128."""
    ks = {t.shape[1] for t in ckpt.tensors.values() if len(t.shape) == 2}
    return next((g for g in BASE_GROUPS if all(k % g == 0 for k in ks)), BASE_GROUPS[-1])


def _family(scheme: Scheme | None, reason: str) -> DefaultChoice:
    return DefaultChoice(None, scheme, None, f"{reason}; converting with the family recipe (rtn)")
