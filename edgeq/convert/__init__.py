"""``edgeq quantize``: a Hugging Face checkpoint (float, or GPTQ) -> an edgeq checkpoint, streamed tensor by tensor.

Where each concern lives (data flow: recipe -> plan -> stream (quantise, pack) -> writer -> records -> verify):

- :mod:`~edgeq.convert.pipeline`: the entry points (``prepare``: headers -> plan; ``convert``: the whole run into a
  staging directory renamed into place);
- :mod:`~edgeq.convert.recipe`: per-family recipes (head and embedding names, keep_bf16, group_sizes);
- :mod:`~edgeq.convert.plan`: every tensor's role and action from headers alone (``Plan``, ``PlanEntry``);
- :mod:`~edgeq.convert.packers` with :mod:`~edgeq.convert.w4a16` and :mod:`~edgeq.convert.w4a8`: the per-kernel
  pieces (quantise and pack in row blocks, the layout record, verification), keyed by :class:`edgeq.keys.Kernel`;
- :mod:`~edgeq.convert.stream`: copying and quantising the plan's entries into the writer;
- :mod:`~edgeq.convert.calibrate` (the layer-streamed GPTQ driver) and :mod:`~edgeq.convert.calibrated`
  (``--method gptq``: plan, calibration windows, writing the driver's results in a declared order);
- :mod:`~edgeq.convert.ingest_config`, :mod:`~edgeq.convert.ingest_gptq`, :mod:`~edgeq.convert.ingest_stream`: GPTQ
  checkpoints as input (settings, plan, exact repack);
- :mod:`~edgeq.convert.records`: the manifest, config.json, the tokenizer files; :mod:`~edgeq.convert.card`: the
  model card; :mod:`~edgeq.convert.verify`: the re-check of what was written.

The math is in :mod:`edgeq.quantize` (no files, no kernels), the bytes in :mod:`edgeq.layouts`, the files in
:mod:`edgeq.io`; nothing here imports the runtime.
"""
