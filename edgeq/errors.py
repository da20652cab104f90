"""One exception type for every user-facing failure.

The CLI turns an :class:`EdgeqError` into one line on stderr and exit code 2. The message must name the file or
tensor involved and say what to do, e.g. ``model.layers.0.mlp.down_proj.weight [256, 770]: K=770 is not a multiple
of the group size 128; use --scheme w4a16-g32 ... or keep the module in bf16 with a recipe``.
"""


class EdgeqError(Exception):
    """A problem with the user's input or environment, explained in one line (exit code 2)."""


class DamagedCheckpointError(EdgeqError):
    """The checkpoint's bytes are damaged: found at load (non-finite scales, a shard whose size or sha256 is not what
    was written) or while generating (non-finite logits; the message names the first module whose output is not
    finite). The CLI exits 2 like any EdgeqError; the server answers 500 damaged_checkpoint."""


class ThresholdError(Exception):
    """A measured quantity broke a user-given bound (exit code 1, e.g. ``--max-kld``)."""
