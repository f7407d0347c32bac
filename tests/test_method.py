"""The method's math: SDE step and log-prob, schedules, rollout structure and cost, advantages, clipped loss.

Run: python -m pytest -q tests/test_method.py
"""
import copy
import math

import pytest
import torch

from methods.base import UpdateContext

from advantage import granular_advantages, group_normalize
from g2rpo import G2RPO, clipped_loss
from sampler import (granular_schedule, ode_sample, rollout_g2rpo, rollout_g2rpo_paper, sde_kl, sde_std_dev, sde_step,
                     sigma_schedule)

REFERENCE_SIGMAS = [1.0, .9783, .9545, .9286, .9000, .8684, .8333, .7941, .7500, .7000, .6429, .5769, .5000,
                    .4091, .3000, .1667, 0.0]


def generators(n, seed=0):
    return [torch.Generator().manual_seed(seed + b) for b in range(n)]


def test_sigma_schedule_matches_reference_values():
    assert torch.allclose(sigma_schedule(16, 3.0), torch.tensor(REFERENCE_SIGMAS), atol=1e-4)


def test_sde_log_prob_equals_torch_normal():
    torch.manual_seed(0)
    sigmas = sigma_schedule(16, 3.0)
    x, v = torch.randn(3, 4, 5), torch.randn(3, 4, 5)
    for i in [0, 3, 7]:
        x_next, log_prob = sde_step(x, v, sigmas, i, eta=0.7)
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        dt = s_next - s
        std_dev = 0.7 * math.sqrt(s / (1 - (s if s < 1 else float(sigmas[1]))))
        mean = x * (1 + std_dev**2 / (2 * s) * dt) + v * (1 + std_dev**2 * (1 - s) / (2 * s)) * dt
        expected = torch.distributions.Normal(mean, std_dev * math.sqrt(-dt)).log_prob(x_next).mean(dim=(1, 2))
        assert log_prob.shape == (3,)
        assert torch.allclose(log_prob, expected, atol=1e-5)


def test_sde_noise_std_matches_reference_table():
    # the reference settings' injected noise std at k = 0..7 for N 16, shift 3, eta 0.7
    sigmas = sigma_schedule(16, 3.0)
    x, v = torch.zeros(1, 20000), torch.zeros(1, 20000)
    expected = [0.700, 0.723, 0.517, 0.427, 0.373, 0.337, 0.310, 0.289]
    for k, std in enumerate(expected):
        noise = torch.ones(1, 20000)
        x_next, _ = sde_step(x, v, sigmas, k, eta=0.7, noise=noise)
        assert abs(float(x_next[0, 0]) - std) < 2e-3, (k, float(x_next[0, 0]))


def test_sde_mean_at_hand_computed_point():
    sigmas = torch.tensor([0.5, 0.25, 0.0])
    x, v, noise = torch.tensor([[2.0]]), torch.tensor([[1.0]]), torch.tensor([[1.0]])
    x_next, _ = sde_step(x, v, sigmas, 0, eta=0.5, noise=noise)
    std_dev, dt = 0.5 * math.sqrt(0.5 / 0.5), -0.25
    mean = 2 * (1 + std_dev**2 / 1.0 * dt) + 1 * (1 + std_dev**2 * 0.5 / 1.0) * dt
    assert abs(mean - 1.59375) < 1e-9  # 2 * 0.9375 - 1.125 * 0.25
    assert abs(float(x_next) - (mean + std_dev * 0.5)) < 1e-6


def test_eta_zero_is_euler_and_scoring_matches_sampling():
    sigmas = sigma_schedule(8, 3.0)
    x, v = torch.randn(2, 6, dtype=torch.bfloat16), torch.randn(2, 6, dtype=torch.bfloat16)
    x_next, log_prob = sde_step(x, v, sigmas, 2, eta=0.0)
    assert log_prob is None and x_next.dtype == torch.float32
    assert torch.equal(x_next, x.float() + (sigmas[3] - sigmas[2]) * v.float())
    sampled, lp = sde_step(x, v, sigmas, 2, eta=0.7)
    _, lp_again = sde_step(x, v, sigmas, 2, eta=0.7, next_latents=sampled)
    assert torch.equal(lp, lp_again)


def test_ode_reaches_fixed_point_of_straight_flow():
    target = torch.tensor([[1.5, -2.0, 0.25]])

    def straight(x, sigma, idx):  # the exact velocity of x_sigma = (1 - sigma) target + sigma eps
        return (x - target) / sigma.view(-1, 1)

    rows = []
    counted = lambda x, sigma, idx: rows.append(x.shape[0]) or straight(x, sigma, idx)
    x0 = ode_sample(counted, torch.randn(4, 3), sigma_schedule(7, 3.0), max_batch=3)
    assert torch.allclose(x0, target.expand(4, 3), atol=1e-5)
    assert rows == [3, 1] * 7  # 7 steps, each in forwards of at most max_batch rows


@pytest.mark.parametrize("k,g,expected", [
    (0, 1, REFERENCE_SIGMAS),
    (0, 2, REFERENCE_SIGMAS[:2] + REFERENCE_SIGMAS[2::2]),  # 2, 4, ..., 16 lands on 0
    (1, 2, REFERENCE_SIGMAS[:3] + REFERENCE_SIGMAS[3:15:2] + [0.0]),  # 3, 5, ..., 15 then 0 instead of .1667
    (7, 3, REFERENCE_SIGMAS[:9] + [REFERENCE_SIGMAS[9], REFERENCE_SIGMAS[12], 0.0]),  # 9, 12, 15 -> 0
])
def test_granular_schedule(k, g, expected):
    got = granular_schedule(torch.tensor(REFERENCE_SIGMAS), k, g)
    assert torch.allclose(got, torch.tensor(expected))
    with pytest.raises(ValueError):
        granular_schedule(torch.tensor(REFERENCE_SIGMAS), k, 0)


def counting_velocity(x, sigma, idx):
    return torch.zeros_like(x)


def reference_nfe(num_steps, group_size, sde_steps, granularities):
    """The reference code's structure: anchor, then per member and k one SDE-step forward plus every completion."""
    sigmas = sigma_schedule(num_steps, 3.0)
    per_member = sum(1 + sum(len(granular_schedule(sigmas, k, g)) - k - 2 for g in granularities)
                     for k in sde_steps)
    return num_steps + group_size * per_member


@pytest.mark.parametrize("granularities,nfe", [([1, 2], 1504), ([1, 2, 3], 1708)])
def test_rollout_nfe_at_reference_settings(granularities, nfe):
    sigmas = sigma_schedule(16, 3.0)
    out = rollout_g2rpo(counting_velocity, torch.zeros(1, 2), sigmas, generators(1), group_size=12,
                        sde_steps=list(range(8)), granularities=granularities, eta=0.7, max_batch=4096)
    reference = rollout_g2rpo_paper(counting_velocity, torch.zeros(1, 2), sigmas, generators(1), group_size=12,
                                        sde_steps=list(range(8)), granularities=granularities, eta=0.7)
    assert out.nfe == nfe
    assert out.calls <= 40  # a few dozen calls, not thousands
    assert reference_nfe(16, 12, range(8), granularities) == reference.nfe == {1504: 1792, 1708: 2188}[nfe]


@pytest.mark.parametrize("n,g,steps,grans,B", [(10, 4, [0, 3, 8], [1, 4], 2), (6, 2, [0, 1, 2, 3, 4, 5], [1, 2, 3], 3)])
def test_rollout_nfe_formula(n, g, steps, grans, B):
    sigmas = sigma_schedule(n, 3.0)
    out = rollout_g2rpo(counting_velocity, torch.zeros(B, 2), sigmas, generators(B), group_size=g, sde_steps=steps,
                        granularities=grans, eta=0.7, max_batch=7)
    # ours: anchor + per member and k, the distinct (sigma-prefix) nodes of the granularity trie
    shared = 0
    for k in steps:
        scheds = [granular_schedule(sigmas, k, gg)[k + 1:].tolist() for gg in grans]
        prefixes = {tuple(s[: j + 1]) for s in scheds for j in range(len(s) - 1)}
        shared += len(prefixes)
    assert out.nfe == B * (n + g * shared)
    assert out.nfe < B * reference_nfe(n, g, steps, grans)


class Affine(torch.nn.Module):
    """A small stand-in velocity network: v = W x + b_prompt + c * sigma."""

    def __init__(self, dim, prompts):
        super().__init__()
        self.w = torch.nn.Linear(dim, dim)
        self.prompt = torch.nn.Embedding(prompts, dim)
        self.c = torch.nn.Parameter(torch.zeros(dim))

    def forward(self, x, sigma, idx):
        return self.w(x) + self.prompt(idx) + self.c * sigma[:, None]


def test_rollout_structure():
    torch.manual_seed(0)
    net = Affine(6, 2)
    sigmas = sigma_schedule(8, 3.0)
    noise = torch.randn(2, 6)
    kw = dict(group_size=3, sde_steps=[0, 2, 5], granularities=[1, 2])
    out = rollout_g2rpo(net, noise, sigmas, generators(2), **kw, eta=0.7, max_batch=5)
    assert out.start_latents.shape == (2, 3, 1, 6) and out.next_latents.shape == (2, 3, 3, 6)
    assert out.old_log_probs.shape == (2, 3, 3) and out.final_latents.shape == (2, 2, 3, 3, 6)
    # members share the anchor bit for bit, and differ after their SDE step
    with torch.no_grad():  # the deterministic trajectory, step by step
        trajectory = [noise]
        for i in range(len(sigmas) - 1):
            trajectory.append(sde_step(trajectory[-1], net(trajectory[-1], sigmas[i].expand(2), torch.arange(2)),
                                       sigmas, i, eta=0.0)[0])
    x0 = trajectory[-1]
    assert torch.equal(ode_sample(net, noise, sigmas), x0)
    for ki, k in enumerate([0, 2, 5]):
        assert torch.equal(out.start_latents[:, ki, 0], trajectory[k])
        assert not torch.allclose(out.next_latents[:, ki, 0], out.next_latents[:, ki, 1])
    assert torch.allclose(out.anchor_final, x0, atol=1e-6)
    # with eta = 0 every g = 1 completion is the anchor's image
    det = rollout_g2rpo(net, noise, sigmas, generators(2), **kw, eta=1e-12)
    assert torch.allclose(det.final_latents[:, 0], x0[:, None, None].expand(2, 3, 3, 6), atol=1e-4)
    # the member noise depends on the prompt's own generator only, not on the batch it shares
    alone = rollout_g2rpo(lambda x, s, i: net(x, s, i + 1), noise[1:], sigmas, generators(2)[1:], **kw, eta=0.7)
    assert torch.allclose(alone.next_latents[0], out.next_latents[1], atol=1e-6)


@pytest.mark.parametrize("steps,grans,B", [([0, 2, 5], [1, 2, 3], 2), ([1, 3], [2, 4], 1), ([0, 6], [1], 2)])
def test_fast_rollout_equals_the_papers_loop(steps, grans, B):
    torch.manual_seed(0)
    net = Affine(6, B)
    sigmas, noise = sigma_schedule(8, 3.0), torch.randn(B, 6)
    kw = dict(group_size=3, sde_steps=steps, granularities=grans, eta=0.7)
    fast = rollout_g2rpo(net, noise, sigmas, generators(B), **kw, max_batch=4)
    plain = rollout_g2rpo_paper(net, noise, sigmas, generators(B), **kw)
    for name in ("start_latents", "next_latents", "old_log_probs", "final_latents", "anchor_final"):
        torch.testing.assert_close(getattr(fast, name), getattr(plain, name), atol=1e-5, rtol=1e-5, msg=name)
    assert fast.nfe < plain.nfe and fast.calls < plain.calls


def test_sde_kl_equals_torch_kl_and_vanishes_at_the_base():
    torch.manual_seed(0)
    sigmas = sigma_schedule(8, 3.0)
    x, v, v_ref = torch.randn(2, 5), torch.randn(2, 5), torch.randn(2, 5)
    for i in (0, 3):
        dt = float(sigmas[i + 1] - sigmas[i])
        std_dev, sigma = 0.7 * math.sqrt(float(sigmas[i]) / (1 - float(sigmas[i if i else 1]))), float(sigmas[i])
        mean = lambda u: x * (1 + std_dev**2 / (2 * sigma) * dt) + u * (1 + std_dev**2 * (1 - sigma) / (2 * sigma)) * dt
        std = std_dev * math.sqrt(-dt)
        expected = torch.distributions.kl_divergence(torch.distributions.Normal(mean(v), std),
                                                     torch.distributions.Normal(mean(v_ref), std)).mean(1)
        torch.testing.assert_close(sde_kl(v, v_ref, sigmas, i, sde_std_dev(sigmas, i, 0.7)), expected, atol=1e-5,
                                   rtol=1e-4)
    assert torch.equal(sde_kl(v, v, sigmas, 2, sde_std_dev(sigmas, 2, 0.7)), torch.zeros(2))


def test_group_normalize():
    r = torch.tensor([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0]])
    a = group_normalize(r, dim=1)
    assert torch.allclose(a[0], torch.tensor([-1.0, 0.0, 1.0]))  # unbiased std of (1, 2, 3) is 1
    assert torch.equal(a[1], torch.zeros(3))  # constant group: 0, not NaN
    with pytest.raises(ValueError, match="at least 2"):
        group_normalize(r[:, :1], dim=1)


def test_granular_advantages_sum_and_clamp():
    torch.manual_seed(0)
    B, J, K, G, R = 2, 3, 4, 5, 2
    rewards = torch.randn(B, J, K, G, R)
    adv = granular_advantages(rewards, adv_clip_max=100.0, weights=torch.tensor([1.0, 0.5]))
    by_hand = torch.zeros(B, K, G)
    for m, w in enumerate([1.0, 0.5]):
        for j in range(J):
            for b in range(B):
                for k in range(K):
                    r = rewards[b, j, k, :, m]
                    by_hand[b, k] += w * (r - r.mean()) / (r.std() + 1e-8)
    assert torch.allclose(adv, by_hand, atol=1e-5)
    assert torch.allclose(adv.mean(-1), torch.zeros(B, K), atol=1e-5)
    spike = torch.zeros(B, J, K, G, R)
    spike[..., -1, :] = 100.0
    assert granular_advantages(spike, adv_clip_max=1.0).abs().max() == 1.0
    assert torch.equal(granular_advantages(torch.ones(B, J, K, G, R), adv_clip_max=5.0), torch.zeros(B, K, G))


def test_clipped_loss_value_and_gradient():
    adv = torch.tensor([1.0, -2.0, 0.5, 3.0])
    old = torch.zeros(4)
    lp = torch.zeros(4, requires_grad=True)
    assert torch.allclose(clipped_loss(lp, old, adv, 1e-4), -adv.mean())
    # push ratios far out of the clip range: positive A with r > 1 + eps and negative A with r < 1 - eps are clipped
    lp = torch.tensor([0.1, -0.1, -0.1, 0.1], requires_grad=True)
    clipped_loss(lp, old, adv, 1e-4).backward()
    # A > 0 with r > 1 + eps, and A < 0 with r < 1 - eps: the clipped branch is the max, so no gradient
    assert lp.grad[0] == 0 and lp.grad[1] == 0 and lp.grad[3] == 0
    assert lp.grad[2] < 0  # A > 0 and r < 1: unclipped, the loss pulls the log-prob up


def g2rpo(**values):
    """G2RPO with the update's values of these tests (clip range 1: the ratio is never clipped), and `values`."""
    return G2RPO(**{**dict(sde_steps=[0], group_size=4, eta=0.7, clip_range=1.0, adv_clip_max=5.0, max_grad_norm=1e9,
                           max_batch=64, inner_epochs=1, kl_beta=0.0), **values})


def test_one_iteration_learns():
    torch.manual_seed(0)
    net = Affine(6, 2)
    sigmas = sigma_schedule(8, 3.0)
    target = torch.tensor([[1.0] * 6, [-1.0] * 6])
    out = rollout_g2rpo(net, torch.randn(2, 6), sigmas, generators(2), group_size=4, sde_steps=[0, 1, 2],
                        granularities=[1, 2], eta=0.7)
    rewards = -(out.final_latents - target[:, None, None, None]).pow(2).mean(-1)  # (B, J, K, G)
    adv = granular_advantages(rewards[..., None], adv_clip_max=5.0)  # (B, K, G)
    params = list(net.parameters())
    before = [p.detach().clone() for p in params]
    frozen = lambda **kw: g2rpo(**kw).update(out, adv,
                                             UpdateContext(net, params, torch.optim.SGD(params, lr=0.0), sigmas))
    loss_before = frozen(step_per_sde_step=False)["loss"]
    first = frozen()
    assert abs(first["ratio_mean"] - 1) < 1e-6 and first["approx_kl"] < 1e-12  # ratio is 1 before any update
    stats = g2rpo().update(out, adv, UpdateContext(net, params, torch.optim.SGD(params, lr=1e-2), sigmas))
    assert stats["optimizer_steps"] == 3 and stats["skipped_steps"] == 0 and stats["grad_norm"] > 0
    assert any(not torch.equal(p, q) for p, q in zip(params, before))
    assert frozen(step_per_sde_step=False)["loss"] < loss_before


@pytest.mark.parametrize("step_per_sde_step", [True, False])
def test_inner_epochs_pass_over_the_rollout_again(step_per_sde_step):
    """--inner-epochs 2: twice the optimizer steps; the first epoch is the single pass (the same first step, ratio
    exactly 1 before any optimizer step); the second scores the rollout under the moved policy (ratios off 1)."""
    torch.manual_seed(0)
    net = Affine(6, 2)
    sigmas = sigma_schedule(6, 3.0)
    out = rollout_g2rpo(net, torch.randn(2, 6), sigmas, generators(2), group_size=4, sde_steps=[0, 1],
                        granularities=[1, 2], eta=0.7)
    adv = torch.randn(2, 2, 4, generator=torch.Generator().manual_seed(1))
    params = list(net.parameters())
    start = copy.deepcopy(net.state_dict())
    context = lambda: UpdateContext(net, params, torch.optim.SGD(params, lr=1e-2), sigmas)
    once = g2rpo(step_per_sde_step=step_per_sde_step).update(out, adv, context())
    after_once = [p.detach().clone() for p in params]
    net.load_state_dict(start)
    twice = g2rpo(step_per_sde_step=step_per_sde_step, inner_epochs=2).update(out, adv, context())
    assert twice["optimizer_steps"] == 2 * once["optimizer_steps"] == (4 if step_per_sde_step else 2)
    assert twice["first_ratio_error"] == once["first_ratio_error"] < 1e-6
    assert twice["ratio_max"] - 1 > once["ratio_max"] - 1 or twice["ratio_min"] < once["ratio_min"]
    assert all(not torch.equal(p, q) for p, q in zip(params, after_once))  # the second pass moved them on


def test_kl_term_zero_at_the_base_and_positive_after_an_update():
    torch.manual_seed(0)
    net, base = Affine(6, 1), Affine(6, 1)
    base.load_state_dict(net.state_dict())
    sigmas = sigma_schedule(6, 3.0)
    out = rollout_g2rpo(net, torch.randn(1, 6), sigmas, generators(1), group_size=4, sde_steps=[0, 1],
                        granularities=[1], eta=0.7)
    adv = torch.randn(1, 2, 4)
    params = list(net.parameters())
    update = lambda lr: g2rpo(kl_beta=0.5).update(
        out, adv, UpdateContext(net, params, torch.optim.SGD(params, lr=lr), sigmas, base_velocity_fn=base))
    assert update(0.0)["kl"] == 0.0
    update(1e-2)
    assert update(0.0)["kl"] > 0.0


def test_update_skips_non_finite():
    net = Affine(6, 1)
    sigmas = sigma_schedule(4, 3.0)
    out = rollout_g2rpo(net, torch.randn(1, 6), sigmas, generators(1), group_size=2, sde_steps=[0],
                        granularities=[1], eta=0.7)
    params = list(net.parameters())
    before = [p.detach().clone() for p in params]
    adv = torch.tensor([[[float("nan"), 1.0]]])
    stats = g2rpo(max_grad_norm=1.0).update(out, adv,
                                            UpdateContext(net, params, torch.optim.SGD(params, lr=1.0), sigmas))
    assert stats["skipped_steps"] == 1 and stats["optimizer_steps"] == 0
    assert all(torch.equal(p, q) for p, q in zip(params, before))


class DoubledNoise(G2RPO):
    """A fork that changes one thing: the SDE step's noise scale, doubled."""

    def std_dev(self, sigmas, i):
        return 2 * super().std_dev(sigmas, i)


def test_a_fork_that_changes_the_step_samples_and_scores_with_it():
    """G2RPO's rollout samples its branches through `self.step`, the hook its update scores with, so a subclass that
    changes the step (here its std_dev) changes both: the first ratios are 1 up to rounding (0.47 from 1 here with a
    rollout that took its own step), and the branches' spread is the doubled noise's."""
    torch.manual_seed(0)
    net = Affine(6, 1)
    sigmas = sigma_schedule(6, 3.0)
    fork, plain = DoubledNoise(**{**vars(g2rpo(sde_steps=[0, 1])), "granularities": [1]}), g2rpo(sde_steps=[0, 1])
    noise = torch.randn(1, 6)
    out = fork.rollout(net, noise, sigmas, generators(1), [0, 1])
    params = list(net.parameters())
    stats = fork.update(out, torch.randn(1, 2, 4), UpdateContext(net, params, torch.optim.SGD(params, lr=0.0), sigmas))
    assert stats["first_ratio_error"] < 1e-6 and abs(stats["ratio_mean"] - 1) < 1e-6
    spread = lambda rollout: (rollout.next_latents - rollout.next_latents.mean(2, keepdim=True)).std()
    assert spread(out) > 1.5 * spread(plain.rollout(net, noise, sigmas, generators(1), [0, 1]))
