"""Cost models shaped like a real target's, for policy tests that must not depend on timing."""

from __future__ import annotations

from exactspec.autogamma.costs import CostModel

Q41 = [1.0, 1.73, 2.13, 2.50, 3.05, 3.61, 3.86, 4.12, 4.54, 4.96, 5.38, 5.80, 6.24, 6.67, 7.11, 7.54]


def q41_cost() -> CostModel:
    return CostModel([0.0086 * r for r in Q41], frozen=True)
