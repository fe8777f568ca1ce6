"""How precise a tokens-per-target-forward figure is: its standard error over the prompts."""

from __future__ import annotations

import math
from collections.abc import Sequence


def ratio_standard_error(tokens: Sequence[float], forwards: Sequence[float]) -> float | None:
    """Standard error of R = sum(tokens) / sum(forwards) over prompts (tokens[i], forwards[i] of prompt i).

    The prompts are what varies from one measurement to the next (another 24 prompts give another
    figure), so the error is taken over them. R is a ratio of sums, not a mean of per-prompt ratios
    (a long answer weighs more), so the delta method gives it:
    SE = sqrt(sum((t_i - R * f_i)^2) / (n * (n - 1))) / mean(f).
    None below 2 prompts (or with no forwards): there is no spread to estimate."""
    if len(tokens) != len(forwards):
        raise ValueError(f"{len(tokens)} token counts for {len(forwards)} forward counts: give one of each per prompt")
    n, total_f = len(tokens), sum(forwards)
    if n < 2 or total_f <= 0:
        return None
    r = sum(tokens) / total_f
    squares = sum((t - r * f) ** 2 for t, f in zip(tokens, forwards))
    return math.sqrt(squares / (n * (n - 1))) / (total_f / n)


def plus_minus(value: float, se: float | None, digits: int = 3) -> str:
    """`3.004 ± 0.041`, or the figure alone where there is no standard error (one prompt, an old result)."""
    return f"{value:.{digits}f}" if se is None else f"{value:.{digits}f} ± {se:.{digits}f}"
