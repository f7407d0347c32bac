"""G2RPO: the clipped policy update, and the method as train.py runs it (rollout -> advantages -> update).

For every trained SDE step k in M, the policy's velocity at the step's start latent gives each member's
log-probability of its stored SDE sample x_{k+1}^i (the same `sampler.sde_step` formula the rollout used), and
(paper Eq. 8-9)
    r_i,k  = exp(log pi_theta(x_{k+1}^i | x_k) - log pi_old(x_{k+1}^i | x_k))
    L_k    = mean_i max(-A_i,k * r_i,k,  -A_i,k * clip(r_i,k, 1 - eps_clip, 1 + eps_clip))
    L      = mean_k L_k   (+ beta * mean_k KL_k, optional, off in the reference code)
Every member of a prompt starts step k from the same anchor latent, so one forward per prompt (batch B, not B*G)
scores all G members.

`G2RPO` is the method: its hyperparameters (its own flags, and the run's flags it reads) and its three steps. Every
other method (methods/) is a class with the same interface (methods/__init__.py lists it); each builds on the
primitives here (`clipped_loss`, `step_loss_backward`, `optimizer_step`, `update_stats`) and in sampler.py and
advantage.py. `step_loss_backward` also takes per-member weights and start latents of their own (S = G) for the
methods whose members have their own trajectories; G2RPO passes neither.

Shapes: B prompts, G group size, K SDE steps, S start latents per prompt (1 here: the anchor; G for methods whose
members have their own trajectories).

Deviations from the reference code (numbers of the README's list): 5 (one optimizer step per k by default, or one
on the averaged objective), 8 (a non-finite gradient skips the optimizer step).
"""
import math
from dataclasses import dataclass, field

import torch

from advantage import granular_advantages
from sampler import granular_schedule, rollout_g2rpo, sde_kl, sde_std_dev, sde_step


def clipped_loss(log_probs, old_log_probs, advantages, clip_range, weights=None):
    """PPO's clipped surrogate max(-A r, -A clip(r, 1 - eps, 1 + eps)), mean over members, or with `weights` (one
    per member) their weighted sum."""
    ratio = torch.exp(log_probs - old_log_probs)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * ratio.clamp(1 - clip_range, 1 + clip_range)
    pg_loss = torch.maximum(pg_loss1, pg_loss2)
    return pg_loss.mean() if weights is None else (pg_loss * weights).sum()


def member_log_probs(step_fn, start_latents, velocity, targets, sigmas, k):
    """The log-probability of each stored sample under the step from its start latent: start_latents (n, ...) and
    their velocity (n, ...), targets (n, M, ...), the M members that left each start latent. Returns (n, M)."""
    n, members = targets.shape[:2]
    _, log_probs = step_fn(start_latents.repeat_interleave(members, 0), velocity.repeat_interleave(members, 0),
                           sigmas, k, next_latents=targets.flatten(0, 1))  # (n * M,)
    return log_probs.view(n, members)  # (n, M)


def step_loss_backward(velocity_fn, rollout, advantages, sigmas, ki, *, step_fn, clip_range, max_batch,
                       loss_scale=1.0, kl_beta=0.0, base_velocity_fn=None, kl_fn=None, weights=None, sync_rows=None):
    """Loss of trained step `ki` over every member, back-propagated (times `loss_scale`) in micro-batches of at most
    `max_batch` start latents. advantages: (B, G). step_fn(latents, velocity, sigmas, k, next_latents=...) scores a
    stored step (`sampler.sde_step` at the method's eta); kl_fn(velocity, base_velocity, sigmas, k) -> (n,) is the
    step's KL to the base model, whose velocity `base_velocity_fn` gives (used when kl_beta > 0). Returns this
    step's statistics as floats (None when no member trains it).

    weights: None (the loss is the mean over all B*G members), or (B, G), each member's weight in the loss (0: it
    does not train this step; a start latent none of whose members trains it is not forwarded). sync_rows(n): the
    number of start latents every rank forwards when this one has n (distributed runs must make the same calls).
    """
    k = rollout.sde_steps[ki]
    B, S, G = rollout.start_latents.shape[0], rollout.start_latents.shape[2], advantages.shape[1]
    members = G // S  # members scored by one forward
    start_latents = rollout.start_latents[:, ki].flatten(0, 1)  # (B*S, ...)
    targets = rollout.next_latents[:, ki].unflatten(1, (S, members)).flatten(0, 1)  # (B*S, G/S, ...)
    old_log_probs = rollout.old_log_probs[:, ki].reshape(B * S, members)  # (B*S, G/S)
    advantages = advantages.reshape(B * S, members)  # (B*S, G/S)
    prompt_index = torch.arange(B, device=start_latents.device).repeat_interleave(S)  # (B*S,)
    if weights is not None:
        weights = weights.reshape(B * S, members).to(start_latents.device)  # (B*S, G/S)
    rows = forwarded_rows(B * S, weights, sync_rows, start_latents.device)  # the start latents forwarded
    loss, kl, log_ratios = 0.0, 0.0, []
    for micro_batch in rows.split(max_batch) if len(rows) else []:
        n, x = len(micro_batch), start_latents[micro_batch]  # x: (n, ...)
        sigma = sigmas[k].expand(n).to(x.device)  # (n,)
        velocity = velocity_fn(x, sigma, prompt_index[micro_batch])  # (n, ...)
        # every member of a start latent is scored under the same velocity
        log_probs = member_log_probs(step_fn, x, velocity, targets[micro_batch], sigmas, k)  # (n, G/S)
        if weights is None:
            # the step's loss is a mean over all B*G members: each micro-batch weighs by its share
            share = n / (B * S)
            batch_loss = clipped_loss(log_probs, old_log_probs[micro_batch], advantages[micro_batch],
                                      clip_range) * share
        else:
            batch_loss = clipped_loss(log_probs, old_log_probs[micro_batch], advantages[micro_batch], clip_range,
                                      weights[micro_batch])
        if kl_beta > 0:  # KL to the base model's step (same std): |mean_theta - mean_ref|^2 / (2 std^2)
            with torch.no_grad():
                base = base_velocity_fn(x, sigma, prompt_index[micro_batch])  # (n, ...)
            row_kl = kl_fn(velocity, base, sigmas, k)  # (n,)
            batch_kl = row_kl.mean() * share if weights is None else (row_kl * weights[micro_batch].sum(1)).sum()
            batch_loss = batch_loss + kl_beta * batch_kl
            kl += float(batch_kl.detach())
        # backward even when the loss is not finite: its gradient is then not finite either, so the (all-reduced)
        # gradient norm skips the step on every rank alike, and DDP / FSDP collectives stay matched
        (batch_loss * loss_scale).backward()
        loss += float(batch_loss.detach())
        log_ratio = (log_probs - old_log_probs[micro_batch]).detach()  # (n, G/S)
        log_ratios.append(log_ratio.flatten() if weights is None else log_ratio[weights[micro_batch] > 0])
    log_ratio = torch.cat(log_ratios) if log_ratios else torch.empty(0)  # one value per trained member
    return None if log_ratio.numel() == 0 else {"loss": loss, "kl": kl, **ratio_stats(log_ratio, clip_range)}


def forwarded_rows(n, weights, sync_rows, device):
    """The start latents a step forwards, of its n: all of them, or those with a member of weight > 0 (weights
    (n, M)), topped up to `sync_rows`' count with rows of weight 0, which add no gradient, so that every rank makes
    the same calls."""
    rows = torch.arange(n, device=device)  # (n,)
    if weights is None:
        return rows
    active = weights.gt(0).any(1)  # (n,)
    count = int(active.sum()) if sync_rows is None else sync_rows(int(active.sum()))
    return torch.cat([rows[active], rows[~active]])[:count].sort().values  # (count,)


def ratio_stats(log_ratio, clip_range):
    """What the ratios r = exp(log_ratio) of the trained members say: approx_kl = mean (log r)^2 / 2, the share
    clipped, and their mean, max and min."""
    ratio = log_ratio.exp()
    return {"approx_kl": float(0.5 * (log_ratio**2).mean()),
            "clipfrac": float(((ratio - 1).abs() > clip_range).float().mean()),
            "ratio_mean": float(ratio.mean()), "ratio_max": float(ratio.max()), "ratio_min": float(ratio.min())}


def optimizer_step(params, optimizer, max_grad_norm):
    """Clip the gradient norm and step, unless the norm is not finite (then the parameters stay untouched).
    Returns the gradient norm before clipping."""
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    if math.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def update_stats(per_step, grad_norms, per_optimizer_step=False):
    """An update's statistics from its steps' (`step_loss_backward`, in order) and its gradient norms: each
    averaged over the trained steps (loss and kl: over the optimizer steps when `per_optimizer_step`, where each
    entry holds its share of one optimizer step's objective), ratio_max the max, ratio_min the min, grad_norm over
    the steps taken, the counts optimizer_steps and skipped_steps, and first_ratio_error: max |r - 1| over the
    members of the first step scored, before any optimizer step, where the policy is still the rollout's and r is
    1 up to rounding (nan where this rank scored none there)."""
    first = per_step[0] if per_step else None  # scored before the first optimizer step
    per_step = [s for s in per_step if s is not None]  # (steps no member of this rank trains give None)
    if not per_step:
        per_step = [dict(loss=0.0, kl=0.0, approx_kl=0.0, clipfrac=0.0, ratio_mean=1.0, ratio_max=1.0, ratio_min=1.0)]
    stats = {name: sum(s[name] for s in per_step) / len(per_step) for name in per_step[0]}
    if per_optimizer_step and grad_norms:
        stats.update({name: sum(s[name] for s in per_step) / len(grad_norms) for name in ("loss", "kl")})
    stats["ratio_max"] = max(s["ratio_max"] for s in per_step)
    stats["ratio_min"] = min(s["ratio_min"] for s in per_step)
    stats["first_ratio_error"] = (max(first["ratio_max"] - 1, 1 - first["ratio_min"]) if first is not None
                                  else float("nan"))
    taken = [g for g in grad_norms if math.isfinite(g)]
    stats["grad_norm"] = sum(taken) / len(taken) if taken else float("nan")
    stats["optimizer_steps"], stats["skipped_steps"] = len(taken), len(grad_norms) - len(taken)
    return stats


@dataclass
class G2RPO:
    """G2RPO (arXiv 2510.01982): singular stochastic sampling, multi-granularity advantages, the clipped update.

    The fields are the values the method reads: the run's flags (lab/flags.py documents them), then its own, which
    train.py adds to its command line under --method g2rpo (their docstrings are the flags' help).
    """

    sde_steps: list[int]
    group_size: int
    eta: float
    clip_range: float
    adv_clip_max: float
    max_grad_norm: float
    max_batch: int
    inner_epochs: int
    kl_beta: float
    # --- its own flags ---
    granularities: list[int] = field(default_factory=lambda: [1, 2, 3])
    """Lambda, ODE strides of the completions (paper {1, 2, 3}; released scripts {1, 2}); {1} ablates them."""
    step_per_sde_step: bool = True
    """One optimizer step per trained step k (the G2RPO reference scripts); False: the gradients of every trained
    step accumulate into one optimizer step an iteration (the paper's objective averaged over k)."""

    same_noise = True  # the G members of a prompt share x_T (their SDE steps branch off one anchor)
    per_step_advantages = True  # each trained step has its own advantage (--step-credit can move them)
    recipe, flux, per_steps = {}, {}, {}  # G2RPO's values are the flags' defaults (lab/flags.py, TrainArgs)

    def problem(self, num_steps):
        """Why these values cannot run, in one line, or None."""
        if not self.granularities or min(self.granularities) < 1 or \
                len(set(self.granularities)) != len(self.granularities):
            return f"--granularities {self.granularities}: give distinct strides >= 1, e.g. --granularities 1 2 3"
        return None

    def notes(self, sigmas):
        """Granularities whose schedules coincide at a step give the same completion, so its reward counts several
        times in the advantage (as in the reference code): a line for each, rather than silence."""
        lines = []
        for k in self.sde_steps:
            seen = {}
            for g in self.granularities:
                seen.setdefault(tuple(granular_schedule(sigmas, k, g).tolist()), []).append(g)
            lines += [f"note: at SDE step {k} the granularities {same} give the same completion; its reward counts "
                      f"{len(same)} times in the advantage (as in the reference code)"
                      for same in seen.values() if len(same) > 1]
        return lines

    # ALGO LOGIC: the three steps of an iteration, and the SDE step they share
    def step(self, latents, velocity, sigmas, i, noise=None, next_latents=None):
        """The SDE step of the rollout, and of the update's re-scoring (`sampler.sde_step` at this eta)."""
        return sde_step(latents, velocity, sigmas, i, self.eta, noise, next_latents)

    def kl(self, velocity, base_velocity, sigmas, i):
        """The step's KL to the base model (`sampler.sde_kl`), per sample: (n,)."""
        return sde_kl(velocity, base_velocity, sigmas, i, sde_std_dev(sigmas, i, self.eta))

    def trained_steps(self, iteration):
        """M, the same every iteration."""
        return self.sde_steps

    def rollout(self, velocity_fn, noise, sigmas, generators, steps, image_only_fn=None):
        """The anchor, one SDE step per member at each k of `steps`, the multi-granularity completions
        (`sampler.rollout_g2rpo`). noise: (B, ...) one x_T per prompt."""
        return rollout_g2rpo(velocity_fn, noise, sigmas, generators, group_size=self.group_size, sde_steps=steps,
                             granularities=self.granularities, eta=self.eta, max_batch=self.max_batch,
                             image_only_fn=image_only_fn)

    def advantages(self, scores, weights, ranks=None):
        """scores: (B, J, K, G, R) -> A[i, k] (B, K, G): each (reward, granularity, step) normalised in its group,
        summed with the reward weights (R,), clamped (`advantage.granular_advantages`)."""
        return granular_advantages(scores, adv_clip_max=self.adv_clip_max, weights=weights)

    def optimizer_steps(self, num_trained_steps):
        """The optimizer steps of one update over K trained steps."""
        return self.inner_epochs * (num_trained_steps if self.step_per_sde_step else 1)

    def update(self, velocity_fn, params, optimizer, rollout, advantages, sigmas, generators=None,
               base_velocity_fn=None, ranks=None):
        """The clipped update on one rollout. advantages: (B, K, G). base_velocity_fn: the base model's velocity,
        for the KL term (kl_beta > 0). An inner epoch after the first scores the rollout under the policy the last
        one left, so its ratios move off 1 and the clip bounds how far. Returns `update_stats`."""
        K = advantages.shape[1]
        per_step, grad_norms = [], []
        optimizer.zero_grad(set_to_none=True)
        for _ in range(self.inner_epochs):
            for ki in range(K):
                # L = mean_k L_k: each step's gradient is scaled by 1/K when one optimizer step takes them all
                per_step.append(step_loss_backward(
                    velocity_fn, rollout, advantages[:, ki], sigmas, ki, step_fn=self.step,
                    clip_range=self.clip_range, max_batch=self.max_batch,
                    loss_scale=1.0 if self.step_per_sde_step else 1.0 / K, kl_beta=self.kl_beta,
                    base_velocity_fn=base_velocity_fn, kl_fn=self.kl))
                if self.step_per_sde_step or ki == K - 1:
                    grad_norms.append(optimizer_step(params, optimizer, self.max_grad_norm))
        return update_stats(per_step, grad_norms)


def update_loss(velocity_fn, rollout, sigmas, step_fn, advantages=None):
    """The update's loss for the first prompt at its first trained step, as a closure for the gradient self-check
    (lab/kernels.py): one forward scores the members of the first start latent, through `clipped_loss` without
    its clip (at the first step r = 1, where the clip's mask flips on ratio differences of 1e-4, which the math
    kernel's rounding alone makes). advantages: (B, K, G), or None for ones: then the gradient is the
    log-likelihood's, which no advantage can zero (a run's first group may have equal rewards). It draws no random
    numbers, so it can run under each kernel in turn."""
    k = rollout.sde_steps[0]
    members = rollout.next_latents.shape[2] // rollout.start_latents.shape[2]  # G, or 1 (one start per member)
    start = rollout.start_latents[:1, 0, 0]  # (1, ...)
    targets = rollout.next_latents[:1, 0, :members]  # (1, G/S, ...)
    index = torch.zeros(1, dtype=torch.long, device=start.device)
    weights = torch.ones(1, members) if advantages is None else advantages[:1, 0, :members]  # (1, G/S)

    def loss_fn():
        velocity = velocity_fn(start, sigmas[k].expand(1).to(start.device), index)  # (1, ...)
        log_probs = member_log_probs(step_fn, start, velocity, targets, sigmas, k)  # (1, G/S)
        return clipped_loss(log_probs, rollout.old_log_probs[:1, 0, :members], weights.to(log_probs.device),
                            float("inf"))
    return loss_fn
