"""AWM, Advantage Weighted Matching (Xue et al. 2025, arXiv 2509.25050): the policy gradient with the pretraining
loss as the image's log-likelihood, as its authors' training script (scxue/advantage_weighted_matching,
`scripts/train_sd3_awm.py`) computes it.

Time convention (sampler.py): sigma runs from 1 (noise) to 0 (data), x_s = (1 - s) x0 + s eps, v = eps - x0.

The paper's argument: DDPO-style methods (Flow-GRPO, G2RPO) score the sampler's Gaussian steps, and the gradient of
a step's log-likelihood is a denoising loss whose target is the next noisy latent, not the clean image; that noisy
target adds variance. AWM keeps the policy gradient, E[A grad log pi(x0)], and estimates log pi(x0) by the
flow-matching loss that pretrained the model, on the clean image with fresh noise. Each iteration (the authors'
epoch):
  1. rollout: G images per prompt, each from its own noise, by the current policy; only the final latents x0 are
     kept, no log-probability (any solver serves: nothing of the sampler is scored);
  2. the advantage: Flow-GRPO's with the std of every image of the iteration (methods.base.global_std_advantages),
     then scaled into [-1, 1], c = --adv-clip-max (the authors' 5):
        A = (R - mean_prompt R) / (std_all R + 1e-4),      A' = clip(A, -c, c) / c
  3. the update, on the forward process: each micro-batch of 3 images of a group (--time-micro-batch) shares 6
     stratified sigmas of the schedule, one from each of the bins over its first 90 % without sigma 1
     (--time-sampling discrete_wo_init: at 14 steps [1,2) [2,4) [4,6) [6,8) [8,10) [10,12)), fresh noise eps each:
        x = (1 - s) x0 + s eps,      mse = mean |v_theta(x, s) - (eps - x0)|^2          (float64)
        l = -(s / p) ((mse + 1e-10)^p - (1e-10)^p)          the log-likelihood's estimate, ghuber weighting, p 0.25
        rho = exp(l - sg(l))                                 on-policy: 1, its gradient the log-likelihood's
        L = mean over rows of max(-A' rho, -A' clip(rho, 1 - eps_c, 1 + eps_c))       (eps_c the authors' 1)
            + k mean |v_theta - v_ref|^2 + e mean |v_theta - v_ema|^2
     with k = --kl-beta (the authors' 0.001, to the base model) and e = --ema-kl-beta (their 1.0, to the EMA
     anchor). At rho = 1 its gradient is mean A' (s / p) grad (mse + 1e-10)^p: pretraining's loss on each image,
     weighted by how much better than its group it scored; an image with A' < 0 is pushed away. One AdamW step on
     the whole mean (--member-chunks 1); with more, l_old is each row's l before the first step and the clip acts;
  4. the EMA anchor (the authors' "mimic TRPO"), the method's state, follows after each update:
        theta_ema <- d theta_ema + (1 - d) theta,   d = min(0.001 s, 0.3)   (--ema-anchor-rate, --ema-anchor-max)
     over the optimizer steps s so far; it never samples, it only holds the update near recent policies.
Other weightings of l the authors offer (--awm-weighting): uniform -mse, t -s mse, t2 -s^2 mse, huber
-s (sqrt(mse + 1e-10) - 1e-5).

Differences from the authors' code:
  1. Rollouts: the authors sample with SA-Solver (predictor and corrector order 2, data prediction), 14 steps, with
     stochasticity tau = 0.4 on 0.3 <= s <= 0.9 (GenEval, OCR; 0, an ODE, for PickScore). Diffusers'
     SASolverScheduler cannot run on a flow-matching grid that ends at 0: with use_flow_sigmas its grid stops at
     shift(0.999 / N) (0.19 at 14 steps: the images are left noisy), and given a grid ending at 0 it returns NaN
     (tests/test_decoupled.py shows both). So this file rolls out with the project's DPM-Solver++(2M), the
     second-order data-prediction ODE solver (the authors' PickScore setting, tau = 0, is an ODE too).
  2. The schedule is the run's: --sigma-grid sd3 is theirs; the tiny preset keeps the tiny world's linear grid of 8
     steps (held-out evaluation then samples the same images for every method), and its 6 bins of the first 90 %
     without sigma 1 are the steps 1 to 6 each.
  3. The authors add the EMA term only where k > 0; here it is on wherever e > 0 (the same at their configs).
  4. s counts the optimizer steps the updates have asked for, a step skipped for a non-finite gradient too; the
     count is state (`StepCount`), so --inner-epochs or --member-chunks changed on --resume changes only the steps
     from then on; the first 2 epochs, which the authors' script skips, train here.
  5. The random draws come from this project's per-prompt generators; a micro-batch is consecutive members of one
     group (theirs: shuffled images); fp32 on CPU, bf16 autocast on GPU, no GradScaler (theirs: fp16).
Differences from the paper: the paper's loss is the advantage-weighted matching loss with the uniform weighting; the
ghuber weighting, the clip of A to +-5 and /5, the stratified sigmas, the KL to the base and the EMA anchor are the
code's.

Presets (`presets`): flux is Flow-Factory's FLUX.1-dev LoRA recipe (X-GenGroup/Flow-Factory,
`examples/awm/lora/flux1/default.yaml`); sd3 the authors' SD3.5-M GenEval one (`config/dgx_awm.py`); tiny keeps the
authors' algorithm on the tiny world's sizes (docs/methods.md).

Run it:
    python train.py --model tiny --method awm
    python train.py --model flux --method awm                 # Flow-Factory's recipe: LoRA r64, one GPU
    torchrun --nproc_per_node 8 train.py --model sd3 --model-path stabilityai/stable-diffusion-3.5-medium \
        --method awm                                          # the authors' SD3.5-M run

Shapes: B prompts, G group size, T training sigmas per image, (...) a latent.
"""
from dataclasses import dataclass
from typing import Literal

import torch

from g2rpo import clipped_loss
from methods.base import (SOLVERS, TIME_SAMPLINGS, FrozenCopy, Method, StepCount, check_timesteps,
                          flow_matching_check_loss, forward_process, global_std_advantages, ode_rollout, optimizer_step,
                          per_member_noise, ratio_stats, training_timesteps, update_stats)

WEIGHTINGS = ("ghuber", "uniform", "t", "t2", "huber")  # --awm-weighting
# -----------------------------------------------------------------------------------------------------------------
# The values AWM runs with, each with whose it is; what they do not name is every method's start
# (g2rpo.py's VALUES) and the model's preset (lab/flags.py). `python train.py --model M --method NAME
# --show-config` prints a run's, each value with where it came from.
# -----------------------------------------------------------------------------------------------------------------
RECIPE = dict(kl_beta=1e-3, clip_range=1.0, adv_clip_max=5.0, max_grad_norm=1.0)  # the authors', every --model
PRESETS = {
    # Flow-Factory's FLUX.1-dev LoRA recipe (examples/awm/lora/flux1/default.yaml): 10 ODE steps at 512^2,
    # guidance 3.5, G 16, 48 prompts an epoch, micro-batches of 2, 4 training sigmas over the first 70 %, the
    # advantage clipped to +-1, no KL, the EMA term 0.1, the anchor's decay to 0.3 over 300 epochs, global std
    "flux": dict(lora_rank=64, lora_alpha=128.0, resolution=512, num_steps=10, shift=3.0, sigma_grid="sd3",
                 guidance=3.5, group_size=16, prompts_per_iteration=48, lr=3e-4, weight_decay=1e-4,
                 kl_beta=0.0, adv_clip_max=1.0, ema_kl_beta=0.1, time_sampling="discrete", train_timesteps=4,
                 time_fraction=0.7, time_micro_batch=2, rollout_solver="euler"),
    # the authors' SD3.5-M GenEval run (config/dgx_awm.py): 14 steps at 512^2, no CFG, G 24, 72 prompts an
    # epoch, LoRA r32 alpha 64, lr 3e-4
    "sd3": dict(lora_rank=32, lora_alpha=64.0, resolution=512, num_steps=14, shift=3.0, sigma_grid="sd3",
                guidance=1.0, group_size=24, prompts_per_iteration=72, lr=3e-4, weight_decay=1e-4),
}


def matching_log_likelihood(velocity, x0, noise, sigma, weighting="uniform", power=0.25):
    """l, the weighted flow-matching estimate of log pi(x0) per row, from mse = mean |v - (eps - x0)|^2 in float64:
    uniform -mse, t -s mse, t2 -s^2 mse, huber -s (sqrt(mse + 1e-10) - 1e-5), ghuber -(s / p) ((mse + 1e-10)^p -
    (1e-10)^p). velocity, x0, noise (n, ...), sigma (n,) -> (n,), float64."""
    v = velocity.double()
    mse = ((v - (noise - x0).double()) ** 2).flatten(1).mean(1)  # (n,)
    s = sigma.double()  # (n,)
    if weighting == "t":
        return -s * mse
    if weighting == "t2":
        return -s**2 * mse
    if weighting == "huber":
        return -s * (torch.sqrt(mse + 1e-10) - 1e-5)
    if weighting == "ghuber":
        return -(s / power) * ((mse + 1e-10) ** power - 1e-10**power)
    return -mse


def velocity_distance(velocity, other):
    """mean |v - v'|^2 per row, the KL terms' distance: (n, ...) -> (n,), fp32 (fp64 stays)."""
    v = velocity if velocity.dtype == torch.float64 else velocity.float()
    return ((v - other.to(v.dtype)) ** 2).flatten(1).mean(1)


def scaled_advantages(advantages, adv_clip_max):
    """A' = clip(A, -c, c) / c, in [-1, 1]."""
    return advantages.clamp(-adv_clip_max, adv_clip_max) / adv_clip_max


@dataclass
class AWM(Method):
    """AWM: the run's flags it reads (methods/base.py's, and --num-steps), then its own (train.py's under
    --method awm). Its state: the EMA anchor, a copy of the trained weights."""

    label = "AWM"
    unread = {"eta": "its rollout is an ODE, it samples no SDE step"}

    num_steps: int
    # --- its own flags ---
    awm_weighting: Literal[WEIGHTINGS] = "ghuber"
    """The weighting of the log-likelihood's estimate over sigma (the authors' ghuber; uniform is the paper's)."""
    awm_ghuber_power: float = 0.25
    """p of the ghuber weighting, in (0, 1] (the authors' 0.25; 1 is the t weighting)."""
    ema_kl_beta: float = 1.0
    """e, the weight of mean |v_theta - v_ema|^2 to the EMA anchor (the authors' 1.0; Flow-Factory's FLUX 0.1; 0:
    no anchor term)."""
    ema_anchor_rate: float = 0.001
    """The EMA anchor's decay d = min(rate s, --ema-anchor-max) after s optimizer steps (the authors' 0.001)."""
    ema_anchor_max: float = 0.3
    """The EMA anchor's largest decay, in [0, 1) (the authors' 0.3)."""
    time_sampling: Literal[TIME_SAMPLINGS] = "discrete_wo_init"
    """How each image's training sigmas are drawn from the schedule's (methods.base.training_timesteps):
    discrete_wo_init, one from each of --train-timesteps bins over the first --time-fraction of the schedule without
    sigma 1 (the authors' GenEval and OCR); discrete, the same with it (their PickScore, Flow-Factory's); permuted,
    the first --train-timesteps of each image's random order of all N."""
    train_timesteps: int = 6
    """T, the training sigmas of each image (the authors' 6; 0: int(--time-fraction N))."""
    time_fraction: float = 0.9
    """The share of the schedule the draw covers, in (0, 1] (the authors' 0.9; Flow-Factory's timestep_range)."""
    time_micro_batch: int = 3
    """Consecutive members of a group that share a stratified draw (the authors' micro-batch of 3)."""
    global_std: bool = True
    """Normalise each group's centred rewards by the std of every reward of the iteration, on every rank, + 1e-4
    (the authors'); --no-global-std: by the group's own std."""
    member_chunks: int = 1
    """The members of each group split into this many chunks, one optimizer step each on the gradient accumulated
    over its images and their sigmas (the authors' one step an iteration, where rho = 1; more: the clip acts from
    the second step)."""
    rollout_solver: Literal[SOLVERS] = "dpm++2m"
    """The rollout's ODE solver on the run's schedule, one forward a step: DPM-Solver++(2M) (second order, in place
    of the authors' SA-Solver: difference 1) or the project's Euler (Flow-Factory's ODE). Held-out evaluation samples
    with Euler."""

    per_step_advantages = False  # one reward per image
    recipe, presets = RECIPE, PRESETS  # (the file's top)

    def problem(self, num_steps):
        if not 0 < self.awm_ghuber_power <= 1:
            return f"--awm-ghuber-power {self.awm_ghuber_power}: must be in (0, 1] (the authors' 0.25)"
        if self.ema_kl_beta < 0 or self.ema_anchor_rate < 0 or not 0 <= self.ema_anchor_max < 1:
            return (f"--ema-kl-beta {self.ema_kl_beta} --ema-anchor-rate {self.ema_anchor_rate} --ema-anchor-max "
                    f"{self.ema_anchor_max}: the weight and rate must be >= 0 and the largest decay in [0, 1)")
        if self.time_micro_batch < 1:
            return f"--time-micro-batch {self.time_micro_batch}: must be >= 1 (the authors' 3)"
        problem = check_timesteps(self.time_sampling, self.train_timesteps, self.time_fraction, num_steps)
        if problem:
            return problem
        if not 1 <= self.member_chunks <= self.group_size:
            return f"--member-chunks {self.member_chunks}: must be in 1..--group-size {self.group_size}"
        return None

    # ---- the EMA anchor, held as state ----
    def __post_init__(self):
        self.ema = FrozenCopy([])  # no weights until `start`
        self.steps = StepCount()  # s, the optimizer steps so far, which the decay is keyed on

    def start(self, trained):
        self.ema = FrozenCopy(trained)

    def state_dict(self):
        return {"ema_anchor": self.ema.copies, "ema_anchor_steps": self.steps.state_dict()}

    def load_state_dict(self, state):
        if "ema_anchor" in state:
            self.ema.load(state["ema_anchor"])
        self.steps.load_state_dict(state.get("ema_anchor_steps"))

    # ALGO LOGIC
    def initial_noise(self, draw, generators):
        return per_member_noise(draw, generators, self.group_size)  # (B, G, ...): each image its own x_T

    def trained_steps(self, iteration):
        """The schedule's steps, from which each image draws its training sigmas (no SDE step is sampled)."""
        return list(range(self.num_steps))

    def timesteps_per_image(self):
        return self.train_timesteps or int(self.time_fraction * self.num_steps)

    def rollout(self, velocity_fn, noise, sigmas, generators, steps, image_only_fn=None):
        """G ODE samples per prompt of the current policy: only x0 kept."""
        return ode_rollout(velocity_fn, noise, sigmas, self.max_batch, trained=steps,
                           solver=self.rollout_solver)

    def advantages(self, scores, weights, ranks=None, rollout=None):
        """scores: (B, 1, 1, G, R) -> (B, 1, G), each image's advantage (clipped to +-adv_clip_max; the update
        scales it into [-1, 1])."""
        if self.global_std:
            return global_std_advantages(scores, weights, self.adv_clip_max, ranks)
        from advantage import granular_advantages

        return granular_advantages(scores, adv_clip_max=self.adv_clip_max, weights=weights)

    def optimizer_steps(self, num_trained_steps):
        return self.inner_epochs * self.member_chunks

    def update_nfe(self, rollout):
        """Per image and training sigma: one forward with gradients each inner epoch; once, without gradients, l_old
        where a rollout takes more than one optimizer step, v_ref with --kl-beta and v_ema with --ema-kl-beta."""
        B, G = rollout.final_latents.shape[0], rollout.final_latents.shape[3]
        rows = B * G * self.timesteps_per_image()
        once = (self.optimizer_steps(0) > 1) + (self.kl_beta > 0) + (self.ema_kl_beta > 0)
        return rows * (self.inner_epochs + once)

    def update(self, rollout, advantages, ctx):
        """The clipped advantage-weighted matching loss with its two KL terms over every image and its training
        sigmas, in `member_chunks` optimizer steps per inner epoch; then the EMA anchor moves."""
        B, G, T = rollout.final_latents.shape[0], rollout.final_latents.shape[3], self.timesteps_per_image()
        A = scaled_advantages(advantages[:, 0].to(rollout.final_latents.device), self.adv_clip_max)  # (B, G)
        A = A.repeat_interleave(T, 1).flatten()  # (B G T,)
        steps = training_timesteps(self.time_sampling, ctx.generators, G, self.num_steps, T, self.time_fraction,
                                   self.time_micro_batch)  # (B, G, T)
        x0, noise, x, sigma, index = forward_process(rollout, ctx.sigmas, ctx.generators, steps)  # (B G T, ...)
        rows = torch.arange(B * G * T, device=x.device).view(B, G, T)
        batches = rows.flatten().split(self.max_batch)

        def every_row(velocity_fn):  # (B G T, ...), no gradients
            with torch.no_grad():
                return torch.cat([velocity_fn(x[i], sigma[i], index[i]) for i in batches])

        weighting = dict(weighting=self.awm_weighting, power=self.awm_ghuber_power)
        old = None  # l_old of every row; with one optimizer step, each row's own l before the step
        if self.optimizer_steps(T) > 1:
            old = matching_log_likelihood(every_row(ctx.velocity_fn), x0, noise, sigma, **weighting)  # (B G T,)
        base = every_row(ctx.base_velocity_fn) if self.kl_beta > 0 else None  # v_ref
        if self.ema_kl_beta > 0:
            with self.ema.swapped():
                anchor = every_row(ctx.velocity_fn)  # v_ema
        per_step, grad_norms = [], []
        ctx.optimizer.zero_grad(set_to_none=True)
        for _ in range(self.inner_epochs):
            for members in torch.arange(G).tensor_split(self.member_chunks):
                chunk = rows[:, members].flatten()  # (n,) the rows of this optimizer step
                totals, log_ratios = {"loss": 0.0, "kl": 0.0, "ema_kl": 0.0, "matching_loss": 0.0}, []
                for i in chunk.split(self.max_batch):
                    velocity = ctx.velocity_fn(x[i], sigma[i], index[i])  # (m, ...)
                    log_likelihood = matching_log_likelihood(velocity, x0[i], noise[i], sigma[i], **weighting)
                    old_i = log_likelihood.detach() if old is None else old[i]
                    # max(-A' rho, -A' clip(rho)) summed over the micro-batch, then the mean over the chunk's rows
                    loss = clipped_loss(log_likelihood, old_i, A[i], self.clip_range) * len(i) / len(chunk)
                    if base is not None:  # k mean |v_theta - v_ref|^2 to the base model
                        kl = velocity_distance(velocity, base[i]).sum() / len(chunk)
                        loss = loss + self.kl_beta * kl
                        totals["kl"] += float(kl.detach())
                    if self.ema_kl_beta > 0:  # e mean |v_theta - v_ema|^2 to the EMA anchor
                        ema_kl = velocity_distance(velocity, anchor[i]).sum() / len(chunk)
                        loss = loss + self.ema_kl_beta * ema_kl
                        totals["ema_kl"] += float(ema_kl.detach())
                    loss.backward()
                    totals["loss"] += float(loss.detach())
                    totals["matching_loss"] -= float(log_likelihood.detach().sum()) / len(chunk)
                    log_ratios.append((log_likelihood - old_i).detach().float())
                grad_norms.append(optimizer_step(ctx.params, ctx.optimizer, self.max_grad_norm))
                per_step.append({**totals, **ratio_stats(torch.cat(log_ratios), self.clip_range)})
        # d = min(rate s, max), s the optimizer steps taken by the end of this update, skipped ones included
        # (difference 4); written rate (s / n) n, which is rate (i + 1) n bit for bit where no n changed
        s, n = self.steps.after(ctx.iteration, len(grad_norms)), len(grad_norms)
        decay = min(self.ema_anchor_rate * (s / n) * n, self.ema_anchor_max)
        self.ema.blend(decay)  # theta_ema <- d theta_ema + (1 - d) theta
        stats = {**update_stats(per_step, grad_norms), "ema_decay": decay}
        if old is None:  # rho = 1 by construction at the one step: the loop's first-ratio check has nothing to check
            del stats["first_ratio_error"]
        return stats

    def check_loss(self, velocity_fn, rollout, sigmas):
        """The flow-matching loss at the schedule's middle step: at rho = 1 with the uniform weighting, the gradient
        of AWM's loss with an advantage of one."""
        return flow_matching_check_loss(velocity_fn, rollout, sigmas, self.num_steps // 2)
