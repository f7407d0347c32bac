"""DanceGRPO (Xue et al. 2025, arXiv 2505.07818): G whole SDE trajectories per prompt, one reward per trajectory.

From the authors' `XueZeyue/DanceGRPO` (`fastvideo/train_grpo_flux.py`, `scripts/finetune/finetune_flux_grpo.sh`):
  - the SDE step has Flow-GRPO's mean with a constant noise scale std_dev = eta (sampler.sde_mean_std):
        mean = x + dt (v + eta^2 / (2 sigma) (x + (1 - sigma) v)),   std = eta sqrt(-dt),   eta 0.3
    (at the same eta, on the 16-step schedule, G2RPO's std is 6.8 down to 0.45 times it);
  - the image is decoded from the last step's x0_hat = x - sigma v;
  - the members of a prompt share their initial noise; the advantage is the group's (unbiased std + 1e-8,
    clipped to 5), broadcast to every step of the trajectory;
  - each member trains its own random int(0.6 (N - 1)) of the steps 0..N-2 (9 of 15 at N 16; never the last
    step, which its code does not store); the loss is the mean over a chunk's (member, step) pairs and the
    optimizer steps every 4 members: 3 steps an iteration at G 12 (methods/trajectories.py);
  - clip range 1e-4, lr 1e-5, full fine-tune, gradient clip 1.0, no KL.

Differences from the authors' code:
  1. The random draws (noise, the steps each member trains) come from this project's per-prompt generators.
  2. Its log-prob drops the Gaussian's constant terms, which cancel in the ratio; this one keeps them.
  3. It quantises the timestep it passes to the transformer (int(sigma * 1000) / 1000); this project passes the
     exact sigma (the README's deviation 3).
  4. On presets other than --model flux, the preset's sizes (G, N, resolution, lr, ...) stand and only the
     algorithm changes, so that the tiny world compares algorithms at equal settings.

Run it:
    python train.py --model tiny --method dancegrpo
    torchrun --nproc_per_node 8 train.py --model flux --method dancegrpo
"""
import dataclasses
from dataclasses import dataclass

import torch

from advantage import granular_advantages
from methods.base import Method, SDEStep, check_sde_steps
from methods.trajectories import accumulated_update, all_but_last, rollout_trajectories
# -----------------------------------------------------------------------------------------------------------------
# The values DanceGRPO runs with, each with whose it is; what they do not name is every method's start
# (g2rpo.py's VALUES) and the model's preset (lab/flags.py). `python train.py --model M --method NAME
# --show-config` prints a run's, each value with where it came from.
# -----------------------------------------------------------------------------------------------------------------
RECIPE = dict(eta=0.3)  # on every --model
PRESETS = {"flux": dict(group_size=12, num_steps=16, shift=3.0, resolution=720, lr=1e-5, clip_range=1e-4,
                        kl_beta=0.0, lora_rank=0)}  # its published FLUX.1 run


def random_step_mask(generators, num_steps, group_size, fraction):
    """The steps each member trains: its own int(fraction * K) of the K steps, drawn uniformly without replacement
    from its prompt's generator. Returns (B, K, G) bool."""
    count = int(fraction * num_steps)
    mask = torch.zeros(len(generators), num_steps, group_size, dtype=torch.bool)  # (B, K, G)
    for b, generator in enumerate(generators):
        for member in range(group_size):
            mask[b, torch.randperm(num_steps, generator=generator)[:count], member] = True
    return mask


@dataclass
class DanceGRPO(Method, SDEStep):
    """DanceGRPO: the run's flags it reads (methods/base.py's, and --sde-steps), then its own (train.py's flags
    under --method dancegrpo)."""

    label = "DanceGRPO"

    sde_steps: list[int]
    # --- its own flags ---
    timestep_fraction: float = 0.6
    """The share of --sde-steps each member trains: every member trains its own random int(fraction * |M|) of
    them, drawn each iteration (DanceGRPO 0.6 of steps 0..N-2: 9 of 15); 1 = all, for every member."""
    member_chunks: int = 3
    """The members of each group split into this many chunks, one optimizer step each on the gradient accumulated
    over its members and trained steps (DanceGRPO 3: chunks of 4 at G 12; 1 = one step an iteration)."""

    per_step_advantages = False  # one reward per trajectory, for all its steps
    recipe, presets = RECIPE, PRESETS  # (the file's top)
    per_steps = dict(sde_steps=all_but_last)  # values that follow the run's N
    # written before methods had files: the axes it ran with (None: a flag of its own now)
    legacy = dict(sampling="full", sde_type="dance", decode="x0", timestep_fraction=None, member_chunks=None,
                  step_per_sde_step=False)

    def problem(self, num_steps):
        problem = check_sde_steps(self.sde_steps, num_steps) or self.sde_type_problem(self.sde_steps, num_steps)
        if problem:
            return problem
        if not 0 < self.timestep_fraction <= 1:
            return f"--timestep-fraction {self.timestep_fraction}: must be in (0, 1] (DanceGRPO 0.6; 1 = every step)"
        if int(self.timestep_fraction * len(self.sde_steps)) < 1:
            return (f"--timestep-fraction {self.timestep_fraction} of {len(self.sde_steps)} trained steps trains "
                    f"none; use at least {1 / len(self.sde_steps):.3g}")
        if not 1 <= self.member_chunks <= self.group_size:
            return f"--member-chunks {self.member_chunks}: must be in 1..--group-size {self.group_size}"
        return None

    # ALGO LOGIC
    def std_dev(self, sigmas, i):
        """DanceGRPO's SDE step: the flow step's mean and std at a constant std_dev = eta (SDEStep's step and KL)."""
        return self.eta

    def trained_steps(self, iteration):
        return self.sde_steps

    def rollout(self, velocity_fn, noise, sigmas, generators, steps, image_only_fn=None):
        """G full SDE trajectories per prompt from its shared noise (B, ...); images from the last x0_hat."""
        return rollout_trajectories(velocity_fn, noise, sigmas, generators, group_size=self.group_size,
                                    sde_steps=steps, step_fn=self.step, max_batch=self.max_batch, x0_image=True,
                                    image_only_fn=image_only_fn)

    def advantages(self, scores, weights, ranks=None, rollout=None):
        """scores: (B, 1, 1, G, R) -> (B, 1, G), the group advantage of each trajectory."""
        return granular_advantages(scores, adv_clip_max=self.adv_clip_max, weights=weights)

    def optimizer_steps(self, num_trained_steps):
        return self.inner_epochs * self.member_chunks

    def update_nfe(self, rollout):
        """Each member forwards its own int(fraction K) trained steps: B G int(fraction K) a pass (in one process;
        under torchrun a rank tops its calls up to the busiest rank's)."""
        B, K, G = rollout.start_latents.shape[:3]
        return B * G * int(self.timestep_fraction * K) * self.inner_epochs

    def for_planning(self):
        """Every member trains every step: the upper bound of the random share's cost (perf/update_nfe's too)."""
        return dataclasses.replace(self, timestep_fraction=1.0)

    def update(self, rollout, advantages, ctx):
        """Each member trains its own random share of the steps, drawn now from its prompt's generator."""
        B, K, G = advantages.shape
        train_mask = random_step_mask(ctx.generators, K, G, self.timestep_fraction) if self.timestep_fraction < 1 \
            else None  # (B, K, G)
        return accumulated_update(self, ctx, rollout, advantages, train_mask)
