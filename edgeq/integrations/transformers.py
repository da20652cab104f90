"""edgeq checkpoints through transformers' ``from_pretrained``: the ``edgeq`` quantization config and quantizer.

``import edgeq`` registers both (edgeq/integrations/__init__.py); then ``AutoModelForCausalLM.from_pretrained(out)``
on a directory ``edgeq quantize`` wrote runs edgeq's kernels. What happens, hook by hook (the hooks and the registry
used here exist unchanged in transformers 5.16 to 5.24; nothing else of transformers is touched):

1. transformers reads ``quantization_config``; ``quant_method: "edgeq"`` maps to :class:`EdgeqConfig`, then
   :class:`EdgeqHfQuantizer` with ``pre_quantized=True``.
2. ``validate_environment``: CPU only (a ``device_map`` placing anything elsewhere is refused), and only checkpoints
   edgeq wrote (quantising a float model on the fly is refused: run ``edgeq quantize``). ``update_dtype``: bfloat16,
   the kernels' activation type.
3. The model is built on the meta device; ``_process_model_before_weight_loading`` runs edgeq's loader steps on it:
   the checkpoint's config and manifest are validated, its safetensors files are mapped (MAP_PRIVATE), and every
   quantised Linear becomes edgeq's ``Int4Linear`` (tinygemm_w4a16) or ``W4A8Linear`` (amx_w4a8) over the mapped
   packed bytes -- the same functions ``edgeq.runtime.load`` calls, so the same checks, the same layout repack
   warning, the same kernel choice; a packed (4-bit) input embedding becomes ``PackedEmbedding``
   (edgeq/runtime/embedding.py). No bf16 weight of a quantised module ever exists. The tensors those modules
   consume (``M.qweight``, ``M.scales_and_zeros`` / ``M.scales`` / ``M.zeros``, ``M.perm``, ``M.bias``, a packed
   embedding's levels) are added to the model's ``_keys_to_ignore_on_load_unexpected``: transformers does not load
   or report them, and a packed embedding has no ``weight`` for it to look for.
4. transformers loads the remaining tensors (a bf16 embedding table, norms) its own way.
5. ``_process_model_after_weight_loading``: the W4A16 prefill scratch and crossover, as ``edgeq.runtime.load`` sizes
   them, and ``model.edgeq`` (:class:`EdgeqState`: paths taken, mapped bytes, kernel choice).

This module imports only transformers' registry and config modules at import time (it is imported while
``transformers.quantizers.auto`` finishes importing); edgeq's runtime is imported when a checkpoint is loaded.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers.quantizers.auto import register_quantization_config, register_quantizer
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from edgeq.errors import EdgeqError
from edgeq.keys import MANIFEST, QUANT_METHOD

METHOD = QUANT_METHOD
LEGACY_SKIP_KEY = "modules_not_converted"  # the skip list's name before the HF spelling modules_to_not_convert


class EdgeqConfig(QuantizationConfigMixin):
    """An edgeq checkpoint's ``quantization_config`` (docs/format.md), as transformers holds it.

    Every key is kept as written; edgeq's loader validates the checkpoint against its manifest at load. Checkpoints
    written before the HF-style keys existed read the same: ``modules_not_converted`` is read as
    ``modules_to_not_convert``, a missing ``bits`` is 4 and a missing ``sym`` false (both kernels store zero points).
    """

    def __init__(self, quant_method: str = METHOD, bits: int = 4, sym: bool = False,
                 modules_to_not_convert: list[str] | None = None, **fields):
        legacy = fields.pop(LEGACY_SKIP_KEY, None)
        if modules_to_not_convert is None:
            modules_to_not_convert = legacy
        self.quant_method = quant_method
        self.bits = bits
        self.sym = sym
        self.modules_to_not_convert = sorted(modules_to_not_convert or [])
        for key, value in fields.items():
            setattr(self, key, value)
        self.post_init()

    def post_init(self) -> None:
        if self.quant_method != METHOD:
            raise ValueError(f"quantization_config.quant_method {self.quant_method!r}: EdgeqConfig reads {METHOD!r} only")
        if self.bits != 4:
            raise ValueError(f"quantization_config.bits {self.bits!r}: edgeq checkpoints store 4-bit weights; "
                             "the checkpoint is inconsistent, re-quantise it")


@dataclass
class EdgeqState:
    """What loading an edgeq checkpoint through transformers built: ``model.edgeq``.

    ``path_counts`` counts calls per compute path, as ``LoadedModel.path_counts`` does (tinygemm_decode,
    native_decode, dequant_prefill, w4a8_kernel, w4a8_portable, input_gather). ``files`` keeps the mappings alive."""

    path: Path
    kernel: str
    scheme: str
    files: object  # edgeq.io.mapped.MappedFiles
    info: object  # the validated edgeq.runtime.qinfo.QuantInfo
    consumed: frozenset[str]
    mapped_bytes: int  # quantised-module bytes used in place from the mapped files
    copied_bytes: int  # bytes materialised (a layout repack, a non-bf16 bias)
    layout: str  # "native" | "repacked"
    runtime: object | None = None  # the W4A16 Runtime (kernel, scratch, crossover); None for amx_w4a8
    kernel_note: str = ""  # amx_w4a8: which W4A8 path runs and why
    path_counts: Counter = field(default_factory=Counter)
    prefill_crossover: int | None = None
    crossover_source: str = "n/a"
    swapped: object | None = None  # the runtime's edgeq.runtime.swap.SwapResult (paths, bytes, kernel choice)

    def ignore_pattern(self) -> str:
        """One regex matching exactly the checkpoint tensors the edgeq modules consume."""
        return "^(?:" + "|".join(re.escape(n) for n in sorted(self.consumed)) + ")$"


class EdgeqHfQuantizer(HfQuantizer):
    """Loads edgeq checkpoints into edgeq's quantised modules over the mapped file (see the module docstring)."""

    requires_calibration = False  # validate_environment refuses on-the-fly quantisation with edgeq's own message

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.state: EdgeqState | None = None

    def validate_environment(self, *args, **kwargs) -> None:
        if not self.pre_quantized:
            raise ValueError("edgeq quantises offline, not inside from_pretrained: run `edgeq quantize MODEL -o OUT`, "
                             "then `import edgeq` and from_pretrained(OUT)")
        device_map = kwargs.get("device_map")
        elsewhere = _non_cpu(device_map)
        if elsewhere:
            raise ValueError(f"device_map={device_map!r}: {', '.join(elsewhere)} is not the CPU; edgeq checkpoints run "
                             "on the CPU only: load without device_map")

    def update_dtype(self, dtype):
        if dtype is not None and dtype != torch.bfloat16:
            _logger().warning(f"edgeq checkpoints run in bfloat16 (the kernels' activation type); dtype={dtype} "
                              "is replaced by torch.bfloat16")
        return torch.bfloat16

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        # edgeq unties the head (it quantises it on its own): a config.json that still says tied made transformers
        # tie the quantised head to the table after loading (an AttributeError); the runtime and vLLM ignore it too
        model.config.tie_word_embeddings = False
        if hasattr(model, "get_expanded_tied_weights_keys"):  # transformers 5 read the tie at construction
            model.all_tied_weights_keys = model.get_expanded_tied_weights_keys(all_submodels=False)
        self.state = swap_modules(model, checkpoint_dir(model, checkpoint_files))
        ignored = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
        model._keys_to_ignore_on_load_unexpected = ignored | {self.state.ignore_pattern()}
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        if self.state is not None:
            finish(model, self.state)
            model.edgeq = self.state
        for p in model.parameters():  # inference only: no gradient flows through the 4-bit modules' kernels, so a
            p.requires_grad_(False)   # loss.backward() that seemed to work trained nothing; now torch refuses it
        return model

    def is_serializable(self, *args, **kwargs) -> bool:
        """False: the directory edgeq wrote is the serialised form (transformers then refuses save_pretrained and
        points at the logger's warnings: this one says what to do)."""
        path = self.state.path if self.state is not None else "the edgeq checkpoint directory"
        _logger().warning(f"edgeq: save_pretrained cannot write an edgeq checkpoint; {path} already is the saved "
                          "model: copy that directory (or run `edgeq quantize` on the float model again)")
        return False

    @property
    def is_trainable(self) -> bool:
        return False


def register() -> None:
    """Register :class:`EdgeqConfig` and :class:`EdgeqHfQuantizer` under ``"edgeq"`` (a no-op when they already are).

    Raises when the registry refuses (another class holds the name) or does not exist; the caller warns."""
    for registrar, cls in ((register_quantization_config, EdgeqConfig), (register_quantizer, EdgeqHfQuantizer)):
        try:
            registrar(METHOD)(cls)
        except ValueError as e:  # "already registered": fine when it is ours (a re-import), not when it is not
            if not _registered_is_ours(cls):
                raise ValueError(f"transformers already has a different {METHOD!r} entry ({e})") from e


def _registered_is_ours(cls) -> bool:
    import transformers.quantizers.auto as auto  # noqa: PLC0415

    mappings = (getattr(auto, "AUTO_QUANTIZATION_CONFIG_MAPPING", {}), getattr(auto, "AUTO_QUANTIZER_MAPPING", {}))
    return any(getattr(m.get(METHOD), "__qualname__", None) == cls.__qualname__ and
               getattr(m.get(METHOD), "__module__", None) == cls.__module__ for m in mappings)


def _logger():
    from transformers.utils import logging  # noqa: PLC0415

    return logging.get_logger("edgeq")


SPREAD_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")  # accelerate's strategies: where devices are


def _accelerators() -> bool:
    mps = getattr(torch.backends, "mps", None)
    xpu = getattr(torch, "xpu", None)
    return (torch.cuda.is_available() or bool(xpu is not None and xpu.is_available())
            or bool(mps is not None and mps.is_available()))


def _non_cpu(device_map) -> list[str]:
    """The entries of a ``device_map`` that are not the CPU ([] for None, "cpu", torch.device("cpu"), and for
    "auto" & co. on a machine with no accelerator, where they mean the CPU)."""
    if device_map is None or (device_map in SPREAD_MAPS and not _accelerators()):
        return []
    values = device_map.values() if isinstance(device_map, dict) else [device_map]
    return sorted({str(v) for v in values if str(v) != "cpu"})  # str(torch.device("cpu")) == "cpu"


def checkpoint_dir(model, checkpoint_files) -> Path:
    """The directory of the checkpoint being loaded (its weight files' directory), which must hold the manifest."""
    if checkpoint_files:
        directory = Path(checkpoint_files[0]).parent
    else:
        directory = Path(getattr(model.config, "_name_or_path", "") or getattr(model.config, "name_or_path", ""))
    if not (directory / MANIFEST).is_file():
        raise EdgeqError(f"{directory}: no {MANIFEST} next to the weights; from_pretrained needs the whole edgeq "
                         "checkpoint directory (for a hub repo: `hf download REPO --local-dir DIR`, then load DIR)")
    return directory


@contextlib.contextmanager
def _plain_torch():
    """CPU tensors in fp32 by default while edgeq builds its modules: transformers calls the hook inside its meta
    device and model-dtype contexts, and edgeq's layout and kernel probes must run on real fp32 tensors."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device("cpu"):
            yield
    finally:
        torch.set_default_dtype(dtype)


def swap_modules(model, directory: Path) -> EdgeqState:
    """Validate ``directory`` as edgeq's loader does and replace every quantised Linear of the (meta) ``model`` with
    edgeq's module over the mapped packed bytes, through the runtime's own swap (:func:`edgeq.runtime.swap.swap`)."""
    from edgeq import env  # noqa: PLC0415
    from edgeq.env import STRICT_LAYOUT  # noqa: PLC0415
    from edgeq.io.manifest import read_json  # noqa: PLC0415
    from edgeq.io.mapped import MappedFiles  # noqa: PLC0415
    from edgeq.runtime.preflight import preflight  # noqa: PLC0415
    from edgeq.runtime.qinfo import read_checkpoint  # noqa: PLC0415
    from edgeq.runtime.swap import swap  # noqa: PLC0415

    with _plain_torch():
        info = read_checkpoint(directory, read_json(directory / "config.json"))
        if info is None:
            raise EdgeqError(f"{directory}/config.json: no edgeq quantization_config")
        if info.head_name not in dict(model.named_modules()):  # AutoModel: the bare stack, names without "model."
            raise EdgeqError(f"{directory}: {type(model).__name__} has no {info.head_name}; edgeq checkpoints hold a "
                             "causal LM with its quantised head: load them with AutoModelForCausalLM")
        files, counts = MappedFiles(directory), Counter()
        preflight(directory, files, info)  # load()'s refusals: transformers would fill a missing weight randomly
        try:
            strict = env.flag(STRICT_LAYOUT)
            swapped = swap(model, files, info, counts, strict_layout=strict, stacklevel=2)  # warns at the hook
        except EdgeqError as e:  # the refusal names the CLI's switch; here it is the environment variable
            raise EdgeqError(str(e).replace("--strict-layout", f"{STRICT_LAYOUT}=1")) from None
    return EdgeqState(path=directory, kernel=info.kernel, scheme=str(info.scheme), files=files, info=info,
                      consumed=swapped.consumed, mapped_bytes=swapped.mapped_bytes, copied_bytes=swapped.copied_bytes,
                      layout=swapped.layout, runtime=swapped.runtime, kernel_note=swapped.note, path_counts=counts,
                      swapped=swapped)


def finish(model, state: EdgeqState) -> None:
    """After transformers loaded the other tensors: the W4A16 prefill scratch and crossover, as load() sets them."""
    from edgeq.runtime.swap import finish as finish_swap  # noqa: PLC0415

    with _plain_torch():
        state.swapped = finish_swap(state.swapped, model, state.info)
    state.prefill_crossover, state.crossover_source = state.swapped.prefill_crossover, state.swapped.crossover_source


# Importing this module first (before transformers' registry) fires the registry's import hook while this module is
# half-built; the hook then leaves the registration to this line.
from edgeq.integrations.registration import register as _register  # noqa: E402

_register(sys.modules[__name__])
