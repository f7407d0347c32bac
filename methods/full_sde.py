"""G2RPO's ablation of singular stochastic sampling: every member a whole SDE trajectory, all else as G2RPO.

The paper's first claim is that a reward credited to one SDE step says more than one shared by a whole trajectory.
This method tests it: it keeps G2RPO's SDE step (eta 0.7), its trained steps M, its shared initial noise, its group
advantage and its update (one optimizer step per trained step), and replaces the rollout by G full SDE
trajectories per prompt, one reward each, broadcast to the steps of M. The bench's "full SDE, same M" row.

Run it:
    python train.py --model tiny --method full-sde
"""
from dataclasses import dataclass

from g2rpo import G2RPO
from methods.base import Method, SDEStep, check_sde_steps
from methods.trajectories import rollout_trajectories


@dataclass
class FullSDE(Method, SDEStep):
    """The run's flags it reads (methods/base.py's, and --sde-steps), then its own (train.py's under --method
    full-sde)."""

    label = "full SDE"
    values_from = "the paper's ablation"

    sde_steps: list[int]
    # --- its own flag ---
    step_per_sde_step: bool = True
    """One optimizer step per trained step k (as G2RPO); False: one an iteration, on the objective averaged over k."""

    per_step_advantages = False  # one reward per trajectory
    legacy = dict(method="g2rpo", sampling="full")  # written before methods had files: G2RPO's --sampling full
    # G2RPO's trained steps, advantage and update, borrowed rather than inherited (its SDE step is SDEStep's, as
    # G2RPO's): a subclass would inherit --granularities and G2RPO's notes, which whole trajectories have no use for
    trained_steps, advantages = G2RPO.trained_steps, G2RPO.advantages
    optimizer_steps, update = G2RPO.optimizer_steps, G2RPO.update

    def problem(self, num_steps):
        return check_sde_steps(self.sde_steps, num_steps) or self.sde_type_problem(self.sde_steps, num_steps)

    def rollout(self, velocity_fn, noise, sigmas, generators, steps, image_only_fn=None):
        """G full SDE trajectories per prompt from its shared noise (B, ...), every step an SDE step."""
        return rollout_trajectories(velocity_fn, noise, sigmas, generators, group_size=self.group_size,
                                    sde_steps=steps, step_fn=self.step, max_batch=self.max_batch,
                                    image_only_fn=image_only_fn)
