"""Flow-DPPO (arXiv 2606.11025): Flow-GRPO with the PPO clip replaced by a trust region on the exact KL between the
old and the new SDE transition.

Flow-GRPO bounds each update by clipping the ratio r = pi_theta(x' | x) / pi_old(x' | x) of one sample, a noisy
measure of how far the policy has moved. Every SDE step is a Gaussian, so the distance itself is exact and cheap: the
old and the new step share their std and differ in their means, and
    KL_i = mean |mu_theta(x_i) - mu_old(x_i)|^2 / (2 std^2)          (averaged over the latent, as the log-prob)
A member is dropped from the loss where the update has both left the trust region and moves the way its advantage
already pushes it:
    keep_i = not (KL_i >= delta  and  ((A_i > 0 and r_i > 1) or (A_i < 0 and r_i < 1)))
    L      = mean_i (-A_i r_i keep_i)    (+ beta mean |mu_theta - mu_ref|^2, the KL to the base model)
so a member inside the region, or one the update pulls back toward the old policy, keeps its full gradient. The
old means mu_old are kept at rollout (`Rollout.old_means`), as are the old log-probs; both stay frozen over the
iteration's optimizer steps.

The rest is Flow-GRPO's (methods/flow_grpo.py): each member its own initial noise, the advantage over the whole
batch's std, one reward per trajectory for every trained step, the members of each group split into chunks, one
optimizer step each. SDE steps are sampled only at the trained steps, `--sde-draws` of them drawn each iteration
among the first `--sde-window` steps, ODE elsewhere; the step is the coefficients-preserving one (--sde-type cps,
sampler.py) by default. The mask's KL is the exact Gaussian KL of either step type, so its threshold means the
same on both (a CPS ratio lives on another scale, the KL does not).

From Flow-Factory's Flow-DPPO trainer (X-GenGroup/Flow-Factory, `DPPOTrainer`: its x-based trust region, the KL of
the step's Gaussian of either type) and its SD3.5-M recipe (`examples/dppo/lora/sd3_5/geneval2_single.yaml`):
  - CPS noise level 0.7; 10 steps, 3 SDE steps drawn among steps 0-5 each epoch;
  - delta = 1e-6 (kl_mask_threshold); the pull to the base model x-based, beta 1e-3 on mean |mu - mu_ref|^2 (the
    squared mean gap that Flow-Factory calls its x-based KL);
  - G 16, 64 prompts an epoch, 2 optimizer steps an epoch, one inner epoch, advantages over the global std,
    clipped to 5;
  - LoRA r32 alpha 64, lr 3e-4, weight decay 1e-4, gradient norm 1, 512^2, no CFG but in the KL term's reference
    forward (kl_guidance_scale 4.5); EMA 0.9 every 4 epochs.
No FLUX.1 recipe of Flow-DPPO is published: --model flux takes these values on FLUX.1's own guidance.

Differences from Flow-Factory's code:
  1. The SDE steps are drawn from (seed, iteration), the same on every rank; theirs from the scheduler's own seed.
  2. It splits an epoch's batch in two for its two optimizer steps; this project splits each group's members.
  3. It keeps per-prompt statistics across an epoch's repeated prompts; this project normalises each group once.
  4. The random draws come from this project's per-prompt generators; the exact sigma goes to the transformer.
  5. --clip-range is not read (no ratio is clipped); losses/clipfrac still counts |r - 1| > --clip-range.
  6. On presets other than flux and sd3, the preset's sizes stand and only the algorithm changes.
  7. The base model of the KL term runs at the run's --guidance. Flow-Factory's SD3.5-M recipe runs it at
     kl_guidance_scale 4.5 (CFG on the frozen reference while the policy samples without); --kl-guidance names that
     value, but a value other than the run's guidance is refused until the harness runs the base forward at it (it
     needs the negative prompt's embeddings, which a rollout without CFG does not encode).

Run it:
    python train.py --model tiny --method flow-dppo
    python train.py --model sd3 --method flow-dppo                 # Flow-Factory's SD3.5-M recipe, LoRA r32

Shapes: B prompts, G group size, K trained steps, (...) a latent.
"""
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch

from methods.base import Method, SDEStep, global_std_advantages, iteration_generator, per_member_noise
from methods.trajectories import accumulated_update, rollout_trajectories
from sampler import SDE_TYPES

# -----------------------------------------------------------------------------------------------------------------
# The values Flow-DPPO runs with, each with whose it is; what they do not name is every method's start
# (g2rpo.py's VALUES) and the model's preset (lab/flags.py). `python train.py --model M --method NAME
# --show-config` prints a run's, each value with where it came from.
# -----------------------------------------------------------------------------------------------------------------
# Flow-Factory's SD3.5-M recipe (examples/dppo/lora/sd3_5/geneval2_single.yaml)
SD35 = dict(group_size=16, num_steps=10, shift=3.0, sigma_grid="sd3", resolution=512, prompts_per_iteration=64,
            lr=3e-4, weight_decay=1e-4, max_grad_norm=1.0, kl_beta=1e-3, lora_rank=32, lora_alpha=64.0,
            ema_decay=0.9, ema_every=4)
RECIPE = dict(eta=0.7)
# its SD3.5-M recipe samples without CFG (guidance 1); its KL term's base model at CFG 4.5 is difference 7
PRESETS = {"sd3": dict(SD35, guidance=1.0), "flux": SD35}
PER_SDE_TYPE = {}  # its defaults are its authors' CPS values already


def random_steps(iteration, *, count, window, seed):
    """The SDE steps of an iteration: `count` distinct steps of 0..window - 1, drawn from (seed, iteration), sorted."""
    return sorted(torch.randperm(window, generator=iteration_generator(seed, iteration))[:count].tolist())


def trust_region_kl(mean, old_mean, std):
    """KL(new step || old step) of two Gaussians with one std, averaged over the latent: (n, ...) -> (n,)."""
    kl = (mean.float() - old_mean.float()) ** 2 / (2 * std**2)
    return kl.mean(dim=tuple(range(1, kl.ndim)))


def masked_loss(log_probs, old_log_probs, advantages, kl, threshold, weights):
    """Flow-DPPO's loss over members (n, M). Returns (loss, keep): loss = sum of weights * (-A r keep), a scalar;
    keep (n, M) bool, False where KL >= threshold and r moves the way A pushes it (r > 1 for A > 0, r < 1 for A < 0).
    kl: (n, M) or (n, 1), one per member or per start latent."""
    ratio = torch.exp(log_probs - old_log_probs)
    with torch.no_grad():
        along = ((advantages > 0) & (ratio > 1)) | ((advantages < 0) & (ratio < 1))
        keep = ~((kl >= threshold) & along)
    return (-advantages * ratio * keep * weights).sum(), keep


@dataclass
class FlowDPPO(Method, SDEStep):
    """Flow-DPPO: the run's flags it reads (methods/base.py's, --num-steps, --seed and --guidance), then its own
    (train.py's under --method flow-dppo)."""

    label = "Flow-DPPO"

    num_steps: int
    seed: int
    guidance: float
    # --- its own flags ---
    kl_mask_threshold: float = 1e-6
    """delta: a member whose step's KL(new || old) reaches this, and whose ratio moves the way its advantage pushes,
    is dropped from the loss (Flow-Factory 1e-6)."""
    sde_draws: int = 3
    """SDE steps drawn afresh each iteration (and trained), ODE elsewhere (Flow-Factory 3)."""
    sde_window: int = 6
    """The drawn steps lie within steps 0..sde_window - 1 (Flow-Factory 6 of 10)."""
    member_chunks: int = 2
    """The members of each group split into this many chunks, one optimizer step each (Flow-Factory's 2 gradient
    steps an epoch)."""
    kl_guidance: Optional[float] = None
    """The guidance of the base model's velocity in the KL term (Flow-Factory's kl_guidance_scale, 4.5 in its SD3.5-M
    recipe); None: the run's --guidance, the only value that runs here yet (difference 7)."""
    sde_type: Literal[SDE_TYPES] = field(default="cps", kw_only=True)
    """The SDE step: cps (coefficients-preserving, Flow-Factory's for Flow-DPPO, eta in (0, 1]) or flow (G2RPO's
    Gaussian step). The mask's KL is exact on either, so --kl-mask-threshold keeps its meaning."""

    per_step_advantages = False
    recipe, presets, per_sde_type = RECIPE, PRESETS, PER_SDE_TYPE  # (the file's top)

    def problem(self, num_steps):
        if not 1 <= self.sde_draws <= self.sde_window <= num_steps:
            return (f"--sde-draws {self.sde_draws} of --sde-window {self.sde_window}: needs 1 <= draws <= window <= "
                    f"--num-steps {num_steps}")
        keep_out = f"--sde-window {num_steps - 1}" + (f" --sde-draws {num_steps - 1}"
                                                      if self.sde_draws > num_steps - 1 else "")
        problem = self.sde_type_problem(range(self.sde_window), num_steps, keep_out)  # (the steps a draw may take)
        if problem:
            return problem
        if self.kl_mask_threshold < 0:
            return f"--kl-mask-threshold {self.kl_mask_threshold}: must be >= 0 (Flow-Factory 1e-6)"
        if self.kl_guidance is not None and self.kl_guidance < 0:
            return f"--kl-guidance {self.kl_guidance}: must be >= 0, or None for the run's --guidance"
        if self.kl_guidance is not None and self.kl_guidance != self.guidance and self.kl_beta > 0:
            return (f"--kl-guidance {self.kl_guidance}: the KL term's base model runs at the run's --guidance "
                    f"{self.guidance} here (its forward at another guidance is not built yet); drop --kl-guidance")
        if not 1 <= self.member_chunks <= self.group_size:
            return f"--member-chunks {self.member_chunks}: must be in 1..--group-size {self.group_size}"
        return None

    # ALGO LOGIC (the SDE step is SDEStep's: CPS by default)
    def initial_noise(self, draw, generators):
        """Each member its own x_T: (B, G, ...)."""
        return per_member_noise(draw, generators, self.group_size)

    def trained_steps(self, iteration):
        return random_steps(iteration, count=self.sde_draws, window=self.sde_window, seed=self.seed)

    def cost_iterations(self):
        """64 draws of the SDE steps."""
        return list(range(64))

    def rollout(self, velocity_fn, noise, sigmas, generators, steps, image_only_fn=None):
        """noise: (B, G, ...); SDE at the drawn `steps`, ODE elsewhere; each trained step's old mean kept."""
        return rollout_trajectories(velocity_fn, noise, sigmas, generators, group_size=self.group_size,
                                    sde_steps=steps, step_fn=self.step, max_batch=self.max_batch,
                                    ode_elsewhere=True, per_member_noise=True, image_only_fn=image_only_fn,
                                    mean_fn=self.mean_std)

    def advantages(self, scores, weights, ranks=None, rollout=None):
        return global_std_advantages(scores, weights, self.adv_clip_max, ranks)

    def kl(self, velocity, base_velocity, sigmas, i):
        """Its pull to the base model, x-based: mean |mu - mu_ref|^2 per sample (n,), the squared mean gap (not a
        KL: no 1 / (2 std^2)). mean_std is linear in (x, v), so mu(x, v) - mu(x, v_ref) = mu(0, v - v_ref)."""
        gap = velocity.float() - base_velocity.float()
        mean_gap = self.mean_std(torch.zeros_like(gap), gap, sigmas, i)[0]
        return (mean_gap**2).mean(dim=tuple(range(1, gap.ndim)))

    def base_guidance(self, guidance):
        """The base model's guidance in the KL term: --kl-guidance, or the run's --guidance."""
        return guidance if self.kl_guidance is None else self.kl_guidance

    def optimizer_steps(self, num_trained_steps):
        return self.inner_epochs * self.member_chunks

    def update(self, rollout, advantages, ctx):
        """Flow-GRPO's accumulated update with the mask's loss; losses/masked_fraction: the share of trained members
        the mask dropped, over every rank."""
        if self.kl_beta > 0 and self.kl_guidance is not None and ctx.base_guidance != self.kl_guidance:
            raise RuntimeError(f"--kl-guidance {self.kl_guidance}: the base model's velocity came at guidance "
                               f"{ctx.base_guidance} (None: the run's), not at the method's `base_guidance`; the loop "
                               f"must run ctx.base_velocity_fn at it (or pass --kl-guidance None)")
        counts = [0, 0]  # members dropped, members trained

        def loss(ki, rows, velocity, log_probs, old_log_probs, step_advantages, weights):
            k = rollout.sde_steps[ki]
            x = rollout.start_latents[:, ki].flatten(0, 1)[rows]  # (n, ...): one member a row (S = G)
            mean, std = self.mean_std(x, velocity.detach(), ctx.sigmas, k)  # (n, ...): the mask takes no gradient
            old_mean = rollout.old_means[:, ki].flatten(0, 1)[rows]  # (n, ...)
            kl = trust_region_kl(mean, old_mean, std)[:, None]  # (n, 1)
            batch_loss, keep = masked_loss(log_probs, old_log_probs, step_advantages, kl, self.kl_mask_threshold,
                                           weights)
            counts[0] += int((~keep & (weights > 0)).sum())
            counts[1] += int((weights > 0).sum())
            return batch_loss

        stats = accumulated_update(self, ctx, rollout, advantages, policy_loss=loss)
        all_sum = ctx.ranks.sum if ctx.ranks is not None else (lambda n: n)
        stats["masked_fraction"] = all_sum(counts[0]) / max(all_sum(counts[1]), 1)  # over every rank's members
        return stats
