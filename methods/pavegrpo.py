"""Pave-GRPO (arXiv 2606.01636, by G2RPO's authors): denser temporal supervision from G2RPO's own rollouts.

The rollout and the rewards are G2RPO's: an ODE anchor, one SDE step per member at each trained step k, ODE
completions (the authors' scripts complete at one granularity, stride 1). What changes is the update. At step k, with
Delta = sigma_{k+1} - sigma_k and the anchor latent x_k shared by the group:
  - the usual term scores each member's stored x_{k+1}^i under the SDE step from (x_k, sigma_k), as G2RPO does;
  - for each n in the sub-step counts S (the authors' `seg_list`, {2, 3}), the interval is split into n equal
    sub-steps s_j = sigma_k + j Delta / n, and the current policy walks n - 1 Euler sub-steps from x_k, with gradients
    through every one of them:
        y_0 = x_k,   y_{j+1} = y_j + (Delta / n) v_theta(y_j, s_j)          j = 0 .. n - 2
    then x_{k+1}^i is scored under the SDE step from (y_{n-1}, s_{n-1}) over the last sub-interval (the same
    `sampler.sde_step` formula, at the sub-step's own sigma and dt);
  - the loss of step k is the usual term plus the mean over n of the sub-trajectory terms,
        L_k = l(log p_0) + (1 / |S|) sum_n l(log p_n),        l(log p) = mean_i -A_i,k exp(log p_i - sg(log p_i))
    and the update takes one optimizer step on the mean over k.
Only the update pays: sum_n (n - 1) extra forwards per start latent and trained step (3 for S = {2, 3}); train.py
counts them as perf/update_nfe.

The loss as the authors run it (`ratio_on_policy` here): the ratio is taken against a detached copy of the same
forward, so it is exactly 1, never clipped, and its gradient is -A grad log p: a REINFORCE step with the group
advantage. G2RPO's update (g2rpo.py) takes the ratio against the log-probability the rollout stored, clipped to
1 +- eps: the same gradient at the first optimizer step of an iteration (where the policy is still the rollout's),
but after it (an optimizer step per k, --inner-epochs) the clip bounds how far each step moves the policy. The
sub-trajectory terms have no stored log-probability to be the old one (the rollout never walked them), which is why
this ratio suits them. The figures logged (losses/ratio_*, first_ratio_error) compare the usual term's
log-probability with the rollout's, as G2RPO's do, so that a rollout that disagrees with the update still shows.

Differences from the authors' code (`Bujiazi/GRPO-Series`, src/method_pavegrpo.py, scripts/train_pavegrpo.sh):
  1. The log-probability keeps the Gaussian's log-std and constant terms, which cancel in the ratio.
  2. The sub-steps' velocities are batched by depth across n (one call at each depth), as theirs; with several
     prompts per rank they are also batched across prompts (theirs: one prompt per GPU).
  3. Every rank draws its own noise (per-prompt generators); theirs seeds every GPU alike.
  4. On presets other than --model flux, the preset's sizes stand (as for every peer).

Run it:
    python train.py --model tiny --method pavegrpo
    torchrun --nproc_per_node 8 train.py --model flux --method pavegrpo --rewards hpsv3=1.0
"""
from dataclasses import dataclass, field

import torch

from g2rpo import G2RPO
from methods.base import Method, SDEStep, member_log_probs, optimizer_step, ratio_stats, step_backward, update_stats
from sampler import sde_step
# -----------------------------------------------------------------------------------------------------------------
# The values Pave-GRPO runs with, each with whose it is; what they do not name is every method's start
# (g2rpo.py's VALUES) and the model's preset (lab/flags.py). `python train.py --model M --method NAME
# --show-config` prints a run's, each value with where it came from.
# -----------------------------------------------------------------------------------------------------------------
RECIPE = {"eta": 0.8}
PRESETS = {
    # scripts/train_pavegrpo.sh: 8 GPUs x 1 prompt, a full fine-tune (bf16, gradient checkpointing), 300 steps,
    # HPSv3
    "flux": {"resolution": 512, "num_steps": 16, "shift": 3.0, "sde_steps": [0, 2, 4, 6], "group_size": 12,
             "lr": 2e-6, "lora_rank": 0, "prompts_per_iteration": 8, "num_iterations": 300, "max_grad_norm": 1.0,
             "adv_clip_max": 5.0, "rewards": ["hpsv3=1.0"]},
    # the tiny world and FLUX.2 klein complete at G2RPO's strides there (the bench's rows were measured so)
    "tiny": dict(granularities=[1, 2, 3]), "flux2": dict(granularities=[1, 2])}


def ratio_on_policy(log_probs, advantages):
    """mean_i -A_i exp(log p_i - sg(log p_i)): the ratio is 1, the gradient -A grad log p (the authors' loss)."""
    return (-advantages * torch.exp(log_probs - log_probs.detach())).mean()


def sub_step_log_probs(velocity_fn, step_fn, x, velocity, targets, sigmas, k, prompt_index, counts, max_batch=None):
    """The log-probability of each stored x_{k+1} at the end of each sub-trajectory of step k. x: (n, ...) the start
    latents, `velocity` the current policy's velocity there (n, ...), targets (n, G, ...) the members that left each,
    prompt_index (n,), counts: the sub-step counts c. For each c: c - 1 Euler sub-steps from x, then the SDE step of
    the last sub-interval. The velocities at one depth are one call (in rows of at most `max_batch`), with
    gradients. Returns {c: (n, G)}; sum (c - 1) forwards were made per start latent."""
    n = x.shape[0]
    sub = {c: torch.linspace(float(sigmas[k]), float(sigmas[k + 1]), c + 1) for c in counts}  # s_0 .. s_c
    y, v = {c: x for c in counts}, {c: velocity for c in counts}
    for depth in range(1, max(counts, default=1)):
        walking = [c for c in counts if depth < c]  # the sub-trajectories that take another sub-step
        for c in walking:
            y[c] = sde_step(y[c], v[c], sub[c], depth - 1, eta=0.0)[0]  # Euler, in fp32: y_depth
        latents = torch.cat([y[c] for c in walking])  # (n * len(walking), ...)
        sigma = torch.cat([sub[c][depth].expand(n) for c in walking]).to(x.device)
        index = prompt_index.repeat(len(walking))
        rows = torch.arange(len(latents)).split(max_batch or len(latents))
        velocities = torch.cat([velocity_fn(latents[r], sigma[r], index[r]) for r in rows])
        v.update(zip(walking, velocities.split(n)))
    return {c: member_log_probs(step_fn, y[c], v[c], targets, sub[c], c - 1) for c in counts}  # (n, G) each


def series_update(method, ctx, rollout, advantages, counts):
    """The update of the GRPO series (Pave-GRPO; AdaGRPO, which has no sub-steps: `counts` empty) on G2RPO's rollout:
    per inner epoch one optimizer step on L = mean_k L_k, the authors' on-policy ratio. advantages: (B, K, G). The
    start latents are the prompts' anchors (one per prompt), in micro-batches of `method.max_batch`; the sub-steps
    add sum_c (c - 1) forwards per start latent, whose activations are held until the micro-batch's backward.
    ctx: methods.base.UpdateContext. Returns `methods.base.update_stats`."""
    B, K, G = advantages.shape
    per_step, grad_norms = [], []
    ctx.optimizer.zero_grad(set_to_none=True)
    for _ in range(method.inner_epochs):
        for ki, k in enumerate(rollout.sde_steps):
            targets = rollout.next_latents[:, ki]  # (B, G, ...)

            def loss_fn(rows, x, velocity, log_probs, base):
                A = advantages[rows, ki].to(x.device)  # (n, G)
                step_loss = ratio_on_policy(log_probs, A)
                if counts:
                    subs = sub_step_log_probs(ctx.velocity_fn, method.step, x, velocity, targets[rows], ctx.sigmas,
                                              k, rows.to(x.device), counts, method.max_batch)
                    step_loss = step_loss + sum(ratio_on_policy(lp, A) for lp in subs.values()) / len(counts)
                kl = 0.0
                if method.kl_beta > 0:  # KL to the base model's step at x_k, as G2RPO's
                    row_kl = method.kl(velocity, base(), ctx.sigmas, k).mean()
                    step_loss = step_loss + method.kl_beta * row_kl
                    kl = float(row_kl.detach()) * len(rows) / B
                share = len(rows) / B / K  # each micro-batch weighs by its share of mean_k mean_b
                log_ratio = (log_probs - rollout.old_log_probs[rows, ki].to(x.device)).detach().flatten()
                return step_loss * share, float(step_loss.detach()) * len(rows) / B, kl, log_ratio

            loss, kl, log_ratios = step_backward(method, ctx, rollout, ki, loss_fn)
            per_step.append({"loss": loss, "kl": kl, **ratio_stats(log_ratios, method.clip_range)})
        grad_norms.append(optimizer_step(ctx.params, ctx.optimizer, method.max_grad_norm))
    return update_stats(per_step, grad_norms)


@dataclass
class PaveGRPO(Method, SDEStep):
    """Pave-GRPO: the run's flags it reads (methods/base.py's, and --sde-steps), then its own (train.py's under
    --method pavegrpo)."""

    label = "Pave-GRPO"

    sde_steps: list[int]
    # --- its own flags ---
    sub_steps: list[int] = field(default_factory=lambda: [2, 3])
    """S, the sub-step counts of the extra trajectories scored at each trained step (the authors' seg_list {2, 3});
    each count n costs n - 1 forwards with gradients per start latent and step; [] is G2RPO's rollout with the
    authors' on-policy loss alone."""
    granularities: list[int] = field(default_factory=lambda: [1])
    """ODE strides of the completions, as G2RPO's --granularities (the authors' scripts: {1})."""

    per_step_advantages = True
    recipe, presets = RECIPE, PRESETS  # (the file's top)
    # G2RPO's trained steps, rollout and advantage, borrowed (a subclass would inherit G2RPO's flags); its SDE step
    # and KL are SDEStep's, as G2RPO's
    trained_steps, rollout, advantages = G2RPO.trained_steps, G2RPO.rollout, G2RPO.advantages
    notes = G2RPO.notes

    def problem(self, num_steps):
        if any(n < 2 for n in self.sub_steps) or len(set(self.sub_steps)) != len(self.sub_steps):
            return f"--sub-steps {self.sub_steps}: give distinct counts >= 2, e.g. --sub-steps 2 3"
        return G2RPO.problem(self, num_steps)

    def update_nfe(self, rollout):
        """Forwards with gradients: 1 + sum_n (n - 1) per start latent, trained step and inner epoch."""
        return Method.update_nfe(self, rollout) * (1 + sum(n - 1 for n in self.sub_steps))

    def optimizer_steps(self, num_trained_steps):
        return self.inner_epochs

    def update(self, rollout, advantages, ctx):
        return series_update(self, ctx, rollout, advantages, self.sub_steps)
