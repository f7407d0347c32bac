"""The clipped G2RPO policy update.

For every trained SDE step k in M, the policy's velocity at the step's start latent gives each member's
log-probability of its stored SDE sample x_{k+1}^i (the same `sde_step` formula the rollout used), and
    r_i,k  = exp(log pi_theta(x_{k+1}^i | x_k) - log pi_old(x_{k+1}^i | x_k))
    L_k    = mean_i max(-A_i,k * r_i,k,  -A_i,k * clip(r_i,k, 1 - eps_clip, 1 + eps_clip))      (paper Eq. 8-9)
with A clamped to +-adv_clip_max. In G2RPO every member of a prompt starts step k from the same anchor latent,
so one forward per prompt (batch B, not B*G) scores all G members; the full-SDE baseline has one start latent
per member. There is no KL term (as in the reference).

Shapes: B prompts, G group size, K SDE steps, S start latents per prompt (1 for G2RPO, G for full SDE).

Deviations from the reference code:
  1. `step_per_sde_step=False` takes one optimizer step on the loss averaged over k (the paper's objective);
     the default `True` takes one step per k, as the reference scripts do (8 optimizer steps per iteration).
  2. The shared-latent forward is computed once per prompt, not once per member.
  3. A non-finite gradient norm (which a non-finite loss gives) skips the optimizer step (the parameters stay
     untouched) and is counted.
"""
import torch

from sampler import sde_step


def clipped_loss(log_probs, old_log_probs, advantages, clip_range, adv_clip_max):
    """mean( max(-A r, -A clip(r, 1 - clip_range, 1 + clip_range)) ), r = exp(log_probs - old_log_probs)."""
    a = advantages.clamp(-adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_probs - old_log_probs)
    return torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip_range, 1 + clip_range)).mean()


def g2rpo_update(velocity_fn, params, optimizer, rollout, advantages, sigmas, eta, clip_range, adv_clip_max,
                 max_grad_norm, step_per_sde_step=True, max_batch=64):
    """Policy update on one rollout. advantages: (B, K, G). Returns a dict of statistics (floats)."""
    B, K, G = advantages.shape
    S = rollout.latents.shape[2]
    per_sample = G // S  # members scored by one forward
    terms = B * G * (1 if step_per_sde_step else K)  # the loss is a mean over this many (member, step) terms
    stats = {"loss": 0.0, "approx_kl": 0.0, "clipfrac": 0.0, "ratio_mean": 0.0, "ratio_max": 0.0,
             "grad_norm": 0.0, "skipped_steps": 0, "optimizer_steps": 0}

    def finish_step():
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        if torch.isfinite(grad_norm):
            optimizer.step()
            stats["optimizer_steps"] += 1
            stats["grad_norm"] += float(grad_norm) / (K if step_per_sde_step else 1)
        else:
            stats["skipped_steps"] += 1
        optimizer.zero_grad(set_to_none=True)

    optimizer.zero_grad(set_to_none=True)
    for ki, k in enumerate(rollout.sde_steps):
        start = rollout.latents[:, ki].flatten(0, 1)  # (B*S, ...)
        targets = rollout.next_latents[:, ki].reshape(B * S, per_sample, *start.shape[1:])  # (B*S, G/S, ...)
        old = rollout.old_log_probs[:, ki].reshape(B * S, per_sample)  # (B*S, G/S)
        adv = advantages[:, ki].reshape(B * S, per_sample)  # (B*S, G/S)
        prompt_index = torch.arange(B, device=start.device).repeat_interleave(S)  # (B*S,)
        for c in range(0, B * S, max_batch):
            sl = slice(c, c + max_batch)
            n = start[sl].shape[0]
            sigma = sigmas[k].expand(n).to(start.device)
            velocity = velocity_fn(start[sl], sigma, prompt_index[sl])  # (n, ...)
            # every member of a sample is scored under the same velocity: repeat it per member
            _, log_probs = sde_step(start[sl].repeat_interleave(per_sample, 0),
                                    velocity.repeat_interleave(per_sample, 0), sigmas, k, eta,
                                    next_latents=targets[sl].flatten(0, 1))
            log_probs = log_probs.view(n, per_sample)  # (n, G/S)
            loss = clipped_loss(log_probs, old[sl], adv[sl], clip_range, adv_clip_max) * (n * per_sample / terms)
            # backward even when the loss is not finite: its gradient is then not finite either, so the (all-reduced)
            # gradient norm skips the step on every rank alike, and DDP / FSDP collectives stay matched
            loss.backward()
            with torch.no_grad():
                log_ratio = log_probs - old[sl]
                ratio = log_ratio.exp()
                w = n * per_sample / (B * G * K)
                stats["loss"] += float(loss) * (1 if step_per_sde_step else K) / K
                stats["approx_kl"] += float(0.5 * (log_ratio**2).mean()) * w
                stats["clipfrac"] += float(((ratio - 1).abs() > clip_range).float().mean()) * w
                stats["ratio_mean"] += float(ratio.mean()) * w
                stats["ratio_max"] = max(stats["ratio_max"], float(ratio.max()))
        if step_per_sde_step:
            finish_step()
    if not step_per_sde_step:
        finish_step()
    return stats
