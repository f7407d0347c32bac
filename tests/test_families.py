"""The newer families, Z-Image and FLUX.2 klein (images) and Wan (video), each on a tiny real pipeline (random
weights, built offline, loaded with from_pretrained): the image adapters' sampling and decoding against the stock
pipeline's, with and without guidance; the fast rollout against the paper's loop; train.py end to end, LoRA and
full; the trained weights in the stock pipeline (LoRA with load_lora_weights); image rewards over a video's frames,
video sample grids; bad input (a wrong resolution or frame count) refused before loading.

Run: python -m pytest -q tests/test_families.py
"""
import json
import math
import os

import pytest
import torch

from conftest import QUICK, run_train
from lab.models import ADAPTERS, WanAdapter
from sampler import ode_sample, rollout_g2rpo, rollout_g2rpo_paper, sigma_schedule

PROMPTS = ["a red circle on the left", "two blue squares"]
FAMILIES = ["zimage", "flux2", "qwenimage"]


def stock_shift(family, steps, size=(32, 32)):
    """The time shift the stock pipeline applies at `size`: Z-Image's, SD3's and the tiny FLUX.1's fixed 3, FLUX.2's
    exp(mu) of its empirical mu at H W / 16 image positions (64 at 32²), Qwen-Image's exp(mu) of its dynamic shift
    at its H W / 256 tokens (4 at 32²)."""
    if family in ("zimage", "sd3", "flux"):
        return 3.0
    tokens = size[0] * size[1]
    if family == "qwenimage":
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

        return math.exp(calculate_shift(tokens // 256, 256, 8192, 0.5, 0.9))
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    return math.exp(compute_empirical_mu(tokens // 16, steps))


def load(family, path, guidance):
    return ADAPTERS[family].load(path, "cpu", torch.float32, guidance=guidance, max_sequence_length=32)


@pytest.fixture
def family_path(request, zimage_path, flux2_path, qwenimage_path, sd3_path, tmp_path):
    family, guidance = request.param
    if family == "flux2" and guidance:  # CFG belongs to the klein base models (not distilled)
        from conftest import build_flux2_pipeline

        path = str(tmp_path / "flux2_base")
        build_flux2_pipeline(distilled=False).save_pretrained(path)
        return family, guidance, path
    return family, guidance, {"zimage": zimage_path, "flux2": flux2_path, "qwenimage": qwenimage_path,
                              "sd3": sd3_path}[family]


@pytest.mark.parametrize("family_path", [(f, g) for f in FAMILIES for g in (0.0, 2.0)], indirect=True,
                         ids=lambda p: f"{p[0]}-guidance{p[1]:g}")
def test_the_adapter_samples_as_the_stock_pipeline(family_path):
    family, guidance, path = family_path
    adapter = load(family, path, guidance)
    assert adapter.forwards_per_velocity == (2 if guidance else 1)
    noise = adapter.noise([torch.Generator().manual_seed(s) for s in range(2)], 32)
    cond = adapter.encode(PROMPTS)
    velocity = lambda x, s, i: adapter.velocity(adapter.transformer, cond, x, s, i, 32)
    ours = ode_sample(velocity, noise, sigma_schedule(3, stock_shift(family, 3)), max_batch=8)
    options = {}
    if family == "flux2":  # the stock pipeline takes the noise as 2x2 patches (B, 4C, h/2, w/2)
        noise = noise.transpose(1, 2).reshape(2, -1, 8, 8)
        options = dict(text_encoder_out_layers=adapter.text_layers)  # (1, 2, 3) of the tiny 4-layer Qwen3
    if family == "qwenimage":  # true CFG: its scale and the card's negative prompt (guidance_scale is for distilled)
        options = dict(true_cfg_scale=guidance, negative_prompt=adapter.negative_prompt if guidance else None)
    else:
        options["guidance_scale"] = guidance
    stock = adapter.pipe(prompt=PROMPTS, height=32, width=32, num_inference_steps=3, latents=noise.clone(),
                         max_sequence_length=32, output_type="pt", **options).images
    torch.testing.assert_close(adapter.decode(ours, 32), stock, atol=1e-4, rtol=1e-4)


def test_sd3_guidance_up_to_1_is_the_conditional_velocity(sd3_path):
    """As its pipeline: CFG only above 1. At 0 or 1 one forward of the conditional branch, which depends on the
    prompt (an unconditional velocity would not)."""
    adapters = {g: ADAPTERS["sd3"].load(sd3_path, "cpu", torch.float32, guidance=g) for g in (0.0, 1.0, 4.5)}
    assert [a.forwards_per_velocity for a in adapters.values()] == [1, 1, 2]
    x, sigma = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(0)), torch.full((2,), 0.7)
    v = {}
    for g, adapter in adapters.items():
        cond = adapter.encode(PROMPTS)
        v[g] = adapter.velocity(adapter.transformer, cond, x[:1].expand(2, -1, -1, -1), sigma, torch.arange(2), 32)
    torch.testing.assert_close(v[0.0], v[1.0])
    assert (v[0.0][0] - v[0.0][1]).abs().max() > 1e-4  # two prompts, two velocities
    # above 1 the guided velocity v_u + w (v_c - v_u), another one
    adapter = adapters[4.5]
    cond = adapter.encode(PROMPTS)
    guided = adapter.velocity(adapter.transformer, cond, x[:1].expand(2, -1, -1, -1), sigma, torch.arange(2), 32)
    assert not torch.allclose(guided, v[0.0])


def test_a_distilled_flux2_refuses_guidance(flux2_path, capsys):
    from lab import flags

    with pytest.raises(SystemExit):
        flags.check_flags(flags.parse_args(["--model", "flux2", "--model-path", flux2_path, "--guidance", "4"]), 1)
    assert "distilled FLUX.2 klein" in capsys.readouterr().err


def test_guidance_set_after_loading_switches_cfg(tmp_path):
    """evaluate.py sets each model's guidance on one loaded adapter: CFG and its forward count follow the value."""
    from conftest import build_flux2_pipeline

    path = str(tmp_path / "flux2_base")
    build_flux2_pipeline(distilled=False).save_pretrained(path)
    adapter = load("flux2", path, 0.0)
    assert not adapter.cfg and adapter.forwards_per_velocity == 1
    adapter.guidance = 4.0
    assert adapter.cfg and adapter.forwards_per_velocity == 2 and "negative_embeds" in adapter.encode(PROMPTS)


@pytest.mark.parametrize("family", [*FAMILIES, "wan", "wan22"])
def test_fast_rollout_equals_the_papers_loop(family, zimage_path, flux2_path, qwenimage_path, wan_path, wan22_path):
    if family in ("wan", "wan22"):  # with its guidance: two image-forwards a velocity
        path, channels, side = (wan_path, 16, 4) if family == "wan" else (wan22_path, 48, 2)  # 8x, or 16x latents
        adapter = WanAdapter.load(path, "cpu", torch.float32, guidance=5.0, max_sequence_length=16, num_frames=5)
        assert adapter.forwards_per_velocity == 2
        assert adapter.noise([torch.Generator()], 32).shape == (1, channels, 2, side, side)
    else:
        adapter = load(family, {"zimage": zimage_path, "flux2": flux2_path, "qwenimage": qwenimage_path}[family],
                       2.0 if family == "qwenimage" else 0.0)  # Qwen-Image with its true CFG
    cond = adapter.encode(PROMPTS)
    velocity = lambda x, s, i: adapter.velocity(adapter.transformer, cond, x, s, i, 32)
    sigmas, kw = sigma_schedule(4, 3.0), dict(group_size=3, sde_steps=[0, 1], granularities=[1, 2], eta=0.7)
    gens = lambda: [torch.Generator().manual_seed(b) for b in range(2)]
    noise = adapter.noise(gens(), 32)
    fast = rollout_g2rpo(velocity, noise, sigmas, gens(), **kw, max_batch=64)
    paper = rollout_g2rpo_paper(velocity, noise, sigmas, gens(), **kw)
    torch.testing.assert_close(fast.final_latents, paper.final_latents, atol=1e-4, rtol=1e-4)
    assert fast.nfe < paper.nfe


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("lora", [0, 4])
def test_two_iterations_and_the_weights_in_the_stock_pipeline(family, lora, zimage_path, flux2_path, qwenimage_path,
                                                               tmp_path):
    path = {"zimage": zimage_path, "flux2": flux2_path, "qwenimage": qwenimage_path}[family]
    out = str(tmp_path / "run")
    run_train(["--model", family, "--model-path", path, "--output-dir", out, "--num-iterations", "2",
               "--lora-rank", str(lora), "--lr", "1e-2", "--eval-every", "2", "--checkpoint-every", "2", *QUICK,
               *(["--lora-feed-forward"] if lora else [])])
    folder = os.path.join(out, "checkpoints", "iter_000002")
    adapter = load(family, path, 0.0)
    pipe, options = adapter.pipe, dict(text_encoder_out_layers=(1, 2, 3)) if family == "flux2" else {}
    if family == "qwenimage":
        options["true_cfg_scale"] = 1.0
    else:
        options["guidance_scale"] = 0.0
    sample = lambda: pipe(prompt=PROMPTS[:1], height=32, width=32, num_inference_steps=2,
                          generator=torch.Generator().manual_seed(0), max_sequence_length=32, output_type="pt",
                          **options).images
    before = sample()
    if lora:
        pipe.load_lora_weights(os.path.join(folder, "lora"))
        names = [n for n, _ in pipe.transformer.named_modules() if n.endswith("lora_A")]
        # LoRA on attention and on feed-forward layers, and in FLUX.2's single-stream blocks too
        assert (any(".w1." in n or ".ff." in n or "_mlp." in n for n in names)
                and any("attention" in n or "attn" in n for n in names))
        if family == "flux2":
            assert any(n.startswith("single_transformer_blocks") for n in names)
    else:
        pipe.transformer = type(pipe.transformer).from_pretrained(os.path.join(folder, "transformer"))
    after = sample()
    assert after.shape == (1, 3, 32, 32) and torch.isfinite(after).all()
    assert (after - before).abs().max() > 1e-4  # the trained weights changed what it draws


@pytest.mark.parametrize("family", ["flux", "sd3", *FAMILIES])
def test_a_non_square_size_samples_as_the_stock_pipeline(family, flux_path, sd3_path, zimage_path, flux2_path,
                                                         qwenimage_path):
    """--height 32 --width 48 (TrainArgs.size): each image family's noise, velocity and decoding at 32 x 48 give the
    stock pipeline's images, without guidance (FLUX.1 with its embedded guidance)."""
    path = {"flux": flux_path, "sd3": sd3_path, "zimage": zimage_path, "flux2": flux2_path,
            "qwenimage": qwenimage_path}[family]
    adapter = ADAPTERS[family].load(path, "cpu", torch.float32, guidance=3.5 if family == "flux" else 0.0,
                                    max_sequence_length=16 if family in ("flux", "sd3") else 32)
    size = (32, 48)
    noise = adapter.noise([torch.Generator().manual_seed(s) for s in range(2)], size)
    cond = adapter.encode(PROMPTS)
    velocity = lambda x, s, i: adapter.velocity(adapter.transformer, cond, x, s, i, size)
    ours = adapter.decode(ode_sample(velocity, noise, sigma_schedule(3, stock_shift(family, 3, size)), max_batch=8),
                          size)
    assert ours.shape == (2, 3, 32, 48)
    options = dict(guidance_scale=3.5 if family == "flux" else 0.0, max_sequence_length=16 if family in ("flux", "sd3")
                   else 32)
    if family == "flux2":  # the stock pipeline takes the noise as 2x2 patches (B, 4C, h/2, w/2)
        noise = noise.transpose(1, 2).reshape(2, -1, 8, 12)
        options.update(text_encoder_out_layers=adapter.text_layers)
    elif family == "qwenimage":
        options = dict(true_cfg_scale=1.0, max_sequence_length=32)
    if family in ("flux", "sd3"):  # a fixed shift 3 as the adapter's (the tiny FLUX's scheduler has no dynamic shift)
        adapter.pipe.scheduler = type(adapter.pipe.scheduler).from_config(
            adapter.pipe.scheduler.config, shift=3.0, use_dynamic_shifting=False)
    if family == "sd3":  # its pipeline spaces its steps down to the scheduler's sigma_min unless given them: ours
        options["sigmas"] = [1 - i / 3 for i in range(3)]
    stock = adapter.pipe(prompt=PROMPTS, height=32, width=48, num_inference_steps=3, latents=noise.clone(),
                         output_type="pt", **options).images
    torch.testing.assert_close(ours, stock, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_wrong_resolution_is_refused_before_loading(family):
    proc = run_train(["--model", family, "--model-path", f"/nonexistent/{family}", *QUICK, "--resolution", "40"],
                     check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == ("error: --resolution 40 is not a multiple of 16 (VAE "
                                                            "factor x 2x2 patches); use e.g. 32")


@pytest.mark.parametrize("family", ["wan", "wan22"])
def test_wan_samples_as_the_stock_pipeline(family, wan_path, wan22_path):
    """At 32 x 64, 5 frames, CFG 5: the adapter's ODE videos are the stock WanPipeline's (Wan 2.2 TI2V's pipeline
    expands the timestep per token; the adapter's one timestep a sample gives the same), given the same step spacing
    (WanPipeline spaces its steps down to its scheduler's sigma_min unless told: docs/models.md)."""
    path = {"wan": wan_path, "wan22": wan22_path}[family]
    adapter = WanAdapter.load(path, "cpu", torch.float32, guidance=5.0, max_sequence_length=16, num_frames=5)
    size = (32, 64)
    noise = adapter.noise([torch.Generator().manual_seed(s) for s in range(2)], size)
    cond = adapter.encode(PROMPTS)
    velocity = lambda x, s, i: adapter.velocity(adapter.transformer, cond, x, s, i, size)
    shift = adapter.pipe.scheduler.config.shift  # the tiny pipelines' fixed shifts: 3 (Wan 2.1), 5 (Wan 2.2)
    ours = adapter.decode(ode_sample(velocity, noise, sigma_schedule(3, shift), max_batch=8), size)  # (B, 3, F, H, W)
    scheduler, set_timesteps = adapter.pipe.scheduler, adapter.pipe.scheduler.set_timesteps
    scheduler.set_timesteps = lambda n, device=None, **kw: set_timesteps(sigmas=[1 - i / n for i in range(n)],
                                                                         device=device)
    stock = adapter.pipe(prompt=PROMPTS, negative_prompt="", height=32, width=64, num_frames=5, num_inference_steps=3,
                         latents=noise.clone(), guidance_scale=5.0, max_sequence_length=16, output_type="pt").frames
    torch.testing.assert_close(ours, stock.transpose(1, 2), atol=1e-4, rtol=1e-4)  # stock: (B, F, 3, H, W)


@pytest.mark.parametrize("family, lora", [("wan", 0), ("wan", 4), ("wan22", 4)])
def test_wan_trains_on_video_and_its_weights_load_in_the_stock_pipeline(family, lora, wan_path, wan22_path,
                                                                        tmp_path):
    from diffusers import WanPipeline

    out, path = str(tmp_path / "run"), {"wan": wan_path, "wan22": wan22_path}[family]
    width = {"wan": 48, "wan22": 64}[family]  # 32 x 48 (Wan 2.2: sides multiples of 32)
    proc = run_train(["--model", family, "--model-path", path, "--output-dir", out, "--num-iterations", "2",
                      "--lora-rank", str(lora), "--lr", "1e-2", "--eval-every", "2", "--checkpoint-every", "2", *QUICK,
                      "--num-frames", "5", "--reward-frames", "2", "--guidance", "5.0", "--width", str(width)])
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["iteration"] for r in rows] == [0, 1, 2] and 0 <= rows[2]["eval/reward/shapes"] <= 1
    samples = os.path.join(out, "samples")
    assert os.path.exists(os.path.join(samples, "eval_iter_000002.gif"))  # the videos, animated
    from PIL import Image

    assert Image.open(os.path.join(samples, "eval_iter_000002.gif")).n_frames == 5
    assert Image.open(os.path.join(samples, "eval_iter_000002.png")).width > 4 * width  # a strip of frames a sample
    assert "trained reward on the held-out prompts" in proc.stdout
    pipe = WanPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    sample = lambda: pipe(prompt=PROMPTS[:1], height=32, width=width, num_frames=5, num_inference_steps=2,
                          guidance_scale=5.0, generator=torch.Generator().manual_seed(0), max_sequence_length=16,
                          output_type="pt").frames
    before = sample()
    folder = os.path.join(out, "checkpoints", "iter_000002")
    if lora:
        pipe.load_lora_weights(os.path.join(folder, "lora"))
    else:
        pipe.transformer = type(pipe.transformer).from_pretrained(os.path.join(folder, "transformer"))
    after = sample()
    assert after.shape[-2:] == (32, width) and torch.isfinite(after).all() and (after - before).abs().max() > 1e-4
    if lora:  # evaluate.py on the video run: base against trained, scored over frames, a strip a sample in the grid
        import evaluate

        evaluate.main(["--checkpoint", out, "--prompt-file", QUICK[QUICK.index("--eval-prompt-file") + 1],
                       "--metrics", "shapes", "--num-prompts", "2", "--output-dir", str(tmp_path / "eval")])
        assert Image.open(str(tmp_path / "eval" / "grid.png")).width > 2 * 4 * width
        assert len(json.load(open(str(tmp_path / "eval" / "results.json")))["rows"]) == 2


def test_an_image_reward_scores_a_video_as_the_mean_over_its_frames():
    from lab import tiny
    from rewards import load_reward

    prompts = ["a red circle on the left", "a blue bar on the top"]
    frames = [tiny.render(prompts, torch.Generator().manual_seed(s)) for s in range(4)]  # 4 frames of 2 videos
    frames[1][0] = 0.1  # an empty frame in the first video
    video = torch.stack(frames, 2)  # (2, 3, 4, 32, 32)
    per_frame = torch.stack([tiny.shape_reward(f, prompts) for f in frames], 1)  # (2, 4)
    torch.testing.assert_close(load_reward("shapes")(video, prompts), per_frame.mean(1))
    torch.testing.assert_close(load_reward("shapes", frames_every=2)(video, prompts), per_frame[:, ::2].mean(1))


@pytest.mark.parametrize("family, frames, message", [
    ("wan", ["--num-frames", "6"], "--num-frames 6: Wan takes 4k + 1 frames"),
    ("wan", ["--num-frames", "5", "--resolution", "40"], "--resolution 40 is not a multiple of 16"),
    ("wan22", ["--num-frames", "5", "--width", "48"], "--width 48 is not a multiple of 32"),
])
def test_wan_bad_input_is_refused_in_one_line_before_loading(family, frames, message):
    proc = run_train(["--model", family, "--model-path", f"/nonexistent/{family}", *QUICK, *frames], check=False)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_an_image_model_refuses_frames():
    proc = run_train(["--model", "zimage", "--model-path", "/nonexistent/zimage", *QUICK, "--num-frames", "5"],
                     check=False)
    assert proc.returncode == 2 and "--num-frames 5 is for video models (--model wan, wan22)" in proc.stderr
