"""``edgeq inspect``: what is in a checkpoint, what serving it costs, what is wrong with it (edgeq/inspect/)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from edgeq.console import emit, err, out
from edgeq.errors import ThresholdError
from edgeq.io.hub import REVISION_HELP, resolve_model
from edgeq.runtime.sizes import parse_bytes


def inspect(
    path: Path = typer.Argument(..., help="Checkpoint directory or hub id (org/name): edgeq, plain Hugging Face, or GPTQ/AWQ/compressed-tensors/torchao/bitsandbytes."),
    revision: Annotated[Optional[str], typer.Option("--revision", help=REVISION_HELP)] = None,
    tensors: bool = typer.Option(False, "--tensors", help="Per-tensor table: name, shape, dtype, role, bytes."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output (schema: docs/inspect.md)."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="Context for the memory projection [default: min(model maximum, what the KV budget holds)]."),
    kv_cache_bytes: str = typer.Option("256MiB", "--kv-cache-bytes", help="KV cache budget for the memory projection, e.g. 512MiB."),
    verify: bool = typer.Option(False, "--verify", help="Also read all tensor data: NaN/Inf, scales, shard sha256, unpack/repack round trip."),
    strict: bool = typer.Option(False, "--strict", help="Exit code 1 when any problem is found."),
    strict_layout: bool = typer.Option(False, "--strict-layout", help="A layout that load would repack is a problem (load refuses it under the same flag)."),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="Recipe NAME or .toml FILE for tensor roles and the plan [default: by model_type]."),
) -> None:
    """Show what is in a checkpoint, what serving it costs, and what is wrong with it (headers only by default)."""
    from edgeq.inspect.report import inspect_checkpoint, render  # noqa: PLC0415 (torch: only when the command runs)

    report = inspect_checkpoint(resolve_model(path, revision), verify=verify, max_model_len=max_model_len,
                                kv_cache_bytes=parse_bytes(kv_cache_bytes, "--kv-cache-bytes"), strict_layout=strict_layout,
                                recipe=recipe, tensors=tensors)
    emit(report, as_json, lambda r: render(r, out, err))
    if strict and report.problems:
        raise ThresholdError(f"--strict: {len(report.problems)} problem(s) found in {report.path}")
