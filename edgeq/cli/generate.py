"""``edgeq generate``: one completion, streamed to stdout (edgeq/runtime/generation.py does the work)."""

from __future__ import annotations

import time
from typing import Optional

import typer

from edgeq.cli.options import MAX_MODEL_LEN_HELP, QUIET_HELP, THREADS_HELP, size_option
from edgeq.console import emit, say, write
from edgeq.errors import EdgeqError
from edgeq.io.hub import REVISION_HELP, resolve_model


def generate(
    model: str = typer.Argument(..., help="An edgeq checkpoint (or a bf16 Hugging Face checkpoint): directory or hub id."),
    prompt: str = typer.Argument(..., help="The prompt text."),
    revision: Optional[str] = typer.Option(None, "--revision", help=REVISION_HELP),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Tokens to generate at most (EOS or --stop end sooner)."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Sample only from the most likely tokens holding this mass."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling (temperature > 0) [default: random]."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt with the tokenizer's chat template."),
    stop: Optional[list[str]] = typer.Option(None, "--stop", help="Stop string (repeatable) [default: none]."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help=MAX_MODEL_LEN_HELP),
    kv_cache_bytes: str = size_option("256MiB", "--kv-cache-bytes", "KV cache budget, e.g. 512MiB."),
    threads: Optional[int] = typer.Option(None, "--threads", help=THREADS_HELP),
    as_json: bool = typer.Option(False, "--json", help="Nothing streamed: one JSON object on stdout with the text, "
                                 "token ids, timings and compute paths."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help=QUIET_HELP),
    strict_layout: bool = typer.Option(False, "--strict-layout", help="Refuse a checkpoint packed for another layout."),
    verify: bool = typer.Option(False, "--verify", help="Check every shard's sha256 against the manifest before "
                                "generating (reads the whole checkpoint once; see docs/runtime.md)."),
) -> None:
    """Generate text, streamed to stdout; load info and tokens/s on stderr (--json: one JSON record instead)."""
    model = str(resolve_model(model, revision))
    generate_command(model, prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, chat=chat,
                     max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes, stop=stop, strict_layout=strict_layout,
                     as_json=as_json, quiet=quiet, threads=threads, verify=verify)


def generate_command(path: str, prompt: str, max_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0,
                     seed: int | None = None, chat: bool = False, max_model_len: int | None = None,
                     kv_cache_bytes: str | int = "256MiB", stop: list[str] | None = None, strict_layout: bool = False,
                     threads: int | None = None, verify: bool = False, as_json: bool = False,
                     quiet: bool = False) -> None:
    """``edgeq generate PATH PROMPT`` on a local directory: stream the completion to stdout; load info and tokens/s
    to stderr (not with ``quiet``). ``as_json``: nothing streamed, one JSON object on stdout at the end
    (:func:`edgeq.runtime.generation.generation_record`)."""
    from edgeq.runtime.generation import (  # noqa: PLC0415 (torch, transformers: only when the command runs)
        Generation, SamplingParams, describe_paths, encode_prompt, generation_record)
    from edgeq.runtime.loader import load  # noqa: PLC0415

    quiet = quiet or as_json
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=tuple(stop or ()))
    try:  # before loading: a bad option costs no load
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # bytes the shell passed that are not UTF-8 (Python keeps them as surrogates)
        raise EdgeqError(f"PROMPT: not valid UTF-8 (position {e.start}); pass the prompt as UTF-8 text") from None
    t = time.perf_counter()
    lm = load(path, max_model_len=max_model_len, kv_cache_bytes=kv_cache_bytes, strict_layout=strict_layout, threads=threads,
              verify=verify)
    load_seconds = time.perf_counter() - t
    s = lm.settings
    say(f"loaded {path} in {load_seconds:.2f} s: {describe_paths(s)}, max_model_len {s.max_model_len}, KV cache "
        f"{s.max_cached_tokens} tokens, {s.threads} threads", quiet)
    g = Generation(lm, encode_prompt(lm, prompt, chat), params)
    for d in g:
        if not as_json:
            write(d.text)
    r = g.result
    if as_json:
        emit(generation_record(path, lm, r, load_seconds), as_json=True)
        return
    write("\n")
    say(f"prefill {r.prompt_tokens} tokens at {r.prefill_tokens_per_s:.1f} tok/s; decode {len(r.token_ids)} tokens "
        f"at {r.decode_tokens_per_s:.1f} tok/s; finish: {r.finish_reason}; paths {dict(lm.path_counts)}", quiet)
