"""Whole trajectories: the rollout and the update that the peers share (DanceGRPO, Flow-GRPO, Flow-GRPO-Fast,
MixGRPO, Flow-DPPO, and G2RPO's full-SDE ablation).

Where G2RPO branches its G members off one ODE anchor, these methods sample G whole trajectories per prompt, SDE
steps on every step (DanceGRPO, Flow-GRPO) or only inside a window of steps with ODE steps elsewhere (MixGRPO,
Flow-GRPO-Fast). A trajectory's image gets one reward, and its advantage is broadcast to every step it trains.
Each member has its own start latent at each trained step, so the update forwards B*G latents a step (S = G in
`g2rpo.step_loss_backward`), where G2RPO's forwards B.

Their update accumulates the gradient over the trained steps and splits the members of each group into chunks,
one optimizer step each (`accumulated_update`); DanceGRPO further trains each member on its own random share of
the steps (`train_mask`), so each member has a weight in each step's loss (`weighted_step_loss_backward`).

Shapes: B prompts, G group size, K trained steps, (...) the latent.
"""
import torch

from g2rpo import clipped_loss
from methods.base import optimizer_step, ratio_stats, step_backward, update_stats
from sampler import CountingVelocity, Rollout, prompt_noise, sde_step


def all_but_last(num_steps: int) -> list:
    """Steps 0..N-2: DanceGRPO and Flow-GRPO never train the step into sigma = 0."""
    return list(range(num_steps - 1))


@torch.no_grad()
def rollout_trajectories(velocity_fn, noise, sigmas, generators, *, group_size, sde_steps, step_fn, max_batch,
                         ode_elsewhere=False, per_member_noise=False, x0_image=False, image_only_fn=None,
                         mean_fn=None):
    """G trajectories per prompt: an SDE step (`step_fn`) on every step, or only on `sde_steps` when
    `ode_elsewhere`; keeps the start latent, the sample and its log-prob at each step of `sde_steps`.

    sde_steps: the trained steps (all SDE, and with `ode_elsewhere` the only SDE ones). noise: (B, ...) one initial
    noise per prompt, shared by its members, or with `per_member_noise` (B, G, ...), one per member. From a shared
    noise the members are identical until their first SDE step, so the steps before it run
    once per prompt. x0_image: the image is decoded from the x0_hat = x - sigma v of the last step rather than from
    its sample (DanceGRPO; the same latent when that step is ODE). image_only_fn: the velocity of the steps
    outside `sde_steps` (default `velocity_fn`). mean_fn(x, v, sigmas, i) -> (mean, std): given, each trained step's
    Gaussian mean is kept too (`Rollout.old_means`).
    """
    B, G, device = noise.shape[0], group_size, noise.device
    shape = noise.shape[2:] if per_member_noise else noise.shape[1:]
    forward, image_forward = CountingVelocity.pair(velocity_fn, image_only_fn, max_batch)
    # (B, ...) while the members are still one latent, then (B*G, ...)
    x, trained = (noise.flatten(0, 1) if per_member_noise else noise).float(), {}
    for i in range(len(sigmas) - 1):
        stochastic = i in sde_steps or not ode_elsewhere
        if stochastic and x.shape[0] == B:  # the members part at their first SDE step
            x = x.repeat_interleave(G, dim=0)  # (B*G, ...)
        index = torch.arange(B, device=device).repeat_interleave(x.shape[0] // B)  # (B or B*G,)
        v = (forward if i in sde_steps else image_forward)(
            x, sigmas[i].expand(x.shape[0]).to(device), index)  # (B or B*G, ...)
        if not stochastic:
            x, _ = sde_step(x, v, sigmas, i, eta=0.0)  # Euler
            continue
        step_noise = prompt_noise(generators, (G, *shape), device).flatten(0, 1)  # (B*G, ...)
        x_next, log_prob = step_fn(x, v, sigmas, i, noise=step_noise)  # (B*G, ...), (B*G,)
        if i in sde_steps:
            # (B, G, ...), (B, G, ...), (B, G)
            trained[i] = (x.view(B, G, *shape), x_next.view(B, G, *shape), log_prob.view(B, G),
                          None if mean_fn is None else mean_fn(x, v, sigmas, i)[0].view(B, G, *shape))
        if x0_image and i == len(sigmas) - 2:
            x_next = x.float() - float(sigmas[i]) * v.float()  # x0_hat = x - sigma v of the last step: (B*G, ...)
        x = x_next
    if x.shape[0] == B:  # no SDE step at all (MixGRPO's empty window): G copies of the ODE sample
        x = x.repeat_interleave(G, dim=0)  # (B*G, ...)

    def stack(part, like):  # the trained steps' part along dim 1; K = 0 (an empty window): an empty one
        return (torch.stack([trained[k][part] for k in sde_steps], 1) if sde_steps
                else like.new_zeros(B, 0, *like.shape[1:]))
    return Rollout(
        start_latents=stack(0, x.view(B, G, *shape)),  # (B, K, G, ...)
        next_latents=stack(1, x.view(B, G, *shape)),  # (B, K, G, ...)
        old_log_probs=stack(2, x.new_zeros(B, G)),  # (B, K, G)
        final_latents=x.view(B, 1, 1, G, *shape),  # (B, 1, 1, G, ...)
        anchor_final=None, sde_steps=list(sde_steps), granularities=[],
        old_means=None if mean_fn is None else stack(3, x.view(B, G, *shape)),  # (B, K, G, ...)
        **CountingVelocity.totals(forward, image_forward))


def weighted_step_loss_backward(method, ctx, rollout, advantages, ki, weights, policy_loss=None):
    """The clipped loss of trained step `ki` with a weight per member (g2rpo.step_loss_backward's, whose mean
    becomes a weighted sum), back-propagated by `methods.base.step_backward`. advantages and weights: (B, G); a
    member of weight 0 does not train this step, and a start latent none of whose members trains it is not
    forwarded, unless other ranks forward more (`forwarded_rows`). policy_loss(ki, rows, velocity, log_probs,
    old_log_probs, advantages, weights) -> the weighted sum of a micro-batch's losses, in place of PPO's clipped one
    (Flow-DPPO's mask); rows index the (B*S,) start latents. Returns this step's statistics, or None when no member
    of this rank trains it."""
    k = rollout.sde_steps[ki]
    B, S, G = rollout.start_latents.shape[0], rollout.start_latents.shape[2], advantages.shape[1]
    old_log_probs = rollout.old_log_probs[:, ki].reshape(B * S, G // S)  # (B*S, G/S)
    advantages = advantages.reshape(B * S, G // S)  # (B*S, G/S)
    weights = weights.reshape(B * S, G // S).to(rollout.start_latents.device)  # (B*S, G/S)

    def loss_fn(rows, x, velocity, log_probs, base):
        w = weights[rows]  # (n, G/S)
        if policy_loss is None:
            loss = clipped_loss(log_probs, old_log_probs[rows], advantages[rows], method.clip_range, w)
        else:
            loss = policy_loss(ki, rows, velocity, log_probs, old_log_probs[rows], advantages[rows], w)
        kl = 0.0
        if method.kl_beta > 0:  # the method's KL to the base model's step, weighted as its members
            batch_kl = (method.kl(velocity, base(), ctx.sigmas, k) * w.sum(1)).sum()
            loss = loss + method.kl_beta * batch_kl
            kl = float(batch_kl.detach())
        return loss, float(loss.detach()), kl, (log_probs - old_log_probs[rows]).detach()[w > 0]

    rows = forwarded_rows(weights, ctx.ranks)  # the start latents forwarded
    loss, kl, log_ratio = step_backward(method, ctx, rollout, ki, loss_fn, rows)  # log_ratio: one a trained member
    return None if log_ratio.numel() == 0 else {"loss": loss, "kl": kl, **ratio_stats(log_ratio, method.clip_range)}


def forwarded_rows(weights, ranks=None):
    """The start latents a step forwards, of its n: those with a member of weight > 0 (weights (n, M)), topped up
    with rows of weight 0, which add no gradient, to the largest count of any rank, so that every rank makes the
    same calls."""
    rows = torch.arange(weights.shape[0], device=weights.device)  # (n,)
    active = weights.gt(0).any(1)  # (n,)
    count = int(active.sum()) if ranks is None else ranks.max(int(active.sum()))
    return torch.cat([rows[active], rows[~active]])[:count].sort().values  # (count,)


def accumulated_update(method, ctx, rollout, advantages, train_mask=None, policy_loss=None):
    """The update of the whole-trajectory peers: the G members of each group split into `method.member_chunks`
    chunks, one optimizer step each on the gradient accumulated over the chunk's (member, trained step) pairs.

    The loss of one optimizer step is the mean over every rank's pairs of the chunk: L = sum over pairs of l / n,
    each pair weighted world / n (DDP then divides the summed gradient by world). advantages: (B, K, G);
    train_mask: None (every member trains every step) or (B, K, G) bool, the steps each member trains. `method`
    gives the hyperparameters (clip_range, max_batch, kl_beta, inner_epochs, max_grad_norm, member_chunks) and the
    step and KL formulas (`step`, `kl`): every peer shares this loop and brings its own formulas to it. ctx:
    methods.base.UpdateContext (its ranks make every rank's calls the same). policy_loss: another loss than PPO's
    clipped one (`weighted_step_loss_backward`). Returns `methods.base.update_stats`.
    """
    B, K, G = advantages.shape
    if K == 0:  # an empty window (MixGRPO's, once a cycle) trains nothing
        return {"optimizer_steps": 0, "skipped_steps": 0}
    world = ctx.ranks.world if ctx.ranks is not None else 1
    all_sum = ctx.ranks.sum if ctx.ranks is not None else (lambda n: n)
    mask = torch.ones(B, K, G, dtype=torch.bool) if train_mask is None else train_mask.cpu()  # (B, K, G)
    per_step, grad_norms = [], []
    ctx.optimizer.zero_grad(set_to_none=True)
    for _ in range(method.inner_epochs):
        for members in torch.arange(G).tensor_split(method.member_chunks):  # member indices, (G/C,) each
            in_chunk = torch.zeros(G, dtype=torch.bool)  # (G,)
            in_chunk[members] = True
            pairs = mask & in_chunk  # (B, K, G): the (member, step) pairs of this optimizer step
            total = all_sum(int(pairs.sum()))  # on every rank
            if total == 0:  # no rank trains this chunk (an empty window): no forward, no optimizer step
                continue
            for ki in range(K):
                weights = pairs[:, ki].float() * world / total  # (B, G)
                per_step.append(weighted_step_loss_backward(method, ctx, rollout, advantages[:, ki], ki, weights,
                                                            policy_loss))
            grad_norms.append(optimizer_step(ctx.params, ctx.optimizer, method.max_grad_norm))
    return update_stats(per_step, grad_norms, per_optimizer_step=True)
