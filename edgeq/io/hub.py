"""Where a model comes from: a local directory, or a Hugging Face hub id resolved in one place for every command.

A source that exists on disk is used as it is (a local ``org/name`` directory shadows the hub id, as in
transformers). Anything else of the form ``org/name`` is a hub id, resolved by ``huggingface_hub.snapshot_download``,
so the hub's own conventions apply unchanged: the cache (``HF_HUB_CACHE`` / ``HF_HOME``), offline mode
(``HF_HUB_OFFLINE=1``: the cache only, no request), authentication (``HF_TOKEN`` / ``hf auth login``) and
``revision`` (a branch, tag or commit; the default branch otherwise). Only the files edgeq reads are fetched: JSON
(config, tokenizer, index, edgeq manifest), safetensors weights, sentencepiece/vocabulary files, chat templates.

Every hub failure becomes one :class:`EdgeqError` line that says which cause it was: offline mode, an unreachable hub
(network, proxy, hub down), an unknown or private repository, a gated one, an unknown revision, or an incomplete
cached snapshot.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Iterable, Optional

from edgeq.errors import EdgeqError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
FAILED = "no such local directory, and fetching it from the Hugging Face hub failed"
REVISION_HELP = "For hub ids (org/name): the branch, tag or commit to use [default: the default branch]."


def is_hub_id(source: str | Path) -> bool:
    """``org/name`` (what the hub accepts as a model repository id), not an existing path."""
    return not Path(source).exists() and HUB_ID.fullmatch(str(source)) is not None


def display_name(source: str | Path) -> Optional[str]:
    """The hub id of a hub source (its snapshot directory is named by commit hash), None for a local path."""
    return str(source) if is_hub_id(source) else None


def resolve_model(source: str | Path, revision: Optional[str] = None) -> Path:
    """The local directory of ``source``: itself when it exists, else the hub snapshot (see the module docstring)."""
    return resolve_models([source], revision)[0]


def resolve_models(sources: Iterable[str | Path | None], revision: Optional[str] = None) -> list[Optional[Path]]:
    """:func:`resolve_model` for several sources of one command (``None`` stays ``None``).

    ``revision`` applies to the hub ids among them; given when none is a hub id, it is an error rather than ignored
    (the user meant some snapshot and would silently get the local files)."""
    sources = list(sources)
    given = [s for s in sources if s is not None]
    if revision is not None and given and all(Path(s).exists() for s in given):
        raise EdgeqError(f"--revision {revision}: applies to hub ids, and {', '.join(map(str, given))} "
                         f"{'is a local path' if len(given) == 1 else 'are local paths'}; drop --revision")
    return [None if s is None else Path(s) if Path(s).exists() else _from_hub(str(s), revision) for s in sources]


def _from_hub(source: str, revision: Optional[str]) -> Path:
    if HUB_ID.fullmatch(source) is None:
        raise EdgeqError(f"{source}: no such directory (nor a hub id of the form org/name); check the path")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(source, revision=revision, allow_patterns=FILES))
    except Exception as e:  # every hub failure (offline, network, 404, auth, revision) becomes one line
        raise EdgeqError(f"{source}: {FAILED}: {explain(e, revision)}") from None


def offline_mode() -> bool:
    """Offline mode as huggingface_hub sees it (it reads HF_HUB_OFFLINE once, at import)."""
    from huggingface_hub import constants

    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def explain(e: BaseException, revision: Optional[str] = None) -> str:
    """The cause of a failed hub resolution, and the fix, in one clause."""
    from huggingface_hub import constants, errors

    cause = e.__cause__ or e.__context__
    cache = getattr(constants, "HF_HUB_CACHE", "the Hugging Face cache")
    incomplete = getattr(errors, "IncompleteSnapshotError", ())
    if isinstance(e, errors.RevisionNotFoundError):
        return f"the hub has no revision {revision!r}; give an existing branch, tag or commit to --revision"
    if isinstance(e, errors.GatedRepoError):
        return "the repository is gated; accept its terms on huggingface.co and log in (hf auth login, or HF_TOKEN)"
    if isinstance(e, errors.RepositoryNotFoundError):
        return ("no such repository on the hub, or it is private; check the id, or log in (hf auth login, or "
                "HF_TOKEN)")
    if incomplete and isinstance(e, incomplete):
        return (f"its cached snapshot in {cache} is incomplete and the hub was not reachable to complete it; "
                "download it again with the network on")
    if offline_mode() or isinstance(cause, errors.OfflineModeIsEnabled):
        return (f"not in the local cache ({cache}) and offline mode is on (HF_HUB_OFFLINE=1); download it once "
                "with offline mode off (unset HF_HUB_OFFLINE), or give a local directory")
    if isinstance(e, (errors.LocalEntryNotFoundError, OSError)):
        why = f"{type(cause).__name__}: {_first_line(cause)}" if cause is not None else type(e).__name__
        return (f"not in the local cache ({cache}) and the hub could not be reached ({why}); check the network "
                "or proxy (HTTPS_PROXY), or set HF_HUB_OFFLINE=1 to use only the cache")
    return f"{type(e).__name__}: {_first_line(e)}"


def _first_line(e: BaseException, limit: int = 160) -> str:
    text = str(e).strip().splitlines()
    return text[0][:limit] if text else ""
