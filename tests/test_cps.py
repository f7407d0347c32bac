"""The coefficients-preserving SDE step (--sde-type cps, sampler.py) for every method that samples SDE steps: the step,
its log-prob and its KL (both of its authors' forms) against the CPS paper's equations restated in float64, a closed
form on a straight flow, G2RPO's fast rollout against the paper's loop with the CPS step, the flags (the CPS clip
range and eta unless given, the refusals), and a 2-iteration tiny run with an exact resume.

Run: python -m pytest -q tests/test_cps.py
"""
import math

import pytest
import torch

from conftest import run_train
from lab import flags
from methods import METHODS
from methods.base import SDEStep
from sampler import cps_kl, cps_mean_std, rollout_g2rpo, rollout_g2rpo_paper, sde_step, sigma_schedule
from test_baselines import SMALL, stopped_after_one
from test_train import read_metrics, transformer_weights

SDE_METHODS = [name for name, cls in METHODS.items() if issubclass(cls, SDEStep)]


def cps_method(name, *argv):
    """The method `name` as train.py builds it on the tiny model with --sde-type cps."""
    return flags.method_of(flags.parse_args(["--model", "tiny", "--method", name, "--sde-type", "cps", *argv]))


def cps_mean_std_64(x, v, s, s_next, eta):
    """The CPS step restated in float64 from its paper: x0_hat = x - s v, eps_hat = x + (1 - s) v, std = s' sin(eta
    pi / 2), mean = (1 - s') x0_hat + sqrt(s'^2 - std^2) eps_hat."""
    x, v = x.double(), v.double()
    std = s_next * math.sin(eta * math.pi / 2)
    return (1 - s_next) * (x - s * v) + math.sqrt(s_next**2 - std**2) * (x + (1 - s) * v), std


def test_the_cps_step_and_its_log_prob_against_float64():
    torch.manual_seed(0)
    sigmas = sigma_schedule(10, 3.0)
    x, v = torch.randn(3, 4, 5), torch.randn(3, 4, 5)
    for eta in (0.3, 0.8, 1.0):
        for i in range(10):
            s, s_next = float(sigmas[i]), float(sigmas[i + 1])
            mean, std = cps_mean_std(x, v, sigmas, i, eta)
            mean_64, std_64 = cps_mean_std_64(x, v, s, s_next, eta)
            torch.testing.assert_close(mean.double(), mean_64, atol=1e-5, rtol=1e-5)
            assert abs(std - std_64) < 1e-7
            # its log-prob: -|x' - mean|^2 averaged over the elements (no constant, no 1 / (2 std^2))
            x_next, log_prob = sde_step(x, v, sigmas, i, eta, sde_type="cps")
            torch.testing.assert_close(log_prob.double(), -((x_next.double() - mean_64) ** 2).mean(dim=(1, 2)),
                                       atol=1e-5, rtol=1e-5)
            if s_next == 0:  # the last step: no noise, the sample is x0_hat and scores 0
                torch.testing.assert_close(x_next, x - s * v, atol=1e-5, rtol=0)
                continue
            # a log-ratio between two policies is the Gaussian's times 2 std^2: the scale its clip range lives on
            v_new = v + 0.01 * torch.randn_like(v)
            _, moved = sde_step(x, v_new, sigmas, i, eta, next_latents=x_next, sde_type="cps")
            gaussian = torch.distributions.Normal(cps_mean_std_64(x, v_new, s, s_next, eta)[0], std_64).log_prob(
                x_next.double()).mean(dim=(1, 2)) - torch.distributions.Normal(mean_64, std_64).log_prob(
                x_next.double()).mean(dim=(1, 2))
            torch.testing.assert_close((moved - log_prob).double(), 2 * std_64**2 * gaussian, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("name", SDE_METHODS)
def test_every_sde_method_takes_the_cps_step_on_a_straight_flow(name):
    # for x = (1 - s) x0 + s eps and the exact velocity eps - x0, x0_hat = x0 and eps_hat = eps, so
    # x' = (1 - s') x0 + sqrt(s'^2 - std^2) eps + std z: the next point carries noise of std s' in all
    torch.manual_seed(0)
    method = cps_method(name, "--eta", "0.8")
    sigmas = sigma_schedule(8, 3.0)
    x0, eps = torch.randn(1, 50_000), torch.randn(1, 50_000)
    for i in range(7):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        z = torch.randn_like(x0)
        x_next, log_prob = method.step((1 - s) * x0 + s * eps, eps - x0, sigmas, i, noise=z)
        std = s_next * math.sin(0.8 * math.pi / 2)
        torch.testing.assert_close(x_next, (1 - s_next) * x0 + math.sqrt(s_next**2 - std**2) * eps + std * z,
                                   atol=1e-5, rtol=1e-5)
        assert abs(float((x_next - (1 - s_next) * x0).std()) / s_next - 1) < 2e-2
        torch.testing.assert_close(log_prob, -(std * z).pow(2).mean(1), atol=1e-6, rtol=1e-4)
    # its KL to another velocity is the CPS step's (sampler.cps_kl), whatever the method's flow-step KL (Flow-DPPO's
    # pull to the base is its own x-based gap on either step: tests/test_flow_dppo.py)
    v, v_ref = torch.randn(2, 30), torch.randn(2, 30)
    if name != "flow-dppo":
        torch.testing.assert_close(method.kl(v, v_ref, sigmas, 2), cps_kl(v, v_ref, sigmas, 2, 0.8))


def test_cps_kl_is_the_authors_mean_gap_or_the_gaussians():
    """The CPS authors' kl_loss (IamCreateAI/FlowCPS): train_sd3.py and train_flux.py since commit 814c359 take
    mean (mu - mu_ref)^2, the default; train_sd3_fast.py keeps / (2 std^2), the Gaussian KL (gaussian=True), which
    torch.distributions gives. Both from the step's means restated in float64."""
    torch.manual_seed(0)
    sigmas, eta = sigma_schedule(8, 3.0), 0.7
    x, v, v_ref = torch.randn(3, 20), torch.randn(3, 20), torch.randn(3, 20)
    for i in range(8):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        kl, gaussian = cps_kl(v, v_ref, sigmas, i, eta), cps_kl(v, v_ref, sigmas, i, eta, gaussian=True)
        if s_next == 0:  # no noise into sigma 0: no KL is taken there
            assert torch.equal(kl, torch.zeros(3)) and torch.equal(gaussian, torch.zeros(3))
            continue
        mean, std = cps_mean_std_64(x, v, s, s_next, eta)
        mean_ref, _ = cps_mean_std_64(x, v_ref, s, s_next, eta)
        # ((prev_sample_mean - prev_sample_mean_ref) ** 2).mean(dim=...), their train_sd3.py:900, train_flux.py:857
        torch.testing.assert_close(kl.double(), ((mean - mean_ref) ** 2).mean(1), atol=1e-7, rtol=1e-5)
        # ... / (2 * std_dev_t ** 2), their train_sd3_fast.py, std_dev_t = sigma' sin(eta pi / 2)
        exact = torch.distributions.kl_divergence(torch.distributions.Normal(mean, std),
                                                  torch.distributions.Normal(mean_ref, std)).mean(1)
        torch.testing.assert_close(gaussian.double(), exact, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(gaussian, kl / (2 * std**2), atol=1e-6, rtol=1e-5)


def test_g2rpo_fast_rollout_equals_the_papers_loop_with_cps():
    torch.manual_seed(0)
    net = torch.nn.Linear(6, 6)
    velocity = lambda x, s, i: net(x) + 0.1 * i[:, None] + s[:, None]
    sigmas, noise = sigma_schedule(8, 3.0), torch.randn(2, 6)
    gens = lambda: [torch.Generator().manual_seed(b) for b in range(2)]
    kw = dict(group_size=3, sde_steps=[0, 2, 5], granularities=[1, 2], eta=0.8, sde_type="cps")
    fast = rollout_g2rpo(velocity, noise, sigmas, gens(), **kw, max_batch=4)
    plain = rollout_g2rpo_paper(velocity, noise, sigmas, gens(), **kw)
    for name in ("start_latents", "next_latents", "old_log_probs", "final_latents", "anchor_final"):
        torch.testing.assert_close(getattr(fast, name), getattr(plain, name), atol=1e-5, rtol=1e-5, msg=name)
    flow = rollout_g2rpo(velocity, noise, sigmas, gens(), **{**kw, "sde_type": "flow"})
    assert not torch.allclose(flow.next_latents, fast.next_latents)


def test_the_cps_flags(capsys):
    # on --model flux, --sde-type cps sets the method's CPS clip range and eta unless given
    for name in ("g2rpo", "flow-grpo", "dancegrpo"):
        args = flags.parse_args(["--model", "flux", "--method", name, "--sde-type", "cps"])
        assert (args.sde_type, args.clip_range, args.eta) == ("cps", 1e-5, 0.8)
        given = flags.parse_args(["--model", "flux", "--method", name, "--sde-type", "cps", "--clip-range", "1e-3"])
        assert given.clip_range == 1e-3 and given.eta == 0.8
    # Flow-GRPO-Fast's default is cps; its flow step takes Flow-GRPO's values
    assert flags.parse_args(["--model", "flux", "--method", "flow-grpo-fast"]).sde_type == "cps"
    flow = flags.parse_args(["--model", "flux", "--method", "flow-grpo-fast", "--sde-type", "flow"])
    assert (flow.clip_range, flow.eta) == (1e-4, 0.9)
    assert flags.preset("flux", "g2rpo", "cps")["clip_range"] == 1e-5
    for argv, words in [(["--sde-type", "cps", "--eta", "1.5"], "(0, 1]"),
                        (["--sde-type", "cps", "--sde-steps", "0", "7"], "step 7 cannot be trained"),
                        (["--method", "pavegrpo", "--sde-type", "cps", "--sde-steps", "0", "7"],
                         "step 7 cannot be trained"),
                        (["--sde-type", "sde"], "--sde-type")]:
        with pytest.raises(SystemExit) as exit_info:
            flags.check_flags(flags.parse_args(["--model", "tiny", *argv]), world=1)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1, (argv, err)


def test_a_cps_run_trains_and_resumes(tiny_cache, tmp_path):
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    common = [*SMALL, "--tiny-cache", tiny_cache, "--sde-type", "cps", "--sde-steps", "0", "3"]
    run_train([*common, "--output-dir", straight, "--num-iterations", "2"])
    stopped_after_one(straight, resumed)
    proc = run_train([*common, "--output-dir", resumed, "--num-iterations", "2", "--resume"])
    assert "resumed from" in proc.stdout
    a, b = transformer_weights(straight, 2), transformer_weights(resumed, 2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = read_metrics(straight)
    assert rows[1]["losses/first_ratio_error"] < 1e-4 and math.isfinite(rows[-1]["losses/loss"])
