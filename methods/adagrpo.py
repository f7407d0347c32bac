"""AdaGRPO (arXiv 2606.06828, by G2RPO's authors): an online prompt curriculum and a cross-level advantage.

Both parts read one moving state: the exponential moving average of the scores of deterministic (ODE) rollouts,
the "anchors", of the prompts offered to the run. Each iteration:
  (a) the curriculum. Every trained prompt is chosen from a pool of P candidates (the authors' 10): the anchor of
      each candidate is sampled from its own noise and scored (one reward, the weighted sum of the run's), the
      moving mean and variance take the pool's mean and (population) variance,
          m <- alpha m + (1 - alpha) mean(s),      v <- alpha v + (1 - alpha) var(s)      (alpha 0.8)
      (the first pool sets them), and the candidate whose anchor score is closest to the updated m is trained,
      with the same noise its anchor had: neither solved nor hopeless, at the policy's current level;
  (b) the cross-level advantage. Each member's reward R_i (the weighted sum, at each trained step) is placed on
      the moving scale, z_i = (R_i - m) / (sqrt(max(v, 1e-8)) + 1e-8); the positive z are divided by their sum and the
      negative ones by the sum of their magnitudes (so each side sums to +-1), or, when one side is empty, z is
      centred instead (z - mean z); the result is clamped to +-adv_clip_max and added to the method's own group
      advantage, itself clamped:  A = clamp(A_group) + clamp(A_global).
The moving state is saved in every checkpoint (curriculum.safetensors), so a resume continues exactly.

As the paper presents it, both parts plug into other methods: `--curriculum-pool P` and `--global-advantage` are
flags of every method (train.py runs them around the method's rollout and advantage); `--method adagrpo` is G2RPO's
rollout at one granularity with both parts on and the authors' loss (methods/pavegrpo.py, `series_update` without
sub-steps: the ratio against a detached copy of the same forward, never clipped, one optimizer step an iteration).

Differences from the authors' code (`Bujiazi/GRPO-Series`, src/method_adagrpo.py, scripts/train_adagrpo.sh):
  1. The moving state is one for the run: the pools of all ranks are gathered for its update, and each rank picks
     from its own pool; theirs keeps one state per GPU, each from its own pool of 10.
  2. The candidate chosen is rolled out again by the method's own rollout (its anchor, recomputed: N forwards of
     the P N the pool costs); theirs reuses the pool's anchor trajectory. perf/nfe counts both.
  3. With several granularities (G2RPO's rollout), the cross-level term is the mean over them; theirs has one.
  4. The log-probability keeps the Gaussian's constant terms; every rank draws its own noise (as for Pave-GRPO).

Run it:
    python train.py --model tiny --method adagrpo
    python train.py --model tiny --method flow-grpo --curriculum-pool 10 --global-advantage    # as a plug-in
    torchrun --nproc_per_node 8 train.py --model flux --method adagrpo --rewards hpsv3=1.0
"""
from dataclasses import dataclass, field

import torch

from g2rpo import G2RPO
from methods.pavegrpo import PaveGRPO, series_update


class Curriculum:
    """The moving mean and variance of anchor scores, and the two rules that read them. Shapes: B prompts, P
    candidates each, G group size."""

    def __init__(self, alpha: float):
        self.alpha, self.mean, self.var = alpha, None, None  # None until the first pool

    def observe(self, scores):
        """Move the state with a pool's anchor scores (all ranks' pools together): (n,). A pool with a score that is
        not finite moves nothing (the iteration's rewards are skipped as a fault; the state must outlive it)."""
        if not bool(torch.isfinite(scores).all()):
            return
        pool_mean, pool_var = float(scores.double().mean()), float(scores.double().var(unbiased=False))
        if self.mean is None:
            self.mean, self.var = pool_mean, pool_var
        else:
            self.mean = self.alpha * self.mean + (1 - self.alpha) * pool_mean
            self.var = self.alpha * self.var + (1 - self.alpha) * pool_var

    def choose(self, scores):
        """The candidate of each slot whose anchor score is closest to the moving mean: scores (B, P) -> (B,)."""
        return (scores.double() - self.mean).abs().argmin(1)

    @property
    def std(self):
        return max(self.var, 1e-8) ** 0.5

    def global_advantage(self, rewards, adv_clip_max):
        """The cross-level advantage of each group: rewards (..., G) -> (..., G), on the moving scale."""
        z = (rewards.double() - self.mean) / (self.std + 1e-8)
        positive, negative = z.clamp(min=0), z.clamp(max=0)
        up, down = positive.sum(-1, keepdim=True), -negative.sum(-1, keepdim=True)  # (..., 1) each
        one_sided = (up < 1e-6) | (down < 1e-6)
        balanced = positive / up.clamp(min=1e-6) + negative / down.clamp(min=1e-6)
        centred = z - z.mean(-1, keepdim=True)
        return torch.where(one_sided, centred, balanced).clamp(-adv_clip_max, adv_clip_max).float()

    def state_dict(self):
        return {"mean_var": torch.tensor([self.mean, self.var], dtype=torch.float64)}

    def load_state_dict(self, state):
        self.mean, self.var = state["mean_var"].tolist()


def with_global_advantage(advantages, scores, weights, curriculum, adv_clip_max):
    """A = A_method + clamp(A_global): advantages (B, K or 1, G) and scores (B, J, K, G, R) with the reward weights
    (R,); the global term is the mean over the J granularities of each (step, member)'s."""
    rewards = torch.einsum("bjkgr,r->bjkg", scores.float(), weights.float().to(scores.device))  # (B, J, K, G)
    extra = curriculum.global_advantage(rewards, adv_clip_max).mean(1)  # (B, K, G)
    if advantages.shape[1] == 1:  # one advantage per trajectory (DanceGRPO, Flow-GRPO): one global term too
        extra = extra.mean(1, keepdim=True)
    return advantages + extra.to(advantages.device)


@dataclass
class AdaGRPO:
    """AdaGRPO: the run's flags it reads (lab/flags.py), then its own (train.py's under --method adagrpo). The
    curriculum's flags (--curriculum-pool, --curriculum-ema, --global-advantage) are the run's: its recipe sets
    them."""

    sde_steps: list[int]
    group_size: int
    eta: float
    clip_range: float
    adv_clip_max: float
    max_grad_norm: float
    max_batch: int
    inner_epochs: int
    kl_beta: float
    # --- its own flag ---
    granularities: list[int] = field(default_factory=lambda: [1])
    """ODE strides of the completions, as G2RPO's --granularities (the authors' scripts: {1})."""

    same_noise = True
    per_step_advantages = True
    recipe = {"curriculum_pool": 10, "curriculum_ema": 0.8, "global_advantage": True}
    # scripts/train_adagrpo.sh: 8 GPUs x 1 trained prompt (of 10), a full fine-tune (bf16), 300 steps, HPSv3
    flux = {"resolution": 512, "num_steps": 16, "shift": 3.0, "sde_steps": [0, 2, 4, 6], "eta": 0.7,
            "group_size": 12, "lr": 2e-6, "lora_rank": 0, "prompts_per_iteration": 8, "num_iterations": 300,
            "max_grad_norm": 1.0, "adv_clip_max": 5.0, "gradient_checkpointing": False,
            "rewards": ["hpsv3=1.0"]}
    per_steps = {}
    step, kl, trained_steps, rollout, advantages = G2RPO.step, G2RPO.kl, G2RPO.trained_steps, G2RPO.rollout, \
        G2RPO.advantages
    notes, problem = G2RPO.notes, G2RPO.problem

    optimizer_steps = PaveGRPO.optimizer_steps  # one an inner epoch, as Pave-GRPO's

    def update(self, velocity_fn, params, optimizer, rollout, advantages, sigmas, generators=None,
               base_velocity_fn=None, ranks=None):
        return series_update(self, velocity_fn, params, optimizer, rollout, advantages, sigmas, [], base_velocity_fn)
