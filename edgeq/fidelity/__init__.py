"""``edgeq fidelity``: is the quantised model still the reference model, token by token?

Both models score the same token windows; per scored position we compare the two next-token distributions. The
statistics follow llama.cpp's ``llama-perplexity --kl-divergence`` (PPL of both, their ratio with an uncertainty that
accounts for the correlation of the two, mean KLD +- standard error and its upper percentiles, same-top-1 rate +-
binomial sigma, RMS of delta-p) plus a top-5 overlap and, with ``per_layer``, the relative output error of every
quantised linear. docs/fidelity.md states every formula.

Where each concern lives (arrows: who calls whom)::

    edgeq/cli/fidelity.py   the command (above this package): Typer signature, progress bar, printing, exit codes
      -> checkpoints   paths -> models (edgeq.runtime.load), REF/QUANT order check
        -> run         compare / save_reference_file / compare_to_reference_file on in-memory models
          -> sides     a model as a scoring function (+ module, tokenizer, vocab size)
          -> tokens    vocabulary and tokenizer agreement, tokenizer hash
          -> text      evaluation text -> token ids -> windows, scored positions per window
          -> loop      window by window through both models (memory: one window of logits)
            -> metrics full-vocabulary KLD, NLL, top-1, top-5, delta-p per position
            -> topk    the same against a reference known through its top k (--ref), with the KLD bound
            -> probe   --per-layer forward hooks
          -> reffile   the --save-ref file: write, read, validate
          -> stats     per-position arrays -> FidelityReport (means, standard errors, percentiles)
    report       FidelityReport / LayerError (JSON schema edgeq.fidelity/1) and the human table
    thresholds   --max-kld / --min-top1 / --max-ppl-ratio

The Python API is re-exported here: ``from edgeq import fidelity as F; F.compare(ref_model, quant_model)``.
"""

from edgeq.fidelity.checkpoints import check_order, run_fidelity
from edgeq.fidelity.reffile import DEFAULT_REF_TOPK, ReferenceFile, load_reference_file
from edgeq.fidelity.report import FidelityReport, LayerError, render
from edgeq.fidelity.run import compare, compare_to_reference_file, save_reference_file
from edgeq.fidelity.text import DEFAULT_CTX
from edgeq.fidelity.thresholds import broken_bounds

__all__ = ["DEFAULT_CTX", "DEFAULT_REF_TOPK", "FidelityReport", "LayerError", "ReferenceFile", "broken_bounds",
           "check_order", "compare", "compare_to_reference_file", "load_reference_file", "render", "run_fidelity",
           "save_reference_file"]
