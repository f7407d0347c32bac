"""DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117): online RL on the forward process, with no SDE step scored,
as its authors' training script (NVlabs/DiffusionNFT, `scripts/train_nft_sd3.py`) computes it.

Time convention (sampler.py): sigma runs from 1 (noise) to 0 (data), x_s = (1 - s) x0 + s eps, v = eps - x0.

Where G2RPO and its peers score the log-probability of SDE steps, DiffusionNFT trains with the flow-matching loss on
clean images, as pretraining does. Each iteration (the authors' epoch):
  1. rollout: G images per prompt, each from its own noise, by the deterministic ODE of the *old* policy v_old (a
     frozen copy of the weights, the method's state), DPM-Solver++(2M) in data prediction (methods.base); only the
     final latents x0 are kept, no log-probability;
  2. the optimality probability of each image from Flow-GRPO's advantage with the std of every image of the
     iteration (methods.base.global_std_advantages; --no-global-std: the group's):
        A = (R - mean_prompt R) / (std_all R + 1e-4),      r = clip(clip(A, -5, 5) / 5 / 2 + 1/2, 0, 1)
     (the paper's r = 1/2 + 1/2 clip((R - E[R]) / Z, -1, 1) with Z = 5 std_all R; 5 is --adv-clip-max);
  3. the update, on the forward process: each image draws its own random order of the schedule's N sigmas (sigma 1
     included) and trains at the first T = int(0.99 N) of them (--time-sampling), fresh noise eps each:
        x = (1 - s) x0 + s eps
        v+ = (1 - b) v_old(x, s) + b v_theta(x, s)             the implicit positive policy
        v- = (1 + b) v_old(x, s) - b v_theta(x, s)             the implicit negative policy
     regressed in x0 space, x0_hat = x - s v, with the adaptive weight (a stop-gradient sg of the error's mean):
        l(v) = mean |x0_hat(v) - x0|^2 / sg(max(mean |x0_hat(v) - x0|, 1e-5))      (means over the latent)
        L = mean over images and their T sigmas of  5 [r l(v+) + (1 - r) l(v-)] / b  +  k mean |v_theta - v_ref|^2
     with k = --kl-beta (the authors' 1e-4, to the base model) and 5 = --adv-clip-max; an image of r = 1 pulls
     v_theta toward x0 beyond v_old, one of r = 0 pushes it away, and v_theta = v_old where r = 1/2. One AdamW step
     on the whole mean (--member-chunks 1);
  4. the old policy follows: theta_old <- d theta_old + (1 - d) theta after each update, keyed on the optimizer
     steps s taken so far (--nft-decay):
        linear (the authors' type 1):  d = min(0.001 s, 0.5)              (--nft-decay-rate, --nft-decay-max)
        ocr (their type 2):            d = 0 while s < 75, then min(0.0075 (s - 75), 0.999)
     so the old policy is the current one at first, then an ever slower average.
Nothing is stored from the sampler but x0, so any solver serves; the compute moves from the rollout to the update
(two forwards per image and sigma, v_old and v_theta, and a third to the base with --kl-beta; perf/update_nfe counts
them all).

Differences from the authors' code:
  1. The schedule is the run's: --sigma-grid sd3 is theirs (diffusers' FlowMatchEulerDiscreteScheduler grid); the
     tiny preset keeps the tiny world's linear grid of 8 steps, so that held-out evaluation samples the same images
     for every method. Evaluation samples with the project's Euler ODE (theirs: 40 Euler steps, no CFG).
  2. The exact sigma goes to the transformer in the rollout too (theirs passes int(1000 s) there, the float in the
     update).
  3. s counts the optimizer steps the updates have asked for, a step skipped for a non-finite gradient too (theirs
     counts the steps taken); the count is state (`StepCount`), so --inner-epochs or --member-chunks changed on
     --resume changes only the steps from then on.
  4. The random draws (the sigma orders, the noise) come from this project's per-prompt generators, so a run is the
     same on any number of ranks; the images of a prompt train together, not in shuffled micro-batches.
  5. fp32 on CPU, bf16 autocast on GPU, no GradScaler (theirs: fp16 with a GradScaler).
  6. Rollouts use no FP8 copy (--rollout-precision fp8 makes the current policy's images, not the old one's).
Differences from the paper: the x0-space error over its own detached mean |error| changes the weighting over sigma
(per image, s MSE_v / MAE_v); 5 / b only scales the loss; Z is 5 times the global std; the KL to the base and the
training sigmas on the sampler's grid are the code's alone.

Presets (`presets`): flux is Flow-Factory's FLUX.1-dev LoRA recipe (X-GenGroup/Flow-Factory,
`examples/nft/lora/flux1/default.yaml`); sd3 the authors' SD3.5-M one (`config/nft.py`); tiny keeps the authors'
algorithm on the tiny world's sizes (docs/methods.md: it learns on seeds 0-2).

Run it:
    python train.py --model tiny --method diffusionnft
    python train.py --model flux --method diffusionnft            # Flow-Factory's recipe: LoRA r64, one GPU
    torchrun --nproc_per_node 8 train.py --model sd3 --model-path stabilityai/stable-diffusion-3.5-medium \
        --method diffusionnft                                     # the authors' SD3.5-M run

Shapes: B prompts, G group size, T training sigmas per image, (...) a latent.
"""
import math
from dataclasses import dataclass
from typing import Literal

import torch

from advantage import granular_advantages
from methods.base import (SOLVERS, TIME_SAMPLINGS, FrozenCopy, Method, StepCount, check_timesteps,
                          flow_matching_check_loss, forward_process, global_std_advantages, ode_rollout, optimizer_step,
                          per_member_noise, training_timesteps)

DECAYS = ("linear", "ocr")  # --nft-decay
# -----------------------------------------------------------------------------------------------------------------
# The values DiffusionNFT runs with, each with whose it is; what they do not name is every method's start
# (g2rpo.py's VALUES) and the model's preset (lab/flags.py). `python train.py --model M --method NAME
# --show-config` prints a run's, each value with where it came from.
# -----------------------------------------------------------------------------------------------------------------
RECIPE = dict(kl_beta=1e-4, adv_clip_max=5.0, max_grad_norm=1.0)  # the authors' script, on every --model
PRESETS = {
    # Flow-Factory's FLUX.1-dev LoRA recipe (examples/nft/lora/flux1/default.yaml): 8 ODE steps at 384^2, G 16,
    # 48 prompts an epoch, 2 training sigmas in the first 70 % of the schedule, no KL, the group's std, the old
    # policy's decay 0.001 an epoch up to 0.5
    "flux": dict(lora_rank=64, lora_alpha=128.0, resolution=384, num_steps=8, shift=3.0, sigma_grid="sd3",
                 group_size=16, prompts_per_iteration=48, lr=3e-4, weight_decay=1e-4, kl_beta=0.0,
                 time_sampling="discrete", train_timesteps=2, time_fraction=0.7, global_std=False,
                 rollout_solver="euler"),
    # the authors' SD3.5-M run (config/nft.py): 10 DPM-Solver++(2M) steps at 512^2, no CFG, G 24, 48 prompts an
    # epoch, LoRA r32 alpha 64, lr 3e-4
    "sd3": dict(lora_rank=32, lora_alpha=64.0, resolution=512, num_steps=10, shift=3.0, sigma_grid="sd3",
                guidance=1.0, group_size=24, prompts_per_iteration=48, lr=3e-4, weight_decay=1e-4),
}


def full(t):
    """A tensor in fp32 for the loss's arithmetic (fp64 stays fp64: the tests restate the loss in it)."""
    return t if t.dtype == torch.float64 else t.float()


def optimality(advantages, adv_clip_max):
    """r = clip(clip(A, -c, c) / c / 2 + 1/2, 0, 1), c = adv_clip_max: (...) -> (...), in [0, 1]."""
    return (advantages.clamp(-adv_clip_max, adv_clip_max) / adv_clip_max / 2 + 0.5).clamp(0.0, 1.0)


def x0_regression(velocity, x, sigma, x0):
    """l(v) = mean |x0_hat - x0|^2 / sg(max(mean |x0_hat - x0|, 1e-5)), x0_hat = x - s v, per row: (n, ...) -> (n,)."""
    error = (full(x) - sigma.view(-1, *[1] * (x.dim() - 1)) * full(velocity)) - full(x0)  # (n, ...)
    dims = tuple(range(1, x.dim()))
    scale = error.detach().abs().mean(dims).clamp_min(1e-5)  # (n,) the adaptive weight's sg(mean |.|)
    return (error**2).mean(dims) / scale  # (n,)


def nft_loss(velocity, old_velocity, x, sigma, x0, r, beta, scale):
    """scale [r l(v+) + (1 - r) l(v-)] / beta per row: v+ = (1 - beta) v_old + beta v, v- = (1 + beta) v_old - beta v.
    velocity (n, ...) with gradients, old_velocity (n, ...) without, r (n,). Returns (n,), and l(v+), l(v-)."""
    old, velocity = full(old_velocity), full(velocity)
    positive = (1 - beta) * old + beta * velocity  # v+: (n, ...)
    negative = (1 + beta) * old - beta * velocity  # v-: (n, ...)
    l_pos, l_neg = x0_regression(positive, x, sigma, x0), x0_regression(negative, x, sigma, x0)  # (n,) each
    return scale * (r * l_pos + (1 - r) * l_neg) / beta, l_pos, l_neg


def old_decay(schedule, steps, rate=0.001, largest=0.5):
    """d, the old policy's decay after `steps` optimizer steps: linear min(rate s, largest) (the authors' type 1),
    ocr 0 while s < 75, then min(0.0075 (s - 75), 0.999) (their type 2)."""
    if schedule == "ocr":
        return 0.0 if steps < 75 else min(0.0075 * (steps - 75), 0.999)
    return min(rate * steps, largest)


@dataclass
class DiffusionNFT(Method):
    """DiffusionNFT: the run's flags it reads (methods/base.py's, and --num-steps), then its own (train.py's under
    --method diffusionnft). Its state: the old policy, a copy of the trained weights."""

    label = "DiffusionNFT"
    unread = {"eta": "its rollout is an ODE, it samples no SDE step", "clip_range": "its loss takes no ratio"}

    num_steps: int
    # --- its own flags ---
    nft_beta: float = 1.0
    """b, how far the implicit policies v+ and v- lie from the old one along v_theta - v_old (> 0; the authors' 1.0
    for GenEval, PickScore and HPSv2, 0.1 for OCR and several rewards)."""
    time_sampling: Literal[TIME_SAMPLINGS] = "permuted"
    """How each image's training sigmas are drawn from the schedule's (methods.base.training_timesteps): permuted,
    the first --train-timesteps of its own random order of all N (the authors'); discrete, one from each of
    --train-timesteps bins over the first --time-fraction of the schedule (Flow-Factory's); discrete_wo_init, the
    same without sigma 1."""
    train_timesteps: int = 0
    """T, the training sigmas of each image (0: int(--time-fraction N), the authors' 9 of 10)."""
    time_fraction: float = 0.99
    """The share of the schedule the draw covers, in (0, 1] (the authors' 0.99; Flow-Factory's timestep_range)."""
    time_micro_batch: int = 1
    """Consecutive members of a group that share a stratified draw (1: each image its own)."""
    nft_decay: Literal[DECAYS] = "linear"
    """The old policy's decay d over the optimizer steps s so far: linear, min(--nft-decay-rate s, --nft-decay-max)
    (the authors' default), or ocr, 0 until s = 75, then min(0.0075 (s - 75), 0.999) (their OCR config)."""
    nft_decay_rate: float = 0.001
    """The linear decay's slope per optimizer step (the authors' 0.001; 0: the old policy is the current one)."""
    nft_decay_max: float = 0.5
    """The linear decay's largest d, in [0, 1) (the authors' 0.5): theta_old <- d theta_old + (1 - d) theta."""
    global_std: bool = True
    """Normalise each group's centred rewards by the std of every reward of the iteration, on every rank, + 1e-4
    (the authors'); --no-global-std: by the group's own std (Flow-Factory's FLUX recipe)."""
    member_chunks: int = 1
    """The members of each group split into this many chunks, one optimizer step each on the gradient accumulated
    over its images and their sigmas (the authors' one step an iteration)."""
    rollout_solver: Literal[SOLVERS] = "dpm++2m"
    """The rollout's ODE solver on the run's schedule, one forward a step: DPM-Solver++(2M) (the authors' `dpm2`) or
    the project's Euler (Flow-Factory's ODE). Only x0 is kept, so the update is the same either way; held-out
    evaluation samples with Euler."""

    per_step_advantages = False  # one reward per image
    recipe, presets = RECIPE, PRESETS  # (the file's top)

    def problem(self, num_steps):
        if not self.nft_beta > 0:
            return f"--nft-beta {self.nft_beta}: must be > 0 (the authors' 1.0)"
        if self.time_micro_batch < 1:
            return f"--time-micro-batch {self.time_micro_batch}: must be >= 1 (1: each image its own draw)"
        problem = check_timesteps(self.time_sampling, self.train_timesteps, self.time_fraction, num_steps)
        if problem:
            return problem
        if not 0 <= self.nft_decay_max < 1 or self.nft_decay_rate < 0:
            return (f"--nft-decay-rate {self.nft_decay_rate} --nft-decay-max {self.nft_decay_max}: the rate must be "
                    f">= 0 and the largest decay in [0, 1)")
        if not 1 <= self.member_chunks <= self.group_size:
            return f"--member-chunks {self.member_chunks}: must be in 1..--group-size {self.group_size}"
        return None

    # ---- the old policy, held as state ----
    def __post_init__(self):
        self.old = FrozenCopy([])  # no weights until `start` (the bench's and the plan's counts need none)
        self.steps = StepCount()  # s, the optimizer steps so far, which the decay is keyed on

    def start(self, trained):
        self.old = FrozenCopy(trained)

    def state_dict(self):
        return {"old_policy": self.old.copies, "old_policy_steps": self.steps.state_dict()}

    def load_state_dict(self, state):
        if "old_policy" in state:
            self.old.load(state["old_policy"])
        self.steps.load_state_dict(state.get("old_policy_steps"))

    # ALGO LOGIC
    def initial_noise(self, draw, generators):
        return per_member_noise(draw, generators, self.group_size)  # (B, G, ...): each image its own x_T

    def trained_steps(self, iteration):
        """The schedule's steps, from which each image draws its training sigmas (no SDE step is sampled); the
        rollout hands them to the update as its `sde_steps`."""
        return list(range(self.num_steps))

    def timesteps_per_image(self):
        """T, each image's training sigmas."""
        return self.train_timesteps or int(self.time_fraction * self.num_steps)

    def rollout(self, velocity_fn, noise, sigmas, generators, steps, image_only_fn=None):
        """G ODE samples per prompt of the old policy: only x0 kept."""
        with self.old.swapped():
            return ode_rollout(velocity_fn, noise, sigmas, self.max_batch, trained=steps,
                               solver=self.rollout_solver)

    def advantages(self, scores, weights, ranks=None, rollout=None):
        """scores: (B, 1, 1, G, R) -> (B, 1, G), each image's advantage (clipped to +-adv_clip_max)."""
        if self.global_std:
            return global_std_advantages(scores, weights, self.adv_clip_max, ranks)
        return granular_advantages(scores, adv_clip_max=self.adv_clip_max, weights=weights)

    def optimizer_steps(self, num_trained_steps):
        return self.inner_epochs * self.member_chunks

    def update_nfe(self, rollout):
        """Per image and training sigma and inner epoch: v_theta with gradients; once, v_old without (and v_ref with
        --kl-beta)."""
        B, G = rollout.final_latents.shape[0], rollout.final_latents.shape[3]
        rows = B * G * self.timesteps_per_image()
        return rows * (self.inner_epochs + 1 + (self.kl_beta > 0))

    def update(self, rollout, advantages, ctx):
        """The NFT loss over every image and its training sigmas, in `member_chunks` optimizer steps per inner epoch;
        then the old policy moves."""
        B, G, T = rollout.final_latents.shape[0], rollout.final_latents.shape[3], self.timesteps_per_image()
        r = optimality(advantages[:, 0].to(rollout.final_latents.device), self.adv_clip_max)  # (B, G)
        steps = training_timesteps(self.time_sampling, ctx.generators, G, self.num_steps, T, self.time_fraction,
                                   self.time_micro_batch)  # (B, G, T)
        x0, _, x, sigma, index = forward_process(rollout, ctx.sigmas, ctx.generators, steps)  # (B G T, ...)
        r = r.repeat_interleave(T, 1).flatten()  # (B G T,)
        rows = torch.arange(B * G * T, device=x.device).view(B, G, T)
        batches = rows.flatten().split(self.max_batch)
        with torch.no_grad(), self.old.swapped():  # v_old at every row, one pass
            old = torch.cat([ctx.velocity_fn(x[i], sigma[i], index[i]) for i in batches])  # (B G T, ...)
        base = None
        if self.kl_beta > 0:  # v_ref, the base model's, at every row
            with torch.no_grad():
                base = torch.cat([ctx.base_velocity_fn(x[i], sigma[i], index[i]) for i in batches])  # (B G T, ...)
        totals = {"loss": 0.0, "kl": 0.0, "positive_loss": 0.0, "negative_loss": 0.0}
        grad_norms = []
        ctx.optimizer.zero_grad(set_to_none=True)
        for _ in range(self.inner_epochs):
            for members in torch.arange(G).tensor_split(self.member_chunks):
                chunk = rows[:, members].flatten()  # (n,) the rows of this optimizer step
                for i in chunk.split(self.max_batch):
                    velocity = ctx.velocity_fn(x[i], sigma[i], index[i])  # (m, ...)
                    loss, l_pos, l_neg = nft_loss(velocity, old[i], x[i], sigma[i], x0[i], r[i], self.nft_beta,
                                                  self.adv_clip_max)
                    loss = loss.sum() / len(chunk)  # the mean over the chunk's rows
                    if base is not None:  # k mean |v_theta - v_ref|^2 to the base model
                        kl = ((full(velocity) - full(base[i])) ** 2).flatten(1).mean(1).sum() / len(chunk)
                        loss = loss + self.kl_beta * kl
                        totals["kl"] += float(kl.detach())
                    loss.backward()
                    totals["loss"] += float(loss.detach())
                    totals["positive_loss"] += float(l_pos.detach().sum()) / len(chunk)
                    totals["negative_loss"] += float(l_neg.detach().sum()) / len(chunk)
                grad_norms.append(optimizer_step(ctx.params, ctx.optimizer, self.max_grad_norm))
        # s, the optimizer steps taken by the end of this update, skipped ones included (difference 3)
        decay = old_decay(self.nft_decay, self.steps.after(ctx.iteration, len(grad_norms)), self.nft_decay_rate,
                          self.nft_decay_max)
        self.old.blend(decay)  # theta_old <- d theta_old + (1 - d) theta
        taken = [g for g in grad_norms if math.isfinite(g)]
        return {**{k: v / len(grad_norms) for k, v in totals.items()}, "old_decay": decay,
                "grad_norm": sum(taken) / len(taken) if taken else float("nan"),
                "optimizer_steps": len(taken), "skipped_steps": len(grad_norms) - len(taken)}

    def check_loss(self, velocity_fn, rollout, sigmas):
        """The flow-matching loss at the schedule's middle step (its own loss needs the old policy's forward)."""
        return flow_matching_check_loss(velocity_fn, rollout, sigmas, self.num_steps // 2)
