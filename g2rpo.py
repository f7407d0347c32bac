"""The clipped G2RPO policy update.

For every trained SDE step k in M, the policy's velocity at the step's start latent gives each member's
log-probability of its stored SDE sample x_{k+1}^i (the same `sde_step` formula the rollout used), and
(paper Eq. 8-9)
    r_i,k  = exp(log pi_theta(x_{k+1}^i | x_k) - log pi_old(x_{k+1}^i | x_k))
    L_k    = mean_i max(-A_i,k * r_i,k,  -A_i,k * clip(r_i,k, 1 - eps_clip, 1 + eps_clip))
    L      = mean_k L_k   (+ beta * mean_k KL_k, optional, off in the reference code)
In G2RPO every member of a prompt starts step k from the same anchor latent, so one forward per prompt (batch B,
not B*G) scores all G members; the full-SDE baseline has one start latent per member (S = G).

Shapes: B prompts, G group size, K SDE steps, S start latents per prompt (1 for G2RPO, G for full SDE).

The baselines' updates (docs/baselines.md) reuse this loop: a member may train only some of the steps
(`random_step_mask`, DanceGRPO), and the gradients may accumulate over chunks of members before an optimizer step.

Deviations from the reference code (numbers of the README's list): 14 (the baselines), 5 (one optimizer step per
k by default, or one
on the averaged objective), 8 (a non-finite gradient skips the optimizer step).
"""
import math

import torch

from sampler import sde_kl, sde_step


def clipped_loss(log_probs, old_log_probs, advantages, clip_range, weights=None):
    """PPO's clipped surrogate max(-A r, -A clip(r, 1 - eps, 1 + eps)), mean over members, or with `weights` (one
    per member) their weighted sum."""
    ratio = torch.exp(log_probs - old_log_probs)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * ratio.clamp(1 - clip_range, 1 + clip_range)
    pg_loss = torch.maximum(pg_loss1, pg_loss2)
    return pg_loss.mean() if weights is None else (pg_loss * weights).sum()


def step_loss_backward(velocity_fn, rollout, advantages, sigmas, ki, *, eta, clip_range, loss_scale, max_batch,
                       kl_beta=0.0, base_velocity_fn=None, sde_type="flow", kl_form="exact", weights=None,
                       sync_rows=None):
    """Loss of trained step `ki` over every member, back-propagated (times `loss_scale`) in micro-batches of start
    latents. advantages: (B, G). Returns this step's statistics as floats (None when no member trains it).

    weights: None (the loss is the mean over all B*G members), or (B, G), each member's weight in the loss (0: it
    does not train this step; a start latent none of whose members trains it is not forwarded). sync_rows(n): the
    number of start latents every rank forwards when this one has n (distributed runs must make the same calls).
    """
    k = rollout.sde_steps[ki]
    B, S, G = rollout.latents.shape[0], rollout.latents.shape[2], advantages.shape[1]
    members = G // S  # members scored by one forward
    start_latents = rollout.latents[:, ki].flatten(0, 1)  # (B*S, ...)
    targets = rollout.next_latents[:, ki].unflatten(1, (S, members)).flatten(0, 1)  # (B*S, G/S, ...)
    old_log_probs = rollout.old_log_probs[:, ki].reshape(B * S, members)  # (B*S, G/S)
    advantages = advantages.reshape(B * S, members)  # (B*S, G/S)
    prompt_index = torch.arange(B, device=start_latents.device).repeat_interleave(S)  # (B*S,)
    rows = torch.arange(B * S, device=start_latents.device)  # (B*S,) the start latents forwarded
    if weights is not None:
        weights = weights.reshape(B * S, members).to(start_latents.device)  # (B*S, G/S)
        active = weights.gt(0).any(1)  # (B*S,)
        count = int(active.sum()) if sync_rows is None else sync_rows(int(active.sum()))
        # the training rows, then (to match the other ranks' calls) rows of weight 0, which add no gradient
        rows = torch.cat([rows[active], rows[~active]])[:count].sort().values  # (count,)
    loss, kl, log_ratios = 0.0, 0.0, []
    for chunk in rows.split(max_batch) if len(rows) else []:
        chunk_size, x = len(chunk), start_latents[chunk]  # x: (chunk_size, ...)
        sigma = sigmas[k].expand(chunk_size).to(x.device)  # (chunk_size,)
        velocity = velocity_fn(x, sigma, prompt_index[chunk])  # (chunk_size, ...)
        # every member of a start latent is scored under the same velocity
        _, log_probs = sde_step(x.repeat_interleave(members, 0), velocity.repeat_interleave(members, 0),
                                sigmas, k, eta, next_latents=targets[chunk].flatten(0, 1),
                                sde_type=sde_type)  # (chunk_size * G/S,)
        log_probs = log_probs.view(chunk_size, members)  # (chunk_size, G/S)
        if weights is None:
            # the step's loss is a mean over all B*G members: each chunk weighs by its share
            share = chunk_size / (B * S)
            chunk_loss = clipped_loss(log_probs, old_log_probs[chunk], advantages[chunk], clip_range) * share
        else:
            chunk_loss = clipped_loss(log_probs, old_log_probs[chunk], advantages[chunk], clip_range, weights[chunk])
        if kl_beta > 0:  # KL to the base model's step (same std): |mean_theta - mean_ref|^2 / (2 std^2)
            with torch.no_grad():
                base = base_velocity_fn(x, sigma, prompt_index[chunk])  # (chunk_size, ...)
            row_kl = sde_kl(velocity, base, sigmas, k, eta, sde_type, kl_form)  # (chunk_size,)
            chunk_kl = row_kl.mean() * share if weights is None else (row_kl * weights[chunk].sum(1)).sum()
            chunk_loss = chunk_loss + kl_beta * chunk_kl
            kl += float(chunk_kl.detach())
        # backward even when the loss is not finite: its gradient is then not finite either, so the (all-reduced)
        # gradient norm skips the step on every rank alike, and DDP / FSDP collectives stay matched
        (chunk_loss * loss_scale).backward()
        loss += float(chunk_loss.detach())
        log_ratio = (log_probs - old_log_probs[chunk]).detach()  # (chunk_size, G/S)
        log_ratios.append(log_ratio.flatten() if weights is None else log_ratio[weights[chunk] > 0])
    log_ratio = torch.cat(log_ratios) if log_ratios else torch.empty(0)  # one value per trained member
    if log_ratio.numel() == 0:
        return None
    ratio = log_ratio.exp()
    return {"loss": loss, "kl": kl, "approx_kl": float(0.5 * (log_ratio**2).mean()),
            "clipfrac": float(((ratio - 1).abs() > clip_range).float().mean()),
            "ratio_mean": float(ratio.mean()), "ratio_max": float(ratio.max()), "ratio_min": float(ratio.min())}


def random_step_mask(generators, num_steps, group_size, fraction):
    """DanceGRPO's trained steps: each member trains its own int(fraction * K) of the K steps, drawn uniformly
    without replacement from its prompt's generator. Returns (B, K, G) bool."""
    count = int(fraction * num_steps)
    mask = torch.zeros(len(generators), num_steps, group_size, dtype=torch.bool)  # (B, K, G)
    for b, generator in enumerate(generators):
        for member in range(group_size):
            mask[b, torch.randperm(num_steps, generator=generator)[:count], member] = True
    return mask


def optimizer_step(params, optimizer, max_grad_norm):
    """Clip the gradient norm and step, unless the norm is not finite (then the parameters stay untouched).
    Returns the gradient norm before clipping."""
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    if math.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def g2rpo_update(velocity_fn, params, optimizer, rollout, advantages, sigmas, *, eta, clip_range, max_grad_norm,
                 step_per_sde_step=True, max_batch=64, kl_beta=0.0, base_velocity_fn=None, sde_type="flow",
                 kl_form="exact", train_mask=None, member_chunks=1, sync_rows=None, all_sum=None, world=1,
                 inner_epochs=1):
    """Policy update on one rollout. advantages: (B, K, G). Returns the statistics averaged over the trained steps:
    loss (the clipped objective plus beta * KL), kl, approx_kl, clipfrac, ratio_mean, ratio_max (the max),
    ratio_min (the min), grad_norm (over the steps taken), the counts optimizer_steps and skipped_steps, and
    first_ratio_error: max |r - 1| over the members of the first step scored, before any optimizer step, where the
    policy is still the rollout's and r is 1 up to rounding (nan where this rank scored none there).

    When the optimizer steps (the peers differ, docs/baselines.md):
      step_per_sde_step:        one step per trained step k, on the mean over its members (the G2RPO reference code);
      otherwise:                the gradients of every trained step accumulate; the G members of each group
                                split into `member_chunks` chunks, one step each (1: one step an iteration), on
                                the mean over its (member, step) pairs (DanceGRPO, Flow-GRPO, MixGRPO).
    train_mask: None (every member trains every step), or (B, K, G) bool, the steps each member trains (DanceGRPO's
    random subset per member). sync_rows: see `step_loss_backward`. all_sum(n): the sum of n over the `world`
    ranks, so that a mean over (member, step) pairs is over every rank's pairs (DDP then averages the gradients).
    inner_epochs: passes over the rollout (PPO's epochs; 1 in the reference); a pass after the first scores the
    rollout under the policy the previous one left, so its ratios move off 1 and the clip bounds how far.
    """
    B, K, G = advantages.shape
    options = dict(eta=eta, clip_range=clip_range, max_batch=max_batch, kl_beta=kl_beta,
                   base_velocity_fn=base_velocity_fn, sde_type=sde_type, kl_form=kl_form)
    per_step, grad_norms = [], []
    optimizer.zero_grad(set_to_none=True)
    chunks = torch.arange(G).tensor_split(1 if step_per_sde_step else member_chunks)  # member indices, (G/C,) each
    weighted = train_mask is not None or len(chunks) > 1
    all_sum = all_sum or (lambda n: n)
    mask = torch.ones(B, K, G, dtype=torch.bool) if train_mask is None else train_mask.cpu()  # (B, K, G)
    for _ in range(inner_epochs):
        if not weighted:
            for ki in range(K):
                # L = mean_k L_k: each step's gradient is scaled by 1/K when one optimizer step takes them all
                per_step.append(step_loss_backward(
                    velocity_fn, rollout, advantages[:, ki], sigmas, ki,
                    loss_scale=1.0 if step_per_sde_step else 1.0 / K, **options))
                if step_per_sde_step or ki == K - 1:
                    grad_norms.append(optimizer_step(params, optimizer, max_grad_norm))
        else:
            for members in chunks:
                in_chunk = torch.zeros(G, dtype=torch.bool)  # (G,)
                in_chunk[members] = True
                pairs = mask & in_chunk  # (B, K, G): the (member, step) pairs of this optimizer step (or steps)
                chunk_pairs = all_sum(int(pairs.sum()))  # on every rank
                for ki in range(K):
                    # L = sum over the step's pairs of l / n: the mean over every rank's pairs of one optimizer
                    # step, over step k's, or over the chunk's of every k (times `world`: DDP divides the summed
                    # gradient by it)
                    total = all_sum(int(pairs[:, ki].sum())) if step_per_sde_step else chunk_pairs
                    if total == 0:  # no rank trains this step: no forward, no optimizer step
                        continue
                    weights = pairs[:, ki].float() * world / total  # (B, G)
                    per_step.append(step_loss_backward(velocity_fn, rollout, advantages[:, ki], sigmas, ki,
                                                       loss_scale=1.0, weights=weights, sync_rows=sync_rows,
                                                       **options))
                    if step_per_sde_step or ki == K - 1:
                        grad_norms.append(optimizer_step(params, optimizer, max_grad_norm))
    first = per_step[0] if per_step else None  # scored before the first optimizer step
    per_step = [s for s in per_step if s is not None]  # (steps no member of this rank trains give None)
    if not per_step:
        per_step = [dict(loss=0.0, kl=0.0, approx_kl=0.0, clipfrac=0.0, ratio_mean=1.0, ratio_max=1.0, ratio_min=1.0)]
    stats = {name: sum(s[name] for s in per_step) / len(per_step) for name in per_step[0]}
    if weighted and grad_norms:  # each entry holds its share of an optimizer step's objective: the mean objective
        stats.update({name: sum(s[name] for s in per_step) / len(grad_norms) for name in ("loss", "kl")})
    stats["ratio_max"] = max(s["ratio_max"] for s in per_step)
    stats["ratio_min"] = min(s["ratio_min"] for s in per_step)
    stats["first_ratio_error"] = (max(first["ratio_max"] - 1, 1 - first["ratio_min"]) if first is not None
                                  else float("nan"))
    taken = [g for g in grad_norms if math.isfinite(g)]
    stats["grad_norm"] = sum(taken) / len(taken) if taken else float("nan")
    stats["optimizer_steps"], stats["skipped_steps"] = len(taken), len(grad_norms) - len(taken)
    return stats


def update_loss(velocity_fn, rollout, sigmas, eta, advantages=None, sde_type="flow"):
    """The update's loss for the first prompt at its first trained step, as a closure for `check_gradient`: one
    forward scores the members of the first start latent, through `g2rpo.clipped_loss` without its clip (at the
    first step r = 1, where the clip's mask flips on ratio differences of 1e-4, which the math kernel's
    rounding alone makes). advantages: (B, K, G), or None for ones: then the gradient is the log-likelihood's, which
    no advantage can zero (a run's first group may have equal rewards). It draws no random numbers, so it can run
    under each kernel in turn."""
    k = rollout.sde_steps[0]
    members = rollout.next_latents.shape[2] // rollout.latents.shape[2]  # G (G2RPO) or 1 (full SDE)
    start, targets = rollout.latents[:1, 0, 0], rollout.next_latents[0, 0, :members]  # (1, ...), (G/S, ...)
    index = torch.zeros(1, dtype=torch.long, device=start.device)
    weights = torch.ones(1, members) if advantages is None else advantages[:1, 0, :members]  # (1, G/S)

    def loss_fn():
        velocity = velocity_fn(start, sigmas[k].expand(1).to(start.device), index)  # (1, ...)
        shape = (members, *start.shape[1:])
        _, log_probs = sde_step(start.expand(shape), velocity.expand(shape), sigmas, k, eta,
                                next_latents=targets, sde_type=sde_type)  # (G/S,)
        return clipped_loss(log_probs[None], rollout.old_log_probs[:1, 0, :members],
                            weights.to(log_probs.device), float("inf"))
    return loss_fn
