"""Functions tests/test_vllm.py ships into vLLM's worker processes (``LLM.apply_model``): pickled by reference, so
they live in an importable module (the workers import it by name, tests/ being on their inherited sys.path)."""

from __future__ import annotations

import torch


def embedding_rows(model) -> torch.Tensor:
    """In each vLLM worker: the model's input embedding of every token id, bf16 [V, K] (tp > 1: vLLM's masked lookup
    on each rank and its all-reduce, as in a forward)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    (embed,) = [m for m in model.modules() if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)]
    with torch.no_grad():
        return embed(torch.arange(embed.org_vocab_size)).cpu()


def head_levels(model) -> int:
    """In each vLLM worker, after generating: the levels the served head sums (1 + its residual levels; a
    ``--head-levels 2`` head attaches its residual at its first call)."""
    from edgeq.integrations import vllm_state as state

    (head,) = [s.module for s in state.STATE.served.values() if s.head]
    return 1 + len(getattr(head, "residual_levels", ()))
