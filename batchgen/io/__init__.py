"""What a run reads and writes, below the run layer and the file formats that build on it.

* :mod:`batchgen.io.protocols`: the prompt-source and record-format protocols (and
  :class:`~batchgen.io.protocols.PromptRecord`, the row on its way to the engine), which the run
  loop sees instead of format names and which every format implements (batchgen records and
  dataset rows in :mod:`batchgen.run`, OpenAI Batch files in :mod:`batchgen.openai_batch`).
* :mod:`batchgen.io.dataset`: rows from HF ``datasets`` (load, select, ids, UTF-8, columns).
* :mod:`batchgen.io.prompts`: a row's prompt (template, chat template, tokens, checks).
* :mod:`batchgen.io.output_file`: the JSONL file (written, repaired, read back) and the summary file.
* :mod:`batchgen.io.lock`: one run per output file.

Nothing here imports the run layer, a format, torch or the engine. Nothing is imported here.
"""
