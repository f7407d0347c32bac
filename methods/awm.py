"""AWM, Advantage Weighted Matching (Xue et al. 2025, arXiv 2509.25050): the policy gradient with the pretraining
loss as the image's log-likelihood.

Time convention (sampler.py): sigma runs from 1 (noise) to 0 (data), x_s = (1 - s) x0 + s eps, v = eps - x0.

The paper's argument: DDPO-style methods (Flow-GRPO, G2RPO) score the sampler's Gaussian steps, and the gradient of
a step's log-likelihood is a denoising loss whose target is the next noisy latent, not the clean image; that noisy
target adds variance. AWM keeps the policy gradient, E[A grad log pi(x0)], and estimates log pi(x0) by the
flow-matching loss that pretrained the model, on the clean image with fresh noise. Each iteration:
  1. rollout: G images per prompt, each from its own noise, by the deterministic ODE of the current policy; only
     the final latents x0 are kept, no log-probability (any solver serves: nothing of the sampler is scored);
  2. the group advantage A of each image (advantage.granular_advantages: (R - mean_G R) / std_G R per reward,
     weighted, clipped to +-adv_clip_max);
  3. the update, on the forward process: at every step s = sigma_k of the schedule, fresh noise eps per image,
        x = (1 - s) x0 + s eps,       v* = eps - x0
        l_theta(x0) = -mean |v_theta(x, s) - v*|^2          the flow-matching estimate of log pi(x0) (mean over the
                                                             latent's elements)
        rho = exp(l_theta - l_old)                            l_old: the same term under the weights of the rollout
        L = mean over images and steps of max(-A rho, -A clip(rho, 1 - eps_clip, 1 + eps_clip))
     (+ kl_beta |v_theta - v_ref|^2 with --kl-beta). At rho = 1, the first optimizer step's, its gradient is
        grad L = mean A grad |v_theta - v*|^2                 the advantage-weighted matching loss:
     pretraining's loss on each image, weighted by how much better than its group it scored; an image with A < 0
     is pushed away. The clip acts from the second optimizer step of a rollout on (--member-chunks, --inner-epochs).
Nothing is kept across iterations: the ratio's denominator is the policy that rolled out, so AWM has no state.

What this file cannot yet say: it restates the paper alone. The authors' code (scxue/advantage_weighted_matching) has
not been read against it, so the list below is where the paper leaves a choice open and what this file chose;
reading their training script may change it, and the recipe's published sizes (`presets`) wait for that reading.
  1. The solver is this project's Euler ODE on the run's schedule, or DPM-Solver++(2M) on it with --rollout-solver
     dpm++2m (the paper: a sampler need not be scored); which one the authors' rollouts use is unread.
  2. Every image trains at every step of the schedule each iteration, with the flow-matching loss's uniform weight
     over steps; the paper's timestep distribution and weighting w(t) are not restated.
  3. The clip: the paper's loss is the advantage-weighted matching loss; this file takes Flow-GRPO's clipped ratio
     over its log-likelihood, so that a rollout's later optimizer steps stay near the policy that rolled out. With
     one optimizer step a rollout (the default) rho = 1 and the two are the same.
  4. No EMA policy and no reference term beyond --kl-beta's velocity distance to the base model.

Run it:
    python train.py --model tiny --method awm
    python train.py --model flux --method awm --lora-rank 64 --lr 1e-4

Shapes: B prompts, G group size, K training steps (the schedule's N), (...) a latent.
"""
from dataclasses import dataclass
from typing import Literal

import torch

from advantage import granular_advantages
from g2rpo import clipped_loss
from methods.base import (SOLVERS, Method, flow_matching_check_loss, forward_process, ode_rollout, optimizer_step,
                          per_member_noise, ratio_stats, update_stats)


def matching_log_likelihood(velocity, x0, noise):
    """l = -mean |v - (eps - x0)|^2, the flow-matching estimate of log pi(x0), per row: (n, ...) -> (n,)."""
    velocity = velocity if velocity.dtype == torch.float64 else velocity.float()  # fp32 (the tests' fp64 stays)
    return -((velocity - (noise - x0).to(velocity.dtype)) ** 2).flatten(1).mean(1)  # v* = eps - x0; (n,)


@dataclass
class AWM(Method):
    """AWM: the run's flags it reads (methods/base.py's, and --num-steps), then its own (train.py's under
    --method awm). No state: the ratio's denominator is taken inside each update."""

    label = "AWM"

    num_steps: int
    # --- its own flags ---
    member_chunks: int = 1
    """The members of each group split into this many chunks, one optimizer step each on the gradient accumulated
    over its images and the schedule's steps (1: one step a rollout, where rho = 1 and the loss is the paper's
    advantage-weighted matching; more: the clip acts from the second step)."""
    rollout_solver: Literal[SOLVERS] = "euler"
    """The rollout's ODE solver on the run's schedule, one forward a step: the project's Euler, or DPM-Solver++(2M)
    (second order). Only x0 is kept, so the update is the same either way; held-out evaluation samples with Euler."""

    per_step_advantages = False  # one reward per image

    def problem(self, num_steps):
        if not 1 <= self.member_chunks <= self.group_size:
            return f"--member-chunks {self.member_chunks}: must be in 1..--group-size {self.group_size}"
        return None

    # ALGO LOGIC
    def initial_noise(self, draw, generators):
        return per_member_noise(draw, generators, self.group_size)  # (B, G, ...): each image its own x_T

    def trained_steps(self, iteration):
        """The schedule's steps, each a training timestep of every image (no SDE step is sampled)."""
        return list(range(self.num_steps))

    def rollout(self, velocity_fn, noise, sigmas, generators, steps, image_only_fn=None):
        """G ODE samples per prompt of the current policy: only x0 kept."""
        return ode_rollout(velocity_fn, noise, sigmas, self.max_batch, trained=steps,
                           solver=self.rollout_solver)

    def advantages(self, scores, weights, ranks=None):
        """scores: (B, 1, 1, G, R) -> (B, 1, G), the group advantage of each image."""
        return granular_advantages(scores, adv_clip_max=self.adv_clip_max, weights=weights)

    def optimizer_steps(self, num_trained_steps):
        return self.inner_epochs * self.member_chunks

    def update_nfe(self, rollout):
        """One forward with gradients per image and training step and inner epoch, and, where a rollout takes more
        than one optimizer step, one without to fix l_old first."""
        B, G = rollout.final_latents.shape[0], rollout.final_latents.shape[3]
        rows = B * G * len(rollout.sde_steps)
        return rows * self.inner_epochs + (rows if self.optimizer_steps(0) > 1 else 0)

    def update(self, rollout, advantages, ctx):
        """The clipped advantage-weighted matching loss over every image and step, in `member_chunks` optimizer
        steps per inner epoch."""
        B, G, K = rollout.final_latents.shape[0], rollout.final_latents.shape[3], len(rollout.sde_steps)
        A = advantages[:, 0].to(rollout.final_latents.device).repeat_interleave(K, 1).flatten()  # (B G K,)
        x0, noise, x, sigma, index = forward_process(rollout, ctx.sigmas, ctx.generators)  # (B G K, ...)
        rows = torch.arange(B * G * K, device=x.device).view(B, G, K)
        old = None  # l_old of every row; with one optimizer step, each row's own l_theta before the step
        if self.optimizer_steps(K) > 1:
            with torch.no_grad():
                old = torch.cat([matching_log_likelihood(ctx.velocity_fn(x[i], sigma[i], index[i]), x0[i], noise[i])
                                 for i in rows.flatten().split(self.max_batch)])  # (B G K,)
        per_step, grad_norms = [], []
        ctx.optimizer.zero_grad(set_to_none=True)
        for _ in range(self.inner_epochs):
            for members in torch.arange(G).tensor_split(self.member_chunks):
                chunk = rows[:, members].flatten()  # (n,) the rows of this optimizer step
                totals, log_ratios = {"loss": 0.0, "kl": 0.0, "matching_loss": 0.0}, []
                for i in chunk.split(self.max_batch):
                    velocity = ctx.velocity_fn(x[i], sigma[i], index[i])  # (m, ...)
                    log_likelihood = matching_log_likelihood(velocity, x0[i], noise[i])  # (m,)
                    old_i = log_likelihood.detach() if old is None else old[i]
                    # max(-A rho, -A clip(rho)) summed over the micro-batch, then the mean over the chunk's rows
                    loss = clipped_loss(log_likelihood, old_i, A[i], self.clip_range) * len(i) / len(chunk)
                    if self.kl_beta > 0:  # |v_theta - v_ref|^2 to the base model
                        with torch.no_grad():
                            base = ctx.base_velocity_fn(x[i], sigma[i], index[i])
                        kl = ((velocity.float() - base.float()) ** 2).flatten(1).mean(1).sum() / len(chunk)
                        loss = loss + self.kl_beta * kl
                        totals["kl"] += float(kl)
                    loss.backward()
                    totals["loss"] += float(loss.detach())
                    totals["matching_loss"] -= float(log_likelihood.detach().sum()) / len(chunk)
                    log_ratios.append((log_likelihood - old_i).detach())
                grad_norms.append(optimizer_step(ctx.params, ctx.optimizer, self.max_grad_norm))
                per_step.append({**totals, **ratio_stats(torch.cat(log_ratios), self.clip_range)})
        stats = update_stats(per_step, grad_norms)
        if old is None:  # rho = 1 by construction at the one step: the loop's first-ratio check has nothing to check
            del stats["first_ratio_error"]
        return stats

    def check_loss(self, velocity_fn, rollout, sigmas):
        """The flow-matching loss at the schedule's middle step: at rho = 1, the gradient of AWM's loss with an
        advantage of one."""
        return flow_matching_check_loss(velocity_fn, rollout, sigmas, self.num_steps // 2)
