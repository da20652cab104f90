"""The per-machine store of measured routes: ``$EDGEQ_CACHE_DIR`` (default ``~/.cache/edgeq``)/route.json, one entry
per key (CPU flags, torch, edgeq, threads, the kernels available)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Iterable

from edgeq.route.records import RouteReport

CACHE_FILE = "route.json"


def cache_key(flags: Iterable[str], torch_version: str, edgeq_version: str, threads: int,
              kernels: Iterable[str] = ()) -> str:
    """Which measurement a cached route belongs to. ``kernels``: the names of the kernels available (a native build
    that starts or stops working changes the route, so it must change the key)."""
    h = hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:16]
    key = f"flags={h}|torch={torch_version}|edgeq={edgeq_version}|threads={threads}"
    return key + (f"|kernels={','.join(sorted(kernels))}" if kernels else "")


def read_cache(path: Path) -> dict:
    """Every cached route by key ({} when the file is missing or unreadable)."""
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def write_cache(path: Path, key: str, report: RouteReport) -> None:
    """Add (or replace) ``key``'s route, atomically (a temporary file, then rename); a write that fails is skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = read_cache(path)
        data[key] = asdict(report)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: the result is still printed, just not remembered

