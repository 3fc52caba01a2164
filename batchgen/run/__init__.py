"""The run layer: one job from a config to its JSONL records and run summary.

Modules, from the top (each imports only those below it, and :mod:`batchgen.io`):

* :mod:`batchgen.run.execute`: the loop (requests to the executor, results to the writer).
* :mod:`batchgen.run.summary`: the run summary (counts read back from the files, throughput).
* :mod:`batchgen.run.plan`: the checks that need no model, resume, the
  :class:`~batchgen.run.plan.Job`; ``pick`` is the one place that chooses the job's prompt
  source and record format.
* :mod:`batchgen.run.rows`, :mod:`batchgen.run.records`: dataset rows and batchgen records, a
  prompt source and a record format (see :mod:`batchgen.io.protocols`); OpenAI batch lines and
  response lines are :mod:`batchgen.openai_batch.source` and
  :mod:`batchgen.openai_batch.response_lines`.
* :mod:`batchgen.run.signals`, :mod:`batchgen.run.errors`: how a run stops.
* :mod:`batchgen.run.executors`: where the engine runs (local, Ray).
* :mod:`batchgen.run.fingerprint`, :mod:`batchgen.run.progress`.

Nothing is imported here.
"""
