"""The methods that score no SDE step (methods/diffusionnft.py, methods/awm.py): each loss and its gradient against
a restatement of its paper's equations in float64, one update against the same restatement on a toy velocity field,
the ODE rollout against sampler.ode_sample, and each method on the tiny model: 2 iterations with finite rewards, its
self-check, and a resume that ends with the uninterrupted run's weights (and DiffusionNFT's old policy).

Run: python -m pytest -q tests/test_decoupled.py
"""
import math
import os

import torch

from conftest import run_train
from g2rpo import clipped_loss
from methods.awm import AWM, matching_log_likelihood
from methods.base import UpdateContext, dpm_solver_2m, ode_rollout
from methods.diffusionnft import DiffusionNFT, nft_loss, optimality
from sampler import ode_sample, sigma_schedule
from test_baselines import SMALL, stopped_after_one
from test_train import read_metrics, transformer_weights


def restated_nft(v, v_old, x, s, x0, r, beta):
    """The paper's loss, written out: v+ = v_old + beta (v - v_old), v- = v_old - beta (v - v_old), regressed in x0
    space with the adaptive weight 1 / sg(mean |error|), r l(v+) + (1 - r) l(v-), over beta."""
    terms = []
    for implicit in (v_old + beta * (v - v_old), v_old - beta * (v - v_old)):
        error = x - s[:, None] * implicit - x0  # x0_hat - x0
        terms.append((error**2).mean(1) / error.abs().mean(1).detach())
    return (r * terms[0] + (1 - r) * terms[1]) / beta


def test_the_loss_and_its_gradient_match_the_restatement():
    g = torch.Generator().manual_seed(0)
    n, d = 5, 7
    v = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    v_old, x, x0 = (torch.randn(n, d, generator=g, dtype=torch.float64) for _ in range(3))
    s, r = torch.rand(n, generator=g, dtype=torch.float64), torch.rand(n, generator=g, dtype=torch.float64)
    for beta in (1.0, 0.3):
        ours, _, _ = nft_loss(v, v_old, x, s, x0, r, beta)
        theirs = restated_nft(v, v_old, x, s, x0, r, beta)
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
        grad = torch.autograd.grad(ours.sum(), v)[0]
        torch.testing.assert_close(grad, torch.autograd.grad(theirs.sum(), v)[0], rtol=1e-12, atol=1e-12)
    # r = 1/2 and v = v_old: the two implicit policies are the old one, and the gradient cancels
    half = torch.full((n,), 0.5, dtype=torch.float64)
    at_old = v_old.clone().requires_grad_(True)
    loss, _, _ = nft_loss(at_old, v_old, x, s, x0, half, 1.0)
    assert torch.autograd.grad(loss.sum(), at_old)[0].abs().max() < 1e-12


def test_dpm_solver_2m_is_diffusers_on_its_grid():
    """DPM-Solver++(2M) on diffusers' own flow-matching grid (20 steps, shift 3) gives diffusers'
    DPMSolverMultistepScheduler's samples, on a nonlinear velocity field; its first step is the Euler step."""
    from diffusers import DPMSolverMultistepScheduler

    scheduler = DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=3.0)
    scheduler.set_timesteps(20)
    weight = torch.randn(3, 3, generator=torch.Generator().manual_seed(1)) * 0.5

    def velocity(x, sigma, index):
        return torch.tanh(x @ weight) * sigma.view(-1, 1, 1) - x

    noise = torch.randn(5, 4, 3, generator=torch.Generator().manual_seed(0))
    x = noise
    for i, t in enumerate(scheduler.timesteps):
        x = scheduler.step(velocity(x, scheduler.sigmas[i].expand(5), None), t, x).prev_sample
    torch.testing.assert_close(dpm_solver_2m(velocity, noise, scheduler.sigmas, None), x, atol=2e-5, rtol=0)
    sigma = scheduler.sigmas[0].expand(5)
    first = dpm_solver_2m(velocity, noise, torch.tensor([float(sigma[0]), 0.5]), None)  # one step, to 0.5
    torch.testing.assert_close(first, noise - (sigma[0] - 0.5) * velocity(noise, sigma, None))


def test_dpm_solver_2m_is_second_order():
    """On the exact probability-flow velocity of Gaussian data, x0 ~ N(mu, I), from x_1 = z to x0 = mu + z: doubling
    the steps of the project's schedule cuts DPM-Solver++(2M)'s error more than 3 times, Euler's about 2 times."""
    mu = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def velocity(x, sigma, index):  # d/ds of x_s = (1 - s) mu + sqrt((1 - s)^2 + s^2) z
        s = sigma.view(-1, 1, 1).double()
        return -mu + (2 * s - 1) / ((1 - s) ** 2 + s**2) * (x - (1 - s) * mu)

    z = torch.randn(5, 4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    index = torch.zeros(5, dtype=torch.long)
    errors = {"euler": [], "dpm++2m": []}
    for n in (64, 128, 256):
        sigmas = torch.linspace(1, 0, n + 1, dtype=torch.float64)
        errors["euler"].append(float((ode_sample(velocity, z, sigmas, prompt_index=index) - mu - z).abs().max()))
        errors["dpm++2m"].append(float((dpm_solver_2m(velocity, z, sigmas, index) - mu - z).abs().max()))
    for name, (low, high) in {"euler": (1.8, 2.2), "dpm++2m": (3.0, 4.5)}.items():
        e = errors[name]
        assert all(low < e[i] / e[i + 1] < high for i in range(2)), (name, e)


def test_the_optimality_probability():
    A = torch.tensor([-9.0, -5.0, -2.5, 0.0, 2.5, 5.0, 9.0])
    torch.testing.assert_close(optimality(A, 5.0), torch.tensor([0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]))


def make(**values):
    return DiffusionNFT(**{**dict(group_size=3, eta=0.7, clip_range=1e-4, adv_clip_max=5.0, max_grad_norm=100.0,
                                  max_batch=4, inner_epochs=1, kl_beta=0.0, num_steps=4), **values})


def test_the_rollout_is_the_old_policys_ode():
    """G images a prompt, each the ODE sample of its own noise (sampler.ode_sample's latents), and nothing else."""
    weight = torch.nn.Parameter(torch.tensor(0.7))
    net = lambda x, s, i: weight * x + 0.1 * i[:, None].float()  # a prompt-dependent field
    sigmas, noise = sigma_schedule(4, 3.0), torch.randn(2, 3, 5)
    rollout = ode_rollout(net, noise, sigmas, max_batch=4)
    for b in range(2):
        per_prompt = lambda x, s, i, b=b: net(x, s, torch.full_like(i, b))
        torch.testing.assert_close(rollout.final_latents[b, 0, 0], ode_sample(per_prompt, noise[b], sigmas))
    assert rollout.sde_steps == [] and rollout.old_log_probs.shape == (2, 0, 3) and rollout.nfe == 2 * 3 * 4
    # the method samples with its old policy: the copy's weight, not the live one's
    method = make()
    method.start([("weight", weight)])
    with torch.no_grad():
        weight.fill_(2.0)
    ours = method.rollout(net, noise, sigmas, None, [])
    torch.testing.assert_close(ours.final_latents, rollout.final_latents)
    assert float(weight.detach()) == 2.0  # swapped back


def test_one_update_is_the_restated_loss_then_the_old_policy_moves():
    """One SGD step on mean over images and steps of the restated loss, with the noise each image draws from its
    prompt's generator; then theta_old <- eta theta_old + (1 - eta) theta at eta = min(rate i, max)."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.tensor(0.3))
    net = lambda x, s, i: weight * x - s[:, None] * 0.2
    sigmas, B, G, K = sigma_schedule(4, 3.0), 2, 3, 4
    x0 = torch.randn(B, 1, 1, G, 6)
    rollout = ode_rollout(net, torch.randn(B, G, 6), sigmas, max_batch=64, trained=range(K))
    rollout.final_latents = x0
    advantages = torch.randn(B, 1, G) * 3
    method = make(nft_beta=0.5, nft_decay_rate=0.1, nft_decay_max=0.5)
    method.start([("weight", weight)])
    with torch.no_grad():
        method.old.copies["weight"].fill_(0.25)  # an old policy apart from the live one
    ctx = UpdateContext(net, [weight], torch.optim.SGD([weight], lr=0.1), sigmas,
                        [torch.Generator().manual_seed(b) for b in range(B)], iteration=3)
    stats = method.update(rollout, advantages, ctx)
    ours = float(weight.detach())
    # the restatement
    weight.data.fill_(0.3)
    r = optimality(advantages[:, 0], 5.0)
    gens = [torch.Generator().manual_seed(b) for b in range(B)]
    losses = []
    for b in range(B):
        noise = torch.randn((G, K, 6), generator=gens[b])
        for m in range(G):
            for k in range(K):
                s = sigmas[k].view(1)
                x = (1 - s) * x0[b, 0, 0, m] + s * noise[m, k]
                v_old = 0.25 * x - s * 0.2
                losses.append(restated_nft(net(x[None], s, None), v_old[None], x[None], s, x0[b, 0, 0, m][None],
                                           r[b, m].view(1), 0.5))
    torch.stack(losses).mean().backward()
    torch.optim.SGD([weight], lr=0.1).step()
    assert abs(ours - float(weight.detach())) < 1e-6 and stats["optimizer_steps"] == 1
    eta = min(0.1 * 3, 0.5)
    assert abs(float(method.old.copies["weight"]) - (eta * 0.25 + (1 - eta) * ours)) < 1e-6
    assert stats["old_eta"] == eta and math.isfinite(stats["loss"])


def test_diffusionnft_trains_checks_itself_and_resumes_exactly(tiny_cache, tmp_path):
    """Two iterations on the tiny model: finite rewards, the gradient self-check on its own loss, two forwards per
    image and step counted; the same two with a resume after the first end with the same weights and old policy."""
    from safetensors.torch import load_file

    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    common = [*SMALL, "--tiny-cache", tiny_cache, "--method", "diffusionnft", "--group-size", "4"]
    proc = run_train([*common, "--output-dir", straight, "--num-iterations", "2"])
    assert "gradient self-check passed" in proc.stdout
    rows = read_metrics(straight)
    assert all(math.isfinite(r["train/reward/shapes"]) and r["perf/optimizer_steps"] == 1 for r in rows[1:])
    assert rows[1]["perf/update_nfe"] == 2 * 2 * 4 * 8 and rows[1]["perf/nfe"] == 2 * 4 * 8  # B G K, B G N
    stopped_after_one(straight, resumed)
    assert "resumed from" in run_train([*common, "--output-dir", resumed, "--num-iterations", "2", "--resume"]).stdout
    a, b = transformer_weights(straight, 2), transformer_weights(resumed, 2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    old = [load_file(os.path.join(out, "checkpoints", "iter_000002", "old_policy.safetensors"))
           for out in (straight, resumed)]
    assert old[0].keys() == old[1].keys() and all(torch.equal(old[0][k], old[1][k]) for k in old[0])


# ---- AWM ----
def restated_awm(v, v_old, x0, eps, A, clip_range):
    """The paper's loss with the PPO clip, written out: l = -mean (v - (eps - x0))^2, rho = exp(l - l_old),
    max(-A rho, -A clip(rho, 1 - eps_clip, 1 + eps_clip)) per row."""
    l, l_old = (-((u - (eps - x0)) ** 2).mean(1) for u in (v, v_old))
    rho = torch.exp(l - l_old)
    return torch.maximum(-A * rho, -A * rho.clamp(1 - clip_range, 1 + clip_range))


def make_awm(**values):
    return AWM(**{**dict(group_size=3, eta=0.7, clip_range=0.05, adv_clip_max=5.0, max_grad_norm=100.0,
                         max_batch=4, inner_epochs=1, kl_beta=0.0, num_steps=4), **values})


def test_awm_loss_and_gradient_match_the_restatement():
    """The clipped loss over the flow-matching log-likelihood against the restatement (float64, 1e-12); at rho = 1
    its gradient is A grad |v - v*|^2, the advantage-weighted matching loss; beyond the clip, on the side its
    advantage favours, a row has no gradient."""
    g = torch.Generator().manual_seed(1)
    n, d = 6, 5
    x0, eps, v_old = (torch.randn(n, d, generator=g, dtype=torch.float64) for _ in range(3))
    A = torch.randn(n, generator=g, dtype=torch.float64)
    v = (v_old + 0.3 * torch.randn(n, d, generator=g, dtype=torch.float64)).requires_grad_(True)
    ours = clipped_loss(matching_log_likelihood(v, x0, eps), matching_log_likelihood(v_old, x0, eps), A, 0.05)
    theirs = restated_awm(v, v_old, x0, eps, A, 0.05).mean()
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(ours, v)[0], torch.autograd.grad(theirs, v)[0],
                               rtol=1e-12, atol=1e-12)
    # at rho = 1: the gradient of mean A |v - (eps - x0)|^2 / d
    at_old = v_old.clone().requires_grad_(True)
    l = matching_log_likelihood(at_old, x0, eps)
    grad = torch.autograd.grad(clipped_loss(l, l.detach(), A, 0.05), at_old)[0]
    weighted = (A * ((at_old - (eps - x0)) ** 2).mean(1)).mean()
    torch.testing.assert_close(grad, torch.autograd.grad(weighted, at_old)[0], rtol=1e-12, atol=1e-12)
    # a row whose ratio left the clip in its advantage's direction adds nothing
    far = v_old.clone()
    far[0] = eps[0] - x0[0] if A[0] > 0 else v_old[0] + 3.0  # l rises for A > 0, falls for A < 0
    far.requires_grad_(True)
    loss = clipped_loss(matching_log_likelihood(far, x0, eps), matching_log_likelihood(v_old, x0, eps), A, 0.05)
    assert torch.autograd.grad(loss, far)[0][0].abs().max() == 0


def test_awm_update_is_the_restated_loss():
    """member_chunks 1: one SGD step on the restated loss at rho = 1 over every image and step, with the noise each
    image draws from its prompt's generator. member_chunks 3: three steps, the later ones clipped against l_old,
    taken by a forward before the first step (counted in update_nfe)."""
    sigmas, B, G, K = sigma_schedule(4, 3.0), 2, 3, 4
    torch.manual_seed(0)
    x0 = torch.randn(B, 1, 1, G, 6)
    advantages = torch.randn(B, 1, G) * 3
    for chunks in (1, 3):
        weight = torch.nn.Parameter(torch.tensor(0.3))
        net = lambda x, s, i: weight * x - s[:, None] * 0.2
        rollout = ode_rollout(net, torch.randn(B, G, 6), sigmas, max_batch=64, trained=range(K))
        rollout.final_latents = x0
        method = make_awm(member_chunks=chunks, clip_range=0.01)
        ctx = UpdateContext(net, [weight], torch.optim.SGD([weight], lr=0.1), sigmas,
                            [torch.Generator().manual_seed(b) for b in range(B)])
        stats = method.update(rollout, advantages, ctx)
        assert method.update_nfe(rollout) == B * G * K * (1 if chunks == 1 else 2)
        assert stats["optimizer_steps"] == chunks and ("first_ratio_error" in stats) == (chunks > 1)
        # the restatement
        gens = [torch.Generator().manual_seed(b) for b in range(B)]
        rows = []  # (b, m, x, s, eps) in the update's order
        for b in range(B):
            noise = torch.randn((G, K, 6), generator=gens[b])
            for m in range(G):
                for k in range(K):
                    s = sigmas[k].view(1)
                    rows.append((b, m, (1 - s) * x0[b, 0, 0, m] + s * noise[m, k], s, noise[m, k]))
        w = torch.nn.Parameter(torch.tensor(0.3))
        optimizer = torch.optim.SGD([w], lr=0.1)
        v_old = {id(r): 0.3 * r[2] - r[3] * 0.2 for r in rows}  # the policy that rolled out
        for members in torch.arange(G).tensor_split(chunks):
            chosen = [r for r in rows if r[1] in members.tolist()]
            loss = torch.stack([restated_awm((w * r[2] - r[3] * 0.2)[None], v_old[id(r)][None], x0[r[0], 0, 0, r[1]][None],
                                             r[4][None], advantages[r[0], 0, r[1]].view(1), 0.01)
                                for r in chosen]).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        assert abs(float(weight.detach()) - float(w.detach())) < 1e-6, chunks


def test_awm_trains_checks_itself_and_resumes_exactly(tiny_cache, tmp_path):
    """Two iterations on the tiny model, rolled out with DPM-Solver++(2M): finite rewards, the gradient self-check on
    the flow-matching loss, one forward per image and step counted; a resume after the first ends with the same
    weights (AWM keeps no state)."""
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    common = [*SMALL, "--tiny-cache", tiny_cache, "--method", "awm", "--group-size", "4",
              "--rollout-solver", "dpm++2m"]
    proc = run_train([*common, "--output-dir", straight, "--num-iterations", "2"])
    assert "gradient self-check passed" in proc.stdout
    rows = read_metrics(straight)
    assert all(math.isfinite(r["train/reward/shapes"]) and r["perf/optimizer_steps"] == 1 for r in rows[1:])
    assert rows[1]["perf/update_nfe"] == 2 * 4 * 8 and rows[1]["perf/nfe"] == 2 * 4 * 8  # B G K, B G N
    stopped_after_one(straight, resumed)
    assert "resumed from" in run_train([*common, "--output-dir", resumed, "--num-iterations", "2", "--resume"]).stdout
    a, b = transformer_weights(straight, 2), transformer_weights(resumed, 2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
