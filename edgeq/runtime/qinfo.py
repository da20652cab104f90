"""What the runtime needs from an edgeq checkpoint's config.json and edgeq_manifest.json, validated: one reader for
every kernel, :func:`read_checkpoint`.

The manifest's fields are read by :meth:`edgeq.io.manifest.Manifest.from_json` (the only manifest parser); this
module adds what needs both files, in this order: config.json and the manifest name the same kernel, the same
``format_version`` (one this edgeq reads), a kernel this runtime runs, the same scheme and group size; then the
kernel's layout checks its own record (:meth:`read_record` of ``edgeq.layouts.base.get(kernel)``: a tinygemm record
is parsed, hash-checked and compared field by field with config.json's copy; an amx_w4a8 record must equal the
kernel's fixed fingerprint); then the head is among the quantised modules and every per-module group size is one
the kernel takes. Anything else is refused with the file and the reason; nothing is guessed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgeq.errors import EdgeqError
from edgeq.io.manifest import Manifest, head_refusal, read_json
from edgeq.keys import CONFIG, FORMAT_VERSION, MANIFEST, QUANT_METHOD, Kernel
from edgeq.layouts.base import get
from edgeq.scheme import Scheme

FORMAT_VERSIONS = (1, FORMAT_VERSION)  # 1: bf16 embeddings; 2 (FORMAT_VERSION): packed embeddings (docs/format.md)
KERNELS = tuple(k.value for k in Kernel)
# config.json of a tinygemm_w4a16 checkpoint written before the "kernel" key existed omits it (read: the manifest's).
# Every other kernel's config.json names it, so a difference between the two files is refused as one.
LEGACY_KERNEL = Kernel.W4A16


@dataclass(frozen=True)
class QuantInfo:
    """A validated edgeq checkpoint: its manifest, and what the runtime reads from it.

    ``layout`` is the kernel's parsed layout record (:meth:`read_record`: a :class:`~edgeq.layouts.tinygemm.
    TinygemmLayout` for tinygemm_w4a16, the fingerprint dict for amx_w4a8)."""

    manifest: Manifest
    scheme: Scheme
    layout: object

    @property
    def kernel(self) -> Kernel:
        return self.manifest.kernel

    @property
    def format_version(self) -> int:
        return self.manifest.format_version

    @property
    def quantized_modules(self) -> tuple[str, ...]:
        return self.manifest.quantized_modules

    @property
    def head_name(self) -> str:
        return self.manifest.head_name

    @property
    def head_source(self) -> str:
        return str(self.manifest.head.get("source", ""))

    @property
    def untied(self) -> bool:
        return bool(self.manifest.head.get("untied", False))

    @property
    def modules_not_converted(self) -> tuple[tuple[str, str], ...]:
        return tuple(sorted((str(k), str(v)) for k, v in self.manifest.modules_not_converted.items()))

    @property
    def group_sizes(self) -> tuple[tuple[str, int], ...]:
        """(module, G) where G differs from the scheme's (a recipe's group_sizes)."""
        return tuple(sorted(self.manifest.group_sizes.items()))

    def group_size(self, module: str) -> int:
        """The group size ``module`` was quantised with (the manifest's ``group_sizes`` entry, else the scheme's)."""
        return self.manifest.group_sizes.get(module, self.scheme.group_size)


def read_checkpoint(directory: str | Path, config: dict) -> QuantInfo | None:
    """None for a plain (unquantised) HF checkpoint; a validated :class:`QuantInfo` for an edgeq one of any kernel.
    ``config`` is the directory's config.json, already read."""
    directory = Path(directory)
    qc = config.get("quantization_config")
    if not qc:
        if (directory / MANIFEST).exists():
            raise EdgeqError(f"{directory}: has {MANIFEST} but config.json has no quantization_config; the checkpoint is inconsistent")
        return None
    if not isinstance(qc, dict):
        raise EdgeqError(f"{directory}/{CONFIG}: quantization_config is {type(qc).__name__} {str(qc)[:40]!r}, not an "
                         f"object; re-copy config.json from the checkpoint or re-quantise")
    method = qc.get("quant_method")
    if method != QUANT_METHOD:
        raise EdgeqError(f"{directory}/{CONFIG}: quant_method {method!r} is not edgeq's; convert it with `edgeq quantize` first")
    where = f"{directory}/{MANIFEST}"
    raw = read_json(directory / MANIFEST)
    kernel = _kernel(directory, raw, qc)
    scheme = _scheme(where, raw, qc, kernel)
    layout = get(kernel).read_record(raw.get("layout"), qc.get("layout"), scheme.group_size, directory)
    manifest = Manifest.from_json(raw, where)
    if manifest.head_name not in manifest.quantized_modules:
        raise head_refusal(where, manifest.head_name)
    _check_group_sizes(where, manifest)
    return QuantInfo(manifest=manifest, scheme=scheme, layout=layout)


def _kernel(directory: Path, raw: dict, qc: dict) -> Kernel:
    """The kernel both files name, checked in the order a reader meets the problems: the two files disagree (a
    kernel other than the legacy one must be named by both), the format version, then an unknown kernel, named as
    the file spells it (config.json first: the user edits it)."""
    kernel, named = raw.get("kernel"), qc.get("kernel")
    if kernel != named and any(k in KERNELS and k != LEGACY_KERNEL for k in (kernel, named)):
        raise EdgeqError(f"{directory}: config.json says kernel {named!r} but {MANIFEST} says {kernel!r}; the "
                         "checkpoint is inconsistent, re-quantise it")
    version = raw.get("format_version")
    if version not in FORMAT_VERSIONS or qc.get("format_version") != version:
        raise EdgeqError(f"{directory}/{MANIFEST}: format_version {version!r} (config.json says {qc.get('format_version')!r}); "
                         f"this edgeq reads {list(FORMAT_VERSIONS)}: upgrade edgeq or re-quantise")
    for where, name in ((f"{directory}/{CONFIG}", qc.get("kernel", kernel)), (f"{directory}/{MANIFEST}", kernel)):
        if name not in KERNELS:
            raise EdgeqError(f"{where}: kernel {name!r} is not one this runtime runs ({', '.join(KERNELS)}); "
                             f"re-quantise with `edgeq quantize` or upgrade edgeq")
    return Kernel(kernel)


def _scheme(where: str, raw: dict, qc: dict, kernel: Kernel) -> Scheme:
    """The manifest's scheme, which must be of ``kernel`` and agree with config.json's scheme and group size."""
    scheme = Scheme.parse(str(raw.get("scheme", "")))
    if scheme.kernel != kernel or int(qc.get("group_size", scheme.group_size)) != scheme.group_size \
            or str(qc.get("scheme", scheme)) != str(scheme):
        raise EdgeqError(f"{where}: scheme {scheme} does not match kernel {kernel.value!r} / config.json's scheme "
                         f"{qc.get('scheme')!r}, group_size {qc.get('group_size')!r}; the checkpoint is inconsistent")
    return scheme


def _check_group_sizes(where: str, manifest: Manifest) -> None:
    """Every per-module group size (the manifest checked the record's form) is one the kernel's layout takes."""
    allowed = get(manifest.kernel).group_sizes
    for module, g in manifest.group_sizes.items():
        if g not in allowed:
            raise EdgeqError(f"{where}: group_sizes[{module!r}] = {g!r} is not a {manifest.kernel.value.split('_')[0]} "
                             f"group size ({', '.join(map(str, allowed))}); re-quantise the checkpoint")
