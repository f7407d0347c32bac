"""Group-relative advantages, and G2RPO's multi-granularity integration.

GRPO normalises each reward within the group of G samples of one prompt:
    A_i = (R_i - mean_j R_j) / (std_j R_j + eps)                    (torch's unbiased std, eps = 1e-8)
G2RPO (paper Sec. 3.3, ALGORITHM.md Sec. 5) has a reward R[m, g][i, k] for every reward model m, granularity g,
SDE step k and member i; it normalises each (m, g, k) over the group, then integrates:
    A[i, k] = clamp( sum_m w_m * sum_g A[m, g][i, k],  -adv_clip_max, adv_clip_max )
Advantages are per step k: a branch is credited for what happened after its own SDE step.

Shapes: B prompts, G group size, R reward models, J granularities, K SDE steps.

Deviations from the reference code:
  1. Optional per-reward weights w_m (default 1, which is the reference's unweighted sum).
"""
import torch


def group_normalize(rewards: torch.Tensor, group_size: int, eps: float = 1e-8) -> torch.Tensor:
    """(r - mean) / (std + eps) within contiguous groups. rewards: (N, ...) with N = prompts * group_size.

    Every trailing index is normalised on its own. A constant group gives 0 (never NaN).
    """
    if group_size < 2:
        raise ValueError(f"group size must be >= 2 to normalise within a group, got {group_size}")
    if rewards.shape[0] % group_size:
        raise ValueError(f"{rewards.shape[0]} rewards do not split into groups of {group_size}")
    r = rewards.float().unflatten(0, (-1, group_size))  # (N / G, G, ...)
    centred = r - r.mean(dim=1, keepdim=True)
    return (centred / (r.std(dim=1, keepdim=True) + eps)).flatten(0, 1)  # (N, ...)


def granular_advantages(rewards: torch.Tensor, adv_clip_max: float, weights: torch.Tensor | None = None):
    """The multi-granularity advantage. rewards: (R, J, B, K, G); weights: (R,) or None (all 1).

    The full-SDE baseline passes J = 1 and K = 1 (one reward per trajectory) and gets (B, 1, G), which broadcasts
    over its trained steps. Returns (B, K, G).
    """
    R, J, B, K, G = rewards.shape
    # one normalisation call for every reward model, granularity and step: groups along the member axis
    per_group = rewards.permute(2, 4, 0, 1, 3).reshape(B * G, R, J, K)  # (B*G, R, J, K)
    normalised = group_normalize(per_group, G).view(B, G, R, J, K)
    w = torch.ones(R) if weights is None else torch.as_tensor(weights, dtype=torch.float32)
    # A[i, k] = sum_m w_m sum_g A[m, g][i, k]
    summed = torch.einsum("bgrjk,r->bkg", normalised, w.to(normalised.device))  # (B, K, G)
    return summed.clamp(-adv_clip_max, adv_clip_max)
