"""Optional integrations with other tools, each imported only when asked for.

- :mod:`batchgen.integrations.lm_eval`: batchgen as a model of lm-evaluation-harness
  (``pip install "batchgen[lm-eval]"``), and :mod:`batchgen.integrations.lm_eval_command`, the
  ``batchgen lm-eval ...`` command.
"""
