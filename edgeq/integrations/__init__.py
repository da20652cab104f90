"""Integrations with other libraries, installed by ``import edgeq`` at no import cost.

transformers: :func:`install_transformers` registers edgeq's quantizer (``quant_method: "edgeq"``) with transformers'
public registry (``register_quantization_config``, ``register_quantizer``) -- at once when transformers' quantizer
registry (``transformers.quantizers.auto``) is already imported, otherwise the first time it is, through a one-shot
import hook. ``import edgeq`` therefore never imports transformers itself (the CLI's ``inspect`` does not pay for
it), and ``import edgeq; AutoModelForCausalLM.from_pretrained(out)`` works in either import order.

A failure to register (a transformers whose registry differs) never breaks ``import edgeq`` or transformers' own
import: it is one :class:`EdgeqIntegrationWarning`, once, saying what failed and what to use instead.
"""

from __future__ import annotations

import importlib.abc
import sys

from edgeq.integrations.registration import STATE as _state
from edgeq.integrations.registration import EdgeqIntegrationWarning, register, warn_failure

__all__ = ["EdgeqIntegrationWarning", "install_transformers", "register_transformers"]

REGISTRY = "transformers.quantizers.auto"  # the module that defines register_quantizer / register_quantization_config
INTEGRATION = "edgeq.integrations.transformers"  # edgeq's config and quantizer classes


def install_transformers() -> None:
    """Register edgeq's transformers quantizer now if transformers' registry is loaded, else when it is imported."""
    if _state["registered"]:
        return
    if REGISTRY in sys.modules:
        register_transformers()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


def register_transformers() -> bool:
    """Register the ``edgeq`` config and quantizer with transformers; True when they are registered (now or before).
    Any failure is one warning (once), never an exception."""
    if _state["registered"]:
        return True
    partial = sys.modules.get(INTEGRATION)
    if partial is not None and not hasattr(partial, "register"):
        return False  # the hook fired while that module imports transformers' registry: its last line registers
    try:
        from edgeq.integrations import transformers as integration  # noqa: PLC0415 - needs transformers' registry
    except Exception as e:  # noqa: BLE001 - a transformers we do not understand must not break anyone's import
        warn_failure(e)
        return False
    return register(integration)  # a no-op when its import registered already (its last line)


class _Loader(importlib.abc.Loader):
    """The registry module's own loader, then the registration (after the module body has run completely)."""

    def __init__(self, inner, finder):
        self.inner, self.finder = inner, finder

    def __getattr__(self, name):  # get_source, get_filename, is_package ...: the real loader's
        return getattr(self.inner, name)

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        if self.finder in sys.meta_path:
            sys.meta_path.remove(self.finder)  # after the import: never while the import system iterates the list
        register_transformers()


class _AfterImport(importlib.abc.MetaPathFinder):
    """One-shot import hook: finds ``transformers.quantizers.auto`` with the other finders and wraps its loader so
    that edgeq registers right after the module has executed; inert (and removed) afterwards."""

    def __init__(self):
        self.fired = False

    def find_spec(self, name, path, target=None):
        if name != REGISTRY or self.fired:
            return None
        self.fired = True
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, self)
                return spec
        return None
