"""Sampling a flow model with log-probabilities, and the G2RPO rollout.

Time convention (used everywhere in this project): sigma runs from 1 (pure noise) to 0 (data), as in diffusers.
    x_sigma = (1 - sigma) * x0 + sigma * eps,     the model predicts the velocity v ~ eps - x0,
so an Euler (ODE) step from sigma to sigma_next is x + (sigma_next - sigma) * v, and x0_hat = x - sigma * v.

G2RPO rollout for one prompt (paper Sec. 3, ALGORITHM.md Sec. 4):
  1. one initial noise x_T shared by the G group members;
  2. a deterministic ODE anchor trajectory anchor[0..N] from x_T;
  3. singular stochastic sampling: at each k in the SDE step set M, member i takes ONE SDE step from anchor[k],
     giving x_{k+1}^i and its log-probability; every member shares anchor[k], so the anchor's velocity is reused;
  4. multi-granularity completion: from x_{k+1}^i, an ODE on `granular_schedule(sigmas, k, g)` for each g in Lambda.
The baseline (`rollout_full_sde`) samples G full SDE trajectories per prompt instead (DanceGRPO / Flow-GRPO).

A model enters only as a velocity function `velocity_fn(latents, sigma, prompt_index) -> velocity`, with latents
(M, ...) in the model's own layout, a per-sample sigma (M,) and a per-sample index (M,) into the prompt batch, so
branches at different steps and of different prompts share one transformer call.

Shapes: B prompts, G group size, K SDE steps in M, J granularities in Lambda, N sampling steps, (...) the latent.

Deviations from the reference code (bcmi/Granular-GRPO):
  1. The SDE step at k reuses the anchor's velocity at anchor[k] (the reference recomputes it once per member).
  2. The granularities of a branch share every ODE step while their schedules coincide (the first fine step and
     the forward at sigmas[k+2]); the reference recomputes them per granularity.
  3. All live branches of all prompts advance together, micro-batched by `max_batch`; the reference runs every
     forward at batch 1. NFE at the reference settings: 1,504 for Lambda {1, 2} (reference 1,792).
  4. Sigma is passed to the model exactly; the reference quantises it to int(sigma * 1000) / 1000.
"""
import math
from dataclasses import dataclass

import torch


def sigma_schedule(num_steps: int, shift: float) -> torch.Tensor:
    """sigmas[0..N], 1 -> 0: linspace, then the SD3 time shift sigma' = shift * s / (1 + (shift - 1) * s)."""
    s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return (shift * s / (1 + (shift - 1) * s)).float()  # (N + 1,)


def sde_step(latents, velocity, sigmas, i, eta, noise=None, next_latents=None):
    """One step from sigmas[i] to sigmas[i + 1]; returns (next_latents, log_prob (batch,) or None when eta == 0).

    Flow-GRPO's SDE (ALGORITHM.md Sec. 3), with dt = sigma_next - sigma < 0:
        std_dev = eta * sqrt(sigma / (1 - sigma))
        mean    = x * (1 + std_dev^2 / (2 sigma) * dt) + v * (1 + std_dev^2 (1 - sigma) / (2 sigma)) * dt
        x_next  = mean + std_dev * sqrt(-dt) * noise
    Given `next_latents`, nothing is sampled: the stored step is scored (the update re-evaluates rollouts this way).
    """
    # fp32 whatever the model's dtype: the rollout and the update must score the same step identically,
    # or the ratio is not 1 before the first update.
    x, v = latents.float(), velocity.float()
    sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])
    dt = sigma_next - sigma
    if eta == 0:
        return x + dt * v, None  # plain Euler ODE step; no log-prob for a deterministic step
    # at sigma = 1 the reference divides by 1 - sigmas[1] instead of 0
    std_dev = eta * math.sqrt(sigma / (1 - (sigma if sigma < 1 else float(sigmas[1]))))
    mean = x * (1 + std_dev**2 / (2 * sigma) * dt) + v * (1 + std_dev**2 * (1 - sigma) / (2 * sigma)) * dt
    std = std_dev * math.sqrt(-dt)
    if next_latents is None:
        if noise is None:
            noise = torch.randn_like(x)
        next_latents = mean + std * noise.float()
    next_latents = next_latents.float()
    # log N(x_next; mean, std^2), averaged (not summed) over every non-batch element: this fixes the scale of the
    # log-ratio, and so the meaning of the clip range (1e-4 in the reference)
    log_prob = -((next_latents - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return next_latents, log_prob.mean(dim=tuple(range(1, x.ndim)))  # (batch,)


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


class Counter:
    """Calls a velocity function in micro-batches of at most `max_batch` and counts image-forwards and calls."""

    def __init__(self, velocity_fn, max_batch: int):
        self.velocity_fn, self.max_batch = velocity_fn, max_batch
        self.nfe, self.calls = 0, 0

    def __call__(self, latents, sigma, prompt_index):
        out = []
        for start in range(0, latents.shape[0], self.max_batch):
            end = start + self.max_batch
            out.append(self.velocity_fn(latents[start:end], sigma[start:end], prompt_index[start:end]))
            self.nfe, self.calls = self.nfe + out[-1].shape[0], self.calls + 1
        return torch.cat(out)


@dataclass
class Rollout:
    """What the update and the rewards need from one rollout. Fields not used by a mode are None.

    latents:        (B, K, S, ...) where each trained step starts: S = 1 (the shared anchor, G2RPO) or S = G (full SDE)
    next_latents:   (B, K, G, ...) each member's SDE sample from there
    old_log_probs:  (B, K, G) its log-probability at sampling time
    final_latents:  (B, J, K, G, ...) G2RPO: each completion's final latent; full SDE: (B, 1, 1, G, ...)
    anchor_final:   (B, ...) the anchor's final latent (G2RPO only; scored for logging)
    """

    latents: torch.Tensor
    next_latents: torch.Tensor
    old_log_probs: torch.Tensor
    final_latents: torch.Tensor
    anchor_final: torch.Tensor | None
    sde_steps: list
    nfe: int
    calls: int


def _expand(idx: torch.Tensor, repeats: int) -> torch.Tensor:
    return idx.repeat_interleave(repeats)


def prompt_noise(generators, shape, device):
    """Standard normal noise (B, *shape), prompt b drawn from its own CPU generator `generators[b]`, so a prompt's
    noise does not depend on which other prompts share its batch (or rank)."""
    return torch.stack([torch.randn(shape, generator=gen) for gen in generators]).to(device)


@torch.no_grad()
def ode_sample(velocity_fn, noise, sigmas, max_batch=64):
    """Deterministic sampling (eta = 0) of every sample of `noise` (B, ...): returns x0 and every latent (N+1, B, ...)."""
    counter = Counter(velocity_fn, max_batch)
    prompt_index = torch.arange(noise.shape[0], device=noise.device)
    latents, trajectory = noise.float(), [noise.float()]
    for i in range(len(sigmas) - 1):
        sigma = sigmas[i].expand(noise.shape[0]).to(noise.device)
        velocity = counter(latents, sigma, prompt_index)
        latents, _ = sde_step(latents, velocity, sigmas, i, eta=0.0)
        trajectory.append(latents)
    return latents, torch.stack(trajectory), counter


@torch.no_grad()
def rollout_g2rpo(velocity_fn, noise, sigmas, group_size, sde_steps, granularities, eta, generators, max_batch=64):
    """The G2RPO rollout for a batch of prompts. noise: (B, ...) one initial noise per prompt (shared by its group);
    generators: B CPU torch.Generator, one per prompt, for its members' SDE noise.

    Returns a `Rollout`; `nfe` and `calls` count the image-forwards and velocity calls of the whole rollout.
    """
    B, G = noise.shape[0], group_size
    device, shape = noise.device, noise.shape[1:]
    counter = Counter(velocity_fn, max_batch)

    # 2. anchor: the ODE trajectory from x_T, keeping the latent and the velocity at every step that branches
    anchor, velocities = [noise.float()], {}
    for i in range(len(sigmas) - 1):
        v = counter(anchor[i], sigmas[i].expand(B).to(device), torch.arange(B, device=device))  # (B, ...)
        if i in sde_steps:
            velocities[i] = v
        anchor.append(sde_step(anchor[i], v, sigmas, i, eta=0.0)[0])

    # 3. singular stochastic sampling: one SDE step per member from anchor[k], reusing the anchor's velocity there
    next_latents, old_log_probs = [], []
    for k in sde_steps:
        x = anchor[k].repeat_interleave(G, dim=0)  # (B*G, ...)
        v = velocities[k].repeat_interleave(G, dim=0)  # (B*G, ...)
        noise_k = prompt_noise(generators, (G, *shape), device).flatten(0, 1)  # (B*G, ...)
        x_next, log_prob = sde_step(x, v, sigmas, k, eta, noise=noise_k)
        next_latents.append(x_next.view(B, G, *shape))
        old_log_probs.append(log_prob.view(B, G))

    # 4. multi-granularity completion. A node is a latent that several granularities of one branch step k still
    # share (their schedules agree so far); each round, every live node of every k takes one ODE step, in one
    # batched call with per-sample sigma, then splits where its granularities' schedules part.
    schedules = {(k, g): granular_schedule(sigmas, k, g)[k + 1 :] for k in sde_steps for g in granularities}
    nodes = [(k, list(granularities), next_latents[n].reshape(B * G, *shape)) for n, k in enumerate(sde_steps)]
    final = {}
    step = 0
    while nodes:
        live = [node for node in nodes if len(schedules[node[0], node[1][0]]) > step + 1]
        for k, gs, x in nodes:
            if len(schedules[k, gs[0]]) == step + 1:  # schedule exhausted: x is this branch's image latent
                for g in gs:
                    final[k, g] = x
        if not live:
            break
        x_all = torch.cat([x for _, _, x in live])  # (M, ...)
        sigma_all = torch.cat([schedules[k, gs[0]][step].expand(x.shape[0]) for k, gs, x in live]).to(device)
        prompt_all = torch.cat([_expand(torch.arange(B, device=device), G) for _ in live])
        v_all = counter(x_all, sigma_all, prompt_all).split([x.shape[0] for _, _, x in live])
        nodes = []
        for (k, gs, x), v in zip(live, v_all):
            children = {}
            for g in gs:  # group the granularities by where their schedule goes next
                children.setdefault(float(schedules[k, g][step + 1]), []).append(g)
            for child in children.values():
                sched = schedules[k, child[0]]
                nodes.append((k, child, x + (sched[step + 1] - sched[step]).to(device) * v))  # Euler step
        step += 1

    final_latents = torch.stack([torch.stack([final[k, g].view(B, G, *shape) for k in sde_steps], 1)
                                 for g in granularities], 1)  # (B, J, K, G, ...)
    return Rollout(
        latents=torch.stack([anchor[k] for k in sde_steps], 1).unsqueeze(2),  # (B, K, 1, ...)
        next_latents=torch.stack(next_latents, 1),  # (B, K, G, ...)
        old_log_probs=torch.stack(old_log_probs, 1),  # (B, K, G)
        final_latents=final_latents,
        anchor_final=anchor[-1],  # (B, ...)
        sde_steps=list(sde_steps), nfe=counter.nfe, calls=counter.calls,
    )


@torch.no_grad()
def rollout_full_sde(velocity_fn, noise, sigmas, group_size, sde_steps, eta, generators, max_batch=64):
    """Baseline (DanceGRPO / Flow-GRPO): G full SDE trajectories per prompt from the shared noise; one reward per
    trajectory is later broadcast to its trained steps `sde_steps`. Every step is an SDE step."""
    B, G = noise.shape[0], group_size
    device, shape = noise.device, noise.shape[1:]
    counter = Counter(velocity_fn, max_batch)
    prompt_index = _expand(torch.arange(B, device=device), G)  # (B*G,)
    x = noise.float().repeat_interleave(G, dim=0)  # (B*G, ...)
    trained = {}
    for i in range(len(sigmas) - 1):
        v = counter(x, sigmas[i].expand(B * G).to(device), prompt_index)
        noise_i = prompt_noise(generators, (G, *shape), device).flatten(0, 1)  # (B*G, ...)
        x_next, log_prob = sde_step(x, v, sigmas, i, eta, noise=noise_i)
        if i in sde_steps:
            trained[i] = (x, x_next, log_prob)
        x = x_next
    return Rollout(
        latents=torch.stack([trained[k][0].view(B, G, *shape) for k in sde_steps], 1),  # (B, K, G, ...)
        next_latents=torch.stack([trained[k][1].view(B, G, *shape) for k in sde_steps], 1),  # (B, K, G, ...)
        old_log_probs=torch.stack([trained[k][2].view(B, G) for k in sde_steps], 1),  # (B, K, G)
        final_latents=x.view(B, 1, 1, G, *shape),  # (B, 1, 1, G, ...)
        anchor_final=None, sde_steps=list(sde_steps), nfe=counter.nfe, calls=counter.calls,
    )
