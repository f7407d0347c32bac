"""The clipped G2RPO policy update.

For every trained SDE step k in M, the policy's velocity at the step's start latent gives each member's
log-probability of its stored SDE sample x_{k+1}^i (the same `sde_step` formula the rollout used), and
(paper Eq. 8-9)
    r_i,k  = exp(log pi_theta(x_{k+1}^i | x_k) - log pi_old(x_{k+1}^i | x_k))
    L_k    = mean_i max(-A_i,k * r_i,k,  -A_i,k * clip(r_i,k, 1 - eps_clip, 1 + eps_clip))
    L      = mean_k L_k   (+ beta * mean_k KL_k, optional, off in the reference)
In G2RPO every member of a prompt starts step k from the same anchor latent, so one forward per prompt (batch B,
not B*G) scores all G members; the full-SDE baseline has one start latent per member (S = G).

Shapes: B prompts, G group size, K SDE steps, S start latents per prompt (1 for G2RPO, G for full SDE).

Deviations from the reference code (numbers of the README's list): 5 (one optimizer step per k by default, or one
on the averaged objective), 8 (a non-finite gradient skips the optimizer step).
"""
import math

import torch

from sampler import sde_kl, sde_step


def clipped_loss(log_probs, old_log_probs, advantages, clip_range):
    """PPO's clipped surrogate, mean over members: max(-A r, -A clip(r, 1 - eps, 1 + eps))."""
    ratio = torch.exp(log_probs - old_log_probs)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * ratio.clamp(1 - clip_range, 1 + clip_range)
    return torch.maximum(pg_loss1, pg_loss2).mean()


def step_loss_backward(velocity_fn, rollout, advantages, sigmas, ki, *, eta, clip_range, loss_scale, max_batch,
                       kl_beta=0.0, reference_velocity_fn=None):
    """Loss of trained step `ki` over every member, back-propagated (times `loss_scale`) in micro-batches of start
    latents. advantages: (B, G). Returns this step's statistics as floats."""
    k = rollout.sde_steps[ki]
    B, S, G = rollout.latents.shape[0], rollout.latents.shape[2], advantages.shape[1]
    members = G // S  # members scored by one forward
    start_latents = rollout.latents[:, ki].flatten(0, 1)  # (B*S, ...)
    targets = rollout.next_latents[:, ki].unflatten(1, (S, members)).flatten(0, 1)  # (B*S, G/S, ...)
    old_log_probs = rollout.old_log_probs[:, ki].reshape(B * S, members)  # (B*S, G/S)
    advantages = advantages.reshape(B * S, members)  # (B*S, G/S)
    prompt_index = torch.arange(B, device=start_latents.device).repeat_interleave(S)  # (B*S,)
    loss, kl, log_ratios = 0.0, 0.0, []
    for chunk in torch.arange(B * S, device=start_latents.device).split(max_batch):
        chunk_size, x = len(chunk), start_latents[chunk]  # x: (chunk_size, ...)
        sigma = sigmas[k].expand(chunk_size).to(x.device)  # (chunk_size,)
        velocity = velocity_fn(x, sigma, prompt_index[chunk])  # (chunk_size, ...)
        # every member of a start latent is scored under the same velocity
        _, log_probs = sde_step(x.repeat_interleave(members, 0), velocity.repeat_interleave(members, 0),
                                sigmas, k, eta, next_latents=targets[chunk].flatten(0, 1))  # (chunk_size * G/S,)
        log_probs = log_probs.view(chunk_size, members)  # (chunk_size, G/S)
        # the step's loss is a mean over all B*G members: each chunk weighs by its share
        share = chunk_size / (B * S)
        chunk_loss = clipped_loss(log_probs, old_log_probs[chunk], advantages[chunk], clip_range) * share
        if kl_beta > 0:  # KL to the base model's step (same std): |mean_theta - mean_ref|^2 / (2 std^2)
            with torch.no_grad():
                reference = reference_velocity_fn(x, sigma, prompt_index[chunk])  # (chunk_size, ...)
            chunk_kl = sde_kl(velocity, reference, sigmas, k, eta).mean() * share
            chunk_loss = chunk_loss + kl_beta * chunk_kl
            kl += float(chunk_kl.detach())
        # backward even when the loss is not finite: its gradient is then not finite either, so the (all-reduced)
        # gradient norm skips the step on every rank alike, and DDP / FSDP collectives stay matched
        (chunk_loss * loss_scale).backward()
        loss += float(chunk_loss.detach())
        log_ratios.append((log_probs - old_log_probs[chunk]).detach())
    log_ratio = torch.cat(log_ratios)  # (B*S, G/S): one value per member
    ratio = log_ratio.exp()
    return {"loss": loss, "kl": kl, "approx_kl": float(0.5 * (log_ratio**2).mean()),
            "clipfrac": float(((ratio - 1).abs() > clip_range).float().mean()),
            "ratio_mean": float(ratio.mean()), "ratio_max": float(ratio.max())}


def optimizer_step(params, optimizer, max_grad_norm):
    """Clip the gradient norm and step, unless the norm is not finite (then the parameters stay untouched).
    Returns the gradient norm before clipping."""
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_grad_norm))
    if math.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def g2rpo_update(velocity_fn, params, optimizer, rollout, advantages, sigmas, *, eta, clip_range, max_grad_norm,
                 step_per_sde_step=True, max_batch=64, kl_beta=0.0, reference_velocity_fn=None):
    """Policy update on one rollout. advantages: (B, K, G). Returns the statistics averaged over the trained steps:
    loss (the clipped objective plus beta * KL), kl, approx_kl, clipfrac, ratio_mean, ratio_max (the max),
    grad_norm (over the steps taken), and the counts optimizer_steps and skipped_steps."""
    K = advantages.shape[1]
    per_step, grad_norms = [], []
    optimizer.zero_grad(set_to_none=True)
    for ki in range(K):
        # L = mean_k L_k: each step's gradient is scaled by 1/K when one optimizer step takes them all
        per_step.append(step_loss_backward(
            velocity_fn, rollout, advantages[:, ki], sigmas, ki, eta=eta, clip_range=clip_range,
            loss_scale=1.0 if step_per_sde_step else 1.0 / K, max_batch=max_batch, kl_beta=kl_beta,
            reference_velocity_fn=reference_velocity_fn))
        if step_per_sde_step or ki == K - 1:
            grad_norms.append(optimizer_step(params, optimizer, max_grad_norm))
    stats = {name: sum(s[name] for s in per_step) / K for name in per_step[0]}
    stats["ratio_max"] = max(s["ratio_max"] for s in per_step)
    taken = [g for g in grad_norms if math.isfinite(g)]
    stats["grad_norm"] = sum(taken) / len(taken) if taken else float("nan")
    stats["optimizer_steps"], stats["skipped_steps"] = len(taken), len(grad_norms) - len(taken)
    return stats
