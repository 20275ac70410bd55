"""The verifier as tensor ops, batched over rows, for targets on a GPU: the [γ+1, V] laws stay on the
device and an iteration moves only the emitted token ids to the host.

Same rule and same uniforms semantics as `verify.verify_with_uniforms` (row b: entry i < γ_b of its
uniforms decides draft i, entry γ_b drives inverse-CDF sampling of the residual / bonus token), so a
row gives the same tokens on any device from the same random numbers (tested against
`verify_reference`). The CPU keeps the NumPy verifier: per row it is faster there.
"""

from __future__ import annotations

import torch

from .sampling import sample_rows


def verify_rows(
    draft_ids: torch.Tensor,  # [A, K] long, row b's drafts in [:gammas[b]] (the rest is padding)
    gammas: torch.Tensor,  # [A] long, drafts per row
    draft_probs: torch.Tensor | None,  # [A, K, V] or None (point-mass proposals)
    target_probs: torch.Tensor,  # [A, K+1, V]
    uniforms: torch.Tensor,  # [A, K+1], row b uses [:gammas[b]+1]
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (accepted [A] drafts per row, next [A] the token after them), on the laws' device."""
    A, K = draft_ids.shape
    device = target_probs.device
    draft_ids, gammas, uniforms = draft_ids.to(device), gammas.to(device), uniforms.to(device)
    rows = torch.arange(A, device=device)
    if K:
        p_x = target_probs[:, :K].gather(-1, draft_ids[..., None]).squeeze(-1)  # [A, K]
        if draft_probs is None:
            accept = uniforms[:, :K] < p_x
        else:
            draft_probs = draft_probs.to(device)
            accept = uniforms[:, :K] * draft_probs.gather(-1, draft_ids[..., None]).squeeze(-1) < p_x
        accept &= torch.arange(K, device=device) < gammas[:, None]
        accepted = accept.int().cumprod(-1).sum(-1)  # [A] length of the accepted prefix
    else:
        accepted = torch.zeros(A, dtype=torch.long, device=device)
    p_n = target_probs[rows, accepted]  # [A, V] the law at the first rejection (or the bonus law)
    rejected = accepted < gammas
    if K:
        at = accepted.clamp_max(K - 1)
        if draft_probs is None:  # max(0, p - point mass at x) is p without x
            residual = p_n.scatter(-1, draft_ids[rows, at][:, None], 0.0)
        else:
            residual = (p_n - draft_probs[rows, at]).clamp_min(0)
        residual = torch.where(rejected[:, None] & (residual.sum(-1, keepdim=True) > 0), residual, p_n)
    else:
        residual = p_n
    return accepted, sample_rows(residual, uniforms[rows, gammas])


def verify_rows_coupled(
    draft_ids: torch.Tensor,  # [A, K] long, point-mass drafts, row b's in [:gammas[b]]
    gammas: torch.Tensor,  # [A] long
    target_probs: torch.Tensor,  # [A, K+1, V]
    uniforms: torch.Tensor,  # [A, K+1]: position i's uniform (spec.sampling.Uniforms)
) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify.verify_coupled` batched: every position's token drawn by inverse CDF from its own uniform;
    drafts accepted while they equal it. -> (accepted [A], next [A]: the drawn token after them)."""
    A, K1, V = target_probs.shape
    device = target_probs.device
    draft_ids, gammas, uniforms = draft_ids.to(device), gammas.to(device), uniforms.to(device)
    drawn = sample_rows(target_probs.reshape(A * K1, V), uniforms.reshape(A * K1)).reshape(A, K1)  # [A, K+1]
    K = K1 - 1
    if K:
        same = (drawn[:, :K] == draft_ids) & (torch.arange(K, device=device) < gammas[:, None])
        accepted = same.int().cumprod(-1).sum(-1)
    else:
        accepted = torch.zeros(A, dtype=torch.long, device=device)
    return accepted, drawn[torch.arange(A, device=device), accepted]
