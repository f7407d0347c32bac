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

`--method adagrpo` is G2RPO's rollout at one granularity with both parts on and the authors' loss
(methods/pavegrpo.py, `series_update` without sub-steps: the ratio against a detached copy of the same forward,
never clipped, one optimizer step an iteration). As the paper presents it, both parts plug into other methods:
`--adagrpo-base NAME` runs them around that method's rollout, advantage and update, with its own flags at their
defaults (its recipe's values of the run's flags are not applied: give them, e.g. --eta 0.9 for flow-grpo).
Communication: the pools' anchor scores are gathered over the ranks (one all-gather an iteration) to move the one
moving state; everything else stays on each rank.

Differences from the authors' code (`Bujiazi/GRPO-Series`, src/method_adagrpo.py, scripts/train_adagrpo.sh):
  1. The moving state is one for the run: the pools of all ranks are gathered for its update, and each rank picks
     from its own pool; theirs keeps one state per GPU, each from its own pool of 10.
  2. The candidate chosen is rolled out again by the method's own rollout (its anchor, recomputed: N forwards of
     the P N the pool costs); theirs reuses the pool's anchor trajectory. perf/nfe counts both.
  3. With several granularities (G2RPO's rollout), the cross-level term is the mean over them; theirs has one.
  4. The log-probability keeps the Gaussian's constant terms; every rank draws its own noise (as for Pave-GRPO).

Run it:
    python train.py --model tiny --method adagrpo
    python train.py --model tiny --method adagrpo --adagrpo-base flow-grpo --eta 0.9             # as a plug-in
    torchrun --nproc_per_node 8 train.py --model flux --method adagrpo --rewards hpsv3=1.0
"""
import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import torch

from methods import REGISTRY
from methods.base import Batch, Method, SDEStep, delegate
from sampler import SDE_TYPES

BASES = ("own", *(name for name in REGISTRY if name != "adagrpo"))

# -----------------------------------------------------------------------------------------------------------------
# The values AdaGRPO runs with, each with whose it is; what they do not name is every method's start
# (g2rpo.py's VALUES) and the model's preset (lab/flags.py). `python train.py --model M --method NAME
# --show-config` prints a run's, each value with where it came from.
# -----------------------------------------------------------------------------------------------------------------
# scripts/train_adagrpo.sh: 8 GPUs x 1 trained prompt (of 10), a full fine-tune (bf16), 300 steps, HPSv3
PRESETS = {
    "flux": {"resolution": 512, "num_steps": 16, "shift": 3.0, "sde_steps": [0, 2, 4, 6], "eta": 0.7,
             "group_size": 12, "lr": 2e-6, "lora_rank": 0, "prompts_per_iteration": 8, "num_iterations": 300,
             "max_grad_norm": 1.0, "adv_clip_max": 5.0, "gradient_checkpointing": False,
             "rewards": ["hpsv3=1.0"]},
    # the tiny world and FLUX.2 klein complete at G2RPO's strides there (the bench's rows were measured so)
    "tiny": dict(granularities=[1, 2, 3]), "flux2": dict(granularities=[1, 2])}


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


@delegate("base", hooks=("notes", "start", "step", "kl", "initial_noise", "trained_steps", "rollout", "update",
                         "optimizer_steps", "update_nfe", "cost_iterations", "check_loss"),
          properties=("per_step_advantages",))
@dataclass
class AdaGRPO(Method, SDEStep):
    """AdaGRPO: the run's flags it reads (methods/base.py's, --sde-steps, and --num-steps and --seed, which a base
    method may read), then its own (train.py's under --method adagrpo). Its state: the curriculum's moving mean
    and variance, and the base method's, if any."""

    label = "AdaGRPO"

    sde_steps: list[int]
    num_steps: int
    seed: int
    # --- its own flags ---
    granularities: list[int] = field(default_factory=lambda: [1])
    """ODE strides of the completions, as G2RPO's --granularities (the authors' scripts: {1})."""
    curriculum_pool: int = 10
    """P, the candidates each trained prompt is chosen from: the one whose deterministic rollout scores closest to
    the moving mean of such scores (each candidate costs --num-steps forwards; the authors' 10; >= 2)."""
    curriculum_ema: float = 0.8
    """alpha of the curriculum's moving mean and variance: m <- alpha m + (1 - alpha) (the pool's mean); in [0, 1)
    (the authors' 0.8)."""
    global_advantage: bool = True
    """The cross-level advantage, added to the method's: each member's reward on the curriculum's moving scale,
    positives and negatives each normalised to sum +-1 (the authors' on)."""
    adagrpo_base: Literal[BASES] = "own"
    """The method the curriculum and the cross-level advantage plug into: own (G2RPO's rollout with the authors'
    on-policy loss: --method pavegrpo without sub-steps), or another --method's rollout, advantage and update, its
    own flags at their defaults."""
    sde_type: Literal[SDE_TYPES] | None = field(default=None, kw_only=True)
    """The base method's SDE step (its --sde-type: flow or cps); None: the base method's default."""

    presets = PRESETS  # (the file's top)

    # flags of every method in configurations written before this file owned them: a run of another method with the
    # curriculum on is refused on resume (it resumes as --method adagrpo --adagrpo-base NAME, a new run)
    retired_flags = {"curriculum_pool": 0, "global_advantage": False}

    def __post_init__(self):
        self.curriculum = Curriculum(self.curriculum_ema)
        # the method the curriculum plugs into, from the run's flags it reads and its own defaults; "own" is the
        # authors' AdaGRPO: G2RPO's rollout with the series' update without sub-steps, Pave-GRPO's with none
        from methods import METHODS

        cls = METHODS["pavegrpo" if self.adagrpo_base == "own" else self.adagrpo_base]
        self.base = cls(**{f.name: getattr(self, f.name) for f in dataclasses.fields(cls)
                           if f.name in self.__dataclass_fields__ and getattr(self, f.name) is not None},
                        **({"sub_steps": []} if self.adagrpo_base == "own" else {}))

    def problem(self, num_steps):
        if self.curriculum_pool < 2:
            return (f"--curriculum-pool {self.curriculum_pool}: a prompt is chosen from at least 2 candidates "
                    f"(AdaGRPO 10)")
        if self.curriculum_pool > 1000:
            return (f"--curriculum-pool {self.curriculum_pool}: at most 1000 candidates a prompt (each costs "
                    f"--num-steps forwards; AdaGRPO 10)")
        if not 0 <= self.curriculum_ema < 1:
            return f"--curriculum-ema {self.curriculum_ema}: must be in [0, 1) (AdaGRPO 0.8)"
        return self.base.problem(num_steps)

    # ---- (a) the curriculum: which prompts this iteration trains on ----
    @property
    def anchor_candidates(self):
        return self.curriculum_pool

    def prompts(self, it, data):
        """Each prompt the one of its pool of P candidates whose anchor (an ODE rollout from the noise the prompt
        would train with) scores closest to the moving mean, which the pools of all ranks move first."""
        pool = self.curriculum_pool
        candidates, positions = data.batch(it, pool)  # slot b's candidates: b * pool .. (b + 1) * pool - 1
        distinct = len(set(data.prompts))
        if distinct < 2:
            data.note("the prompt file holds one prompt, so the curriculum chooses among its noises alone")
        elif len(candidates) * data.world > distinct:
            data.note(f"the curriculum's pools ({len(candidates) * data.world} candidates an iteration, "
                      f"--curriculum-pool {pool}) outnumber the prompt file's {distinct} prompts: a pool repeats "
                      f"prompts, each with its own noise")
        anchors = data.ode_images(it, candidates, positions)  # (B * P, ...)
        anchor_scores = data.score(anchors, candidates).float().cpu() @ data.weights  # (B * P,)
        self.curriculum.observe(data.ranks.gather(anchor_scores) if data.ranks is not None else anchor_scores)
        chosen = [b * pool + int(c) for b, c in enumerate(self.curriculum.choose(anchor_scores.view(-1, pool)))]
        return Batch([candidates[i] for i in chosen], [positions[i] for i in chosen],
                     nfe=len(candidates) * (len(data.sigmas) - 1),
                     metrics={"curriculum/moving_mean": self.curriculum.mean,
                              "curriculum/moving_std": self.curriculum.std,
                              "curriculum/pool_score": float(anchor_scores.mean()),
                              "curriculum/chosen_score": float(anchor_scores[chosen].mean())})

    def state_dict(self):
        """The moving mean and variance (nan before the first pool), as curriculum.safetensors."""
        mean_var = [float("nan")] * 2 if self.curriculum.mean is None else [self.curriculum.mean, self.curriculum.var]
        return {"curriculum": {"mean_var": torch.tensor(mean_var, dtype=torch.float64)}, **self.base.state_dict()}

    def load_state_dict(self, state):
        if "curriculum" in state:
            mean, var = state["curriculum"]["mean_var"].tolist()
            self.curriculum.mean, self.curriculum.var = (None, None) if mean != mean else (mean, var)
        self.base.load_state_dict(state)

    # ---- (b) the cross-level advantage, added to the method's ----
    def advantages(self, scores, weights, ranks=None, rollout=None):
        advantages = self.base.advantages(scores, weights, ranks, rollout)
        if not self.global_advantage:
            return advantages
        return with_global_advantage(advantages, scores, weights, self.curriculum, self.adv_clip_max)

    # ---- the rest is the base method's (own: G2RPO's rollout and the authors' loss), forwarded by `delegate` ----
    def for_planning(self):
        planned = copy.copy(self)
        planned.base = self.base.for_planning()
        return planned
