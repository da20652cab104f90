"""What backs a tensor's memory, and the two decode loops run side by side: shared by the runtime's tests."""

from __future__ import annotations

from pathlib import Path

from edgeq.runtime import generate_ids, load


def mapped_file(ptr: int) -> str | None:
    """The file whose mapping holds address ``ptr`` in this process (None: anonymous memory)."""
    for line in open("/proc/self/maps"):
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= ptr < hi:
            return fields[5] if len(fields) > 5 else None
    return None


def vm_flags(ptr: int) -> list[str] | None:
    """smaps VmFlags of the mapping that holds address ``ptr`` (``hg``: MADV_HUGEPAGE, ``nh``: MADV_NOHUGEPAGE)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split(maxsplit=1)[0] if line.strip() else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= ptr < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return None


def greedy_both_loops(path: str | Path, tokens: int = 32):
    """(lean model, [(ids, path counts) of the lean loop, the same of the transformers loop]) for ``tokens`` greedy
    tokens after "Once upon a time" (prefill threshold 4, torch decode ops, transformers' SDPA attention)."""
    lean = load(path, prefill_threshold=4, decode_ops="torch", prefill_attn="sdpa")
    hf = load(path, prefill_threshold=4, decode_loop="transformers", prefill_attn="sdpa")
    prompt = lean.tokenizer("Once upon a time")["input_ids"]
    runs = []
    for lm in (lean, hf):
        lm.reset_counts()
        ids, *_ = generate_ids(lm, prompt, tokens)
        runs.append((ids, dict(lm.path_counts)))
    return lean, runs
