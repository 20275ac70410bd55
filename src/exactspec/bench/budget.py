"""`bench --quick`'s budget: the workloads with their own runners (selfconsistency, agent, agent-repeat)
cut to what fits in QUICK_SECONDS each on this machine, priced by the target's measured T(1).

Their full size is fixed by their data files (8 prompts of 8 samples; 12 sessions of 3 steps, every
method replaying each), so on a slow CPU a "quick" run of them took longer than a full run of the
others (13 minutes at T(1) = 62 ms). A unit of work is priced as plain decoding of its tokens, every
method's: T(1) a token (T(B, 1) a step of a B-row batch). Speculation is cheaper than that and
prefill dearer; the budget is a bound on the size of the run, not a prediction of its time.
"""

from __future__ import annotations

QUICK_SECONDS = 60.0  # what each of those workloads may cost under --quick
MIN_TOKENS = 16  # an answer cut shorter measures little but its prefill


def affordable(seconds: float, unit_s: float, most: int, least: int = 1) -> int:
    """How many units of work costing `unit_s` each fit in `seconds`: at most `most` (the work asked
    for), at least `least` (or `most`, if fewer)."""
    fit = int(seconds / unit_s) if unit_s > 0 else most
    return max(min(least, most), min(most, fit))


def fit_batches(seconds: float, step_s: float, prompts: int, max_new_tokens: int) -> tuple[int, int]:
    """(prompts, max_new_tokens) of the selfconsistency workload within `seconds`, where `step_s` is
    one decoding step of every method's batch: fewer prompts first (at least one), then shorter samples."""
    prompts = affordable(seconds, max_new_tokens * step_s, prompts)
    return prompts, affordable(seconds, prompts * step_s, max_new_tokens, MIN_TOKENS)


def fit_sessions(seconds: float, token_s: float, sessions: int, steps: int, max_new_tokens: int,
                 least_sessions: int = 1) -> tuple[int, int, int]:
    """(sessions, steps per session, max_new_tokens) of an agent workload within `seconds`, where
    `token_s` is one token of every method: fewer sessions first (at least `least_sessions`), then
    fewer steps per session (at least one), then shorter answers."""
    sessions = affordable(seconds, steps * max_new_tokens * token_s, sessions, least_sessions)
    steps = affordable(seconds, sessions * max_new_tokens * token_s, steps)
    return sessions, steps, affordable(seconds, sessions * steps * token_s, max_new_tokens, MIN_TOKENS)
