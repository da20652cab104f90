"""Where things are: the repository, its bundled data, and the bundled trained model (no torch import here, so
conftest stays light)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "edgeq" / "data"
FIXTURE = DATA / "tiny-prose"  # the bundled trained model (Llama, tied head, bf16)
