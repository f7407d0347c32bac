"""DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117): online RL on the forward process, with no SDE step scored.

Time convention (sampler.py): sigma runs from 1 (noise) to 0 (data), x_s = (1 - s) x0 + s eps, v = eps - x0.

Where G2RPO and its peers score the log-probability of SDE steps, DiffusionNFT trains with the flow-matching loss on
clean images, as pretraining does. Each iteration:
  1. rollout: G images per prompt, each from its own noise, by the deterministic ODE of the *old* policy v_old (a
     frozen copy of the weights, the method's state); only the final latents x0 are kept, no log-probability;
  2. the optimality probability of each image from its group-normalised advantage A (advantage.granular_advantages,
     summed over the rewards and clipped to +-adv_clip_max):
        r = 0.5 + 0.5 clip(A / adv_clip_max, -1, 1)                               in [0, 1]
     (the paper's r = 0.5 + 0.5 clip((R - E[R]) / Z, -1, 1), with Z = adv_clip_max std_G R);
  3. the update, on the forward process: at every step s = sigma_k of the schedule, fresh noise eps per image,
        x = (1 - s) x0 + s eps,       v* = eps - x0
        v+ = (1 - beta) v_old(x, s) + beta v_theta(x, s)         the implicit positive policy
        v- = (1 + beta) v_old(x, s) - beta v_theta(x, s)         the implicit negative policy
     regressed in x0 space, x0_hat = x - s v, with the adaptive weight (a stop-gradient sg of the error's mean):
        l(v) = |x0_hat(v) - x0|^2 / sg(mean |x0_hat(v) - x0|)    (means over the latent's elements)
        L = mean over images and steps of [r l(v+) + (1 - r) l(v-)] / beta
     (+ kl_beta |v_theta - v_ref|^2 with --kl-beta); an image of r = 1 pulls v_theta toward v* beyond v_old, one of
     r = 0 pushes it away, and v_theta = v_old where r = 1/2;
  4. the old policy follows: theta_old <- eta theta_old + (1 - eta) theta after each update, with
        eta_i = min(--nft-decay-rate * i, --nft-decay-max)        (iteration i; 0 at first: the old policy is the
                                                                   current one, then an ever slower average)
Nothing is stored from the sampler but x0, so any solver serves; the compute moves from the rollout to the update
(two forwards per image and step: v_old without gradients, v_theta with them; perf/update_nfe counts both).

What this file cannot yet say: it restates the paper alone. The authors' code (NVlabs/DiffusionNFT) has not been read
against it, so the numbered differences below are from the paper; checking their training script may add to them,
and the recipe's published sizes (`presets`) wait for that reading.
  1. The solver is this project's Euler ODE on the run's schedule, or DPM-Solver++(2M) on it with --rollout-solver
     dpm++2m (the paper: any black-box solver); which one the authors' rollouts use is unread.
  2. Every image trains at every step of the schedule each iteration, in `--member-chunks` optimizer steps.
  3. r's normaliser Z is the group's std times adv_clip_max (the one advantage every method here computes).
  4. The old policy's schedule runs on iterations; its defaults (rate 0.001, at most 0.5) are this file's reading
     of the paper's soft update.
  5. Rollouts use no FP8 copy (--rollout-precision fp8 makes the current policy's images, not the old one's).

Run it:
    python train.py --model tiny --method diffusionnft
    python train.py --model flux --method diffusionnft --lora-rank 64 --lr 1e-4

Shapes: B prompts, G group size, K training steps (the schedule's N), (...) a latent.
"""
import math
from dataclasses import dataclass
from typing import Literal

import torch

from advantage import granular_advantages
from methods.base import (SOLVERS, FrozenCopy, Method, flow_matching_check_loss, forward_process, ode_rollout,
                          optimizer_step, per_member_noise)


def full(t):
    """A tensor in fp32 for the loss's arithmetic (fp64 stays fp64: the tests restate the loss in it)."""
    return t if t.dtype == torch.float64 else t.float()


def optimality(advantages, adv_clip_max):
    """r = 0.5 + 0.5 clip(A / adv_clip_max, -1, 1): (...) -> (...), in [0, 1]."""
    return 0.5 + 0.5 * (advantages / adv_clip_max).clamp(-1.0, 1.0)


def x0_regression(velocity, x, sigma, x0):
    """l(v) = |x0_hat - x0|^2 / sg(mean |x0_hat - x0|) with x0_hat = x - s v, per image: (n, ...) -> (n,)."""
    error = (full(x) - sigma.view(-1, *[1] * (x.dim() - 1)) * full(velocity)) - full(x0)  # (n, ...)
    dims = tuple(range(1, x.dim()))
    scale = error.detach().abs().mean(dims).clamp_min(1e-5)  # (n,) the adaptive weight's sg(mean |.|)
    return (error**2).mean(dims) / scale  # (n,)


def nft_loss(velocity, old_velocity, x, sigma, x0, r, beta):
    """[r l(v+) + (1 - r) l(v-)] / beta per image: v+ = (1 - beta) v_old + beta v, v- = (1 + beta) v_old - beta v.
    velocity (n, ...) with gradients, old_velocity (n, ...) without, r (n,). Returns (n,), and l(v+), l(v-)."""
    old, velocity = full(old_velocity), full(velocity)
    positive = (1 - beta) * old + beta * velocity  # v+: (n, ...)
    negative = (1 + beta) * old - beta * velocity  # v-: (n, ...)
    l_pos, l_neg = x0_regression(positive, x, sigma, x0), x0_regression(negative, x, sigma, x0)  # (n,) each
    return (r * l_pos + (1 - r) * l_neg) / beta, l_pos, l_neg


@dataclass
class DiffusionNFT(Method):
    """DiffusionNFT: the run's flags it reads (methods/base.py's, and --num-steps), then its own (train.py's under
    --method diffusionnft). Its state: the old policy, a copy of the trained weights."""

    label = "DiffusionNFT"

    num_steps: int
    # --- its own flags ---
    nft_beta: float = 1.0
    """beta, how far the implicit policies v+ and v- lie from the old one along v_theta - v_old (> 0)."""
    nft_decay_rate: float = 0.001
    """The old policy's soft update: eta_i = min(rate * i, --nft-decay-max) at iteration i (0: it is the current
    policy at every iteration)."""
    nft_decay_max: float = 0.5
    """The old policy's largest eta, in [0, 1): theta_old <- eta theta_old + (1 - eta) theta."""
    member_chunks: int = 1
    """The members of each group split into this many chunks, one optimizer step each on the gradient accumulated
    over its images and the schedule's steps."""
    rollout_solver: Literal[SOLVERS] = "euler"
    """The rollout's ODE solver on the run's schedule, one forward a step: the project's Euler, or DPM-Solver++(2M)
    (second order). Only x0 is kept, so the update is the same either way; held-out evaluation samples with Euler."""

    per_step_advantages = False  # one reward per image
    # the tiny preset's values learn as they are (docs/methods.md: seeds 0-2 at less than the quick start's compute);
    # the published FLUX sizes wait for the authors' scripts

    def problem(self, num_steps):
        if not self.nft_beta > 0:
            return f"--nft-beta {self.nft_beta}: must be > 0 (the paper's 1)"
        if not 0 <= self.nft_decay_max < 1 or self.nft_decay_rate < 0:
            return (f"--nft-decay-rate {self.nft_decay_rate} --nft-decay-max {self.nft_decay_max}: the rate must be "
                    f">= 0 and the largest eta in [0, 1)")
        if not 1 <= self.member_chunks <= self.group_size:
            return f"--member-chunks {self.member_chunks}: must be in 1..--group-size {self.group_size}"
        return None

    # ---- the old policy, held as state ----
    def __post_init__(self):
        self.old = FrozenCopy([])  # no weights until `start` (the bench's and the plan's counts need none)

    def start(self, trained):
        self.old = FrozenCopy(trained)

    def state_dict(self):
        return {"old_policy": self.old.copies}

    def load_state_dict(self, state):
        if "old_policy" in state:
            self.old.load(state["old_policy"])

    # ALGO LOGIC
    def initial_noise(self, draw, generators):
        return per_member_noise(draw, generators, self.group_size)  # (B, G, ...): each image its own x_T

    def trained_steps(self, iteration):
        """The schedule's steps, each a training timestep of every image (no SDE step is sampled); the rollout
        hands them to the update as its `sde_steps`."""
        return list(range(self.num_steps))

    def rollout(self, velocity_fn, noise, sigmas, generators, steps, image_only_fn=None):
        """G ODE samples per prompt of the old policy: only x0 kept."""
        with self.old.swapped():
            return ode_rollout(velocity_fn, noise, sigmas, self.max_batch, trained=steps,
                               solver=self.rollout_solver)

    def advantages(self, scores, weights, ranks=None):
        """scores: (B, 1, 1, G, R) -> (B, 1, G), the group advantage of each image."""
        return granular_advantages(scores, adv_clip_max=self.adv_clip_max, weights=weights)

    def optimizer_steps(self, num_trained_steps):
        return self.inner_epochs * self.member_chunks

    def update_nfe(self, rollout):
        """Two forwards per image and training step (v_old without gradients, v_theta with), per inner epoch."""
        B, G = rollout.final_latents.shape[0], rollout.final_latents.shape[3]
        return 2 * B * G * len(rollout.sde_steps) * self.inner_epochs

    def update(self, rollout, advantages, ctx):
        """The NFT loss over every image and step, in `member_chunks` optimizer steps; then the old policy moves."""
        B, G, K = rollout.final_latents.shape[0], rollout.final_latents.shape[3], len(rollout.sde_steps)
        r = optimality(advantages[:, 0].to(rollout.final_latents.device), self.adv_clip_max)  # (B, G)
        x0, _, x, sigma, index = forward_process(rollout, ctx.sigmas, ctx.generators)  # (B G K, ...)
        r = r.repeat_interleave(K, 1).flatten()  # (B G K,)
        rows = torch.arange(B * G * K, device=x.device).view(B, G, K)
        with torch.no_grad(), self.old.swapped():  # v_old at every row, one pass
            old = torch.cat([ctx.velocity_fn(x[i], sigma[i], index[i])
                             for i in rows.flatten().split(self.max_batch)])  # (B G K, ...)
        totals = {"loss": 0.0, "kl": 0.0, "positive_loss": 0.0, "negative_loss": 0.0}
        grad_norms = []
        ctx.optimizer.zero_grad(set_to_none=True)
        for _ in range(self.inner_epochs):
            for members in torch.arange(G).tensor_split(self.member_chunks):
                chunk = rows[:, members].flatten()  # (n,) the rows of this optimizer step
                for i in chunk.split(self.max_batch):
                    velocity = ctx.velocity_fn(x[i], sigma[i], index[i])  # (m, ...)
                    loss, l_pos, l_neg = nft_loss(velocity, old[i], x[i], sigma[i], x0[i], r[i], self.nft_beta)
                    loss = loss.sum() / len(chunk)  # the mean over the chunk's rows
                    if self.kl_beta > 0:  # |v_theta - v_ref|^2 to the base model
                        with torch.no_grad():
                            base = ctx.base_velocity_fn(x[i], sigma[i], index[i])
                        kl = ((velocity.float() - base.float()) ** 2).flatten(1).mean(1).sum() / len(chunk)
                        loss = loss + self.kl_beta * kl
                        totals["kl"] += float(kl)
                    loss.backward()
                    totals["loss"] += float(loss.detach())
                    totals["positive_loss"] += float(l_pos.detach().sum()) / len(chunk)
                    totals["negative_loss"] += float(l_neg.detach().sum()) / len(chunk)
                grad_norms.append(optimizer_step(ctx.params, ctx.optimizer, self.max_grad_norm))
        eta = min(self.nft_decay_rate * ctx.iteration, self.nft_decay_max)
        self.old.blend(eta)  # theta_old <- eta theta_old + (1 - eta) theta
        taken = [g for g in grad_norms if math.isfinite(g)]
        return {**{k: v / len(grad_norms) for k, v in totals.items()}, "old_eta": eta,
                "grad_norm": sum(taken) / len(taken) if taken else float("nan"),
                "optimizer_steps": len(taken), "skipped_steps": len(grad_norms) - len(taken)}

    def check_loss(self, velocity_fn, rollout, sigmas):
        """The flow-matching loss at the schedule's middle step (its own loss needs the old policy's forward)."""
        return flow_matching_check_loss(velocity_fn, rollout, sigmas, self.num_steps // 2)
