"""The baselines as their authors run them: each axis of --method against the peer's formula, restated here from
its published equations and numbers (never its code), the recipes' resolved values, and every recipe training end
to end on the tiny model across a resume.

Run: python -m pytest -q tests/test_baselines.py
"""
import math
import os
import shutil
import statistics

import pytest
import torch

from lab import flags
from advantage import granular_advantages
from conftest import run_train
from g2rpo import g2rpo_update, random_step_mask
from sampler import Rollout, rollout_full_sde, sde_kl, sde_step, sigma_schedule, window_steps
from test_train import read_metrics, transformer_weights


def test_dancegrpo_step_noise_is_eta_sqrt_minus_dt_and_its_mean_its_score_form():
    # DanceGRPO's step: noise std eta sqrt(sigma - sigma'), mean x + dt v - dt eta^2 / 2 * score, with the score
    # of the Gaussian x_sigma around (1 - sigma) x0_hat: -(x - (1 - sigma) x0_hat) / sigma^2, x0_hat = x - sigma v
    torch.manual_seed(0)
    sigmas, eta = sigma_schedule(16, 3.0), 0.3
    x, v = torch.randn(2, 64), torch.randn(2, 64)
    for i in range(16):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        dt = s_next - s
        shifted, _ = sde_step(torch.zeros(1, 8), torch.zeros(1, 8), sigmas, i, eta, noise=torch.ones(1, 8),
                              sde_type="dance")
        assert abs(float(shifted[0, 0]) - eta * math.sqrt(s - s_next)) < 1e-6, i  # every step, the last included
        x0_hat = x - s * v
        score = -(x - (1 - s) * x0_hat) / s**2
        mean = x + dt * v - dt * eta**2 / 2 * score
        x_next, log_prob = sde_step(x, v, sigmas, i, eta, sde_type="dance")
        expected = torch.distributions.Normal(mean, eta * math.sqrt(-dt)).log_prob(x_next).mean(1)
        torch.testing.assert_close(log_prob, expected, atol=1e-5, rtol=1e-5)


def test_cps_step_preserves_the_noise_level_of_a_straight_flow():
    # Flow-GRPO's coefficients-preserving step, for x = (1 - sigma) x0 + sigma eps and the exact velocity eps - x0:
    # x0_hat = x0 and eps_hat = eps, so x' = (1 - sigma') x0 + sqrt(sigma'^2 - std^2) eps + std z, std = sigma'
    # sin(eta pi / 2): the next point lies on the same kind of path, its noise of total std sigma'
    torch.manual_seed(0)
    sigmas, eta = sigma_schedule(6, 3.0), 0.8
    x0, eps = torch.randn(1, 200_000), torch.randn(1, 200_000)
    for i in range(6):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        x = (1 - s) * x0 + s * eps
        z = torch.randn_like(x)
        x_next, log_prob = sde_step(x, eps - x0, sigmas, i, eta, noise=z, sde_type="cps")
        std = s_next * math.sin(eta * math.pi / 2)
        expected = (1 - s_next) * x0 + math.sqrt(s_next**2 - std**2) * eps + std * z
        torch.testing.assert_close(x_next, expected, atol=1e-5, rtol=1e-5)
        if s_next > 0:
            assert abs(float((x_next - (1 - s_next) * x0).std()) / s_next - 1) < 1e-2
        # its log-prob: -(x' - mean)^2 averaged over elements, without the Gaussian's constant and 1 / (2 std^2)
        torch.testing.assert_close(log_prob, -(std * z) .pow(2).mean(1), atol=1e-6, rtol=1e-5)
    # the last step (sigma' = 0) lands on x0_hat and scores 0
    assert torch.allclose(x_next, x0, atol=1e-5) and float(log_prob.abs().max()) == 0


def test_the_two_kl_forms_differ_by_minus_dt():
    torch.manual_seed(0)
    sigmas, eta = sigma_schedule(16, 3.0), 0.7
    v, v_ref = torch.randn(3, 40), torch.randn(3, 40)
    for i in range(16):
        s, dt = float(sigmas[i]), float(sigmas[i + 1] - sigmas[i])
        exact = sde_kl(v, v_ref, sigmas, i, eta, kl_form="exact")
        flow = sde_kl(v, v_ref, sigmas, i, eta, kl_form="flow-grpo")
        torch.testing.assert_close(flow / exact, torch.full((3,), -dt), rtol=1e-5, atol=0)
        # Flow-GRPO's kl_loss: mean |mean - mean_ref|^2 / (2 std_dev^2), std_dev = eta sqrt(sigma / (1 - sigma))
        std_dev = eta * math.sqrt(s / (1 - (s if s < 1 else float(sigmas[1]))))
        mean = lambda u: sde_step(torch.zeros(3, 40), u, sigmas, i, eta, noise=torch.zeros(3, 40))[0]
        torch.testing.assert_close(flow, ((mean(v) - mean(v_ref)) ** 2).mean(1) / (2 * std_dev**2), rtol=1e-4,
                                   atol=1e-7)
    # at N 16 the exact form is 6 to 46 times the other (the README's figure)
    ratios = [1 / float(sigmas[i] - sigmas[i + 1]) for i in range(16)]
    assert round(min(ratios), 3) == 6.0 and round(max(ratios), 3) == 46.0


def test_flow_grpo_global_std_on_a_hand_made_batch():
    # two prompts of three members, one reward model, one step: each group's mean, one population std + 1e-4
    rewards = [[1.0, 2.0, 3.0], [10.0, 10.0, 13.0]]
    std = statistics.pstdev([r for group in rewards for r in group])
    expected = [[(r - statistics.mean(group)) / (std + 1e-4) for r in group] for group in rewards]
    scores = torch.tensor(rewards).view(2, 1, 1, 3, 1)  # (B, J, K, G, R)
    got = granular_advantages(scores, adv_clip_max=5.0, all_rewards=scores)
    torch.testing.assert_close(got, torch.tensor(expected).view(2, 1, 3), atol=1e-6, rtol=1e-6)
    # on two ranks each holds one prompt and the std comes from both
    mine = granular_advantages(scores[1:], adv_clip_max=5.0, all_rewards=scores)
    torch.testing.assert_close(mine[0], got[1])


def test_mixgrpo_window_sequences():
    # MixGRPO's progressive window: range(start, min(start + size, N - 2)), start + 1 every `every` iterations,
    # back to 0 once past N - 2
    def windows(N, size, every, iterations, schedule):
        return [window_steps(it, num_steps=N, size=size, stride=1, every=every, schedule=schedule)
                for it in range(iterations)]

    # the reference setting's 25 iterations a window over N 16: full windows, then two that shrink at the end
    mix = windows(16, 4, 25, 301, "mixgrpo")
    assert mix[0] == [0, 1, 2, 3] and mix[274] == [10, 11, 12, 13]
    assert mix[275:300] == [[11, 12, 13]] * 25 and mix[300] == [12, 13]
    wrap = windows(16, 4, 25, 301, "wrap")
    assert wrap[300] == [12, 13, 14, 15] and sum(a != b for a, b in zip(mix, wrap)) == 26
    # bench part 3's setting, N 8, window 2, every 4, 80 iterations: a cycle of 28 iterations
    mix = windows(8, 2, 4, 80, "mixgrpo")
    cycle = [[0, 1]] * 4 + [[1, 2]] * 4 + [[2, 3]] * 4 + [[3, 4]] * 4 + [[4, 5]] * 4 + [[5]] * 4 + [[]] * 4
    assert mix == (cycle * 3)[:80]  # it shrinks, is empty once, rolls back
    assert not any(k in (6, 7) for w in mix for k in w)  # never the last two steps
    assert sum(a != b for a, b in zip(mix, windows(8, 2, 4, 80, "wrap"))) == 20
    # Flow-GRPO-Fast's random window: within 0..end - 1
    drawn = [window_steps(it, num_steps=8, size=3, stride=1, every=1, schedule="random", end=4, seed=0)
             for it in range(40)]
    assert {w[0] for w in drawn} == {0, 1} and all(w == list(range(w[0], w[0] + 3)) for w in drawn)


def test_an_empty_window_samples_ode_only():
    net = lambda x, s, i: 0.5 * x
    out = rollout_full_sde(net, torch.randn(2, 6), sigma_schedule(4, 3.0),
                           [torch.Generator().manual_seed(b) for b in range(2)], group_size=3, sde_steps=[], eta=0.7)
    assert out.latents.shape == (2, 0, 3, 6) and out.final_latents.shape == (2, 1, 1, 3, 6)


def test_per_member_noise_and_x0_decoding():
    sigmas, gens = sigma_schedule(4, 3.0), lambda: [torch.Generator().manual_seed(b) for b in range(2)]
    net = lambda x, s, i: 0.5 * x + 0.1
    noise = torch.randn(2, 3, 6)  # (B, G, ...): one initial noise per member
    out = rollout_full_sde(net, noise, sigmas, gens(), group_size=3, sde_steps=[0, 1], eta=0.7, member_noise=True)
    torch.testing.assert_close(out.latents[:, 0], noise)  # step 0 of each member starts from its own noise
    # x0 decoding: the last step's x0_hat = x - sigma v instead of its noisy sample
    sample = rollout_full_sde(net, noise[:, 0], sigmas, gens(), group_size=3, sde_steps=[3], eta=0.7)
    x0 = rollout_full_sde(net, noise[:, 0], sigmas, gens(), group_size=3, sde_steps=[3], eta=0.7, decode="x0")
    x = sample.latents[:, 0]  # (B, G, ...): where the last step starts
    torch.testing.assert_close(x0.final_latents[:, 0, 0], x - float(sigmas[3]) * net(x, None, None))
    assert not torch.allclose(sample.final_latents, x0.final_latents)


def test_dancegrpo_trained_steps_and_its_accumulated_update():
    # each member trains its own int(0.6 * 15) = 9 of the steps 0..14, distinct and drawn anew per member
    gens = [torch.Generator().manual_seed(b) for b in range(2)]
    mask = random_step_mask(gens, 15, 12, 0.6)  # (B, K, G)
    assert mask.shape == (2, 15, 12) and (mask.sum(1) == 9).all()
    assert len({tuple(mask[b, :, g].tolist()) for b in range(2) for g in range(12)}) > 12

    # the update: per chunk of members, one optimizer step on the mean over its (member, step) pairs of the
    # clipped loss, restated here member by member with batch-1 forwards
    torch.manual_seed(0)
    B, K, G, sigmas = 1, 3, 4, sigma_schedule(4, 3.0)
    weight = torch.nn.Parameter(torch.tensor(0.3))
    net = lambda x, s, i: weight * x
    latents, next_latents = torch.randn(B, K, G, 5), torch.randn(B, K, G, 5)
    old = torch.stack([sde_step(latents[:, k].flatten(0, 1), 0.3 * latents[:, k].flatten(0, 1), sigmas, k, 0.3,
                                next_latents=next_latents[:, k].flatten(0, 1), sde_type="dance")[1].view(B, G)
                       for k in range(K)], 1)  # (B, K, G)
    rollout = Rollout(latents, next_latents, old, None, None, [0, 1, 2], 0, 0)
    advantages, mask = torch.randn(B, K, G), torch.rand(B, K, G) > 0.4
    mask[:, 0] = True  # every member trains a step
    kw = dict(eta=0.3, clip_range=0.05, max_grad_norm=100.0, sde_type="dance")
    g2rpo_update(net, [weight], torch.optim.SGD([weight], lr=0.1), rollout, advantages, sigmas,
                 step_per_sde_step=False, train_mask=mask, member_chunks=2, **kw)
    ours = float(weight.detach())
    weight.data.fill_(0.3)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    for members in ([0, 1], [2, 3]):
        pairs = [(k, g) for g in members for k in range(K) if mask[0, k, g]]
        for k, g in pairs:
            x = latents[0, k, g : g + 1]
            _, log_prob = sde_step(x, net(x, None, None), sigmas, k, 0.3, next_latents=next_latents[0, k, g : g + 1],
                                   sde_type="dance")
            ratio = torch.exp(log_prob - old[0, k, g])
            a = advantages[0, k, g]
            loss = torch.maximum(-a * ratio, -a * ratio.clamp(0.95, 1.05)).sum() / len(pairs)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert abs(ours - float(weight)) < 1e-6 and abs(ours - 0.3) > 1e-4


# the recipes' values at --model flux: the peers' published runs (docs/baselines.md names each file)
TABLE = {
    "g2rpo": dict(sampling="g2rpo", group_size=12, num_steps=16, eta=0.7, lr=2e-6, clip_range=1e-4, kl_beta=0.0,
                  sde_steps=list(range(8)), sde_type="flow", adv_std="group", same_noise=True, lora_rank=0,
                  step_per_sde_step=True, timestep_fraction=1.0, decode="sample"),
    "dancegrpo": dict(sampling="full", group_size=12, num_steps=16, eta=0.3, lr=1e-5, clip_range=1e-4, kl_beta=0.0,
                      sde_steps=list(range(15)), timestep_fraction=0.6, sde_type="dance", decode="x0",
                      adv_std="group", same_noise=True, step_per_sde_step=False, member_chunks=3, lora_rank=0,
                      shift=3.0, resolution=720, max_grad_norm=1.0),
    "flow-grpo": dict(sampling="full", group_size=24, num_steps=6, eta=0.9, lr=3e-4, clip_range=1e-4, kl_beta=0.0,
                      sde_steps=[0, 1, 2, 3, 4], sde_type="flow", adv_std="global", same_noise=False,
                      kl_form="flow-grpo", reward_fusion="score", lora_rank=64, resolution=512, guidance=3.5,
                      step_per_sde_step=False, member_chunks=2),
    "flow-grpo-fast": dict(sampling="mixed", sde_type="cps", eta=0.8, window_schedule="random", window_size=3,
                           window_end=3, clip_range=1e-5, group_size=24, num_steps=6, adv_std="global",
                           same_noise=False, lora_rank=64),
    "mixgrpo": dict(sampling="mixed", window_schedule="mixgrpo", window_size=4, window_every=25, window_stride=1,
                    group_size=12, num_steps=25, eta=0.7, lr=1e-5, clip_range=1e-4, kl_beta=0.0, sde_type="flow",
                    adv_std="group", same_noise=True, step_per_sde_step=False, member_chunks=4),
}


@pytest.mark.parametrize("method", list(TABLE))
def test_recipes_resolve_to_the_table(method):
    args = vars(flags.parse_args(["--model", "flux", "--method", method]))
    assert {k: args[k] for k in TABLE[method]} == TABLE[method]
    assert flags.preset("flux", method) == {**args}  # evaluate.py's view of the same defaults
    # on the tiny model the preset's sizes stand and the algorithm changes
    tiny = vars(flags.parse_args(["--model", "tiny", "--method", method]))
    tiny_preset = flags.preset("tiny")
    assert {k: tiny[k] for k in ("group_size", "num_steps", "lr", "clip_range", "resolution")} == \
        {k: tiny_preset[k] for k in ("group_size", "num_steps", "lr", "clip_range", "resolution")}
    for name, value in flags.METHODS[method].algorithm.items():
        assert tiny[name] == value, name
    # a flag given overrides the recipe; the values that follow N follow the N given
    given = vars(flags.parse_args(["--model", "flux", "--method", method, "--eta", "0.5", "--num-steps", "10"]))
    assert given["eta"] == 0.5 and given["num_steps"] == 10
    if method in ("dancegrpo", "flow-grpo"):
        assert given["sde_steps"] == list(range(9))
    if method == "flow-grpo-fast":
        assert given["window_end"] == 5


def test_an_impossible_axis_is_refused_in_one_line(capsys):
    for argv, words in [(["--no-same-noise"], "share x_T"), (["--decode", "x0"], "--decode is for"),
                        (["--method", "dancegrpo", "--member-chunks", "20"], "more than the --group-size"),
                        (["--member-chunks", "2"], "--no-step-per-sde-step"),
                        (["--method", "flow-grpo-fast", "--eta", "1.5"], "(0, 1]"),
                        (["--method", "dancegrpo", "--timestep-fraction", "0.1"], "trains none"),
                        (["--method", "mixgrpo", "--timestep-fraction", "0.6"], "a window can be 1 step"),
                        (["--sampling", "full", "--step-credit", "mean"], "control for --sampling g2rpo"),
                        (["--method", "nope"], "unknown --method")]:
        with pytest.raises(SystemExit) as exit_info:
            flags.check_flags(flags.parse_args(["--model", "tiny", *argv]), world=1)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1, (argv, err)


SMALL = ["--model", "tiny", "--prompts-per-iteration", "2", "--eval-seeds", "1", "--eval-prompts", "2",
         "--final-eval-seeds", "1", "--eval-every", "100", "--checkpoint-every", "1", "--lr", "1e-3"]


@pytest.mark.parametrize("method", ["dancegrpo", "flow-grpo", "flow-grpo-fast", "mixgrpo"])
def test_every_recipe_trains_and_resumes(method, tiny_cache, tmp_path):
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    common = [*SMALL, "--tiny-cache", tiny_cache, "--method", method]
    run_train([*common, "--output-dir", straight, "--num-iterations", "2"])
    # the same run stopped after iteration 1: its folder as the first checkpoint left it, then --resume
    shutil.copytree(straight, resumed)
    shutil.rmtree(os.path.join(resumed, "checkpoints", "iter_000002"))
    with open(os.path.join(resumed, "metrics.jsonl")) as f:
        lines = f.readlines()
    with open(os.path.join(resumed, "metrics.jsonl"), "w") as f:
        f.writelines(lines[:2])
    proc = run_train([*common, "--output-dir", resumed, "--num-iterations", "2", "--resume"])
    assert "resumed from" in proc.stdout
    a, b = transformer_weights(straight, 2), transformer_weights(resumed, 2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = read_metrics(straight)
    assert [r["train/reward/shapes"] for r in rows[1:]] == [r["train/reward/shapes"] for r in read_metrics(resumed)[1:]]
    steps = flags.METHODS[method].algorithm["member_chunks"]
    assert all(r["perf/optimizer_steps"] == steps for r in rows[1:])  # one per chunk of members
    assert rows[1]["perf/nfe"] > 0 and math.isfinite(rows[-1]["losses/loss"])
