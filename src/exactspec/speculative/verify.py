"""The speculative-sampling verifier (Leviathan et al. 2023, Algorithm 1): pure arrays, no models.

Draft token x_i (i = 0..γ-1) is accepted with probability min(1, p_i(x_i) / q_i(x_i)), in order, until
the first rejection. At the first rejected position n the emitted token is drawn from
norm(max(0, p_n - q_n)); if all γ pass, a bonus token is drawn from p_γ. A row therefore emits
num_accepted + 1 tokens. `target_probs` / `draft_probs` are already warped (see sampling.warp).

All randomness enters through `uniforms` [γ+1]: entry i < γ decides acceptance of draft i, the last
drives inverse-CDF sampling of the correction/bonus token. Point-mass drafts at L = 1 use the same rule
in its coupled form (`verify_coupled`): uniform i is position i's, which draws that position's token,
so the emitted text is plain decoding's with the same uniforms.

Lenience (Leviathan et al. 2023, appendix A.5), opt-in and LOSSY: with 0 < L < 1 a draft is accepted
with probability min(1, p(x) / (L·q(x))) and the first rejected position draws from
norm(max(0, p - L·q)); for greedy decoding (`accept_greedy_lenient`) a draft is kept while
p(x) >= L·max p. The output law is then NOT the target's: it leans towards the draft's (more drafts
are accepted, which is the point). L = 1 (the default) is the exact rule above, on the same code
path. (Our reading of the paper's appendix, with its p/q names swapped to ours: p target, q draft.)

Block verification (Sun et al., ICLR 2025; `verify_block_with_uniforms`, opt-in per request with
`verification="block"`) verifies drafts with a real law jointly: exact as well, and never fewer accepted
drafts in expectation per block. Point-mass drafts keep the coupled token rule.

One row at a time, in NumPy: the decode loop (a batch whose rows each verify their own drafts after
one shared target forward) calls it per row on the CPU, and on a fast backend (llama.cpp,
~10 ms per token) the ~25 small torch ops of a batched tensor formulation cost ~5% of every token.
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.typing import ArrayLike

from .sampling import as_numpy, sample_from_uniform


def verify_with_uniforms(
    draft_ids: list[int],  # [γ]
    draft_probs: ArrayLike | None,  # [γ, V] or None (point-mass proposals)
    target_probs: ArrayLike,  # [γ+1, V]
    uniforms: ArrayLike,  # [γ+1] in [0, 1)
    lenience: float = 1.0,  # L in (0, 1]; < 1 is lossy (see the module docstring)
) -> list[int]:
    """-> the emitted tokens: the accepted drafts, then one token from the residual or the bonus law."""
    check_lenience(lenience)
    gamma = len(draft_ids)
    p, u = as_numpy(target_probs), as_numpy(uniforms)
    q = None if draft_probs is None else as_numpy(draft_probs)
    if p.ndim != 2 or p.shape[0] != gamma + 1 or len(u) != gamma + 1:
        raise ValueError(f"target_probs {p.shape} / uniforms {u.shape} do not match {gamma} drafts")
    n = 0
    while n < gamma:
        x = draft_ids[n]
        accept = u[n] * lenience < p[n, x] if q is None else u[n] * lenience * q[n, x] < p[n, x]  # u < p/(Lq)
        if not accept:
            break
        n += 1
    residual = p[n]  # the bonus law when every draft was accepted
    if n < gamma and q is None:  # max(0, p - L·point mass at x): p with p(x) lowered by L (to 0 at L = 1)
        residual = p[n].copy()
        residual[draft_ids[n]] = max(residual[draft_ids[n]] - lenience, 0)
    elif n < gamma:
        residual = np.maximum(p[n] - (q[n] if lenience == 1 else lenience * q[n]), 0)
    if not residual.sum() > 0:  # p == q exactly: rejection had probability 0
        residual = p[n]
    return draft_ids[:n] + [sample_from_uniform(residual, u[gamma])]


def verify_block_with_uniforms(
    draft_ids: list[int],  # [γ]
    draft_probs: ArrayLike,  # [γ, V]: the laws the drafts were sampled from (a real draft law, not point masses)
    target_probs: ArrayLike,  # [γ+1, V]
    uniforms: ArrayLike,  # [γ+1] in [0, 1)
) -> list[int]:
    """Block verification (Sun et al., ICLR 2025): the draft block is verified jointly. Exact (the output
    law is the target's) and, per block, never fewer accepted drafts in expectation than the token rule.

    With p_i, q_i the target's and the draft's laws at position i (each normalised in float64) and x_i the
    drafts, a weight runs forward over the block:

        w_0 = 1,   w_i = min(1, w_{i-1} · p_{i-1}(x_i) / q_{i-1}(x_i))        (i = 1..γ)

    (w_i = min over j <= i of the prefix ratio P_target(x_{j+1..i}) / P_draft(x_{j+1..i})). Position i
    passes its stop test with probability h_γ = w_γ, and for i < γ

        h_i = R_i / (R_i + 1 - w_i),   R_i = Σ_y max(0, w_i·p_i(y) - q_i(y)).

    τ = the LARGEST i in 1..γ whose test passes (0 if none): the drafts x_1..x_τ are kept, then the bonus
    token from p_γ (τ = γ) or a correction from norm(max(0, w_τ·p_τ - q_τ)). A draft rejected by the token
    rule (w_i < 1) can still be kept when later drafts make up for it. Uniform i-1 is position i's stop
    test, the last one draws the emitted token. The tests are tried from γ down, so the full-vocabulary
    R_i is computed only for positions the scan reaches. At τ = 0 this is the token rule's residual.

    Exactness, in short (docs/exactness-and-lenience.md): by backward induction P(τ >= i | x_1..x_i) = w_i
    (it is w_γ at γ, and E[w_{i+1} | x^i] = Σ_y min(q_i(y), w_i·p_i(y)) = w_i - R_i, so
    P(τ >= i) = (w_i - R_i) + (1 - w_i + R_i)·h_i = w_i), hence P(τ = i | x^i) = R_i. Then for every
    string s of length i, P(x^i = s, τ >= i) + P(the output, continued by the target, starts with s and
    τ < i) = P_target(s), by forward induction: at s·y the first part is P_draft(s)·min(q_i(y), w_i p_i(y)),
    the second gains P_draft(s)·max(0, w_i p_i(y) - q_i(y)) from τ = i, and they sum to P_target(s)·p_i(y).
    """
    gamma = len(draft_ids)
    p, q, u = as_numpy(target_probs), as_numpy(draft_probs), as_numpy(uniforms)
    if p.ndim != 2 or p.shape[0] != gamma + 1 or len(u) != gamma + 1 or q.shape[0] < gamma:
        raise ValueError(f"target_probs {p.shape} / draft_probs {q.shape} / uniforms {u.shape} do not match "
                         f"{gamma} drafts")
    p_mass, q_mass = p[:gamma].sum(-1, dtype=np.float64), q[:gamma].sum(-1, dtype=np.float64)  # [γ]
    weights = [1.0]  # w_0..w_γ
    for i, x in enumerate(draft_ids):
        px, qx = float(p[i, x]) / p_mass[i], float(q[i, x]) / q_mass[i]
        w = weights[-1] * px
        weights.append(1.0 if w >= qx else w / qx)

    def residual(i: int) -> np.ndarray:  # max(0, w_i·p_i - q_i) on the normalised laws, float64
        return np.maximum(p[i].astype(np.float64) * (weights[i] / p_mass[i]) - q[i].astype(np.float64) / q_mass[i], 0.0)

    tau, law = 0, None
    for i in range(gamma, 0, -1):  # τ = the largest i whose stop test passes
        if i == gamma:
            if u[i - 1] < weights[i]:  # h_γ = w_γ
                tau = i
                break
            continue
        if weights[i] == 0:  # R_i = 0: h_i = 0, and every earlier weight's test is still to come
            continue
        law = residual(i)
        mass = float(law.sum())
        if u[i - 1] * (mass + 1.0 - weights[i]) < mass:  # u < h_i = R_i / (R_i + 1 - w_i)
            tau = i
            break
        law = None
    if tau == gamma:
        law = p[gamma]  # the bonus law
    elif law is None:  # τ = 0, the scan's only position it did not compute: the token rule's residual
        law = residual(0)
    if not law.sum() > 0:  # p == q (times w): this stop had probability 0
        law = p[tau]
    return list(draft_ids[:tau]) + [sample_from_uniform(law, u[gamma])]


def verify_coupled(draft_ids: list[int], target_probs: ArrayLike, uniforms: ArrayLike) -> list[int]:
    """Point-mass drafts, the exact rule with the plain sampler's coupling: position i's token is drawn
    from p_i by inverse CDF with uniform i, and draft x_i is accepted when that token IS x_i; the first
    token that differs is emitted and ends the proposal (all equal: the bonus token, drawn the same way).
    In law this is Algorithm 1 for q = point mass at x: x is accepted with probability p(x) = min(1,
    p(x)/q(x)), and a rejection emits p conditioned on not x, which is norm(max(0, p - q)). Because each
    position's token depends on its own uniform alone, the output equals plain decoding's with the same
    uniforms (spec.sampling.Uniforms hands unused ones on), whatever was proposed and whatever γ.
    target_probs [γ+1, V], uniforms [>= emitted] -> the emitted tokens (their count = uniforms used)."""
    p = as_numpy(target_probs)
    out = []
    for i, x in enumerate(draft_ids):
        token = sample_from_uniform(p[i], uniforms[i])
        out.append(token)
        if token != x:
            return out
    return out + [sample_from_uniform(p[len(draft_ids)], uniforms[len(draft_ids)])]


def verify(
    draft_ids: list[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
    lenience: float = 1.0,
) -> list[int]:
    """`verify_with_uniforms` with γ+1 uniforms drawn from `generator`."""
    uniforms = torch.rand(len(draft_ids) + 1, generator=generator)
    return verify_with_uniforms(draft_ids, draft_probs, target_probs, uniforms, lenience)


def check_lenience(lenience: float) -> None:
    """Lenience must be in (0, 1]: 1 is exact, smaller accepts more drafts and changes the output law."""
    if not 0.0 < lenience <= 1.0:
        raise ValueError(f"lenience must be in (0, 1] (1 = exact; smaller is lossy), got {lenience}")


def accept_greedy(draft_ids: list[int], target_ids: list[int]) -> list[int]:
    """`verify` on one-hot laws (temperature 0), on token ids: drafts are kept while they equal the
    target's argmax at their position, then the target's argmax at the first mismatch (or at the bonus
    position) follows. draft_ids [γ], target_ids [γ+1] -> the emitted tokens. Same outputs as `verify`
    without any [γ+1, V] array: the target only has to report its argmax."""
    n = 0
    while n < len(draft_ids) and draft_ids[n] == target_ids[n]:
        n += 1
    return draft_ids[:n] + [target_ids[n]]


def accept_greedy_lenient(draft_ids: list[int], target_probs: ArrayLike, lenience: float) -> list[int]:
    """Greedy decoding with lenience L (LOSSY for L < 1): draft i is kept while p_i(x_i) >= L·max p_i,
    where p_i is the target's un-warped next-token law (softmax of its logits); then the target's
    argmax follows. target_probs [γ+1, V]. At L = 1 this is `accept_greedy` (up to exact ties)."""
    check_lenience(lenience)
    p = as_numpy(target_probs)
    n = 0
    while n < len(draft_ids) and p[n, draft_ids[n]] >= lenience * p[n].max():
        n += 1
    return draft_ids[:n] + [int(p[n].argmax())]


def verify_reference(
    draft_ids: list[int], draft_probs: torch.Tensor | None, target_probs: torch.Tensor, uniforms: list[float],
    lenience: float = 1.0,
) -> list[int]:
    """One token at a time, straight from the paper (appendix A.5 for lenience < 1), in torch. The test
    oracle for `verify`.

    draft_probs [γ, V] or None, target_probs [γ+1, V]; returns the emitted tokens.
    """
    out: list[int] = []
    for i, x in enumerate(draft_ids):
        p = target_probs[i]
        q = draft_probs[i] if draft_probs is not None else torch.nn.functional.one_hot(torch.tensor(x), p.numel()).float()
        if uniforms[i] < min(1.0, float(p[x]) / (lenience * float(q[x]))) if q[x] > 0 else True:
            out.append(x)
            continue
        residual = (p - lenience * q).clamp_min(0)
        if residual.sum() <= 0:
            residual = p
        out.append(sample_from_uniform(residual, uniforms[-1]))
        return out
    out.append(sample_from_uniform(target_probs[len(draft_ids)], uniforms[-1]))
    return out
