"""The unbiased pass@k estimator (Chen et al., 2021, "Evaluating Large Language Models Trained
on Code").

With ``n`` samples of which ``c`` pass, the probability that at least one of ``k`` samples drawn
without replacement passes is ``1 - C(n - c, k) / C(n, k)``. The binomials overflow floats for
large ``n``, so the ratio is computed as the product ``prod_{i=n-c+1}^{n} (1 - k / i)``, which
equals it exactly in real arithmetic.
"""

from __future__ import annotations


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from ``n`` samples with ``c`` correct.

    Raises:
        ValueError: unless ``0 <= c <= n`` and ``1 <= k <= n``.
    """
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got n={n}, k={k}")
    if n - c < k:
        return 1.0  # every k-subset contains a correct sample
    ratio = 1.0
    for i in range(n - c + 1, n + 1):
        ratio *= 1.0 - k / i
    return 1.0 - ratio
