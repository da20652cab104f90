"""``edgeq inspect``: what is in a checkpoint, what serving it will cost, and what is wrong with it.

Where each concern lives (callers import :func:`edgeq.inspect.report.inspect_checkpoint` and ``render`` from
:mod:`edgeq.inspect.report`; the command is registered in edgeq/cli/inspect.py):

- ``report.py``   assembles the :class:`~edgeq.inspect.schema.InspectReport` from the parts below
- ``schema.py``   the report's frozen dataclasses: the ``--json`` schema (docs/inspect.md)
- ``kinds.py``    kind detection (edgeq / hf / foreign), quantised modules by tensor suffix, roles, byte categories
- ``checks.py``   an edgeq checkpoint: manifest vs config.json vs the safetensors headers
- ``embeddings.py`` the input embedding table: bf16, or packed 4-bit levels (headers, bytes, --verify's decode)
- ``packed.py``   what depends on the packed format (shapes, layout record, round trip, memory): one
                  implementation for every :class:`edgeq.keys.Kernel`, asking its :mod:`edgeq.layouts` layout
- ``hf.py``       a float checkpoint: every w4a16 scheme's plan, and the default scheme's memory
- ``foreign.py``  GPTQ, AWQ, compressed-tensors, torchao, bitsandbytes: settings, geometry, traps
- ``verify.py``   ``--verify``: digests, values, unpack/repack round trips, the config's model against the shapes
- ``render.py``   the human report
"""
