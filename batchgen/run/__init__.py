"""The run layer: one job from a config to its JSONL records and run summary.

Modules, in the order a job passes through them (each imports only those below it):

* :mod:`batchgen.run.plan`: the checks that need no model, resume, the :class:`~batchgen.run.plan.Job`;
  the one place that picks the job's prompt source and record format.
* :mod:`batchgen.run.execute`: the loop (requests to the executor, results to the writer).
* :mod:`batchgen.run.summary`: the run summary (counts read back from the files, throughput).
* :mod:`batchgen.run.executors`: where the engine runs (local, Ray).
* :mod:`batchgen.run.writer`, :mod:`batchgen.run.lock`: the JSONL writer, the output's lock.
* :mod:`batchgen.run.protocols`: the two protocols the loop sees instead of format names
  (:class:`~batchgen.run.protocols.PromptSource`, :class:`~batchgen.run.protocols.RecordFormat`).

Nothing is imported here: ``import batchgen.run.protocols`` stays light.
"""
