"""Z-Image on a tiny real ZImagePipeline (random weights, built offline, loaded with from_pretrained): the
adapter's velocity against the stock pipeline's own sampling, with and without guidance; the fast rollout against
the paper's loop; train.py end to end, LoRA and full; the LoRA checkpoint in the stock pipeline; bad input.

Run: python -m pytest -q tests/test_zimage.py
"""
import os

import pytest
import torch

from conftest import QUICK, run_train
from models import ZImageAdapter
from sampler import ode_sample, rollout_g2rpo, rollout_g2rpo_reference, sigma_schedule

PROMPTS = ["a red circle on the left", "two blue squares"]


@pytest.mark.parametrize("guidance", [0.0, 2.0])
def test_the_adapter_samples_as_the_stock_pipeline(zimage_path, guidance):
    adapter = ZImageAdapter.load(zimage_path, "cpu", torch.float32, guidance=guidance, max_sequence_length=32)
    assert adapter.forwards_per_velocity == (2 if guidance else 1)
    noise = adapter.noise([torch.Generator().manual_seed(s) for s in range(2)], 32)  # (2, 4, 16, 16)
    cond = adapter.encode(PROMPTS)
    velocity = lambda x, s, i: adapter.velocity(adapter.transformer, cond, x, s, i, 32)
    ours, _, _ = ode_sample(velocity, noise, sigma_schedule(3, 3.0), max_batch=8, keep_trajectory=False)
    # diffusers' loop: its default schedule for 3 steps is the same shift-3 schedule
    stock = adapter.pipe(PROMPTS, height=32, width=32, num_inference_steps=3, guidance_scale=guidance,
                         latents=noise.clone(), max_sequence_length=32, output_type="latent").images
    torch.testing.assert_close(ours, stock, atol=1e-4, rtol=1e-4)


def test_fast_rollout_equals_the_papers_loop(zimage_path):
    adapter = ZImageAdapter.load(zimage_path, "cpu", torch.float32, guidance=0.0, max_sequence_length=32)
    cond = adapter.encode(PROMPTS)
    velocity = lambda x, s, i: adapter.velocity(adapter.transformer, cond, x, s, i, 32)
    sigmas, kw = sigma_schedule(4, 3.0), dict(group_size=3, sde_steps=[0, 1], granularities=[1, 2], eta=0.7)
    gens = lambda: [torch.Generator().manual_seed(b) for b in range(2)]
    noise = adapter.noise(gens(), 32)
    fast = rollout_g2rpo(velocity, noise, sigmas, gens(), **kw, max_batch=64)
    paper = rollout_g2rpo_reference(velocity, noise, sigmas, gens(), **kw)
    torch.testing.assert_close(fast.final_latents, paper.final_latents, atol=1e-4, rtol=1e-4)
    assert fast.nfe < paper.nfe


@pytest.mark.parametrize("lora", [0, 4])
def test_two_iterations_and_the_lora_in_the_stock_pipeline(zimage_path, lora, tmp_path):
    from diffusers import ZImagePipeline

    out = str(tmp_path / "run")
    run_train(["--model", "zimage", "--model-path", zimage_path, "--output-dir", out, "--num-iterations", "2",
               "--lora-rank", str(lora), "--lr", "1e-2", "--eval-every", "2", "--checkpoint-every", "2", *QUICK])
    folder = os.path.join(out, "checkpoints", "iter_000002")
    pipe = ZImagePipeline.from_pretrained(zimage_path)
    pipe.set_progress_bar_config(disable=True)
    sample = lambda: pipe(PROMPTS[:1], height=32, width=32, num_inference_steps=2, guidance_scale=0.0,
                          generator=torch.Generator().manual_seed(0), max_sequence_length=32, output_type="pt").images
    before = sample()
    if lora:
        pipe.load_lora_weights(os.path.join(folder, "lora"))
    else:
        from diffusers import ZImageTransformer2DModel

        pipe.transformer = ZImageTransformer2DModel.from_pretrained(os.path.join(folder, "transformer"))
    after = sample()
    assert after.shape == (1, 3, 32, 32) and torch.isfinite(after).all()
    assert (after - before).abs().max() > 1e-4  # the trained weights changed what it draws


def test_a_wrong_resolution_is_refused_before_loading():
    proc = run_train(["--model", "zimage", "--model-path", "/nonexistent/zimage", *QUICK, "--resolution", "40"],
                     check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == ("error: --resolution 40 is not a multiple of 16 (VAE "
                                                            "factor x 2x2 patches); use e.g. 32")
