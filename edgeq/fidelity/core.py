"""Old import path of the fidelity package (``from edgeq.fidelity import core as F``): an alias to sweep.

Everything lives in the modules of :mod:`edgeq.fidelity` now; this module only re-exports the names it used to
define (the command is edgeq/cli/fidelity.py). To be removed once tests/test_quantize_gptq.py imports
``from edgeq import fidelity as F``, the package's Python API, as edgeq/ and benchmarks/ do.
"""

from edgeq.fidelity.checkpoints import check_order, is_edgeq_checkpoint, run_fidelity
from edgeq.fidelity.loop import Progress
from edgeq.fidelity.metrics import TOP5, position_stats, top_n_mask
from edgeq.fidelity.reffile import DEFAULT_REF_TOPK, REF_FORMAT, ReferenceFile, load_reference_file
from edgeq.fidelity.report import REPORT_SCHEMA, FidelityReport, LayerError, render
from edgeq.fidelity.run import compare, compare_to_reference_file, save_reference_file
from edgeq.fidelity.stats import summarize
from edgeq.fidelity.text import DEFAULT_CTX, DEFAULT_TEXT, SCORE_MODES, Windowing, make_windows, plan_counts
from edgeq.fidelity.thresholds import broken_bounds
from edgeq.fidelity.tokens import check_same_vocabulary, tokenizer_sha256
from edgeq.fidelity.topk import RefRows, position_stats_topk, ref_rows, worst_tail_kl

__all__ = ["DEFAULT_CTX", "DEFAULT_REF_TOPK", "DEFAULT_TEXT", "REF_FORMAT", "REPORT_SCHEMA", "SCORE_MODES", "TOP5",
           "FidelityReport", "LayerError", "Progress", "RefRows", "ReferenceFile", "Windowing", "broken_bounds",
           "check_order", "check_same_vocabulary", "compare", "compare_to_reference_file",
           "is_edgeq_checkpoint", "load_reference_file", "make_windows", "plan_counts", "position_stats",
           "position_stats_topk", "ref_rows", "render", "run_fidelity", "save_reference_file", "summarize",
           "tokenizer_sha256", "top_n_mask", "worst_tail_kl"]
