"""Group-relative advantages, and G2RPO's multi-granularity integration.

GRPO normalises each reward within the group of G samples of one prompt (paper Eq. 6):
    A_i = (R_i - mean_j R_j) / (std_j R_j + eps)                    (torch's unbiased std, eps = 1e-8)
G2RPO has a reward R[m, g][i, k] for every reward model m, granularity g, SDE step k and member i; it normalises
each (m, g, k) over the group, then integrates (paper Eq. 10):
    A[i, k] = clamp( sum_m w_m * sum_g A[m, g][i, k],  -adv_clip_max, adv_clip_max )
Advantages are per step k: a branch is credited for what happened after its own SDE step.

Shapes: B prompts, J granularities, K SDE steps, G group size, R reward models. Rewards keep one layout from
scoring to here: (B, J, K, G, R), the order of the rollout's final latents with the reward models last.

Deviations from the reference code (numbers of the README's list): 10 (optional per-reward weights w_m).
"""
import torch


def group_normalize(rewards: torch.Tensor, dim: int, eps: float = 1e-8) -> torch.Tensor:
    """(r - mean) / (std + eps) along the group axis `dim`; every other index is normalised on its own.

    A constant group gives 0 (never NaN).
    """
    if rewards.shape[dim] < 2:
        raise ValueError(f"a group needs at least 2 members to normalise within it, got {rewards.shape[dim]}")
    r = rewards.float()
    return (r - r.mean(dim, keepdim=True)) / (r.std(dim, keepdim=True) + eps)


def granular_advantages(rewards: torch.Tensor, *, adv_clip_max: float, weights: torch.Tensor | None = None):
    """The multi-granularity advantage. rewards: (B, J, K, G, R); weights: (R,) or None (all 1). Returns (B, K, G).

    A method with one reward per trajectory passes J = 1 and K = 1 and gets (B, 1, G), which broadcasts over its
    trained steps.
    """
    normalised = group_normalize(rewards, dim=3)  # A[m, g][i, k]: (B, J, K, G, R)
    return integrate(normalised, adv_clip_max, weights)  # (B, K, G)


def integrate(normalised: torch.Tensor, adv_clip_max: float, weights: torch.Tensor | None = None) -> torch.Tensor:
    """A[i, k] = clamp(sum_m w_m sum_g A[m, g][i, k], +-adv_clip_max): (B, J, K, G, R) -> (B, K, G). This is the
    one place advantages are clamped."""
    w = torch.ones(normalised.shape[-1]) if weights is None else torch.as_tensor(weights, dtype=torch.float32)
    summed = torch.einsum("bjkgr,r->bkg", normalised, w.to(normalised.device))  # sum_m w_m sum_g: (B, K, G)
    return summed.clamp(-adv_clip_max, adv_clip_max)
