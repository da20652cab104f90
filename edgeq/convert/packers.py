"""The converter's per-kernel pieces, keyed by :class:`edgeq.keys.Kernel`: what writing a layout takes beyond what
its :class:`edgeq.layouts.base.Layout` says (tensors, bytes, shape rules).

The pipeline never branches on the kernel: it asks ``packer(scheme.kernel)`` to

- refuse the options that kernel cannot write (``check_options``: e.g. W4A8 takes no GPTQ input or calibration);
- make the layout record written into the manifest and config.json (``record``: measured for tinygemm, fixed for
  amx_w4a8) and its one-line summary (``describe``), and the card's "runs unchanged on" (``runs_on``);
- quantise and pack one float weight in row blocks (``quantize``), and re-check the written headers (``verify``).

``zero_point_domain`` ("float" or "int") is config.json's; ``per_module_groups`` says whether a recipe's
group_sizes apply (tinygemm takes G per call; the W4A8 kernel one G per checkpoint); ``packed_embeddings`` whether
the embedding table may be written as 4-bit levels in this layout (edgeq/convert/embeddings.py: tinygemm only).

Adding a layout: a module beside w4a16.py / w4a8.py defining ``PACKER``, listed in :data:`_MODULES`. These
pieces belong on the Layout itself (edgeq/layouts/) once it has pack and verify; this registry then goes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from edgeq.convert import w4a8, w4a16
from edgeq.errors import EdgeqError
from edgeq.io.manifest import Manifest
from edgeq.keys import Kernel
from edgeq.scheme import Scheme

_MODULES = (w4a16, w4a8)


class Packer(Protocol):
    kernel: Kernel
    zero_point_domain: str  # config.json quantization_config.zero_point_domain
    per_module_groups: bool  # a recipe's group_sizes apply (else one group size per checkpoint)
    packed_embeddings: bool  # --embeddings packed: the runtime has a lookup for 4-bit levels in this layout

    def check_options(self, scheme: Scheme, method: str, *, gptq_input: bool = False) -> None:
        """Refuse (EdgeqError) a method or input this kernel cannot be written from, before anything is read."""

    def record(self, scheme: Scheme) -> Any:
        """The layout record: ``.to_json()`` (manifest), ``.fingerprint()`` (config.json), ``.layout_hash``."""

    def describe(self, record: Any) -> str:
        """One line: the packed layout written, and why (``edgeq quantize``'s summary)."""

    def runs_on(self, layout: dict) -> str:
        """The machines that run the stored bytes unchanged, from the manifest's layout record (the model card)."""

    def quantize(self, read_rows: Callable[[int, int], torch.Tensor], n: int, k: int, group_size: int, method: str, *,
                 name: str, module: str, record: Any, write: Callable[[str, torch.Tensor], None],
                 progress: Callable[[int], None]) -> float:
        """Quantise and pack one float weight [N, K] read in row blocks, writing the layout's tensors in order;
        returns the relative reconstruction error. ``progress(rows)`` after each block."""

    def verify(self, directory: Path, manifest: Manifest, found: dict) -> None:
        """Re-check a written checkpoint's quantised modules from its headers (``found``: name -> TensorInfo)."""


_PACKERS: dict[Kernel, Packer] = {m.PACKER.kernel: m.PACKER for m in _MODULES}


def packer(kernel: str | Kernel) -> Packer:
    """The converter's pieces for ``kernel`` (a :class:`Kernel` or its string)."""
    try:
        return _PACKERS[Kernel(kernel)]
    except (ValueError, KeyError):
        raise EdgeqError(f"edgeq quantize cannot write kernel {str(kernel)!r}") from None
