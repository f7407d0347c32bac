"""--rollout-precision fp8 on the CPU: which forwards go to the FP8 copy, that the trained steps and so the first
ratio stay exact, the copy's sharing of the transformer's tensors, and the refusals before loading.

FP8 matrix multiplies need a CUDA GPU of compute capability 8.9 or above, so the copy's quantizer here is the CPU
stand-in `kernels.round_to_fp8_rows`: each weight row rounded to float8 e4m3 on its own scale and back, the weight
error of torchao's per-row quantization (not its activation rounding). tools/gpu_check.py measures torchao's own on
the GPU.

Run: python -m pytest -q tests/test_fp8.py
"""
import dataclasses
import os
import sys

import pytest
import torch

from conftest import QUICK, ROOT, run_train
from methods.base import UpdateContext
from lab.kernels import Float8Copy, fp8_problem, round_to_fp8_rows
from methods import METHODS
from methods.trajectories import rollout_trajectories
from sampler import rollout_g2rpo, sde_step, sigma_schedule


def trajectories(ode_elsewhere):
    """Whole trajectories with G2RPO's SDE step: every step (the full-SDE ablation), or a window (MixGRPO)."""
    def rollout(velocity_fn, noise, sigmas, generators, *, group_size, sde_steps, eta, image_only_fn=None):
        step = lambda x, v, s, i, noise=None, next_latents=None: sde_step(x, v, s, i, eta, noise, next_latents)
        return rollout_trajectories(velocity_fn, noise, sigmas, generators, group_size=group_size,
                                    sde_steps=sde_steps, step_fn=step, max_batch=64, ode_elsewhere=ode_elsewhere,
                                    image_only_fn=image_only_fn)
    return rollout


whole_sde_rollout, window_rollout = trajectories(False), trajectories(True)


class Recorder:
    """A velocity function (a fixed linear map of the latent and sigma) that records each call's sigmas."""

    def __init__(self, scale):
        self.scale, self.sigmas = scale, []

    def __call__(self, x, sigma, prompt_index):
        self.sigmas.append(sigma.tolist())
        return self.scale * x + sigma.view(-1, *[1] * (x.ndim - 1))


def rollouts(rollout_fn, fp8, trained=None, **options):
    """The rollout with one velocity function for every forward, and with the image-only ones on `fp8` (the others
    on `trained`, by default a Recorder of the same map)."""
    sigmas = sigma_schedule(6, 3.0)
    noise = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))  # (B, ...)
    make = lambda: [torch.Generator().manual_seed(b) for b in range(2)]
    plain = rollout_fn(Recorder(-0.5), noise, sigmas, make(), group_size=3, eta=0.7, **options)
    trained = trained or Recorder(-0.5)
    split = rollout_fn(trained, noise, sigmas, make(), group_size=3, eta=0.7, image_only_fn=fp8, **options)
    return sigmas, plain, split, trained


@pytest.mark.parametrize("sampling", ["g2rpo", "full", "mixed"])
def test_only_the_trained_steps_run_on_the_policy(sampling):
    """The policy's velocity function sees the trained steps alone, one call each; everything else goes to the
    image-only one. The log-probs the update divides by are the policy's at the stored start latents (which the
    copy's untrained steps before them may have moved), as the update recomputes them: its first ratio is 1."""
    fp8 = Recorder(-0.45)  # another model: its forwards move the images, not the trained steps
    fn, options = {"g2rpo": (rollout_g2rpo, dict(granularities=[1, 2])), "full": (whole_sde_rollout, {}),
                   "mixed": (window_rollout, {})}[sampling]
    steps = [1, 3]
    sigmas, plain, split, trained = rollouts(fn, fp8, sde_steps=steps, **options)
    rows = 2 if sampling == "g2rpo" else 6  # the anchor (B rows), or every member's trajectory (B * G)
    assert trained.sigmas == [[float(sigmas[k])] * rows for k in steps]
    assert split.nfe == plain.nfe and split.calls == plain.calls
    assert split.image_only_nfe == plain.nfe - rows * len(steps) == sum(map(len, fp8.sigmas))
    members = split.next_latents.shape[2] // split.start_latents.shape[2]  # scored by one start latent: G or 1
    for ki, k in enumerate(steps):
        x = split.start_latents[:, ki].flatten(0, 1)  # (B*S, ...)
        rescored = [sde_step(x.repeat_interleave(members, 0), fn(x, sigmas[k].expand(len(x)), None)
                             .repeat_interleave(members, 0), sigmas, k, 0.7,
                             next_latents=split.next_latents[:, ki].flatten(0, 1))[1] for fn in (Recorder(-0.5), fp8)]
        assert torch.equal(rescored[0], split.old_log_probs[:, ki].flatten())  # the policy's, exactly
        assert not torch.allclose(rescored[1], split.old_log_probs[:, ki].flatten())  # not the copy's
    assert not torch.equal(split.final_latents, plain.final_latents)  # the images are the copy's


@pytest.mark.parametrize("sampling", ["g2rpo", "full"])
def test_the_same_function_for_both_is_the_rollout_without_one(sampling):
    """image_only_fn set to velocity_fn itself gives the rollout without image_only_fn, bit for bit, forwards and
    calls included: the split adds no arithmetic. (That the bf16 path equals the code before the split was checked
    by running both commits: docs/performance.md, "FP8 rollouts".)"""
    fn, options = {"g2rpo": (rollout_g2rpo, dict(granularities=[1, 2, 3])), "full": (whole_sde_rollout, {})}[sampling]
    velocity = Recorder(-0.5)
    _, plain, split, _ = rollouts(fn, velocity, trained=velocity, sde_steps=[0, 2], **options)
    for name in ("start_latents", "next_latents", "old_log_probs", "final_latents"):
        assert torch.equal(getattr(split, name), getattr(plain, name)), name
    assert (split.nfe, split.calls) == (plain.nfe, plain.calls) and split.image_only_nfe > 0 == plain.image_only_nfe


def tiny_policy(flux_path, tmp_path, *flags):
    from lab.flags import parse_args
    from lab.policy import build_policy, load_reward_models

    args = parse_args(["--model", "flux", "--model-path", flux_path, "--output-dir", str(tmp_path / "run"),
                       *QUICK, "--lr", "1e-3", *flags])
    policy = build_policy(args, torch.device("cpu"), torch.float32, False, lambda *a: None)
    return args, policy, load_reward_models(args, torch.device("cpu"), torch.float32, {"shapes": 1.0})


@pytest.mark.parametrize("lora", [0, 4])
def test_fp8_copy_shares_all_but_the_quantized_weights(lora, flux_path, tmp_path):
    """The copy quantizes every linear layer of the blocks (LoRA: the frozen base layers, not the adapters) and holds
    the transformer's own tensors everywhere else; the policy's weights are untouched; a full fine-tune's refresh
    follows the new weights."""
    args, policy, _ = tiny_policy(flux_path, tmp_path, "--lora-rank", str(lora))
    t = policy.transformer
    before = {name: p.detach().clone() for name, p in t.named_parameters()}
    fp8 = Float8Copy(t, compile=False, quantize=round_to_fp8_rows)
    blocks = len(t.transformer_blocks) + len(t.single_transformer_blocks)
    assert fp8.names and all(name.split(".")[0] in ("transformer_blocks", "single_transformer_blocks")
                             for name in fp8.names)
    assert not any("lora_" in name or "norm" in name for name in fp8.names)  # adapters, modulation as they are
    assert any("attn.to_q.base_layer" in name for name in fp8.names) == bool(lora)  # LoRA's frozen base
    assert len({name.split(".")[1] + name.split(".")[0] for name in fp8.names}) == blocks  # every block
    source, twin = dict(t.named_parameters()), dict(fp8.module.named_parameters())
    assert source.keys() == twin.keys()
    # shared unless quantized (with its bias, cast to bf16 from the CPU's fp32 as from a full fine-tune's)
    quantized = {name + part for name in fp8.names for part in (".weight", ".bias")}
    for name, p in source.items():
        assert (twin[name] is p) != (name in quantized), name
    assert all(torch.equal(p, before[name]) for name, p in t.named_parameters())  # the policy is untouched
    layer = fp8.names[0]
    assert not torch.equal(twin[layer + ".weight"], source[layer + ".weight"])  # rounded
    assert twin["transformer_blocks.0.norm1.linear.weight"] is source["transformer_blocks.0.norm1.linear.weight"]
    handle = fp8.module.register_forward_pre_hook(lambda *a: None)  # the twin's hooks are its own
    assert not t._forward_pre_hooks
    handle.remove()
    if lora:  # and so are peft's lists of the adapters merged and active
        fp8.module.transformer_blocks[0].attn.to_q.merged_adapters.append("default")
        assert t.transformer_blocks[0].attn.to_q.merged_adapters == []
    if not lora:  # a full fine-tune's step, then the refresh
        with torch.no_grad():
            source[layer + ".weight"].add_(1.0)
        fp8.refresh()
        twin = dict(fp8.module.named_parameters())
        assert torch.allclose(twin[layer + ".weight"], source[layer + ".weight"], rtol=0.07, atol=1e-3)


def test_an_iteration_with_the_fp8_copy(flux_path, tmp_path):
    """train.iteration with the copy: the rollout's trained steps are the policy's, so the first update's ratio is
    exactly 1 and the self-checks pass; the copy makes the other forwards. A rollout whose trained steps ran on the
    copy (the routing broken) is 1.5e-5 off: the check says so in a note within the clip range of 1e-4, and stops
    the run in one line past a clip range it exceeds."""
    import train
    from lab.flags import method_of
    from lab.loop import FirstUpdateChecks, Harness, generators
    from lab.policy import make_velocity_fn
    from lab.run import Run

    args, policy, reward_models = tiny_policy(flux_path, tmp_path, "--lora-rank", "4")
    policy.fp8 = Float8Copy(policy.transformer, compile=False, quantize=round_to_fp8_rows)
    calls = {"policy": 0, "fp8": 0}
    hooks = [module.register_forward_pre_hook(lambda *a, key=key: calls.__setitem__(key, calls[key] + 1))
             for key, module in (("policy", policy.transformer), ("fp8", policy.fp8.module))]
    sigmas = sigma_schedule(args.num_steps, args.shift)
    prompts = ["a red circle on the left", "a blue bar on the top"]
    lines = []
    h = Harness(args, policy, reward_models, Run(args, 0, 1, False, lines.append), prompts, prompts, 0, 1, False)
    h.check = check = FirstUpdateChecks(args, policy, sigmas, lines.append)
    method = method_of(args)
    metrics = train.iteration(0, method, h)
    for hook in hooks:
        hook.remove()
    B, K = args.prompts_per_iteration, len(args.sde_steps)
    assert metrics["losses/first_ratio_error"] == 0.0 and metrics["perf/optimizer_steps"] == K
    assert metrics["perf/image_only_nfe"] == metrics["perf/nfe"] - B * K
    # the policy: K anchor calls in the rollout, K forwards in the update, 2 in the gradient check (the run's kernels
    # and the math kernel's, fp32 both); the copy the rest of the rollout
    assert calls["policy"] == 2 * K + 2 and calls["fp8"] == metrics["perf/calls"] - K
    assert [line.split(":")[0] for line in lines] == ["gradient self-check passed", "first-step ratio check passed"]

    # broken routing: the whole rollout on the copy
    cond = policy.adapter.encode(prompts)
    on_copy = make_velocity_fn(args, policy, policy.fp8.module, cond)
    gens = generators(args.seed, 1, range(B))
    rollout = method.rollout(on_copy, policy.adapter.noise(gens, args.size), sigmas, gens, args.sde_steps)
    ctx = UpdateContext(make_velocity_fn(args, policy, policy.model, cond), policy.params,
                        torch.optim.AdamW(policy.params, lr=0.0), sigmas)
    stats = method.update(rollout, torch.ones(B, K, args.group_size), ctx)
    check.after(stats)  # 1.5e-5 from 1 here: within the clip range of 1e-4, so a note
    assert "not exact: the rollout's forwards at the trained steps differ from the update's" in lines[-1]
    with pytest.raises(SystemExit, match="first-step ratio check failed: .* beyond --clip-range 1e-05"):
        FirstUpdateChecks(dataclasses.replace(args, clip_range=1e-5), policy, sigmas, lines.append).after(stats)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine without a GPU")
def test_fp8_is_refused_before_loading_without_a_gpu(tmp_path):
    out = str(tmp_path / "run")
    proc = run_train(["--model", "flux", "--model-path", "black-forest-labs/FLUX.1-dev", "--output-dir", out,
                      "--rollout-precision", "fp8", *QUICK], check=False)
    assert proc.returncode != 0
    assert "--rollout-precision fp8 needs a CUDA GPU" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not os.path.exists(out)


def test_fp8_refusals_name_the_cause(monkeypatch):
    """The other refusals, on stand-ins for the GPU's answers: an older GPU, an fp32 run, FSDP2, no torchao."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    old_gpu = fp8_problem(1, False, "bf16")
    assert "compute capability 8.9 or above" in old_gpu and "is 8.0" in old_gpu
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert "add --mixed-precision bf16" in fp8_problem(1, False, "no")
    assert "full fine-tune on 8 ranks" in fp8_problem(8, True, "bf16")
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    assert "needs torchao" in fp8_problem(8, False, "bf16")
    assert "pip install -r requirements-fp8.txt" in fp8_problem(1, True, "bf16")
