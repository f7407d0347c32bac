"""G2RPO's authors' follow-ups (methods/pavegrpo.py, methods/adagrpo.py): each formula against a restatement from
the papers' equations on a toy velocity field (not from the authors' code), AdaGRPO's moving state across a resume,
and both methods (and AdaGRPO's parts as a plug-in of the peers) training on the tiny model.

Run: python -m pytest -q tests/test_series.py     (about 2 minutes on 2 cores)
"""
import json
import math
import os

import pytest
import torch

from methods.base import UpdateContext

from conftest import run_train
from methods.adagrpo import Curriculum, with_global_advantage
from methods.pavegrpo import PaveGRPO, sub_step_log_probs
from sampler import Rollout, sigma_schedule
from test_baselines import SMALL, make, stopped_after_one
from test_train import read_metrics, transformer_weights


def gaussian_log_prob(x, mean, std):
    """log N(x; mean, std^2), averaged over the elements of each row."""
    return (-((x - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)).mean(-1)


def sde_log_prob(x, v, sigma, sigma_next, eta, target):
    """G2RPO's SDE step from (x, sigma) to sigma_next (paper Eq. 4-5 restated): std_dev = eta sqrt(sigma / (1 -
    sigma)), mean = x (1 + std_dev^2 dt / (2 sigma)) + v (1 + std_dev^2 (1 - sigma) / (2 sigma)) dt, std = std_dev
    sqrt(-dt); the log-probability of `target`."""
    dt, std_dev = sigma_next - sigma, eta * math.sqrt(sigma / (1 - sigma))
    mean = x * (1 + std_dev**2 * dt / (2 * sigma)) + v * (1 + std_dev**2 * (1 - sigma) / (2 * sigma)) * dt
    return gaussian_log_prob(target, mean, std_dev * math.sqrt(-dt))


def test_pave_sub_trajectories_walk_euler_sub_steps_then_score_the_last():
    """n equal sub-steps of [sigma_k, sigma_k+1]: n - 1 Euler sub-steps of the current policy from x_k, then the
    stored x_k+1 scored under the SDE step of the last sub-interval; gradients reach the policy through the walk."""
    torch.manual_seed(0)
    sigmas, k, eta = sigma_schedule(8, 3.0), 2, 0.8
    weight = torch.nn.Parameter(torch.tensor(0.4))
    net = lambda x, s, i: weight * x + s.view(-1, 1)  # a toy velocity field v(x, sigma)
    x, targets = torch.randn(2, 6), torch.randn(2, 3, 6)  # 2 start latents, 3 members each
    step = make(PaveGRPO, eta=eta).step
    got = sub_step_log_probs(net, step, x, net(x, sigmas[k].expand(2), None), targets, sigmas, k,
                             torch.arange(2), [2, 3])
    s_k, s_next = float(sigmas[k]), float(sigmas[k + 1])
    for n in (2, 3):
        delta = (s_next - s_k) / n
        y, s = x, s_k
        for _ in range(n - 1):  # y_{j+1} = y_j + delta v(y_j, s_j)
            y, s = y + delta * net(y, torch.tensor([s]).expand(2), None), s + delta
        v = net(y, torch.tensor([s]).expand(2), None)
        expected = torch.stack([sde_log_prob(y, v, s, s_next, eta, targets[:, m]) for m in range(3)], 1)
        torch.testing.assert_close(got[n], expected, atol=1e-5, rtol=1e-5)
    # the walk is differentiable: its velocities carry the policy's gradient
    (grad,) = torch.autograd.grad(got[3].sum(), weight)
    assert float(grad) != 0.0


def test_pave_update_is_the_on_policy_loss_of_every_sub_trajectory():
    """One optimizer step on L = mean_k [ l_0 + mean_n l_n ], l = mean_i -A_i exp(log p_i - sg(log p_i)): the
    gradient is -A grad log p, restated with plain SGD."""
    torch.manual_seed(1)
    sigmas, K, G = sigma_schedule(6, 3.0), 2, 3
    weight = torch.nn.Parameter(torch.tensor(0.3))
    net = lambda x, s, i: weight * x
    start, next_latents, advantages = torch.randn(1, K, 1, 4), torch.randn(1, K, G, 4), torch.randn(1, K, G)
    pave = make(PaveGRPO, eta=0.8, max_grad_norm=100.0, sub_steps=[2, 3], sde_steps=[1, 2])  # (sigma < 1 at both)
    rollout = Rollout(start, next_latents, torch.zeros(1, K, G), None, None, [1, 2], [1], 0, 0)
    stats = pave.update(rollout, advantages, UpdateContext(net, [weight], torch.optim.SGD([weight], lr=0.1), sigmas))
    forwards = pave.update_nfe(rollout)  # per start latent (1) and trained step (K): 1 + (2 - 1) + (3 - 1)
    ours = float(weight.detach())
    weight.data.fill_(0.3)
    loss = 0.0
    for ki, k in enumerate([1, 2]):
        x, A = start[0, ki, 0], advantages[0, ki]
        terms = []
        for n in (1, 2, 3):  # n = 1: the usual term
            delta, y, s = (float(sigmas[k + 1]) - float(sigmas[k])) / n, x, float(sigmas[k])
            for _ in range(n - 1):
                y, s = y + delta * net(y, None, None), s + delta
            log_p = sde_log_prob(y.unsqueeze(0), net(y, None, None).unsqueeze(0), s, float(sigmas[k + 1]), 0.8,
                                 next_latents[0, ki])  # (G,)
            terms.append((-A * torch.exp(log_p - log_p.detach())).mean())
        loss = loss + (terms[0] + (terms[1] + terms[2]) / 2) / K
    loss.backward()
    torch.optim.SGD([weight], lr=0.1).step()
    assert abs(ours - float(weight.detach())) < 1e-6 and abs(ours - 0.3) > 1e-5
    assert stats["optimizer_steps"] == 1 and forwards == 4 * K


def test_the_global_advantage_and_its_two_edge_cases():
    """z = (R - m) / (sqrt(v) + 1e-8); positives over their sum, negatives over the sum of their magnitudes; one side
    empty: z centred; clamped."""
    curriculum = Curriculum(0.8)
    curriculum.mean, curriculum.var = 1.0, 4.0  # moving std 2
    rewards = torch.tensor([[0.0, 2.0, 5.0, 1.0],  # z = -0.5, 0.5, 2, 0: positives sum 2.5, negatives 0.5
                            [3.0, 5.0, 9.0, 1.0],  # z = 1, 2, 4, 0: no negative side -> centred
                            [-1.0, -1.0, -1.0, -1.0]])  # z = -1 each: no positive side -> centred (zeros)
    got = curriculum.global_advantage(rewards, adv_clip_max=5.0)
    expected = torch.tensor([[-0.5 / 0.5, 0.5 / 2.5, 2 / 2.5, 0.0],
                             [1 - 7 / 4, 2 - 7 / 4, 4 - 7 / 4, 0 - 7 / 4],
                             [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(got, expected)
    curriculum.var = 1e-6  # a tiny moving std makes the centred term large: the clamp bounds it
    assert float(curriculum.global_advantage(torch.tensor([[3.0, 5.0]]), adv_clip_max=5.0).abs().max()) == 5.0
    # added to the method's advantage, from scores (B, J, K, G, R) weighted over R and averaged over J
    curriculum.var = 4.0
    scores = torch.stack([rewards[:1], rewards[:1] * 0 + 1.0], -1).view(1, 1, 1, 4, 2)  # reward 2 is a constant 1
    total = with_global_advantage(torch.zeros(1, 1, 4), scores, torch.tensor([1.0, 0.0]), curriculum, 5.0)
    torch.testing.assert_close(total, expected[:1].view(1, 1, 4))


def test_the_curriculum_moves_its_mean_and_picks_the_closest_anchor():
    """The first pool sets the moving mean and variance; later ones move them by (1 - alpha); each slot trains the
    candidate whose anchor score is closest to the updated mean."""
    curriculum = Curriculum(0.8)
    curriculum.observe(torch.tensor([0.0, 1.0, 2.0, 3.0]))
    assert curriculum.mean == 1.5 and curriculum.var == 1.25  # the population variance
    curriculum.observe(torch.tensor([5.0, 5.0, 5.0, 5.0]))
    assert curriculum.mean == pytest.approx(0.8 * 1.5 + 0.2 * 5.0) and curriculum.var == pytest.approx(0.8 * 1.25)
    pool = torch.tensor([[0.0, 2.15, 2.3, 9.0],  # m = 2.2
                         [2.19, -3.0, 4.0, 2.0]])
    assert curriculum.choose(pool).tolist() == [1, 0]
    restored = Curriculum(0.8)
    restored.load_state_dict(curriculum.state_dict())
    assert (restored.mean, restored.var) == (curriculum.mean, curriculum.var)


def curriculum_rows(out):
    return [{k: v for k, v in row.items() if k.startswith("curriculum/")} for row in read_metrics(out)[1:]]


@pytest.mark.parametrize("method", ["pavegrpo", "adagrpo"])
def test_each_method_trains_and_resumes(method, tiny_cache, tmp_path):
    """Two iterations, and the same two with a resume after the first: the same weights, rewards and (AdaGRPO) the
    same moving state and choices."""
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    common = [*SMALL, "--tiny-cache", tiny_cache, "--method", method,
              *(["--sub-steps", "2"] if method == "pavegrpo" else ["--curriculum-pool", "3"])]
    run_train([*common, "--output-dir", straight, "--num-iterations", "2"])
    stopped_after_one(straight, resumed)
    assert "resumed from" in run_train([*common, "--output-dir", resumed, "--num-iterations", "2", "--resume"]).stdout
    a, b = transformer_weights(straight, 2), transformer_weights(resumed, 2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = read_metrics(straight)
    assert [r["train/reward/shapes"] for r in rows[1:]] == [r["train/reward/shapes"] for r in read_metrics(resumed)[1:]]
    assert all(r["perf/optimizer_steps"] == 1 for r in rows[1:])
    if method == "adagrpo":  # the moving state and the prompts chosen continue exactly
        assert curriculum_rows(straight) == curriculum_rows(resumed) and curriculum_rows(straight)[0]
        saved = os.path.join(straight, "checkpoints", "iter_000002", "curriculum.safetensors")
        assert os.path.exists(saved)
    else:  # G2RPO's 1 forward per start latent and step, plus 1 for the 2-sub-step trajectory
        assert rows[1]["perf/update_nfe"] == 2 * 2 * 4


@pytest.mark.parametrize("method", ["flow-grpo", "dancegrpo"])
def test_the_curriculum_and_global_advantage_plug_into_a_peer(method, tiny_cache, tmp_path):
    out = str(tmp_path / "run")
    run_train([*SMALL, "--tiny-cache", tiny_cache, "--method", "adagrpo", "--adagrpo-base", method,
               "--curriculum-pool", "2", "--output-dir", out, "--num-iterations", "1"])
    row = read_metrics(out)[1]
    assert math.isfinite(row["losses/loss"]) and row["curriculum/moving_std"] >= 0
    # the pool's anchors are counted: 2 candidates per prompt, N forwards each, beside the method's own rollout
    assert row["perf/nfe"] > 2 * 2 * 8
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["curriculum_pool"] == 2 and config["global_advantage"] and config["adagrpo_base"] == method


def test_both_methods_parse_for_every_family():
    from lab import flags

    for method in ("pavegrpo", "adagrpo"):
        for model in flags.PRESETS:
            args = flags.parse_args(["--model", model, "--method", method])
            flags.check_flags(args, world=1)
            assert ("curriculum_pool" in vars(args)) == (method == "adagrpo"), (model, method)


def test_a_method_flag_outside_its_method_is_refused_in_one_line():
    """AdaGRPO's curriculum is its own flag now: under another --method it is named with the method that has it."""
    from lab import flags

    with pytest.raises(SystemExit):
        flags.parse_args(["--model", "tiny", "--method", "flow-grpo", "--curriculum-pool", "2"])
