"""G2RPO: the method as train.py runs it (rollout -> advantages -> update), and its clipped policy update.

For every trained SDE step k in M, the policy's velocity at the step's start latent gives each member's
log-probability of its stored SDE sample x_{k+1}^i (through `step`, the same step the rollout sampled with), its
ratio r_i,k to the rollout's, and PPO's clipped loss L_k of that step (paper Eq. 8-9, `clipped_loss`).
The paper writes one objective, L = mean_k L_k (+ beta * mean_k KL_k, off in the reference code); the reference
scripts, and this default, take one optimizer step on each L_k in turn (--no-step-per-sde-step: one on L). Every
member of a prompt starts step k from the same anchor latent, so one forward per prompt (batch B, not B*G) scores
all G members.

When the ratio leaves 1: the first L_k of an iteration is scored under the rollout's own policy, so its ratios are
1 up to the rounding of the forward (exactly 1 on the CPU; the first update's self-check tests it). Each optimizer
step then moves the policy, so the next steps' ratios (step k + 1, or the next inner epoch) are taken against the
rollout's log-probabilities under a policy that has moved, and the clip bounds how far each step moves it.

`G2RPO` is the method: its hyperparameters (its own flags, and the run's flags it reads) and its three steps, on
the interface of methods/base.py, which every other method (methods/) implements too.

Shapes: B prompts, G group size, K SDE steps, S start latents per prompt (1 here: the anchor; G for the full-SDE
ablation, whose members have their own trajectories and which borrows this update).

Deviations from the reference code (numbers of the README's list): 5 (one optimizer step per k by default, or one
on the averaged objective), 8 (a non-finite gradient skips the optimizer step).
"""
from dataclasses import dataclass, field

import torch

from advantage import granular_advantages
from methods.base import Method, SDEStep, check_sde_steps, optimizer_step, ratio_stats, step_backward, update_stats
from sampler import granular_schedule, rollout_g2rpo

# ---------------------------------------------------------------------------------------------------------------
# The values G2RPO runs with. --model flux: the reference run (bcmi/Granular-GRPO,
# scripts/finetune/finetune_g2rpo_hps.sh, "script" below) but for Lambda, which is the paper's. On the other models,
# what differs. Every other method starts from these values on a model and its own file says where it differs.
# The model's own settings (resolution, N and shift, guidance) are its preset's (lab/flags.py); any flag overrides
# all of them, and `python train.py --model M --show-config` prints a run's, each with where it came from.
# ---------------------------------------------------------------------------------------------------------------
VALUES = {
    "flux": dict(
        group_size=12,                # G, samples a prompt (script)
        eta=0.7,                      # eta, the noise level of the branching SDE step (script)
        sde_steps=list(range(8)),     # M, the steps that branch and train: the first half of 16 (script)
        granularities=[1, 2, 3],      # Lambda, the completions' ODE strides (paper; the script's {1, 2})
        clip_range=1e-4,              # epsilon of the clipped ratio (script)
        adv_clip_max=5.0,             # advantages clamped to +- this (script)
        kl_beta=0.0,                  # beta: no KL term (script)
        step_per_sde_step=True,       # one AdamW step per trained step k, 8 an iteration (script)
        inner_epochs=1,               # passes over a rollout (script)
        lr=2e-6, weight_decay=1e-4,   # AdamW, a full fine-tune (script)
        max_grad_norm=1.0,            # gradient-norm clip (script)
    ),
    # one GPU with LoRA r32 (the presets' lora_rank): the learning rate LoRA takes (set here); the branching steps of a
    # short or a video-sized schedule (set here: 2,730 velocities a prompt for the videos against 7,730 at 0..7, G 12)
    "sd3": dict(lr=1e-4),
    "zimage": dict(lr=1e-4, sde_steps=[0, 1, 2, 3]),
    "flux2": dict(lr=1e-4, sde_steps=[0, 1], granularities=[1, 2]),  # 4 steps: strides past 2 coincide
    "qwenimage": dict(lr=1e-4, sde_steps=[0, 1, 2, 3], group_size=8),
    "wan": dict(lr=1e-4, sde_steps=[0, 1, 2, 3], group_size=8),
    "wan22": dict(lr=1e-4, sde_steps=[0, 1, 2, 3], group_size=8),
    # the tiny world's 8 steps (set here, docs/tiny_world.md): AdamW at 1e-4 with no decay, a clip range of 1e-3
    "tiny": dict(group_size=8, sde_steps=[0, 1, 2, 3], lr=1e-4, weight_decay=0.0, clip_range=1e-3),
}


def clipped_loss(log_probs, old_log_probs, advantages, clip_range, weights=None):
    """PPO's clipped surrogate of each member, its mean over the members, or with `weights` (one per member) their
    weighted sum."""
    # r_i,k = exp(log pi_theta(x_{k+1}^i | x_k) - log pi_old(x_{k+1}^i | x_k))
    ratio = torch.exp(log_probs - old_log_probs)
    # L_k = mean_i max(-A_i,k r_i,k, -A_i,k clip(r_i,k, 1 - eps, 1 + eps))
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * ratio.clamp(1 - clip_range, 1 + clip_range)
    pg_loss = torch.maximum(pg_loss1, pg_loss2)
    return pg_loss.mean() if weights is None else (pg_loss * weights).sum()


def step_loss_backward(method, ctx, rollout, advantages, ki, loss_scale=1.0):
    """L_k, the loss of trained step `ki` (an index into rollout.sde_steps) over every member, back-propagated (times
    `loss_scale`) by the loop every SDE-step update shares (`methods.base.step_backward`: micro-batches of start
    latents, each member scored by `method.step`). advantages: (B, G). Returns this step's statistics as floats."""
    k = rollout.sde_steps[ki]
    B, S, G = rollout.start_latents.shape[0], rollout.start_latents.shape[2], advantages.shape[1]
    old_log_probs = rollout.old_log_probs[:, ki].reshape(B * S, G // S)  # (B*S, G/S)
    advantages = advantages.reshape(B * S, G // S)  # (B*S, G/S)

    def loss_fn(rows, x, velocity, log_probs, base):
        # L_k is a mean over all B*G members: each micro-batch weighs by its share
        share = len(rows) / (B * S)
        loss = clipped_loss(log_probs, old_log_probs[rows], advantages[rows], method.clip_range) * share
        kl = 0.0
        if method.kl_beta > 0:  # + beta KL(pi_theta || pi_ref) of the step (`SDEStep.kl`)
            batch_kl = method.kl(velocity, base(), ctx.sigmas, k).mean() * share
            loss = loss + method.kl_beta * batch_kl
            kl = float(batch_kl.detach())
        return loss * loss_scale, float(loss.detach()), kl, (log_probs - old_log_probs[rows]).detach().flatten()

    loss, kl, log_ratios = step_backward(method, ctx, rollout, ki, loss_fn)
    return {"loss": loss, "kl": kl, **ratio_stats(log_ratios, method.clip_range)}


@dataclass
class G2RPO(Method, SDEStep):
    """G2RPO (arXiv 2510.01982): singular stochastic sampling, multi-granularity advantages, the clipped update.

    The fields are the values the method reads: the run's flags (methods/base.py's, and --sde-steps), then its own,
    which train.py adds to its command line under --method g2rpo (their docstrings are the flags' help).
    """

    label = "G2RPO"

    sde_steps: list[int]
    # --- its own flags ---
    granularities: list[int] = field(default_factory=lambda: list(VALUES["flux"]["granularities"]))
    """Lambda, ODE strides of the completions (paper {1, 2, 3}; released scripts {1, 2}); {1} ablates them."""
    step_per_sde_step: bool = VALUES["flux"]["step_per_sde_step"]
    """One optimizer step per trained step k (the G2RPO reference scripts); False: the gradients of every trained
    step accumulate into one optimizer step an iteration (the paper's objective averaged over k)."""

    per_step_advantages = True  # each trained step has its own advantage (--step-credit can move them)
    presets = VALUES  # its values on each model; on flux, also every method's starting values (lab/flags.py)
    legacy = dict(sampling="g2rpo")  # written before methods had files (methods/base.py)

    def problem(self, num_steps):
        """Why these values cannot run, in one line, or None."""
        problem = check_sde_steps(self.sde_steps, num_steps) or self.sde_type_problem(self.sde_steps, num_steps)
        if problem:
            return problem
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

    # ALGO LOGIC: the three steps of an iteration (the SDE step they share, `step`, and its `kl` are SDEStep's:
    # sampler.sde_step at this eta, or --sde-type cps)
    def trained_steps(self, iteration):
        """M, the same every iteration."""
        return self.sde_steps

    def rollout(self, velocity_fn, noise, sigmas, generators, steps, image_only_fn=None):
        """The anchor, one SDE step per member at each k of `steps`, the multi-granularity completions
        (`sampler.rollout_g2rpo`). noise: (B, ...) one x_T per prompt."""
        return rollout_g2rpo(velocity_fn, noise, sigmas, generators, group_size=self.group_size, sde_steps=steps,
                             granularities=self.granularities, eta=self.eta, max_batch=self.max_batch,
                             image_only_fn=image_only_fn, step_fn=self.step)

    def advantages(self, scores, weights, ranks=None, rollout=None):
        """scores: (B, J, K, G, R) -> A[i, k] (B, K, G): each (reward, granularity, step) normalised in its group,
        summed with the reward weights (R,), clamped (`advantage.granular_advantages`)."""
        return granular_advantages(scores, adv_clip_max=self.adv_clip_max, weights=weights)

    def optimizer_steps(self, num_trained_steps):
        """The optimizer steps of one update over K trained steps."""
        return self.inner_epochs * (num_trained_steps if self.step_per_sde_step else 1)

    def update(self, rollout, advantages, ctx):
        """The clipped update on one rollout. advantages: (B, K, G); ctx: methods.base.UpdateContext. Returns
        `update_stats`."""
        K = advantages.shape[1]
        per_step, grad_norms = [], []
        ctx.optimizer.zero_grad(set_to_none=True)
        for _ in range(self.inner_epochs):
            for ki in range(K):
                # L = mean_k L_k: each step's gradient is scaled by 1/K when one optimizer step takes them all
                scale = 1.0 if self.step_per_sde_step else 1.0 / K
                per_step.append(step_loss_backward(self, ctx, rollout, advantages[:, ki], ki, scale))
                if self.step_per_sde_step or ki == K - 1:
                    grad_norms.append(optimizer_step(ctx.params, ctx.optimizer, self.max_grad_norm))
        return update_stats(per_step, grad_norms)
