"""The methods that score no SDE step (methods/diffusionnft.py, methods/awm.py), against their authors' training
scripts: each loss and its gradient against a float64 restatement of the authors' formulas (r, A', the per-image
losses with their weights, the KL terms), one update of each against the same restatement on a toy velocity field,
the training-sigma draws' distributions, the decay schedules over steps 0 to 1,000, the sigma grid and
DPM-Solver++(2M) against diffusers, why diffusers' SA-Solver cannot roll out on a flow grid, and each method on the
tiny model: 2 iterations with finite rewards, its self-check, and a resume that ends with the uninterrupted run's
weights and state (DiffusionNFT's old policy, AWM's EMA anchor).

Run: python -m pytest -q tests/test_decoupled.py
"""
import math
import os

import torch

from conftest import run_train
from methods.awm import AWM, matching_log_likelihood, scaled_advantages
from methods.base import (UpdateContext, dpm_solver_2m, global_std_advantages, ode_rollout, stratified_bins,
                          training_timesteps)
from methods.diffusionnft import DiffusionNFT, nft_loss, old_decay, optimality
from sampler import ode_sample, sigma_schedule
from test_baselines import SMALL, stopped_after_one
from test_train import read_metrics, transformer_weights


# ---- what both share: the grid, the solver, the advantage, the training sigmas ----
def test_the_sd3_grid_is_diffusers_flow_match_euler():
    """--sigma-grid sd3 is diffusers' FlowMatchEulerDiscreteScheduler's grid (shift 3) at the authors' step counts."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    for n in (8, 10, 14):
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
        scheduler.set_timesteps(n)
        torch.testing.assert_close(sigma_schedule(n, 3.0, "sd3"), scheduler.sigmas, atol=1e-6, rtol=0)
    assert abs(float(sigma_schedule(10, 3.0, "sd3")[-2]) - 0.0089) < 1e-4  # the linear grid's is 0.25


def test_dpm_solver_2m_is_diffusers_on_the_sd3_grid():
    """DPM-Solver++(2M) on the authors' grid (10 steps, shift 3) gives diffusers' DPMSolverMultistepScheduler's
    samples when that scheduler steps on the same grid, on a nonlinear velocity field."""
    from diffusers import DPMSolverMultistepScheduler

    sigmas = sigma_schedule(10, 3.0, "sd3")
    scheduler = DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=3.0,
                                            lower_order_final=False, final_sigmas_type="zero")
    scheduler.set_timesteps(10)
    scheduler.sigmas, scheduler.timesteps = sigmas, sigmas[:-1] * 1000  # its steps on the authors' grid
    weight = torch.randn(3, 3, generator=torch.Generator().manual_seed(1)) * 0.5

    def velocity(x, sigma, index):
        return torch.tanh(x @ weight) * sigma.view(-1, 1, 1) - x

    noise = torch.randn(5, 4, 3, generator=torch.Generator().manual_seed(0))
    x = noise
    for i, t in enumerate(scheduler.timesteps):
        x = scheduler.step(velocity(x, sigmas[i].expand(5), None), t, x).prev_sample
    torch.testing.assert_close(dpm_solver_2m(velocity, noise, sigmas, None), x, atol=2e-5, rtol=0)


def test_diffusers_sa_solver_cannot_roll_out_on_a_flow_grid():
    """Why AWM rolls out with DPM-Solver++(2M), not diffusers' SASolverScheduler (methods/awm.py, difference 1): with
    flow sigmas its grid stops at shift(0.999 / N) (0.19 at 14 steps), and on a grid that ends at 0 it gives NaN."""
    from diffusers import SASolverScheduler

    def sample(sigmas=None):
        scheduler = SASolverScheduler(use_flow_sigmas=True, flow_shift=3.0, prediction_type="flow_prediction",
                                      tau_func=lambda t: 0.0)
        scheduler.set_timesteps(14)
        if sigmas is not None:
            scheduler.sigmas, scheduler.timesteps = sigmas, sigmas[:-1] * 1000
        x = torch.randn(64, generator=torch.Generator().manual_seed(0))
        for i, t in enumerate(scheduler.timesteps):
            x = scheduler.step(-x, t, x).prev_sample  # a velocity field; only the grid matters here
        return scheduler.sigmas, x

    own, _ = sample()
    assert float(own[-1]) > 0.18 and float(own[-2]) == float(own[-1])  # the last step leaves sigma 0.19 of noise
    _, x = sample(sigma_schedule(14, 3.0, "sd3"))
    assert torch.isnan(x).all()


def test_the_global_std_advantage():
    """A = (R - mean_prompt R) / (std over every image + 1e-4), the population std, as the authors' scripts."""
    scores = torch.randn(3, 1, 1, 5, 1, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 2
    R = scores[:, 0, 0, :, 0]  # (B, G)
    expected = (R - R.mean(1, keepdim=True)) / (R.flatten().std(correction=0) + 1e-4)
    got = global_std_advantages(scores, torch.ones(1, dtype=torch.float64), adv_clip_max=100.0)[:, 0]  # (fp32)
    torch.testing.assert_close(got, expected.float(), rtol=1e-6, atol=1e-6)


def test_diffusionnfts_training_sigmas_are_a_random_9_of_10_per_image():
    """Each image trains at int(0.99 N) = 9 distinct steps of the N = 10 (sigma 1 included, the final 0 never), its
    own draw; over many draws each step is left out equally often (1 in 10)."""
    gens = [torch.Generator().manual_seed(b) for b in range(4)]
    steps = torch.cat([training_timesteps("permuted", gens, 6, 10, int(0.99 * 10), 0.99) for _ in range(50)])
    assert steps.shape == (200, 6, 9) and steps.min() == 0 and steps.max() == 9
    assert all(len(set(row.tolist())) == 9 for row in steps.flatten(0, 1))
    assert len({tuple(sorted(row.tolist())) for row in steps[0]}) > 1  # the images of a group differ
    left_out = torch.bincount(steps.flatten(0, 1).sort(1).values.sum(1).neg() + 45, minlength=10)  # 45 = 0 + .. + 9
    assert left_out.sum() == 1200 and (left_out - 120).abs().max() < 40  # ~ Binomial(1200, 0.1): sd 10.4


def test_awms_training_sigmas_are_stratified_and_shared_by_a_micro_batch():
    """The authors' discrete_wo_init at 14 steps: 6 bins [1,2) [2,4) .. [10,12), one index uniform in each, the same
    for the 3 images of a micro-batch; discrete: [0,2) .. [10,12)."""
    assert stratified_bins(14, 6, 0.9, True) == [(1, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12)]
    assert stratified_bins(14, 6, 0.9, False)[0] == (0, 2) and stratified_bins(10, 4, 0.7, False)[-1] == (5, 7)
    gens = [torch.Generator().manual_seed(b) for b in range(2)]
    draws = torch.cat([training_timesteps("discrete_wo_init", gens, 8, 14, 6, 0.9, 3) for _ in range(300)])
    assert draws.shape == (600, 8, 6)
    for first, last in ((0, 3), (3, 6), (6, 8)):  # micro-batches of members 0-2, 3-5, 6-7
        assert (draws[:, first:last] == draws[:, first : first + 1]).all()
    assert not (draws[:, 0] == draws[:, 3]).all()
    for t, (lo, hi) in enumerate(stratified_bins(14, 6, 0.9, True)):
        counts = torch.bincount(draws[:, 0, t] - lo, minlength=hi - lo)
        assert len(counts) == hi - lo and (counts - 600 / (hi - lo)).abs().max() < 60  # uniform in the bin


def test_the_decay_schedules_over_1000_steps():
    """DiffusionNFT's old policy: type 1 min(0.001 s, 0.5), the OCR type 0 until 75 then min(0.0075 (s - 75),
    0.999); AWM's EMA anchor min(0.001 s, 0.3), at every s in 0..1000."""
    for s in range(1001):
        assert old_decay("linear", s) == min(0.001 * s, 0.5)
        assert old_decay("ocr", s) == (0.0 if s < 75 else min(0.0075 * (s - 75), 0.999))
    assert old_decay("linear", 500) == 0.5 and old_decay("ocr", 209) == 0.999 and old_decay("ocr", 75) == 0.0
    method = make_awm()
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.tensor(0.0))
    method.start([("w", w)])
    net = lambda x, s, i: w * x  # noqa: E731
    rollout = ode_rollout(net, torch.randn(1, 3, 4), sigma_schedule(4, 3.0), max_batch=64, trained=range(4))
    for it in (0, 99, 299, 999):
        ctx = UpdateContext(net, [w], torch.optim.SGD([w], lr=0.0), sigma_schedule(4, 3.0),
                            [torch.Generator().manual_seed(0)], iteration=it)
        assert method.update(rollout, torch.randn(1, 1, 3), ctx)["ema_decay"] == min(0.001 * (it + 1), 0.3)


def test_the_decays_count_the_steps_taken_when_inner_epochs_change_on_resume(tmp_path):
    """Four 1-step updates, then a resume at --inner-epochs 2: s = 4 + 2 = 6 steps, d = 0.006 for DiffusionNFT's old
    policy and AWM's anchor (the count s = (i + 1) x this update's steps gave 10, 0.01, changing the past). The count
    is the state's, as a checkpoint writes it (safetensors); a state of before the count (none there) reckons
    s = (i + 1) x steps, as then."""
    from safetensors.torch import load_file, save_file

    for cls, make_one, part, stat in ((DiffusionNFT, make, "old_policy", "old_decay"),
                                      (AWM, make_awm, "ema_anchor", "ema_decay")):
        w = torch.nn.Parameter(torch.tensor(0.0))
        net = lambda x, s, i: w * x  # noqa: E731
        rollout = ode_rollout(net, torch.randn(1, 3, 4), sigma_schedule(4, 3.0), max_batch=64, trained=range(4))

        def update(method, it):
            ctx = UpdateContext(net, [w], torch.optim.SGD([w], lr=0.0), sigma_schedule(4, 3.0),
                                [torch.Generator().manual_seed(0)], iteration=it)
            return method.update(rollout, torch.randn(1, 1, 3), ctx)[stat]

        first = make_one(inner_epochs=1)
        first.start([("w", w)])
        assert [update(first, it) for it in range(4)] == [0.001 * s for s in (1, 2, 3, 4)]
        saved = {}
        for name, tensors in first.state_dict().items():  # as lab/checkpoint.py writes and reads them back
            save_file(tensors, str(tmp_path / f"{cls.__name__}_{name}.safetensors"))
            saved[name] = load_file(str(tmp_path / f"{cls.__name__}_{name}.safetensors"))
        resumed = make_one(inner_epochs=2)
        resumed.start([("w", w)])
        resumed.load_state_dict(saved)
        assert update(resumed, 4) == 0.001 * 6, cls  # 4 steps before, 2 now
        older = make_one(inner_epochs=2)  # a checkpoint without the count
        older.start([("w", w)])
        older.load_state_dict({part: saved[part]})
        assert update(older, 4) == 0.001 * 5 * 2, cls  # (i + 1) x steps, as before the count was kept


# ---- DiffusionNFT ----
def restated_nft(v, v_old, x, s, x0, r, beta):
    """The authors' loss, written out: v+ = v_old + b (v - v_old), v- = v_old - b (v - v_old), regressed in x0 space
    with the adaptive weight 1 / sg(max(mean |error|, 1e-5)), 5 (r l(v+) + (1 - r) l(v-)) / b."""
    terms = []
    for implicit in (v_old + beta * (v - v_old), v_old - beta * (v - v_old)):
        error = x - s[:, None] * implicit - x0  # x0_hat - x0
        terms.append((error**2).mean(1) / error.abs().mean(1).clamp_min(1e-5).detach())
    return 5 * (r * terms[0] + (1 - r) * terms[1]) / beta


def restated_r(A):
    """r = clamp(clamp(A, -5, 5) / 5 / 2 + 1/2, 0, 1)."""
    return torch.clamp(torch.clamp(A, -5, 5) / 5 / 2 + 0.5, 0, 1)


def test_the_loss_and_its_gradient_match_the_restatement():
    g = torch.Generator().manual_seed(0)
    n, d = 5, 7
    v = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    v_old, x, x0 = (torch.randn(n, d, generator=g, dtype=torch.float64) for _ in range(3))
    s, r = torch.rand(n, generator=g, dtype=torch.float64), torch.rand(n, generator=g, dtype=torch.float64)
    for beta in (1.0, 0.1):
        ours, _, _ = nft_loss(v, v_old, x, s, x0, r, beta, 5.0)
        theirs = restated_nft(v, v_old, x, s, x0, r, beta)
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
        grad = torch.autograd.grad(ours.sum(), v)[0]
        torch.testing.assert_close(grad, torch.autograd.grad(theirs.sum(), v)[0], rtol=1e-12, atol=1e-12)
    # r = 1/2 and v = v_old: the two implicit policies are the old one, and the gradient cancels
    half = torch.full((n,), 0.5, dtype=torch.float64)
    at_old = v_old.clone().requires_grad_(True)
    loss, _, _ = nft_loss(at_old, v_old, x, s, x0, half, 1.0, 5.0)
    assert torch.autograd.grad(loss.sum(), at_old)[0].abs().max() < 1e-12


def test_the_optimality_probability():
    A = torch.tensor([-9.0, -5.0, -2.5, 0.0, 2.5, 5.0, 9.0], dtype=torch.float64)
    torch.testing.assert_close(optimality(A, 5.0), restated_r(A), rtol=0, atol=0)
    torch.testing.assert_close(optimality(A, 5.0), torch.tensor([0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]).double())


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
    method = make(rollout_solver="euler")
    method.start([("weight", weight)])
    with torch.no_grad():
        weight.fill_(2.0)
    ours = method.rollout(net, noise, sigmas, None, [])
    torch.testing.assert_close(ours.final_latents, rollout.final_latents)
    assert float(weight.detach()) == 2.0  # swapped back


def test_one_update_is_the_restated_loss_then_the_old_policy_moves():
    """One SGD step on the mean over images and their training sigmas of the restated loss plus the 1e-4 KL to the
    base, each image at the first 3 of its own random order of the 4 steps and fresh noise, both drawn from its
    prompt's generator; then theta_old <- d theta_old + (1 - d) theta at d = min(0.1 s, 0.5), s = 4 steps so far."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.tensor(0.3))
    net = lambda x, s, i: weight * x - s[:, None] * 0.2  # noqa: E731
    base = lambda x, s, i: 0.35 * x - s[:, None] * 0.2  # noqa: E731
    sigmas, B, G, N = sigma_schedule(4, 3.0), 2, 3, 4
    x0 = torch.randn(B, 1, 1, G, 6)
    rollout = ode_rollout(net, torch.randn(B, G, 6), sigmas, max_batch=64, trained=range(N))
    rollout.final_latents = x0
    scores = torch.randn(B, 1, 1, G, 1)
    method = make(nft_beta=0.5, nft_decay_rate=0.1, nft_decay_max=0.5, train_timesteps=3, kl_beta=1e-4)
    advantages = method.advantages(scores, torch.ones(1))
    method.start([("weight", weight)])
    with torch.no_grad():
        method.old.copies["weight"].fill_(0.25)  # an old policy apart from the live one
    ctx = UpdateContext(net, [weight], torch.optim.SGD([weight], lr=0.1), sigmas,
                        [torch.Generator().manual_seed(b) for b in range(B)], base_velocity_fn=base, iteration=3)
    stats = method.update(rollout, advantages, ctx)
    ours = float(weight.detach())
    assert method.update_nfe(rollout) == B * G * 3 * 3  # v_theta, v_old, v_ref at each row
    # the restatement
    weight.data.fill_(0.3)
    R = scores[:, 0, 0, :, 0]
    r = restated_r((R - R.mean(1, keepdim=True)) / (R.flatten().std(correction=0) + 1e-4))
    losses = []
    for b in range(B):
        gen = torch.Generator().manual_seed(b)
        orders = [torch.randperm(N, generator=gen)[:3] for _ in range(G)]
        noise = torch.randn((G, 3, 6), generator=gen)
        for m in range(G):
            for t, k in enumerate(orders[m].tolist()):
                s = sigmas[k].view(1)
                x = (1 - s) * x0[b, 0, 0, m] + s * noise[m, t]
                v = net(x[None], s, None)
                losses.append(restated_nft(v, (0.25 * x - s * 0.2)[None], x[None], s, x0[b, 0, 0, m][None],
                                           r[b, m].view(1), 0.5) + 1e-4 * ((v - base(x[None], s, None)) ** 2).mean())
    torch.stack(losses).mean().backward()
    torch.optim.SGD([weight], lr=0.1).step()
    assert abs(ours - float(weight.detach())) < 1e-6 and stats["optimizer_steps"] == 1
    decay = min(0.1 * 4, 0.5)
    assert abs(float(method.old.copies["weight"]) - (decay * 0.25 + (1 - decay) * ours)) < 1e-6
    assert stats["old_decay"] == decay and math.isfinite(stats["loss"])


def test_diffusionnft_trains_checks_itself_and_resumes_exactly(tiny_cache, tmp_path):
    """Two iterations on the tiny model: finite rewards, the gradient self-check on its own loss, three forwards per
    image and training sigma counted (v_theta, v_old, v_ref at 7 of 8 sigmas); the same two with a resume after the
    first end with the same weights and old policy."""
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    common = [*SMALL, "--tiny-cache", tiny_cache, "--method", "diffusionnft", "--group-size", "4"]
    proc = run_train([*common, "--output-dir", straight, "--num-iterations", "2"])
    assert "gradient self-check passed" in proc.stdout
    rows = read_metrics(straight)
    assert all(math.isfinite(r["train/reward/shapes"]) and r["perf/optimizer_steps"] == 1 for r in rows[1:])
    assert rows[1]["perf/update_nfe"] == 3 * 2 * 4 * 7 and rows[1]["perf/nfe"] == 2 * 4 * 8  # 3 B G T, B G N
    stopped_after_one(straight, resumed)
    assert "resumed from" in run_train([*common, "--output-dir", resumed, "--num-iterations", "2", "--resume"]).stdout
    assert_same_end(straight, resumed, "old_policy")


def assert_same_end(straight, resumed, state):
    """The same transformer weights and the same method state file at iteration 2, bit for bit."""
    from safetensors.torch import load_file

    a, b = transformer_weights(straight, 2), transformer_weights(resumed, 2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    kept = [load_file(os.path.join(out, "checkpoints", "iter_000002", f"{state}.safetensors"))
            for out in (straight, resumed)]
    assert kept[0] and kept[0].keys() == kept[1].keys() and all(torch.equal(kept[0][k], kept[1][k]) for k in kept[0])


# ---- AWM ----
def restated_awm_log_likelihood(v, x0, eps, s, weighting, p=0.25):
    """The authors' weighted estimate of log pi(x0), from mse = mean (v - (eps - x0))^2."""
    mse = ((v - (eps - x0)) ** 2).mean(1)
    return {"uniform": -mse, "t": -s * mse, "t2": -s**2 * mse, "huber": -s * (torch.sqrt(mse + 1e-10) - 1e-5),
            "ghuber": -(s / p) * ((mse + 1e-10) ** p - 1e-10**p)}[weighting]


def restated_awm(v, v_old, x0, eps, s, A, clip_range, weighting="ghuber"):
    """max(-A' rho, -A' clip(rho, 1 - eps_c, 1 + eps_c)) per row, rho = exp(l - l_old), A' = clamp(A, -5, 5) / 5."""
    l, l_old = (restated_awm_log_likelihood(u, x0, eps, s, weighting) for u in (v, v_old))
    rho = torch.exp(l - l_old)
    A = torch.clamp(A, -5, 5) / 5
    return torch.maximum(-A * rho, -A * rho.clamp(1 - clip_range, 1 + clip_range))


def make_awm(**values):
    return AWM(**{**dict(group_size=3, eta=0.7, clip_range=1.0, adv_clip_max=5.0, max_grad_norm=100.0,
                         max_batch=4, inner_epochs=1, kl_beta=0.0, num_steps=4, time_sampling="discrete",
                         train_timesteps=2, time_fraction=1.0), **values})


def test_awm_loss_and_gradient_match_the_restatement():
    """Every weighting of the log-likelihood against the restatement (float64, 1e-12), the clipped loss over it with
    A' and its gradient; at rho = 1 (on-policy) the gradient of the ghuber loss is mean A' (s / p) grad (mse +
    1e-10)^p; beyond a clip, on the side its advantage favours, a row has no gradient."""
    from g2rpo import clipped_loss

    g = torch.Generator().manual_seed(1)
    n, d = 6, 5
    x0, eps, v_old = (torch.randn(n, d, generator=g, dtype=torch.float64) for _ in range(3))
    s = torch.rand(n, generator=g, dtype=torch.float64)
    A = torch.randn(n, generator=g, dtype=torch.float64) * 4
    v = (v_old + 0.3 * torch.randn(n, d, generator=g, dtype=torch.float64)).requires_grad_(True)
    for weighting in ("ghuber", "uniform", "t", "t2", "huber"):
        torch.testing.assert_close(matching_log_likelihood(v, x0, eps, s, weighting),
                                   restated_awm_log_likelihood(v, x0, eps, s, weighting), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(scaled_advantages(A, 5.0), torch.clamp(A, -5, 5) / 5, rtol=0, atol=0)
    for clip_range in (1.0, 0.05):
        ours = clipped_loss(matching_log_likelihood(v, x0, eps, s, "ghuber"),
                            matching_log_likelihood(v_old, x0, eps, s, "ghuber"), scaled_advantages(A, 5.0),
                            clip_range)
        theirs = restated_awm(v, v_old, x0, eps, s, A, clip_range).mean()
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(torch.autograd.grad(ours, v)[0], torch.autograd.grad(theirs, v)[0],
                                   rtol=1e-12, atol=1e-12)
    # at rho = 1: the gradient of mean A' (s / p) (mse + 1e-10)^p
    at_old = v_old.clone().requires_grad_(True)
    l = matching_log_likelihood(at_old, x0, eps, s, "ghuber")
    grad = torch.autograd.grad(clipped_loss(l, l.detach(), scaled_advantages(A, 5.0), 1.0), at_old)[0]
    mse = ((at_old - (eps - x0)) ** 2).mean(1)
    weighted = (torch.clamp(A, -5, 5) / 5 * (s / 0.25) * (mse + 1e-10) ** 0.25).mean()
    torch.testing.assert_close(grad, torch.autograd.grad(weighted, at_old)[0], rtol=1e-12, atol=1e-12)
    # a row whose ratio left a clip of 0.05 in its advantage's direction adds nothing
    far = v_old.clone()
    far[0] = eps[0] - x0[0] if A[0] > 0 else v_old[0] + 3.0  # l rises for A > 0, falls for A < 0
    far.requires_grad_(True)
    loss = clipped_loss(matching_log_likelihood(far, x0, eps, s, "ghuber"),
                        matching_log_likelihood(v_old, x0, eps, s, "ghuber"), scaled_advantages(A, 5.0), 0.05)
    assert torch.autograd.grad(loss, far)[0][0].abs().max() == 0


def test_awm_update_is_the_restated_loss():
    """member_chunks 1: one SGD step on the restated loss at rho = 1 plus k |v - v_ref|^2 + e |v - v_ema|^2 over
    every image at its micro-batch's stratified sigmas, with the draws of its prompt's generator; then the EMA anchor
    moves. member_chunks 3: three steps, the later ones clipped against l_old, taken by a forward before the first
    step (counted in update_nfe)."""
    sigmas, B, G, T = sigma_schedule(4, 3.0), 2, 3, 2
    torch.manual_seed(0)
    x0 = torch.randn(B, 1, 1, G, 6)
    scores = torch.randn(B, 1, 1, G, 1)
    base = lambda x, s, i: 0.35 * x - s[:, None] * 0.2  # noqa: E731
    for chunks in (1, 3):
        weight = torch.nn.Parameter(torch.tensor(0.3))
        net = lambda x, s, i: weight * x - s[:, None] * 0.2  # noqa: E731
        rollout = ode_rollout(net, torch.randn(B, G, 6), sigmas, max_batch=64, trained=range(4))
        rollout.final_latents = x0
        method = make_awm(member_chunks=chunks, clip_range=0.01, kl_beta=1e-2, ema_kl_beta=0.5, time_micro_batch=2)
        advantages = method.advantages(scores, torch.ones(1))
        method.start([("weight", weight)])
        with torch.no_grad():
            method.ema.copies["weight"].fill_(0.2)  # an anchor apart from the live weights
        ctx = UpdateContext(net, [weight], torch.optim.SGD([weight], lr=0.1), sigmas,
                            [torch.Generator().manual_seed(b) for b in range(B)], base_velocity_fn=base, iteration=9)
        stats = method.update(rollout, advantages, ctx)
        assert method.update_nfe(rollout) == B * G * T * (3 if chunks == 1 else 4)
        assert stats["optimizer_steps"] == chunks and ("first_ratio_error" in stats) == (chunks > 1)
        # the restatement
        rows = []  # (b, m, x, s, eps) in the update's order
        for b in range(B):
            gen = torch.Generator().manual_seed(b)
            shared = [torch.tensor([0, 2]) + (torch.rand(T, generator=gen, dtype=torch.float64) * 2).long()
                      for _ in range(2)]  # bins [0, 2) [2, 4), one draw for members 0-1, one for member 2
            noise = torch.randn((G, T, 6), generator=gen)
            for m in range(G):
                for t, k in enumerate(shared[m // 2].tolist()):
                    s = sigmas[k].view(1)
                    rows.append((b, m, (1 - s) * x0[b, 0, 0, m] + s * noise[m, t], s, noise[m, t]))
        R = scores[:, 0, 0, :, 0]
        A = (R - R.mean(1, keepdim=True)) / (R.flatten().std(correction=0) + 1e-4)
        w = torch.nn.Parameter(torch.tensor(0.3))
        optimizer = torch.optim.SGD([w], lr=0.1)
        v_old = {id(r): 0.3 * r[2] - r[3] * 0.2 for r in rows}  # the policy that rolled out
        for members in torch.arange(G).tensor_split(chunks):
            chosen = [r for r in rows if r[1] in members.tolist()]
            terms = []
            for r in chosen:
                v = (w * r[2] - r[3] * 0.2)[None]
                terms.append(restated_awm(v.double(), v_old[id(r)][None].double(), x0[r[0], 0, 0, r[1]][None].double(),
                                          r[4][None].double(), r[3].double(), A[r[0], r[1]].view(1).double(), 0.01)
                             + 1e-2 * ((v - base(r[2][None], r[3], None)) ** 2).mean()
                             + 0.5 * ((v - (0.2 * r[2] - r[3] * 0.2)[None]) ** 2).mean())
            torch.stack(terms).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        assert abs(float(weight.detach()) - float(w.detach())) < 1e-6, chunks
        decay = min(0.001 * 10 * chunks, 0.3)
        assert abs(float(method.ema.copies["weight"]) - (decay * 0.2 + (1 - decay) * float(weight.detach()))) < 1e-6


def test_awm_trains_checks_itself_and_resumes_exactly(tiny_cache, tmp_path):
    """Two iterations on the tiny model, rolled out with DPM-Solver++(2M): finite rewards, the gradient self-check on
    the flow-matching loss, three forwards per image and training sigma counted (v_theta, v_ref, v_ema at 6
    stratified sigmas); a resume after the first ends with the same weights and the same EMA anchor."""
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    common = [*SMALL, "--tiny-cache", tiny_cache, "--method", "awm", "--group-size", "4"]
    proc = run_train([*common, "--output-dir", straight, "--num-iterations", "2"])
    assert "gradient self-check passed" in proc.stdout
    rows = read_metrics(straight)
    assert all(math.isfinite(r["train/reward/shapes"]) and r["perf/optimizer_steps"] == 1 for r in rows[1:])
    assert rows[1]["perf/update_nfe"] == 3 * 2 * 4 * 6 and rows[1]["perf/nfe"] == 2 * 4 * 8  # 3 B G T, B G N
    stopped_after_one(straight, resumed)
    assert "resumed from" in run_train([*common, "--output-dir", resumed, "--num-iterations", "2", "--resume"]).stdout
    assert_same_end(straight, resumed, "ema_anchor")
