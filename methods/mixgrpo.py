"""MixGRPO (Li et al. 2025, arXiv 2507.21802): SDE steps only inside a sliding window, ODE steps elsewhere, and
only the window trained.

From the authors' `Tencent-Hunyuan/MixGRPO` (`scripts/finetune/finetune_flux_grpo_MixGRPO.sh`,
`fastvideo/utils/grpo_states.py`):
  - G2RPO's SDE step (sampler.sde_step, eta 0.7) inside the window, Euler outside; the members share their
    initial noise, so the steps before the window run once per prompt;
  - the progressive window of 4 steps, moving 1 step every 25 iterations:
        window = range(start, min(start + 4, N - 2)),   start rolls back to 0 once it passes N - 2,
    so it shrinks at the end, never covers the last two steps, and is empty once a cycle;
  - the group advantage (unbiased std + 1e-8, clipped to 5), one per trajectory, for every step of the window;
  - gradients accumulate over chunks of 3 members: 4 optimizer steps an iteration at G 12;
  - 25 steps, 720^2, clip 1e-4, lr 1e-5, full fine-tune.

Differences from the authors' code:
  1. Its run would stop at the empty window (its logging reads a ratio no step computed); here that iteration
     samples ODE only and takes no update.
  2. It sums its rewards' advantages with weights 1/3 each; `--rewards a=1 b=1 c=1` here weighs them 1 each.
  3. The random draws come from this project's per-prompt generators; the exact sigma goes to the transformer.
  4. On presets other than --model flux, the preset's sizes stand and only the algorithm changes.

Run it:
    python train.py --model tiny --method mixgrpo
    torchrun --nproc_per_node 8 train.py --model flux --method mixgrpo
"""
from dataclasses import dataclass

from advantage import granular_advantages
from methods.base import Method, SDEStep
from methods.trajectories import accumulated_update, rollout_trajectories
# -----------------------------------------------------------------------------------------------------------------
# The values MixGRPO runs with, each with whose it is; what they do not name is every method's start
# (g2rpo.py's VALUES) and the model's preset (lab/flags.py). `python train.py --model M --method NAME
# --show-config` prints a run's, each value with where it came from.
# -----------------------------------------------------------------------------------------------------------------
# its published FLUX sizes; on the tiny model's 8 steps, a window of 2 that moves every 4 iterations
PRESETS = {"flux": dict(group_size=12, num_steps=25, shift=3.0, resolution=720, lr=1e-5, clip_range=1e-4,
                        kl_beta=0.0, lora_rank=0),
           "tiny": dict(window_size=2, window_every=4)}


def progressive_window(iteration, *, num_steps, size, stride, every):
    """MixGRPO's window of an iteration: range(start, min(start + size, N - 2)), start moving `stride` every
    `every` iterations and rolling back to 0 once it passes N - 2."""
    last, start = num_steps - 2, 0  # its bound is exclusive: the last trained step is N - 3
    for _ in range(iteration // every):
        start += stride
        if start > last:
            start = 0  # roll back
    return list(range(start, min(start + size, last)))


@dataclass
class MixGRPO(Method, SDEStep):
    """MixGRPO: the run's flags it reads (methods/base.py's, and --num-steps), then its own (train.py's under
    --method mixgrpo)."""

    label = "MixGRPO"

    num_steps: int
    # --- its own flags ---
    window_size: int = 4
    """SDE steps in the window (MixGRPO 4 of 25 steps)."""
    window_stride: int = 1
    """Steps the window moves at each shift (MixGRPO 1: its overlapping progressive window)."""
    window_every: int = 25
    """Iterations between two shifts of the window (MixGRPO 25)."""
    member_chunks: int = 4
    """The members of each group split into this many chunks, one optimizer step each on the gradient accumulated
    over its members and the window's steps (MixGRPO 4: chunks of 3 at G 12; 1 = one step an iteration)."""

    per_step_advantages = False
    presets = PRESETS  # (the file's top)
    legacy = dict(sampling="mixed", window_schedule="mixgrpo", member_chunks=None, step_per_sde_step=False)

    def problem(self, num_steps):
        if num_steps < 3:
            return (f"MixGRPO keeps its window inside steps 0..N-3, which --num-steps {num_steps} does not have; "
                    f"use --num-steps 3 or more")
        for flag, value in (("--window-size", self.window_size), ("--window-stride", self.window_stride),
                            ("--window-every", self.window_every)):
            if value < 1:
                return f"{flag} {value}: must be >= 1"
        if self.window_size > num_steps:
            return f"--window-size {self.window_size} is longer than the schedule of --num-steps {num_steps}"
        if not 1 <= self.member_chunks <= self.group_size:
            return f"--member-chunks {self.member_chunks}: must be in 1..--group-size {self.group_size}"
        return self.sde_type_problem(range(num_steps - 2), num_steps)  # (its window stays within 0..N-3)

    # ALGO LOGIC (the SDE step and its KL are SDEStep's: G2RPO's step, or --sde-type cps)
    def trained_steps(self, iteration):
        return progressive_window(iteration, num_steps=self.num_steps, size=self.window_size,
                                  stride=self.window_stride, every=self.window_every)

    def cost_iterations(self):
        """One iteration at each start of the progressive window: 0..N-2 (the last empty)."""
        return list(range(0, self.window_every * (self.num_steps - 1), self.window_every))

    def rollout(self, velocity_fn, noise, sigmas, generators, steps, image_only_fn=None):
        """noise: (B, ...) shared by the members; SDE inside the window `steps`, ODE elsewhere."""
        return rollout_trajectories(velocity_fn, noise, sigmas, generators, group_size=self.group_size,
                                    sde_steps=steps, step_fn=self.step, max_batch=self.max_batch,
                                    ode_elsewhere=True, image_only_fn=image_only_fn)

    def advantages(self, scores, weights, ranks=None, rollout=None):
        return granular_advantages(scores, adv_clip_max=self.adv_clip_max, weights=weights)

    def optimizer_steps(self, num_trained_steps):
        return self.inner_epochs * self.member_chunks

    def update(self, rollout, advantages, ctx):
        return accumulated_update(self, ctx, rollout, advantages)
