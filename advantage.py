"""Group-relative advantages, and G2RPO's multi-granularity integration.

GRPO normalises each reward within the group of G samples of one prompt (paper Eq. 6):
    A_i = (R_i - mean_j R_j) / (std_j R_j + eps)                    (torch's unbiased std, eps = 1e-8)
G2RPO has a reward R[m, g][i, k] for every reward model m, granularity g, SDE step k and member i; it normalises
each (m, g, k) over the group, then integrates (paper Eq. 10):
    A[i, k] = clamp( sum_m w_m * sum_g A[m, g][i, k],  -adv_clip_max, adv_clip_max )
Advantages are per step k: a branch is credited for what happened after its own SDE step. This is the one place
advantages are clamped. Flow-GRPO's `global_std` divides by one std for the whole batch instead (of every prompt,
on every rank): A_i = (R_i - mean_j R_j) / (std_all R + 1e-4), the population std (`global_normalize`).

Shapes: B prompts, J granularities, K SDE steps, G group size, R reward models. Rewards keep one layout from
scoring to here: (B, J, K, G, R), the order of the rollout's final latents with the reward models last.

Deviations from the reference code (numbers of the README's list): 10 (optional per-reward weights w_m), 14 (the
baselines' global std; the bench's credit controls).
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


def global_normalize(rewards: torch.Tensor, all_rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """Flow-GRPO's global std: (r - the group's mean) / (population std of every reward in `all_rewards` + eps).
    rewards: (B, J, K, G, R) this rank's; all_rewards: (B_all, J, K, G, R) every rank's. Each (j, k, reward model)
    has its own std over every prompt and member."""
    if rewards.shape[3] < 2:
        raise ValueError(f"a group needs at least 2 members to normalise within it, got {rewards.shape[3]}")
    r = rewards.float()
    std = all_rewards.float().std(dim=(0, 3), keepdim=True, correction=0)  # (1, J, K, 1, R)
    return (r - r.mean(3, keepdim=True)) / (std.to(r.device) + eps)


def granular_advantages(rewards: torch.Tensor, *, adv_clip_max: float, weights: torch.Tensor | None = None,
                        all_rewards: torch.Tensor | None = None):
    """The multi-granularity advantage. rewards: (B, J, K, G, R); weights: (R,) or None (all 1); all_rewards: None
    (each group's own std), or every rank's rewards (B_all, J, K, G, R) for the global std. Returns (B, K, G).

    The full-SDE baseline passes J = 1 and K = 1 (one reward per trajectory) and gets (B, 1, G), which broadcasts
    over its trained steps.
    """
    if all_rewards is None:
        normalised = group_normalize(rewards, dim=3)  # A[m, g][i, k]: (B, J, K, G, R)
    else:
        normalised = global_normalize(rewards, all_rewards)  # (B, J, K, G, R)
    w = torch.ones(rewards.shape[-1]) if weights is None else torch.as_tensor(weights, dtype=torch.float32)
    summed = torch.einsum("bjkgr,r->bkg", normalised, w.to(normalised.device))  # sum_m w_m sum_g: (B, K, G)
    return summed.clamp(-adv_clip_max, adv_clip_max)


def step_credit(advantages: torch.Tensor, credit: str) -> torch.Tensor:
    """Which advantage each trained step gets, (B, K, G) -> (B, K, G). own: its own (the method); the bench's
    controls destroy that credit: mean, every step of member i gets the mean of its K advantages; rolled, step k
    gets step k + 1's (the last step the first's), the right values at the wrong steps."""
    if credit == "mean":
        return advantages.mean(1, keepdim=True).expand_as(advantages)
    if credit == "rolled":
        return advantages.roll(-1, dims=1)
    return advantages
