"""The peers as their authors run them (methods/): each one's formulas against the peer's equations, restated here
from its published equations and numbers (never its code), the whole-trajectory rollout, the recipes' resolved
values, and every recipe training end to end on the tiny model across a resume.

Run: python -m pytest -q tests/test_baselines.py
"""
import math
import os
import shutil
import statistics

import pytest
import torch

from methods.base import UpdateContext

from conftest import run_train
from lab import flags
from methods import METHODS
from methods.dancegrpo import DanceGRPO, random_step_mask
from methods.base import global_std_advantages
from methods.flow_grpo import FlowGRPO, FlowGRPOFast, random_window
from methods.mixgrpo import progressive_window
from methods.trajectories import rollout_trajectories
from sampler import Rollout, sde_kl, sde_std_dev, sde_step, sigma_schedule
from test_train import read_metrics, transformer_weights

COMMON = dict(group_size=4, eta=0.7, clip_range=1e-4, adv_clip_max=5.0, max_grad_norm=1.0, max_batch=64,
              inner_epochs=1, kl_beta=0.0)  # the run's flags a method reads, at test values


def make(cls, **values):
    """A method of class `cls` with the common test values, the fields it has, and `values`."""
    fields = {**COMMON, "sde_steps": [0], "num_steps": 8, "seed": 0, "guidance": 3.5, **values}
    return cls(**{k: v for k, v in fields.items() if k in cls.__dataclass_fields__})


def trajectories(noise, sigmas, gens, *, sde_steps, eta=0.7, ode_elsewhere=False, **options):
    """G2RPO's SDE step on whole trajectories (MixGRPO's and the full-SDE ablation's)."""
    step = lambda x, v, sigmas, i, noise=None, next_latents=None: sde_step(x, v, sigmas, i, eta, noise, next_latents)
    return rollout_trajectories(options.pop("net"), noise, sigmas, gens, group_size=3, sde_steps=sde_steps,
                                step_fn=step, max_batch=64, ode_elsewhere=ode_elsewhere, **options)


def test_dancegrpo_step_noise_is_eta_sqrt_minus_dt_and_its_mean_its_score_form():
    # DanceGRPO's step: noise std eta sqrt(sigma - sigma'), mean x + dt v - dt eta^2 / 2 * score, with the score
    # of the Gaussian x_sigma around (1 - sigma) x0_hat: -(x - (1 - sigma) x0_hat) / sigma^2, x0_hat = x - sigma v
    torch.manual_seed(0)
    sigmas, eta = sigma_schedule(16, 3.0), 0.3
    x, v = torch.randn(2, 64), torch.randn(2, 64)
    for i in range(16):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        dt = s_next - s
        dance = make(DanceGRPO, eta=eta)
        shifted, _ = dance.step(torch.zeros(1, 8), torch.zeros(1, 8), sigmas, i, noise=torch.ones(1, 8))
        assert abs(float(shifted[0, 0]) - eta * math.sqrt(s - s_next)) < 1e-6, i  # every step, the last included
        x0_hat = x - s * v
        score = -(x - (1 - s) * x0_hat) / s**2
        mean = x + dt * v - dt * eta**2 / 2 * score
        x_next, log_prob = dance.step(x, v, sigmas, i)
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
        x_next, log_prob = make(FlowGRPOFast, eta=eta).step(x, eps - x0, sigmas, i, noise=z)
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
        exact = sde_kl(v, v_ref, sigmas, i, sde_std_dev(sigmas, i, eta))
        flow = make(FlowGRPO, eta=eta).kl(v, v_ref, sigmas, i)
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
    got = global_std_advantages(scores, torch.ones(1), adv_clip_max=5.0)
    torch.testing.assert_close(got, torch.tensor(expected).view(2, 1, 3), atol=1e-6, rtol=1e-6)

    class TwoRanks:  # this rank holds the second prompt, the other rank the first
        world = 2
        gather = staticmethod(lambda t: torch.cat([scores[:1], t]))
    mine = global_std_advantages(scores[1:], torch.ones(1), adv_clip_max=5.0, ranks=TwoRanks())
    torch.testing.assert_close(mine[0], got[1])
    # several rewards are summed raw first (multi_score): weights 1 and 2 on two copies = 3 times the one reward
    twice = global_std_advantages(torch.cat([scores, scores], -1), torch.tensor([1.0, 2.0]), adv_clip_max=5.0)
    torch.testing.assert_close(twice, got, atol=1e-4, rtol=1e-4)


def test_mixgrpo_window_sequences():
    # MixGRPO's progressive window: range(start, min(start + size, N - 2)), start + 1 every `every` iterations,
    # back to 0 once past N - 2
    def windows(N, size, every, iterations):
        return [progressive_window(it, num_steps=N, size=size, stride=1, every=every) for it in range(iterations)]

    # the reference setting's 25 iterations a window over N 16: full windows, then two that shrink at the end
    mix = windows(16, 4, 25, 301)
    assert mix[0] == [0, 1, 2, 3] and mix[274] == [10, 11, 12, 13]
    assert mix[275:300] == [[11, 12, 13]] * 25 and mix[300] == [12, 13]
    # bench part 3's setting, N 8, window 2, every 4, 80 iterations: a cycle of 28 iterations
    mix = windows(8, 2, 4, 80)
    cycle = [[0, 1]] * 4 + [[1, 2]] * 4 + [[2, 3]] * 4 + [[3, 4]] * 4 + [[4, 5]] * 4 + [[5]] * 4 + [[]] * 4
    assert mix == (cycle * 3)[:80]  # it shrinks, is empty once, rolls back
    assert not any(k in (6, 7) for w in mix for k in w)  # never the last two steps
    # Flow-GRPO-Fast's random window: within 0..end - 1, the same for the same (seed, iteration)
    drawn = [random_window(it, num_steps=8, size=3, end=4, seed=0) for it in range(40)]
    assert {w[0] for w in drawn} == {0, 1} and all(w == list(range(w[0], w[0] + 3)) for w in drawn)
    assert drawn == [random_window(it, num_steps=8, size=3, end=4, seed=0) for it in range(40)]
    wide = [random_window(it, num_steps=8, size=2, end=0, seed=3) for it in range(30)]
    assert all(0 <= w[0] <= 6 for w in wide) and len({w[0] for w in wide}) > 3


def test_full_sde_rollout_shapes():
    torch.manual_seed(0)
    net = lambda x, s, i: 0.5 * x + 0.1 * i[:, None]
    out = trajectories(torch.randn(2, 6), sigma_schedule(8, 3.0), [torch.Generator().manual_seed(b) for b in range(2)],
                       sde_steps=[0, 4], net=net)
    assert out.start_latents.shape == (2, 2, 3, 6) and out.final_latents.shape == (2, 1, 1, 3, 6)
    assert out.nfe == 8 * 6 and out.calls == 8
    torch.testing.assert_close(out.start_latents[:, 0], torch.zeros(2, 3, 6) + out.start_latents[:, 0, :1])  # x_T


@pytest.mark.parametrize("window", [[0, 1], [3, 4, 5], [7]])
def test_mixed_rollout_sde_only_in_the_window(window):
    torch.manual_seed(0)
    net, B, G, N = (lambda x, s, i: 0.5 * x + 0.1 * i[:, None]), 2, 3, 8
    gens = lambda: [torch.Generator().manual_seed(b) for b in range(B)]
    out = trajectories(torch.randn(B, 6), sigma_schedule(N, 3.0), gens(), sde_steps=window, ode_elsewhere=True,
                       net=net)
    first = window[0]
    assert out.nfe == B * (first + G * (N - first))  # members are one latent until the window
    assert out.start_latents.shape == (B, len(window), G, 6) and out.final_latents.shape == (B, 1, 1, G, 6)
    assert torch.equal(out.start_latents[:, 0, 0], out.start_latents[:, 0, 1])  # the window opens on the ODE latent
    assert not torch.allclose(out.final_latents[:, 0, 0, 0], out.final_latents[:, 0, 0, 1])
    # whole SDE trajectories pay every step for every member
    assert trajectories(torch.randn(B, 6), sigma_schedule(N, 3.0), gens(), sde_steps=window, net=net).nfe == B * G * N


def test_an_empty_window_samples_ode_only():
    net = lambda x, s, i: 0.5 * x
    out = trajectories(torch.randn(2, 6), sigma_schedule(4, 3.0), [torch.Generator().manual_seed(b) for b in range(2)],
                       sde_steps=[], ode_elsewhere=True, net=net)
    assert out.start_latents.shape == (2, 0, 3, 6) and out.final_latents.shape == (2, 1, 1, 3, 6)


def test_per_member_noise_and_x0_decoding():
    sigmas, gens = sigma_schedule(4, 3.0), lambda: [torch.Generator().manual_seed(b) for b in range(2)]
    net = lambda x, s, i: 0.5 * x + 0.1
    noise = torch.randn(2, 3, 6)  # (B, G, ...): one initial noise per member
    out = trajectories(noise, sigmas, gens(), sde_steps=[0, 1], per_member_noise=True, net=net)
    torch.testing.assert_close(out.start_latents[:, 0], noise)  # step 0 of each member starts from its own noise
    # x0 decoding: the last step's x0_hat = x - sigma v instead of its noisy sample
    sample = trajectories(noise[:, 0], sigmas, gens(), sde_steps=[3], net=net)
    x0 = trajectories(noise[:, 0], sigmas, gens(), sde_steps=[3], x0_image=True, net=net)
    x = sample.start_latents[:, 0]  # (B, G, ...): where the last step starts
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
    dance = make(DanceGRPO, eta=0.3, clip_range=0.05, max_grad_norm=100.0, member_chunks=2, sde_steps=[0, 1, 2],
                 timestep_fraction=0.6)
    old = torch.stack([dance.step(latents[:, k].flatten(0, 1), 0.3 * latents[:, k].flatten(0, 1), sigmas, k,
                                  next_latents=next_latents[:, k].flatten(0, 1))[1].view(B, G)
                       for k in range(K)], 1)  # (B, K, G)
    rollout = Rollout(latents, next_latents, old, None, None, [0, 1, 2], [], 0, 0)
    advantages = torch.randn(B, K, G)
    # the steps each member trains, drawn by its update from the prompt's generator (restated below)
    mask = random_step_mask([torch.Generator().manual_seed(5)], K, G, 0.6)  # (B, K, G): 1 of 3 steps each
    dance.update(rollout, advantages, UpdateContext(net, [weight], torch.optim.SGD([weight], lr=0.1), sigmas,
                                                    generators=[torch.Generator().manual_seed(5)]))
    ours = float(weight.detach())
    weight.data.fill_(0.3)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    for members in ([0, 1], [2, 3]):
        pairs = [(k, g) for g in members for k in range(K) if mask[0, k, g]]
        for k, g in pairs:
            x = latents[0, k, g : g + 1]
            # DanceGRPO's log-prob: N(x'; x + dt (v + eta^2 / (2 sigma) (x + (1 - sigma) v)), eta^2 (-dt))
            s_k, dt = float(sigmas[k]), float(sigmas[k + 1] - sigmas[k])
            v = net(x, None, None)
            mean = x + dt * (v + 0.3**2 / (2 * s_k) * (x + (1 - s_k) * v))
            log_prob = torch.distributions.Normal(mean, 0.3 * math.sqrt(-dt)).log_prob(
                next_latents[0, k, g : g + 1]).mean(1)
            ratio = torch.exp(log_prob - old[0, k, g])
            a = advantages[0, k, g]
            loss = torch.maximum(-a * ratio, -a * ratio.clamp(0.95, 1.05)).sum() / len(pairs)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert abs(ours - float(weight.detach())) < 1e-6 and abs(ours - 0.3) > 1e-4


# the recipes' values at --model flux: the peers' published runs (each method file names its sources)
TABLE = {
    "g2rpo": dict(group_size=12, num_steps=16, eta=0.7, lr=2e-6, clip_range=1e-4, kl_beta=0.0,
                  sde_steps=list(range(8)), lora_rank=0, step_per_sde_step=True, granularities=[1, 2, 3]),
    "dancegrpo": dict(group_size=12, num_steps=16, eta=0.3, lr=1e-5, clip_range=1e-4, kl_beta=0.0,
                      sde_steps=list(range(15)), timestep_fraction=0.6, member_chunks=3, lora_rank=0,
                      shift=3.0, resolution=720, max_grad_norm=1.0),
    "flow-grpo": dict(group_size=24, num_steps=6, eta=0.9, lr=3e-4, clip_range=1e-4, kl_beta=0.0,
                      sde_steps=[0, 1, 2, 3, 4], lora_rank=64, lora_alpha=128.0, lora_feed_forward=True,
                      resolution=512, guidance=3.5, member_chunks=2),
    "flow-grpo-fast": dict(eta=0.8, window_size=3, window_end=3, clip_range=1e-5, group_size=24, num_steps=6,
                           lora_rank=64, member_chunks=2),
    "mixgrpo": dict(window_size=4, window_every=25, window_stride=1, group_size=12, num_steps=25, eta=0.7, lr=1e-5,
                    clip_range=1e-4, kl_beta=0.0, member_chunks=4),
    # Flow-Factory's SD3.5-M recipe (no FLUX.1 one is published), on FLUX.1's guidance
    "flow-dppo": dict(group_size=16, num_steps=10, eta=0.7, sde_type="cps", lr=3e-4, kl_beta=1e-3, lora_rank=32,
                      lora_alpha=64.0, sigma_grid="sd3", resolution=512, prompts_per_iteration=64, ema_decay=0.9,
                      ema_every=4, kl_mask_threshold=1e-6, sde_draws=3, sde_window=6, member_chunks=2),
    # its authors' FLUX.1-dev script, 8 GPUs x 2 prompts
    "branchgrpo": dict(group_size=16, num_steps=20, eta=0.3, lr=1e-5, clip_range=1e-3, kl_beta=0.0, lora_rank=0,
                       resolution=720, split_points=[0, 3, 6, 9], split_noise_scale=4.0, edges_per_step=6,
                       prompts_per_iteration=16, num_iterations=300, rewards=["hps=1.0"], width_pruning=0,
                       depth_pruning=[]),
    # the G2RPO series (tests/test_series.py tests their formulas): scripts/train_pavegrpo.sh, train_adagrpo.sh
    "pavegrpo": dict(group_size=12, num_steps=16, eta=0.8, lr=2e-6, sde_steps=[0, 2, 4, 6], resolution=512,
                     lora_rank=0, sub_steps=[2, 3], granularities=[1], rewards=["hpsv3=1.0"], num_iterations=300),
    "adagrpo": dict(group_size=12, num_steps=16, eta=0.7, lr=2e-6, sde_steps=[0, 2, 4, 6], resolution=512,
                    lora_rank=0, granularities=[1], curriculum_pool=10, curriculum_ema=0.8, global_advantage=True,
                    rewards=["hpsv3=1.0"], gradient_checkpointing=False),
}
# what a method of whole trajectories runs, by construction, where G2RPO runs otherwise
FIXED = {"dancegrpo": dict(shared_noise=True, per_step_advantages=False),
         "flow-grpo": dict(shared_noise=False, per_step_advantages=False),
         "flow-grpo-fast": dict(shared_noise=False, per_step_advantages=False),
         "mixgrpo": dict(shared_noise=True, per_step_advantages=False),
         "flow-dppo": dict(shared_noise=False, per_step_advantages=False),
         "branchgrpo": dict(shared_noise=True, per_step_advantages=True)}


@pytest.mark.parametrize("method", list(TABLE))
def test_recipes_resolve_to_the_table(method):
    args = vars(flags.parse_args(["--model", "flux", "--method", method]))
    assert {k: args[k] for k in TABLE[method]} == TABLE[method]
    assert flags.preset("flux", method) == {**args}  # evaluate.py's view of the same defaults
    fixed = dict(FIXED.get(method, {}))
    if "shared_noise" in fixed:  # x_T one per prompt (B, ...), or one per member (B, G, ...)
        noise = flags.method_of(flags.parse_args(["--model", "flux", "--method", method])).initial_noise(
            lambda gens: torch.zeros(len(gens), 1), [torch.Generator()] * 2)
        assert (noise.dim() == 2) == fixed.pop("shared_noise")
    for name, value in fixed.items():
        assert getattr(METHODS[method], name) == value, name
    # on the tiny model the preset's sizes stand and the algorithm changes
    tiny = vars(flags.parse_args(["--model", "tiny", "--method", method]))
    tiny_preset = flags.preset("tiny")
    assert {k: tiny[k] for k in ("group_size", "num_steps", "lr", "clip_range", "resolution")} == \
        {k: tiny_preset[k] for k in ("group_size", "num_steps", "lr", "clip_range", "resolution")}
    assert tiny["eta"] == TABLE[method]["eta"]
    # a flag given overrides the recipe; the values that follow N follow the N given
    given = vars(flags.parse_args(["--model", "flux", "--method", method, "--eta", "0.5", "--num-steps", "10"]))
    assert given["eta"] == 0.5 and given["num_steps"] == 10
    if method in ("dancegrpo", "flow-grpo"):
        assert given["sde_steps"] == list(range(9))
    if method == "flow-grpo-fast":
        assert given["window_end"] == 5


def test_a_method_lists_only_its_own_flags():
    # --granularities is G2RPO's, --member-chunks the peers', --window-size the windowed ones'
    assert {"granularities", "step_per_sde_step"} <= set(flags.own_flags("g2rpo"))
    assert not {"granularities", "member_chunks", "window_size"} & set(flags.own_flags("full-sde"))
    assert set(flags.own_flags("mixgrpo")) == {"window_size", "window_stride", "window_every", "member_chunks",
                                               "sde_type"}
    # its own flags are resume keys; the common ones stay as they were
    assert "timestep_fraction" in flags.resume_keys("dancegrpo") and "seed" in flags.resume_keys("dancegrpo")


def test_an_impossible_value_is_refused_in_one_line(capsys):
    for argv, words in [(["--method", "dancegrpo", "--member-chunks", "20"], "1..--group-size"),
                        (["--method", "flow-grpo-fast", "--eta", "1.5"], "(0, 1]"),
                        (["--method", "dancegrpo", "--timestep-fraction", "0.1"], "trains none"),
                        (["--method", "mixgrpo", "--num-steps", "2"], "--num-steps 3 or more"),
                        (["--method", "mixgrpo", "--window-size", "9"], "longer than the schedule"),
                        (["--method", "mixgrpo", "--granularities", "1"], "a flag of --method g2rpo"),
                        (["--method", "full-sde", "--step-credit", "mean"], "a control for the methods whose steps have their own"),
                        (["--granularities", "0"], "distinct strides"),
                        (["--method", "nope"], "unknown --method")]:
        with pytest.raises(SystemExit) as exit_info:
            flags.check_flags(flags.parse_args(["--model", "tiny", *argv]), world=1)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1, (argv, err)
    # G2RPO runs on fewer steps than a peer's window: no window flag stands in its way
    flags.check_flags(flags.parse_args(["--model", "tiny", "--num-steps", "3", "--sde-steps", "0"]), world=1)


SMALL = ["--model", "tiny", "--prompts-per-iteration", "2", "--eval-seeds", "1", "--eval-prompts", "2",
         "--final-eval-seeds", "1", "--eval-every", "100", "--checkpoint-every", "1", "--lr", "1e-3"]


def stopped_after_one(straight, resumed):
    """`resumed`: a copy of the 2-iteration run `straight` as it stood after iteration 1 (its first checkpoint, its
    first two metrics rows), to --resume from."""
    shutil.copytree(straight, resumed)
    shutil.rmtree(os.path.join(resumed, "checkpoints", "iter_000002"))
    with open(os.path.join(resumed, "metrics.jsonl")) as f:
        lines = f.readlines()
    with open(os.path.join(resumed, "metrics.jsonl"), "w") as f:
        f.writelines(lines[:2])


@pytest.mark.parametrize("method", ["dancegrpo", "flow-grpo", "flow-grpo-fast", "mixgrpo", "flow-dppo", "branchgrpo"])
def test_every_recipe_trains_and_resumes(method, tiny_cache, tmp_path):
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    common = [*SMALL, "--tiny-cache", tiny_cache, "--method", method]
    run_train([*common, "--output-dir", straight, "--num-iterations", "2"])
    stopped_after_one(straight, resumed)
    proc = run_train([*common, "--output-dir", resumed, "--num-iterations", "2", "--resume"])
    assert "resumed from" in proc.stdout
    a, b = transformer_weights(straight, 2), transformer_weights(resumed, 2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = read_metrics(straight)
    assert [r["train/reward/shapes"] for r in rows[1:]] == [r["train/reward/shapes"] for r in read_metrics(resumed)[1:]]
    trainer = flags.method_of(flags.parse_args(common))
    steps = trainer.optimizer_steps(len(trainer.trained_steps(1)))
    assert all(r["perf/optimizer_steps"] == steps for r in rows[1:])  # one per chunk of members, or of edges
    assert rows[1]["perf/nfe"] > 0 and math.isfinite(rows[-1]["losses/loss"])
