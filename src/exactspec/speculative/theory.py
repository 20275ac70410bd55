"""The paper's closed forms (Leviathan, Kalman & Matias 2023, Section 3), for α = acceptance rate,
γ = draft tokens per iteration, c = draft/target time per token, ĉ = draft/target arithmetic per token."""

from __future__ import annotations


def expected_tokens(alpha: float, gamma: int) -> float:
    """E[tokens emitted per iteration] = (1 - α^(γ+1)) / (1 - α)  (Eq. 1)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    return gamma + 1.0 if alpha == 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def walltime_factor(alpha: float, gamma: int, c: float = 0.0) -> float:
    """Theorem 3.8: expected speed-up (1 - α^(γ+1)) / ((1 - α)(γc + 1)), verifying γ+1 tokens in one step."""
    return expected_tokens(alpha, gamma) / (gamma * c + 1.0)


def arithmetic_factor(alpha: float, gamma: int, c_hat: float = 0.0) -> float:
    """Theorem 3.11: expected factor of arithmetic operations (1 - α)(γĉ + γ + 1) / (1 - α^(γ+1))."""
    return (gamma * c_hat + gamma + 1.0) / expected_tokens(alpha, gamma)


def optimal_gamma(alpha: float, c: float = 0.0, max_gamma: int = 64) -> int:
    """The γ in 0..max_gamma maximising Theorem 3.8's walltime factor (0 when speculation cannot pay)."""
    return max(range(max_gamma + 1), key=lambda g: (walltime_factor(alpha, g, c), -g))


# The paper's Table 1 (c = ĉ = 0): (α, γ, arithmetic-operations factor, walltime factor).
PAPER_TABLE_1 = [
    (0.6, 2, 1.53, 1.96),
    (0.7, 3, 1.58, 2.53),
    (0.8, 2, 1.23, 2.44),
    (0.8, 5, 1.63, 3.69),
    (0.9, 2, 1.11, 2.71),
    (0.9, 10, 1.60, 6.86),
]
