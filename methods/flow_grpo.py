"""Flow-GRPO (Liu et al. 2025, arXiv 2505.05470) and Flow-GRPO-Fast: whole SDE trajectories, one reward each,
the advantage over the whole batch's std.

From the authors' `yifan123/flow_grpo` (`config/grpo.py` `pickscore_flux` and the `*_fast` configs,
`scripts/train_flux.py`, `flow_grpo/stat_tracking.py`):
  - Flow-GRPO's SDE step is G2RPO's (sampler.sde_step), eta 0.9; every step is SDE, all but the last trained;
  - each member draws its own initial noise (`same_latent=False`);
  - several rewards are summed raw before the advantage (`multi_score`), and the advantage divides by the
    population std of every reward of the iteration, gathered over the ranks, + 1e-4 (`global_std`):
        A_i = (R_i - mean_group R) / (std_all R + 1e-4)
  - its KL to the base model (`kl_loss`, beta 0 in its FLUX config) divides by 2 std_dev^2 without the step's -dt:
        KL = |mean - mean_ref|^2 / (2 std_dev^2),   the Gaussian's KL times -dt,
    so the pull of its 0.01-0.04 on SD3.5 takes a --kl-beta 6-46x smaller in G2RPO's exact form at N 16;
  - G 24, 6 steps, 512^2, clip 1e-4, LoRA r64 alpha 128 on attention and feed-forward, lr 3e-4, 2 optimizer
    steps an iteration.
Flow-GRPO-Fast samples SDE steps only inside a window of 3 steps drawn each iteration within 0..N/2 - 1, ODE
elsewhere, and trains the window alone, with the coefficients-preserving step (`--sde-type cps`, sampler.py's
`cps_mean_std`), eta 0.8. Its log-prob has no constant and no 1 / (2 std^2), hence its clip range of 1e-5; either
method's other --sde-type on --model flux takes the other's values (`per_sde_type`: the authors' configs with and
without CPS, `*_fast_nocfg` and `pickscore_flux`).

Differences from the authors' code:
  1. It splits an epoch's batches in two for its two optimizer steps; this project splits each group's members.
  2. Its EMA of the LoRA weights (on in that config) is --ema-decay here, off unless given.
  3. It keeps per-prompt statistics across an epoch's repeated prompts; this project normalises each group once.
  4. Flow-GRPO-Fast draws its window from each process's Python random state (ranks may differ); here from
     (seed, iteration), the same on every rank. Its `pickscore_flux_fast` config uses the per-prompt std instead.
  5. The random draws come from this project's per-prompt generators; the exact sigma goes to the transformer.
  6. On presets other than --model flux, the preset's sizes stand and only the algorithm changes.

Run it:
    python train.py --model tiny --method flow-grpo          (or --method flow-grpo-fast)
    python train.py --model flux --method flow-grpo          # LoRA r64: one GPU
"""
from dataclasses import dataclass, field
from typing import Literal

import torch

from methods.base import (Method, SDEStep, check_sde_steps, global_std_advantages, iteration_generator,
                          per_member_noise)
from methods.trajectories import accumulated_update, all_but_last, rollout_trajectories
from sampler import SDE_TYPES, sde_std_dev

# -----------------------------------------------------------------------------------------------------------------
# The values Flow-GRPO and Flow-GRPO-Fast run with, each with whose it is; what they do not name is every method's
# start (g2rpo.py's VALUES) and the model's preset (lab/flags.py). `python train.py --model M --method NAME
# --show-config` prints a run's, each value with where it came from.
# -----------------------------------------------------------------------------------------------------------------
FLUX = dict(group_size=24, num_steps=6, shift=3.0, resolution=512, lr=3e-4, kl_beta=0.0, lora_rank=64,
            lora_alpha=128.0, lora_feed_forward=True)  # the published FLUX.1 configs' sizes
# Flow-GRPO
FLOW_GRPO_RECIPE = dict(eta=0.9)
FLOW_GRPO_PRESETS = {"flux": dict(FLUX, clip_range=1e-4)}
FLOW_GRPO_PER_SDE_TYPE = {"cps": {"flux": dict(clip_range=1e-5, eta=0.8)}}  # the authors' *_fast_nocfg configs, CPS
# Flow-GRPO-Fast; on the tiny model's 8 steps, a window of 2
FAST_RECIPE = dict(eta=0.8)
FAST_PRESETS = {"flux": dict(FLUX, clip_range=1e-5), "tiny": dict(window_size=2)}
FAST_PER_SDE_TYPE = {"flow": {"flux": dict(clip_range=1e-4, eta=0.9)}}  # Flow-GRPO's pickscore_flux values


def flow_grpo_kl(velocity, base_velocity, sigmas, i, eta):
    """Flow-GRPO's kl_loss: |mean - mean_ref|^2 / (2 std_dev^2), per sample (n,)."""
    sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])
    std_dev = sde_std_dev(sigmas, i, eta)
    mean_gap = (velocity.float() - base_velocity.float()) * (1 + std_dev**2 * (1 - sigma) / (2 * sigma)) * \
        (sigma_next - sigma)
    kl = mean_gap**2 / (2 * std_dev**2)
    return kl.mean(dim=tuple(range(1, kl.ndim)))  # (n,)


def random_window(iteration, *, num_steps, size, end, seed):
    """Flow-GRPO-Fast's window: `size` consecutive steps drawn afresh each iteration from (seed, iteration),
    within steps 0..end - 1 (end 0: N)."""
    start = int(torch.randint((end or num_steps) - size + 1, (1,), generator=iteration_generator(seed, iteration)))
    return list(range(start, start + size))


@dataclass
class FlowGRPO(Method, SDEStep):
    """Flow-GRPO: the run's flags it reads (methods/base.py's, and --sde-steps), then its own (train.py's under
    --method flow-grpo)."""

    label = "Flow-GRPO"

    sde_steps: list[int]
    # --- its own flags ---
    member_chunks: int = 2
    """The members of each group split into this many chunks, one optimizer step each on the gradient accumulated
    over its members and trained steps (Flow-GRPO 2; 1 = one step an iteration)."""

    per_step_advantages = False
    recipe, presets, per_sde_type = FLOW_GRPO_RECIPE, FLOW_GRPO_PRESETS, FLOW_GRPO_PER_SDE_TYPE  # (the file's top)
    per_steps = dict(sde_steps=all_but_last)
    legacy = dict(sampling="full", adv_std="global", same_noise=False, kl_form="flow-grpo", reward_fusion="score",
                  member_chunks=None, step_per_sde_step=False)  # (methods/base.py)

    def problem(self, num_steps):
        problem = check_sde_steps(self.sde_steps, num_steps) or self.sde_type_problem(self.sde_steps, num_steps)
        if problem:
            return problem
        if not 1 <= self.member_chunks <= self.group_size:
            return f"--member-chunks {self.member_chunks}: must be in 1..--group-size {self.group_size}"
        return None

    # ALGO LOGIC (the SDE step is SDEStep's: G2RPO's, or --sde-type cps)
    def initial_noise(self, draw, generators):
        """Each member its own x_T (`same_latent=False`): (B, G, ...)."""
        return per_member_noise(draw, generators, self.group_size)

    def kl(self, velocity, base_velocity, sigmas, i):
        """Its kl_loss on the flow step (`flow_grpo_kl`); on the CPS step the CPS authors' mean |mu - mu_ref|^2
        (sampler.cps_kl)."""
        if self.sde_type == "cps":
            return SDEStep.kl(self, velocity, base_velocity, sigmas, i)
        return flow_grpo_kl(velocity, base_velocity, sigmas, i, self.eta)

    def trained_steps(self, iteration):
        return self.sde_steps

    def rollout(self, velocity_fn, noise, sigmas, generators, steps, image_only_fn=None):
        """noise: (B, G, ...), one per member."""
        return rollout_trajectories(velocity_fn, noise, sigmas, generators, group_size=self.group_size,
                                    sde_steps=steps, step_fn=self.step, max_batch=self.max_batch, per_member_noise=True,
                                    image_only_fn=image_only_fn)

    def advantages(self, scores, weights, ranks=None, rollout=None):
        return global_std_advantages(scores, weights, self.adv_clip_max, ranks)

    def optimizer_steps(self, num_trained_steps):
        return self.inner_epochs * self.member_chunks

    def update(self, rollout, advantages, ctx):
        return accumulated_update(self, ctx, rollout, advantages)


@dataclass
class FlowGRPOFast(Method, SDEStep):
    """Flow-GRPO-Fast: the run's flags it reads (methods/base.py's, --num-steps and --seed), then its own
    (train.py's under --method flow-grpo-fast)."""

    label = "Flow-GRPO-Fast"

    num_steps: int
    seed: int
    # --- its own flags ---
    window_size: int = 3
    """SDE steps in the window, drawn afresh each iteration (Flow-GRPO-Fast 3)."""
    window_end: int = 0
    """The window lies within steps 0..window_end - 1 (Flow-GRPO-Fast N // 2, which it follows by default); 0 = N."""
    member_chunks: int = 2
    """The members of each group split into this many chunks, one optimizer step each (Flow-GRPO-Fast 2)."""
    sde_type: Literal[SDE_TYPES] = field(default="cps", kw_only=True)
    """The SDE step: cps (coefficients-preserving, Flow-GRPO-Fast's: the noise after a step stays the schedule's
    sigma', eta in (0, 1]; log-prob -|x' - mean|^2) or flow (Flow-GRPO's Gaussian step; --model flux then sets
    Flow-GRPO's clip range and eta)."""

    per_step_advantages = False
    recipe, presets, per_sde_type = FAST_RECIPE, FAST_PRESETS, FAST_PER_SDE_TYPE  # (the file's top)
    per_steps = dict(window_end=lambda num_steps: num_steps // 2)
    legacy = dict(sampling="mixed", window_schedule="random", sde_type="cps", adv_std="global", same_noise=False,
                  kl_form="flow-grpo", reward_fusion="score", member_chunks=None, step_per_sde_step=False)

    def problem(self, num_steps):
        keep_out = f"--window-end {num_steps - 1}" + (f" --window-size {num_steps - 1}"
                                                      if self.window_size > num_steps - 1 else "")
        # (the steps the window may take)
        problem = self.sde_type_problem(range(self.window_end or num_steps), num_steps, keep_out)
        if problem:
            return problem
        if self.window_size < 1 or not self.window_size <= (self.window_end or num_steps) <= num_steps:
            return (f"--window-end {self.window_end}: a random window of --window-size {self.window_size} needs "
                    f"1 <= {self.window_size} <= window end <= --num-steps {num_steps} (0 = N)")
        if not 1 <= self.member_chunks <= self.group_size:
            return f"--member-chunks {self.member_chunks}: must be in 1..--group-size {self.group_size}"
        return None

    # ALGO LOGIC (the SDE step and its KL are SDEStep's, on --sde-type cps by default)
    def trained_steps(self, iteration):
        return random_window(iteration, num_steps=self.num_steps, size=self.window_size, end=self.window_end,
                             seed=self.seed)

    def cost_iterations(self):
        """64 draws of the random window."""
        return list(range(64))

    def rollout(self, velocity_fn, noise, sigmas, generators, steps, image_only_fn=None):
        """noise: (B, G, ...); SDE inside the window `steps`, ODE elsewhere."""
        return rollout_trajectories(velocity_fn, noise, sigmas, generators, group_size=self.group_size,
                                    sde_steps=steps, step_fn=self.step, max_batch=self.max_batch,
                                    ode_elsewhere=True, per_member_noise=True, image_only_fn=image_only_fn)

    # Flow-GRPO's noise (one per member), advantage (the batch's std) and accumulated update
    initial_noise, advantages = FlowGRPO.initial_noise, FlowGRPO.advantages
    optimizer_steps, update = FlowGRPO.optimizer_steps, FlowGRPO.update
