"""The speculative-sampling verifier (Leviathan et al. 2023, Algorithm 1): pure tensors, no models.

For each row, draft token x_i (i = 0..γ-1) is accepted with probability min(1, p_i(x_i) / q_i(x_i)),
in order, until the first rejection. At the first rejected position n the emitted token is drawn
from norm(max(0, p_n - q_n)); if all γ pass, a bonus token is drawn from p_γ. Every row therefore
emits num_accepted + 1 tokens. `target_probs` / `draft_probs` are already warped (see sampling.warp).

All randomness enters through `uniforms` [B, γ+1]: column i < γ decides acceptance of draft i, the
last column drives inverse-CDF sampling of the correction/bonus token. Given the same uniforms a batch
gives the same result as its rows one by one, which the tests pin.
"""

from __future__ import annotations

import torch

from .sampling import sample_from_uniform

PAD = -1  # fills positions after a row's last emitted token


def point_mass(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """draft_ids [B, γ] -> one-hot draft probs [B, γ, V], for drafters that propose without a law."""
    return torch.nn.functional.one_hot(draft_ids, vocab_size).float()


def verify_with_uniforms(
    draft_ids: torch.Tensor,  # [B, γ] long
    draft_probs: torch.Tensor | None,  # [B, γ, V] or None (point-mass proposals)
    target_probs: torch.Tensor,  # [B, γ+1, V]
    uniforms: torch.Tensor,  # [B, γ+1] in [0, 1)
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (tokens [B, γ+1] long, PAD after each row's last token; num_accepted [B] long)."""
    batch, gamma = draft_ids.shape
    vocab = target_probs.shape[-1]
    if target_probs.shape[:2] != (batch, gamma + 1):
        raise ValueError(f"target_probs {tuple(target_probs.shape)} does not match draft_ids {(batch, gamma)}")
    if draft_probs is None:
        draft_probs = point_mass(draft_ids, vocab)
    rows = torch.arange(batch)
    p_at = target_probs[:, :gamma].gather(-1, draft_ids[..., None]).squeeze(-1)  # [B, γ]
    q_at = draft_probs.gather(-1, draft_ids[..., None]).squeeze(-1)  # [B, γ]
    accept = uniforms[:, :gamma] * q_at < p_at  # u < p/q without dividing by q
    num_accepted = accept.long().cumprod(-1).sum(-1)  # [B]

    p_last = target_probs[rows, num_accepted]  # [B, V]
    q_padded = torch.cat([draft_probs, draft_probs.new_zeros(batch, 1, vocab)], dim=1)  # [B, γ+1, V]
    residual = (p_last - q_padded[rows, num_accepted]).clamp_min(0)  # == p_last for the bonus token
    empty = residual.sum(-1, keepdim=True) <= 0  # p == q exactly: rejection had probability 0
    residual = torch.where(empty, p_last, residual)
    last = sample_from_uniform(residual, uniforms[:, gamma])  # [B]

    tokens = torch.cat([draft_ids, draft_ids.new_full((batch, 1), PAD)], dim=1)  # [B, γ+1]
    tokens[rows, num_accepted] = last
    after = torch.arange(gamma + 1)[None, :] > num_accepted[:, None]
    return tokens.masked_fill(after, PAD), num_accepted


def verify_greedy(
    draft_ids: torch.Tensor,  # [B, γ] long
    target_ids: torch.Tensor,  # [B, γ+1] long: the target's argmax at each position
) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify` on one-hot laws (temperature 0), without building [B, γ+1, V] tensors: drafts are
    accepted while they equal the target's argmax; the target's next argmax follows. Same outputs."""
    batch, gamma = draft_ids.shape
    num_accepted = (draft_ids == target_ids[:, :gamma]).long().cumprod(-1).sum(-1)  # [B]
    tokens = torch.cat([draft_ids, draft_ids.new_full((batch, 1), PAD)], dim=1)  # [B, γ+1]
    rows = torch.arange(batch)
    tokens[rows, num_accepted] = target_ids[rows, num_accepted]
    after = torch.arange(gamma + 1)[None, :] > num_accepted[:, None]
    return tokens.masked_fill(after, PAD), num_accepted


def verify(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_with_uniforms` with uniforms drawn from `generator`."""
    batch, gamma = draft_ids.shape
    uniforms = torch.rand(batch, gamma + 1, generator=generator)
    return verify_with_uniforms(draft_ids, draft_probs, target_probs, uniforms)


def verify_reference(
    draft_ids: list[int], draft_probs: torch.Tensor | None, target_probs: torch.Tensor, uniforms: list[float]
) -> list[int]:
    """One row, one token at a time, straight from the paper. The test oracle for `verify`.

    draft_probs [γ, V] or None, target_probs [γ+1, V]; returns the emitted tokens.
    """
    out: list[int] = []
    for i, x in enumerate(draft_ids):
        p = target_probs[i]
        q = draft_probs[i] if draft_probs is not None else point_mass(torch.tensor(x), p.numel())
        if uniforms[i] < min(1.0, float(p[x]) / float(q[x])) if q[x] > 0 else True:
            out.append(x)
            continue
        residual = (p - q).clamp_min(0)
        if residual.sum() <= 0:
            residual = p
        out.append(int(sample_from_uniform(residual[None], torch.tensor([uniforms[-1]]))[0]))
        return out
    bonus = target_probs[len(draft_ids)]
    out.append(int(sample_from_uniform(bonus[None], torch.tensor([uniforms[-1]]))[0]))
    return out
