"""Sampling a flow model with log-probabilities, and the G2RPO rollout.

Time convention (used everywhere in this project): sigma runs from 1 (pure noise) to 0 (data), as in diffusers.
    x_sigma = (1 - sigma) * x0 + sigma * eps,     the model predicts the velocity v ~ eps - x0,
so an Euler (ODE) step from sigma to sigma_next is x + (sigma_next - sigma) * v, and x0_hat = x - sigma * v.

The SDE step (paper Eq. 4-5), from sigma to sigma_next = sigma + dt (dt < 0), is a Gaussian whose mean follows the
velocity with a correction that the noise scale std_dev = eta sqrt(sigma / (1 - sigma)) sets, and whose std is
std_dev sqrt(-dt) (`sde_std_dev`, `sde_mean_std`). Every SDE method may take instead the coefficients-preserving step
(CPS; Wang & Yu 2025, arXiv 2509.05952), which keeps the noise of x_next at exactly sigma_next (`cps_mean_std`), and,
as its authors score it, log p = -|x_next - mean|^2 (averaged): the Gaussian's without its constant and its
1 / (2 std^2), so a ratio of two CPS log-probs is on another scale than the flow step's (hence its own clip range).
Its KL term to the base model drops the 1 / (2 std^2) too, mean |mean - mean_ref|^2, as the CPS authors' main
scripts do since their commit 814c359 (`cps_kl`; their train_sd3_fast.py keeps the Gaussian KL, `gaussian=True`).

G2RPO rollout for one prompt (paper Sec. 3.2-3.3):
  1. one initial noise x_T shared by the G group members;
  2. a deterministic ODE anchor trajectory anchor[0..N] from x_T;
  3. singular stochastic sampling: at each k in the SDE step set M, member i takes ONE SDE step from anchor[k],
     giving x_{k+1}^i and its log-probability;
  4. multi-granularity completion: from x_{k+1}^i, an ODE on `granular_schedule(sigmas, k, g)` for each g in Lambda.
`rollout_g2rpo_paper` is that procedure written loop for loop at batch 1, for reading; `rollout_g2rpo` computes
the same latents with shared and batched forwards (tests/test_method.py checks they agree).

A model enters only as a velocity function `velocity_fn(latents, sigma, prompt_index) -> velocity`, with latents
(n, ...) in the model's own layout, a per-sample sigma (n,) and a per-sample index (n,) into the prompt batch, so
branches at different steps and of different prompts share one transformer call. A rollout may take a second one,
`image_only_fn`, for the forwards whose velocity no log-probability reads: the anchor's steps outside the trained
set and every ODE completion. They only make the images that are scored, so they may run on a cheaper copy of the
model (--rollout-precision fp8), while the trained steps, whose log-probabilities the update's ratio divides by,
stay on `velocity_fn`.

Shapes: B prompts, G group size, K SDE steps in M, J granularities in Lambda, N sampling steps, (...) the latent.

Deviations from the reference code (numbers of the README's list): 1 (shared forwards), 2 (batching).
"""
import math
from dataclasses import dataclass

import torch


SIGMA_GRIDS = ("linear", "sd3")  # --sigma-grid
SDE_TYPES = ("flow", "cps")  # a method's --sde-type: the SDE step above, or the coefficients-preserving one


def sigma_schedule(num_steps: int, shift: float, grid: str = "linear") -> torch.Tensor:
    """sigmas[0..N], 1 -> 0, the SD3 time shift sigma' = shift * s / (1 + (shift - 1) * s) of a grid s:
        linear: s = linspace(1, 0, N + 1)                       (the reference's; sigma_N = 0)
        sd3:    s = linspace(1, shift(1/1000), N), then sigma_N = 0
                (diffusers' FlowMatchEulerDiscreteScheduler, whose last training sigma, itself shifted, ends the grid;
                at N 10 its last nonzero sigma is 0.0089, the linear grid's 0.25)"""
    bend = lambda s: shift * s / (1 + (shift - 1) * s)  # noqa: E731
    if grid == "sd3":
        s = torch.linspace(1.0, bend(1 / 1000), num_steps, dtype=torch.float64)  # (N,)
    else:
        s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)  # (N + 1,)
    sigmas = bend(s)
    if grid == "sd3":
        sigmas = torch.cat([sigmas, sigmas.new_zeros(1)])
    return sigmas.float()  # (N + 1,)


def sde_std_dev(sigmas, i, eta) -> float:
    """The noise scale std_dev of step i, before the sqrt(-dt) of the step: eta * sqrt(sigma / (1 - sigma)). At
    sigma = 1 that divides by 0: the reference code divides by 1 - sigmas[1] instead, and so do we."""
    sigma = float(sigmas[i])
    return eta * math.sqrt(sigma / (1 - (sigma if sigma < 1 else float(sigmas[1]))))


def sde_mean_std(x, v, sigmas, i, std_dev):
    """The Gaussian step from sigmas[i] to sigmas[i + 1] with noise scale `std_dev`: (mean, std) of x_next given x
    and the velocity v (in their dtype: the callers pass fp32). dt = sigma' - sigma < 0:
        mean = x * (1 + std_dev^2 / (2 sigma) * dt) + v * (1 + std_dev^2 (1 - sigma) / (2 sigma)) * dt
        std  = std_dev * sqrt(-dt)
    """
    sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])
    dt = sigma_next - sigma
    mean = x * (1 + std_dev**2 / (2 * sigma) * dt) + v * (1 + std_dev**2 * (1 - sigma) / (2 * sigma)) * dt
    return mean, std_dev * math.sqrt(-dt)


def cps_mean_std(x, v, sigmas, i, eta):
    """The coefficients-preserving step from sigmas[i] to sigmas[i + 1]: (mean, std) of x_next given x and v (in their
    dtype: the callers pass fp32).
        mean = (1 - sigma') (x - sigma v) + sqrt(sigma'^2 - std^2) (x + (1 - sigma) v),   std = sigma' sin(eta pi / 2)
    so x_next = mean + std * noise carries noise of std sigma' in all, as the schedule's x_sigma' does (eta <= 1)."""
    sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])
    std = sigma_next * math.sin(eta * math.pi / 2)
    mean = (1 - sigma_next) * (x - sigma * v) + math.sqrt(max(sigma_next**2 - std**2, 0.0)) * (x + (1 - sigma) * v)
    return mean, std


def step_mean_std(x, v, sigmas, i, std_dev, sde_type="flow", eta=None):
    """(mean, std) of the step of `sde_type` (SDE_TYPES): the flow step at noise scale `std_dev` (`sde_mean_std`), or
    the CPS step at `eta` (`cps_mean_std`)."""
    if sde_type == "cps":
        return cps_mean_std(x, v, sigmas, i, eta)
    return sde_mean_std(x, v, sigmas, i, std_dev)


def gaussian_step(mean, std, noise=None, next_latents=None, sde_type="flow"):
    """Sample x_next = mean + std * noise, or, given `next_latents`, score that stored sample instead (the update
    re-evaluates rollouts this way). Returns (next_latents, log_prob (batch,)); sde_type "cps" scores it as the CPS
    authors do, -|x_next - mean|^2."""
    if next_latents is None:
        next_latents = mean + std * (torch.randn_like(mean) if noise is None else noise.float())
    next_latents = next_latents.float()
    if sde_type == "cps":
        # the Gaussian's log-density less its constant and times 2 std^2 (the std is the old and the new policy's
        # alike, so the ratio keeps its sign, not its size). The step into sigma 0 has std 0: its own sample scores 0
        # at sampling time (and cannot be trained: a run that would is refused)
        log_prob = -((next_latents - mean) ** 2)
    else:
        # log N(x_next; mean, std^2), averaged (not summed) over every non-batch element: this fixes the scale of
        # the log-ratio, and so the meaning of the clip range (1e-4 in the reference)
        log_prob = -((next_latents - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return next_latents, log_prob.mean(dim=tuple(range(1, mean.ndim)))  # (batch,)


def sde_step(latents, velocity, sigmas, i, eta, noise=None, next_latents=None, sde_type="flow"):
    """One step from sigmas[i] to sigmas[i + 1]: returns (next_latents, log_prob (batch,) or None when eta == 0).

    x_next = mean + std * noise with the (mean, std) of `sde_mean_std` at std_dev = `sde_std_dev` (sde_type "cps":
    of `cps_mean_std`). Given `next_latents`, nothing is sampled: the stored step is scored.
    """
    # fp32 whatever the model's dtype, so the update re-scores a stored step with the rollout's arithmetic. This
    # alone does not make the first ratio 1: the velocity must also match, and the update computes it through the
    # DDP / FSDP2 wrapper under the update's attention kernel, the rollout through the bare transformer under the
    # rollout's (same weights; the same kernels unless --rollout-attention-backend differs). tools/gpu_check.py measures
    # the first step's ratio at learning rate 0 on the GPU; losses/first_ratio_error logs it every iteration.
    x, v = latents.float(), velocity.float()
    if eta == 0:
        return x + (float(sigmas[i + 1]) - float(sigmas[i])) * v, None  # plain Euler ODE step; no log-prob
    std_dev = sde_std_dev(sigmas, i, eta) if sde_type == "flow" else None
    mean, std = step_mean_std(x, v, sigmas, i, std_dev, sde_type, eta)
    return gaussian_step(mean, std, noise, next_latents, sde_type)


def sde_kl(velocity, base_velocity, sigmas, i, std_dev):
    """KL(policy step || base model step) at step i, per sample, averaged over elements like the log-prob: (batch,).

    Both steps are Gaussians with the same std, and their means differ only through the velocity:
    mean - mean_base = (v - v_base) * c, with c = (1 + std_dev^2 (1 - sigma) / (2 sigma)) dt the velocity's
    coefficient in the mean (`sde_mean_std`), so KL = |mean - mean_base|^2 / (2 std^2), std = std_dev sqrt(-dt).
    """
    sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])
    dt = sigma_next - sigma
    mean_gap = (velocity.float() - base_velocity.float()) * (1 + std_dev**2 * (1 - sigma) / (2 * sigma)) * dt
    kl = mean_gap**2 / (2 * std_dev**2 * -dt)
    return kl.mean(dim=tuple(range(1, kl.ndim)))  # (batch,)


def cps_kl(velocity, base_velocity, sigmas, i, eta, gaussian=False):
    """The CPS step's KL term to the base model's step, per sample (batch,). The two steps share their std and their
    means differ through the velocity alone (`cps_mean_std` is linear in (x, v), so mean(x, v) - mean(x, v_base) =
    mean(0, v - v_base)), and the term is, averaged over the latent,
        mean |mean gap|^2                    (default: the CPS authors' train_sd3.py and train_flux.py since their
                                              commit 814c359, which dropped the 1 / (2 std^2) with the log-prob's)
        mean |mean gap|^2 / (2 std^2)        (gaussian=True: the Gaussian KL, as their train_sd3_fast.py still has it)
    The step into sigma 0 has no noise, and no KL is taken there (0)."""
    gap = velocity.float() - base_velocity.float()
    mean_gap, std = cps_mean_std(torch.zeros_like(gap), gap, sigmas, i, eta)
    if std == 0:
        return torch.zeros(gap.shape[0], device=gap.device)
    # KL = |mu - mu_ref|^2, on the scale of the CPS log-prob -|x' - mu|^2 (or / (2 std^2), the Gaussian's)
    kl = mean_gap**2 / (2 * std**2) if gaussian else mean_gap**2
    return kl.mean(dim=tuple(range(1, kl.ndim)))  # (batch,)


def granular_schedule(sigmas: torch.Tensor, k: int, g: int) -> torch.Tensor:
    """Sigmas of a branch taken at SDE step k and completed with granularity g: sigmas[0:k+2] ++ sigmas[k+2::g].

    One fine step from sigmas[k+1] to sigmas[k+2], then strides of g. When the stride misses sigma = 0, the last
    entry becomes 0, so the image is the x0_hat of the last evaluated step (as the reference code does).
    """
    if g < 1:
        raise ValueError(f"granularity must be >= 1, got {g}")
    schedule = torch.cat([sigmas[: k + 2], sigmas[k + 2 :: g]]).clone()
    schedule[-1] = 0.0
    return schedule


class CountingVelocity:
    """Calls a velocity function in micro-batches of at most `max_batch` and counts image-forwards and calls."""

    def __init__(self, velocity_fn, max_batch: int):
        self.velocity_fn, self.max_batch = velocity_fn, max_batch
        self.nfe, self.calls = 0, 0

    @staticmethod
    def pair(velocity_fn, image_only_fn, max_batch: int):
        """Counters of the trained steps' forwards and of the image-only ones (the same counter without the latter)."""
        forward = CountingVelocity(velocity_fn, max_batch)
        return forward, (forward if image_only_fn is None else CountingVelocity(image_only_fn, max_batch))

    @staticmethod
    def totals(forward, image_forward) -> dict:
        """A `Rollout`'s counts from the pair: nfe, calls, and image_only_nfe (0 where they are one counter)."""
        both = [forward] if image_forward is forward else [forward, image_forward]
        return dict(nfe=sum(c.nfe for c in both), calls=sum(c.calls for c in both),
                    image_only_nfe=0 if image_forward is forward else image_forward.nfe)

    def __call__(self, latents, sigma, prompt_index):
        out = []
        for start in range(0, latents.shape[0], self.max_batch):
            end = start + self.max_batch
            out.append(self.velocity_fn(latents[start:end], sigma[start:end], prompt_index[start:end]))
            self.nfe, self.calls = self.nfe + out[-1].shape[0], self.calls + 1
        return torch.cat(out)


@dataclass
class Rollout:
    """What the update and the rewards need from one rollout.

    start_latents:  (B, K, S, ...) where each trained step starts: S = 1, the anchor that the G members share (G2RPO),
                    or S = G, one per member (whole trajectories, methods/trajectories.py)
    next_latents:   (B, K, G, ...) each member's SDE sample from there
    old_log_probs:  (B, K, G) its log-probability at sampling time
    final_latents:  (B, J, K, G, ...) each completion's final latent; whole trajectories: (B, 1, 1, G, ...)
    anchor_final:   (B, ...) the anchor's final latent (scored for logging), or None where there is no anchor
    sde_steps:      the K trained steps
    granularities:  the J strides of the completions ([] where there is one image per trajectory)
    nfe, calls:     image-forwards and velocity calls of the whole rollout
    image_only_nfe: how many of those forwards went to `image_only_fn` (0 without one)
    old_means:      (B, K, G, ...) the Gaussian mean of each member's trained step at sampling time, kept for a method
                    that compares the old and the new step's distributions (methods/flow_dppo.py), else None
    """

    start_latents: torch.Tensor
    next_latents: torch.Tensor
    old_log_probs: torch.Tensor
    final_latents: torch.Tensor
    anchor_final: torch.Tensor | None
    sde_steps: list
    granularities: list
    nfe: int
    calls: int
    image_only_nfe: int = 0
    old_means: torch.Tensor | None = None


def prompt_noise(generators, shape, device):
    """Standard normal noise (B, *shape), prompt b drawn from its own CPU generator `generators[b]`, so a prompt's
    noise does not depend on which other prompts share its batch (or rank)."""
    return torch.stack([torch.randn(shape, generator=gen) for gen in generators]).to(device)


@torch.no_grad()
def ode_sample(velocity_fn, noise, sigmas, *, max_batch=64, prompt_index=None):
    """Deterministic sampling (eta = 0) of every sample of `noise` (B, ...): x0, in `max_batch` rows a forward.
    prompt_index (B,): each sample's prompt (default: sample b is prompt b)."""
    counter = CountingVelocity(velocity_fn, max_batch)
    if prompt_index is None:
        prompt_index = torch.arange(noise.shape[0], device=noise.device)
    latents = noise.float()
    for i in range(len(sigmas) - 1):
        velocity = counter(latents, sigmas[i].expand(noise.shape[0]).to(noise.device), prompt_index)
        latents, _ = sde_step(latents, velocity, sigmas, i, eta=0.0)
    return latents


# ------------------------------------------------------------------------------------------------------------------
# The G2RPO rollout as the paper states it: one prompt at a time, one member at a time, batch-1 forwards.
# ------------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def rollout_g2rpo_paper(velocity_fn, noise, sigmas, generators, *, group_size, sde_steps, granularities, eta,
                        sde_type="flow"):
    """The paper's procedure loop for loop (and the reference code's cost: the SDE-step forward is recomputed for
    every member, every completion runs on its own). The arguments of `rollout_g2rpo` but its two speed options
    (every forward is batch 1, on `velocity_fn`): the same noise and the same `Rollout`; slow, for reading and for
    checking the fast rollout."""
    B, G, device, shape = noise.shape[0], group_size, noise.device, noise.shape[1:]
    forward = CountingVelocity(velocity_fn, max_batch=1)
    K, J = len(sde_steps), len(granularities)
    next_latents, old_log_probs = torch.zeros(B, K, G, *shape), torch.zeros(B, K, G)  # (B, K, G, ...), (B, K, G)
    final_latents, anchors = torch.zeros(B, J, K, G, *shape), []  # (B, J, K, G, ...)
    for b in range(B):
        prompt = torch.tensor([b], device=device)
        # 1-2. the anchor: an ODE trajectory from the prompt's shared initial noise x_T
        anchor = [noise[b : b + 1].float()]  # (1, ...) per step
        for i in range(len(sigmas) - 1):
            v = forward(anchor[i], sigmas[i : i + 1].to(device), prompt)  # (1, ...)
            anchor.append(sde_step(anchor[i], v, sigmas, i, eta=0.0)[0])
        anchors.append(anchor)
        for ki, k in enumerate(sde_steps):
            member_noise = torch.randn((G, *shape), generator=generators[b]).to(device)  # (G, ...)
            for member in range(G):
                # 3. singular stochastic sampling: ONE SDE step from anchor[k]
                v = forward(anchor[k], sigmas[k : k + 1].to(device), prompt)  # (1, ...)
                x_next, log_prob = sde_step(anchor[k], v, sigmas, k, eta, noise=member_noise[member : member + 1],
                                            sde_type=sde_type)
                next_latents[b, ki, member], old_log_probs[b, ki, member] = x_next[0], log_prob[0]
                # 4. multi-granularity completion: an ODE from x_{k+1} on each granularity's schedule
                for j, g in enumerate(granularities):
                    schedule = granular_schedule(sigmas, k, g)[k + 1 :].to(device)
                    x = x_next
                    for s in range(len(schedule) - 1):
                        x = x + (schedule[s + 1] - schedule[s]) * forward(x, schedule[s : s + 1], prompt)
                    final_latents[b, j, ki, member] = x[0]
    return Rollout(
        start_latents=torch.stack([torch.cat([a[k] for k in sde_steps]) for a in anchors]).unsqueeze(2),  # (B,K,1,...)
        next_latents=next_latents.to(device), old_log_probs=old_log_probs.to(device),
        final_latents=final_latents.to(device), anchor_final=torch.cat([a[-1] for a in anchors]),  # (B, ...)
        sde_steps=list(sde_steps), granularities=list(granularities), nfe=forward.nfe, calls=forward.calls)


# ------------------------------------------------------------------------------------------------------------------
# The same rollout, fast: shared forwards and every live branch of every prompt in one batched call per round.
# ------------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def rollout_g2rpo(velocity_fn, noise, sigmas, generators, *, group_size, sde_steps, granularities, eta, max_batch=64,
                  image_only_fn=None, sde_type="flow", step_fn=None):
    """The G2RPO rollout for a batch of prompts. noise: (B, ...) one initial noise per prompt (shared by its group);
    generators: B CPU torch.Generator, one per prompt, for its members' SDE noise. image_only_fn: the velocity of
    the anchor's steps outside `sde_steps` and of the completions (default `velocity_fn`). step_fn(x, v, sigmas, i,
    noise=) -> (x_next, log_prob): the branching step, the one the update scores with (a method's `step`); default
    `sde_step` at `eta` of `sde_type` (SDE_TYPES).

    Returns a `Rollout`; `nfe` and `calls` count the image-forwards and velocity calls of the whole rollout.
    """
    B, G, device, shape = noise.shape[0], group_size, noise.device, noise.shape[1:]
    forward, image_forward = CountingVelocity.pair(velocity_fn, image_only_fn, max_batch)

    # 2. anchor: the ODE trajectory from x_T, keeping the latent and the velocity at every step that branches
    anchor, velocities = [noise.float()], {}
    for i in range(len(sigmas) - 1):
        v = (forward if i in sde_steps else image_forward)(
            anchor[i], sigmas[i].expand(B).to(device), torch.arange(B, device=device))  # (B, ...)
        if i in sde_steps:
            velocities[i] = v
        anchor.append(sde_step(anchor[i], v, sigmas, i, eta=0.0)[0])

    # 3. singular stochastic sampling: one SDE step per member from anchor[k]; every member starts from the same
    # latent, so the anchor's velocity there serves them all (deviation 1)
    if step_fn is None:
        step_fn = lambda x, v, s, i, noise: sde_step(x, v, s, i, eta, noise=noise, sde_type=sde_type)  # noqa: E731
    next_latents, old_log_probs = [], []
    for k in sde_steps:
        member_noise = prompt_noise(generators, (G, *shape), device).flatten(0, 1)  # (B*G, ...)
        x_next, log_prob = step_fn(anchor[k].repeat_interleave(G, 0), velocities[k].repeat_interleave(G, 0),
                                   sigmas, k, noise=member_noise)  # (B*G, ...), (B*G,)
        next_latents.append(x_next.view(B, G, *shape))
        old_log_probs.append(log_prob.view(B, G))

    # 4. multi-granularity completion of every branch, granularities sharing forwards (deviation 1)
    final = complete_granularities(image_forward, torch.stack(next_latents, 1), sigmas, sde_steps, granularities)
    return Rollout(
        start_latents=torch.stack([anchor[k] for k in sde_steps], 1).unsqueeze(2),  # (B, K, 1, ...)
        next_latents=torch.stack(next_latents, 1),  # (B, K, G, ...)
        old_log_probs=torch.stack(old_log_probs, 1),  # (B, K, G)
        final_latents=final,  # (B, J, K, G, ...)
        anchor_final=anchor[-1],  # (B, ...)
        sde_steps=list(sde_steps), granularities=list(granularities), **CountingVelocity.totals(forward, image_forward))


def complete_granularities(forward, next_latents, sigmas, sde_steps, granularities):
    """ODE completions of every branch x_{k+1} (B, K, G, ...) at every granularity: (B, J, K, G, ...).

    A node is a latent that some granularities of one step k still share (their schedules agree so far). Each
    round, every live node of every k takes one Euler step, all in one batched call with per-sample sigma
    (deviation 2), then splits where its granularities' schedules part. A node whose schedule is spent is final.
    """
    B, K, G, *shape = next_latents.shape
    device = next_latents.device
    schedules = {(k, g): granular_schedule(sigmas, k, g)[k + 1 :].to(device) for k in sde_steps for g in granularities}
    nodes = [(k, list(granularities), next_latents[:, ki].reshape(B * G, *shape)) for ki, k in enumerate(sde_steps)]
    prompt_index = torch.arange(B, device=device).repeat_interleave(G)  # (B*G,)
    final, position = {}, 0  # position: index into every live node's schedule
    while nodes:
        live = []
        for k, gs, x in nodes:
            if len(schedules[k, gs[0]]) == position + 1:  # schedule spent: x is the image latent of these (k, g)
                final.update({(k, g): x for g in gs})
            else:
                live.append((k, gs, x))
        if not live:
            break
        sigma = torch.cat([schedules[k, gs[0]][position].expand(B * G) for k, gs, _ in live])  # (n,)
        velocity = forward(torch.cat([x for _, _, x in live]), sigma, prompt_index.repeat(len(live)))  # (n, ...)
        nodes = []
        for (k, gs, x), v in zip(live, velocity.split(B * G)):
            children = {}  # granularities grouped by where their schedule goes next
            for g in gs:
                children.setdefault(float(schedules[k, g][position + 1]), []).append(g)
            for sigma_next, child in children.items():
                nodes.append((k, child, x + (sigma_next - schedules[k, gs[0]][position]) * v))  # Euler step
        position += 1
    return torch.stack([torch.stack([final[k, g].view(B, G, *shape) for k in sde_steps], 1)
                        for g in granularities], 1)  # (B, J, K, G, ...)
