"""The registration state of edgeq's transformers integration: registered once, a failure warned once.

Both places that register call :func:`register` here: the import hook in ``edgeq/integrations/__init__.py`` (when
transformers' registry finishes importing) and the last line of ``edgeq/integrations/transformers.py`` (when that
module is imported first, the hook fired while it was half-built). Neither imports the other for it.
"""

from __future__ import annotations

import warnings

STATE = {"registered": False, "warned": False}


class EdgeqIntegrationWarning(UserWarning):
    """edgeq could not register itself with a library (the message says why and what to use instead)."""


def register(integration) -> bool:
    """``integration.register()`` (edgeq/integrations/transformers.py) unless already done; True when registered.
    Any failure is one warning (once), never an exception."""
    if STATE["registered"]:
        return True
    try:
        integration.register()
    except Exception as e:  # noqa: BLE001 - a transformers we do not understand must not break anyone's import
        warn_failure(e)
        return False
    STATE["registered"] = True
    return True


def warn_failure(error: Exception) -> None:
    """The one warning (once per process) that transformers will not load edgeq checkpoints here, and why."""
    if not STATE["warned"]:
        STATE["warned"] = True
        warnings.warn(f"edgeq could not register its transformers quantizer ({type(error).__name__}: {error}); "
                      "AutoModelForCausalLM.from_pretrained on an edgeq checkpoint will NOT load its weights here. "
                      "Use edgeq.runtime.load(path) instead (docs/transformers.md)", EdgeqIntegrationWarning,
                      stacklevel=4)
