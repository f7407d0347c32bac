"""Flow-DPPO (methods/flow_dppo.py): its trust-region KL against torch.distributions on both step types, its mask and
loss against a float64 restatement member by member, one whole update against the same restatement with batch-1
forwards, the draw of its SDE steps and its refusals. Its 2-iteration tiny run and exact resume, and its recipe's
resolved values, are test_baselines.py's.

Run: python -m pytest -q tests/test_flow_dppo.py
"""
import math

import pytest
import torch

from lab import flags
from methods.base import UpdateContext
from methods.flow_dppo import FlowDPPO, masked_loss, random_steps, trust_region_kl
from sampler import sigma_schedule
from test_baselines import make


def test_the_trust_region_kl_is_the_gaussians_on_both_step_types():
    torch.manual_seed(0)
    sigmas = sigma_schedule(8, 3.0)
    x, v, v_old = torch.randn(3, 20), torch.randn(3, 20), torch.randn(3, 20)
    for sde_type in ("cps", "flow"):
        method = make(FlowDPPO, eta=0.7, sde_type=sde_type)
        for i in range(7):
            mean, std = method.mean_std(x, v, sigmas, i)
            old_mean, _ = method.mean_std(x, v_old, sigmas, i)
            exact = torch.distributions.kl_divergence(torch.distributions.Normal(mean.double(), std),
                                                      torch.distributions.Normal(old_mean.double(), std)).mean(1)
            torch.testing.assert_close(trust_region_kl(mean, old_mean, std).double(), exact, atol=1e-7, rtol=1e-5)
    # the pull to the base model, x-based on either step: mean |mu - mu_ref|^2 (no 1 / (2 std^2))
    for sde_type in ("cps", "flow"):
        method = make(FlowDPPO, eta=0.7, sde_type=sde_type)
        for i in range(7):
            gap = method.mean_std(x, v, sigmas, i)[0] - method.mean_std(x, v_old, sigmas, i)[0]
            torch.testing.assert_close(method.kl(v, v_old, sigmas, i), (gap**2).mean(1), atol=1e-7, rtol=1e-5)


def test_the_mask_and_the_loss_against_float64():
    torch.manual_seed(0)
    n, M = 40, 3
    log_probs = torch.randn(n, M, dtype=torch.float64, requires_grad=True)
    old = log_probs.detach() + 0.1 * torch.randn(n, M, dtype=torch.float64)
    advantages = torch.randn(n, M, dtype=torch.float64)
    kl = torch.rand(n, 1, dtype=torch.float64) * 2e-6
    weights = torch.rand(n, M, dtype=torch.float64)
    loss, keep = masked_loss(log_probs, old, advantages, kl, 1e-6, weights)
    expected, gradient, dropped = 0.0, torch.zeros(n, M, dtype=torch.float64), 0
    for row in range(n):
        for m in range(M):
            a, r = float(advantages[row, m]), math.exp(float(log_probs.detach()[row, m] - old[row, m]))
            # dropped: outside the trust region and moving the way the advantage pushes
            drop = float(kl[row, 0]) >= 1e-6 and ((a > 0 and r > 1) or (a < 0 and r < 1))
            assert bool(keep[row, m]) == (not drop)
            dropped += drop
            if not drop:
                expected += -a * r * float(weights[row, m])
                gradient[row, m] = -a * r * float(weights[row, m])  # d(-A r) / d log_prob = -A r
    assert 0 < dropped < n * M
    assert abs(float(loss.detach()) - expected) < 1e-12
    loss.backward()
    torch.testing.assert_close(log_probs.grad, gradient)


def test_one_update_against_the_restatement():
    # the update, restated member by member with batch-1 forwards: per chunk of members one SGD step on the mean
    # over its (member, step) pairs of -A r keep, the CPS step's mean and log-prob restated from its equations
    torch.manual_seed(0)
    B, G, N, eta = 1, 4, 6, 0.7
    sigmas = sigma_schedule(N, 3.0)
    weight = torch.nn.Parameter(torch.tensor(0.3))
    net = lambda x, s, i: weight * x + 0.2
    method = make(FlowDPPO, eta=eta, group_size=G, max_grad_norm=100.0, member_chunks=2, num_steps=N)
    noise = torch.randn(B, G, 8)
    steps = [1, 3]
    with torch.no_grad():
        rollout = method.rollout(net, noise, sigmas, [torch.Generator().manual_seed(0)], steps)
    assert rollout.old_means.shape == (B, 2, G, 8)
    advantages = torch.randn(B, 1, G).expand(B, 2, G)
    weight.data.fill_(0.6)  # the policy has moved since the rollout: KLs > 0, ratios != 1

    def restated(x, s, s_next, v):  # the CPS step's mean and std (float64)
        std = s_next * math.sin(eta * math.pi / 2)
        return (1 - s_next) * (x - s * v) + math.sqrt(s_next**2 - std**2) * (x + (1 - s) * v), std

    kls = []
    with torch.no_grad():
        for ki, k in enumerate(steps):
            x = rollout.start_latents[0, ki].double()
            mean, std = restated(x, float(sigmas[k]), float(sigmas[k + 1]), net(x, None, None).double())
            kls.append(((mean - rollout.old_means[0, ki].double()) ** 2).mean(1) / (2 * std**2))  # (G,)
    middle = torch.cat(kls).sort().values[3:5]
    method.kl_mask_threshold = float(middle.mean())  # half the members outside the region, none on its edge
    method.update(rollout, advantages, UpdateContext(net, [weight], torch.optim.SGD([weight], lr=0.5), sigmas))
    ours = float(weight.detach())

    weight.data.fill_(0.6)
    optimizer, dropped = torch.optim.SGD([weight], lr=0.5), 0
    for members in ([0, 1], [2, 3]):
        pairs = [(ki, k, g) for g in members for ki, k in enumerate(steps)]
        for ki, k, g in pairs:
            x = rollout.start_latents[0, ki, g].double()
            mean, std = restated(x, float(sigmas[k]), float(sigmas[k + 1]), net(x, None, None).double())
            log_prob = -((rollout.next_latents[0, ki, g].double() - mean) ** 2).mean()
            ratio = torch.exp(log_prob - rollout.old_log_probs[0, ki, g].double())
            a = float(advantages[0, ki, g])
            # the KL of the policy as it stands (the first chunk's step has moved it for the second)
            kl = float(((mean.detach() - rollout.old_means[0, ki, g].double()) ** 2).mean()) / (2 * std**2)
            assert abs(float(ratio.detach()) - 1) > 1e-3  # off the mask's edge, where fp32 could flip it
            outside = kl >= method.kl_mask_threshold
            if outside and ((a > 0 and ratio > 1) or (a < 0 and ratio < 1)):
                dropped += 1
                continue
            (-a * ratio / len(pairs)).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert 0 < dropped < 8
    assert abs(ours - float(weight.detach())) < 1e-6 and abs(ours - 0.6) > 1e-5


def test_its_sde_steps_and_its_refusals(capsys):
    drawn = [random_steps(it, count=3, window=6, seed=0) for it in range(50)]
    assert all(len(set(d)) == 3 and d == sorted(d) and 0 <= d[0] and d[-1] <= 5 for d in drawn)
    assert drawn == [random_steps(it, count=3, window=6, seed=0) for it in range(50)]  # the same on every rank
    assert len({tuple(d) for d in drawn}) > 10 and {k for d in drawn for k in d} == set(range(6))
    args = flags.parse_args(["--model", "tiny", "--method", "flow-dppo"])
    assert (args.sde_type, args.eta, args.sde_draws, args.sde_window, args.kl_mask_threshold) == \
        ("cps", 0.7, 3, 6, 1e-6)
    sd3 = flags.parse_args(["--model", "sd3", "--method", "flow-dppo"])
    assert (sd3.group_size, sd3.num_steps, sd3.guidance, sd3.kl_beta, sd3.ema_decay, sd3.ema_every) == \
        (16, 10, 1.0, 1e-3, 0.9, 4)
    for argv, words in [(["--sde-draws", "7"], "needs 1 <= draws <= window"),
                        (["--sde-window", "8"], "step 7 cannot be trained"),
                        (["--kl-mask-threshold", "-1"], "must be >= 0"),
                        (["--member-chunks", "9"], "1..--group-size")]:
        with pytest.raises(SystemExit):
            flags.check_flags(flags.parse_args(["--model", "tiny", "--method", "flow-dppo", *argv]), world=1)
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1, (argv, err)


def test_its_kl_reference_runs_at_the_kl_guidance():
    """--kl-guidance (Flow-Factory's kl_guidance_scale, 4.5 on --model sd3): the method asks the loop for the base
    model at it (`base_guidance`) and its KL term takes the base velocity the loop gives, restated here as the
    authors' classifier-free guidance v_ref = v_u + w (v_c - v_u) at w = 4.5; an update whose base velocity came at
    another guidance (a loop that does not honour `base_guidance`: ctx.base_guidance None) stops in one line, rather
    than train against the wrong reference."""
    torch.manual_seed(0)
    B, G, N = 1, 4, 6
    sigmas = sigma_schedule(N, 3.0)
    weight = torch.nn.Parameter(torch.tensor(0.3))
    net = lambda x, s, i: weight * x + 0.2  # noqa: E731
    conditional, unconditional = (lambda x, s, i: 0.25 * x + 0.2), (lambda x, s, i: 0.1 * x)
    guided = lambda x, s, i: unconditional(x, s, i) + 4.5 * (conditional(x, s, i) - unconditional(x, s, i))  # noqa
    method = make(FlowDPPO, eta=0.7, group_size=G, max_grad_norm=100.0, member_chunks=1, num_steps=N, kl_beta=0.1,
                  kl_guidance=4.5, kl_mask_threshold=1e9)
    assert method.base_guidance(1.0) == 4.5
    with torch.no_grad():
        rollout = method.rollout(net, torch.randn(B, G, 8), sigmas, [torch.Generator().manual_seed(0)], [1])
    advantages = torch.zeros(B, 1, G)  # the KL term alone moves the weight

    def update(**ctx):
        weight.data.fill_(0.3)
        method.update(rollout, advantages, UpdateContext(net, [weight], torch.optim.SGD([weight], lr=1.0), sigmas,
                                                         base_velocity_fn=guided, **ctx))
        return float(weight.detach())

    with pytest.raises(RuntimeError, match="--kl-guidance 4.5"):
        update()
    ours = update(base_guidance=4.5)
    # the restatement: beta mean over members of mean |mu_theta - mu_ref|^2 (the CPS step's means, x-based)
    weight.data.fill_(0.3)
    x = rollout.start_latents[0, 0]  # (G, 8)
    mean = lambda v: method.mean_std(x, v, sigmas, 1)[0]  # noqa: E731
    (0.1 * ((mean(net(x, None, None)) - mean(guided(x, None, None))) ** 2).mean(1).mean()).backward()
    expected = 0.3 - float(weight.grad)
    assert abs(ours - expected) < 1e-6 and abs(ours - 0.3) > 1e-6
