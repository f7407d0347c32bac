"""Shared fixtures: tiny but real diffusers pipelines built from configs and saved with save_pretrained, and a
helper that runs train.py in a subprocess. Nothing is downloaded (HF_HUB_OFFLINE=1)."""
import os
import subprocess
import sys

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def build_sd3_pipeline(seed=0):
    """A randomly initialised tiny StableDiffusion3Pipeline: two CLIP encoders with projection, T5, MMDiT."""
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from lab import tiny

    torch.manual_seed(seed)
    clip_tok, t5_tok = tiny.build_tokenizers()
    clip_config = dict(vocab_size=len(clip_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, max_position_embeddings=77, projection_dim=32, bos_token_id=0,
                       eos_token_id=1, pad_token_id=1)
    return StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
                                          attention_head_dim=16, num_attention_heads=2, joint_attention_dim=64,
                                          caption_projection_dim=32, pooled_projection_dim=64, pos_embed_max_size=32),
        vae=AutoencoderKL(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
                          up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[16, 16], layers_per_block=1,
                          latent_channels=4, norm_num_groups=8, shift_factor=0.06, scaling_factor=1.5),
        text_encoder=CLIPTextModelWithProjection(CLIPTextConfig(**clip_config)), tokenizer=clip_tok,
        text_encoder_2=CLIPTextModelWithProjection(CLIPTextConfig(**clip_config)), tokenizer_2=clip_tok,
        text_encoder_3=T5EncoderModel(T5Config(vocab_size=len(t5_tok), d_model=64, d_kv=16, d_ff=64, num_layers=1,
                                               num_heads=4, relative_attention_num_buckets=8,
                                               decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)),
        tokenizer_3=t5_tok)


def _tiny_vae(vae_class=None, **scaling):
    from diffusers import AutoencoderKL

    return (vae_class or AutoencoderKL)(
        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
        block_out_channels=[16, 16], layers_per_block=1, latent_channels=4, norm_num_groups=8,
        mid_block_add_attention=False, **scaling)


def build_zimage_pipeline(seed=0):
    """A randomly initialised tiny ZImagePipeline: a Qwen3 text encoder, the single-stream transformer, a small VAE."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    from lab import tiny

    torch.manual_seed(seed)
    tokenizer = tiny.build_chat_tokenizer()
    text_encoder = Qwen3Model(Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                          head_dim=16, max_position_embeddings=64))
    transformer = ZImageTransformer2DModel(in_channels=4, dim=64, n_layers=2, n_refiner_layers=1, n_heads=4,
                                           n_kv_heads=4, cap_feat_dim=32, axes_dims=[4, 6, 6], axes_lens=[64, 32, 32])
    vae = _tiny_vae(use_quant_conv=False, use_post_quant_conv=False, shift_factor=0.1, scaling_factor=0.5)
    return ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae, text_encoder=text_encoder,
                          tokenizer=tokenizer, transformer=transformer)


def build_flux2_pipeline(seed=0, distilled=True):
    """A randomly initialised tiny Flux2KleinPipeline: a 4-layer Qwen3 (its layers 1, 2, 3 concatenated), the
    double- and single-stream transformer, a small VAE with its batch-norm statistics."""
    from diffusers import (AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline,
                           Flux2Transformer2DModel)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from lab import tiny

    torch.manual_seed(seed)
    tokenizer = tiny.build_chat_tokenizer()
    text_encoder = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                                                head_dim=16, max_position_embeddings=64, tie_word_embeddings=True))
    transformer = Flux2Transformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                          attention_head_dim=16, num_attention_heads=2, joint_attention_dim=96,
                                          timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4),
                                          guidance_embeds=False)
    vae = _tiny_vae(AutoencoderKLFlux2, sample_size=32)
    with torch.no_grad():  # statistics as a trained VAE has them, so the tests see the normalisation undone
        vae.bn.running_mean.uniform_(-0.5, 0.5)
        vae.bn.running_var.uniform_(0.5, 2.0)
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type="exponential")
    return Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              transformer=transformer, is_distilled=distilled)


def build_qwenimage_pipeline(seed=0):
    """A randomly initialised tiny QwenImagePipeline: a 2-layer Qwen2.5-VL (its language model's last hidden states
    are the caption), the MMDiT transformer on 2x2 patches, Qwen-Image's causal video VAE (8x), and its scheduler's
    dynamic shift."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from lab import tiny

    torch.manual_seed(seed)
    tokenizer = tiny.build_qwen_tokenizer()
    ids = dict(bos_token_id=0, eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, **ids),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[0]), **ids))
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=2,
                                              attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                              axes_dims_rope=(4, 6, 6))
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                 temperal_downsample=[False, True, True])
    with torch.no_grad():  # a random decoder draws flat grey (std 0.04), where the pixel reward is 0 for every image
        vae.decoder.conv_out.weight.mul_(5)
        vae.decoder.conv_out.bias.mul_(5)
    # Qwen-Image's scheduler (its scheduler_config.json) without the terminal stretch, which this project does not run
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
                                                base_image_seq_len=256, max_image_seq_len=8192,
                                                time_shift_type="exponential")
    return QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=transformer)


def _tiny_umt5():
    """Wan's text side, tiny: the tiny world's T5 tokenizer and a 2-layer UMT5 encoder (seed torch first)."""
    from transformers import UMT5Config, UMT5EncoderModel

    from lab import tiny

    tokenizer = tiny.build_tokenizers()[1]
    return tokenizer, UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                                  num_heads=4, relative_attention_num_buckets=8, pad_token_id=0,
                                                  eos_token_id=1, decoder_start_token_id=0))


def build_wan_pipeline(seed=0):
    """A randomly initialised tiny WanPipeline (Wan 2.1 layout): UMT5, the video transformer, a video VAE that
    packs 4 frames and 8x8 pixels into a latent."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    torch.manual_seed(seed)
    tokenizer, text_encoder = _tiny_umt5()
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                        in_channels=16, out_channels=16, text_dim=32, freq_dim=32, ffn_dim=32,
                                        num_layers=2, rope_max_seq_len=32)
    vae = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))


def build_wan22_pipeline(seed=0):
    """A randomly initialised tiny Wan 2.2 TI2V-style WanPipeline: 48 latent channels, the residual VAE that packs
    2x2 pixels before its 8x (16x in all, so sides are multiples of 32), timesteps expanded per token."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    torch.manual_seed(seed)
    tokenizer, text_encoder = _tiny_umt5()
    transformer = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                        in_channels=48, out_channels=48, text_dim=32, freq_dim=32, ffn_dim=32,
                                        num_layers=2, rope_max_seq_len=32)
    stats = torch.Generator().manual_seed(seed)  # per-channel statistics as a trained VAE has them
    vae = AutoencoderKLWan(base_dim=8, z_dim=48, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
                           patch_size=2, scale_factor_spatial=16,
                           latents_mean=(torch.rand(48, generator=stats) - 0.5).tolist(),
                           latents_std=(torch.rand(48, generator=stats) + 0.5).tolist())
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), expand_timesteps=True)


def _saved(factory, build):
    path = str(factory.mktemp(build.__name__) / "pipeline")
    build().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def wan_path(tmp_path_factory):
    return _saved(tmp_path_factory, build_wan_pipeline)


@pytest.fixture(scope="session")
def wan22_path(tmp_path_factory):
    return _saved(tmp_path_factory, build_wan22_pipeline)


@pytest.fixture(scope="session")
def qwenimage_path(tmp_path_factory):
    return _saved(tmp_path_factory, build_qwenimage_pipeline)


@pytest.fixture(scope="session")
def zimage_path(tmp_path_factory):
    return _saved(tmp_path_factory, build_zimage_pipeline)


@pytest.fixture(scope="session")
def flux2_path(tmp_path_factory):
    return _saved(tmp_path_factory, build_flux2_pipeline)


@pytest.fixture(scope="session")
def flux_path(tmp_path_factory):
    """A random tiny FLUX.1-style pipeline (guidance embedding, CLIP + T5) in a folder, as users' weights are."""
    from lab import tiny

    path = str(tmp_path_factory.mktemp("flux") / "pipeline")
    tiny.build_pipeline(seed=0).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def sd3_path(tmp_path_factory):
    return _saved(tmp_path_factory, build_sd3_pipeline)


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    """The pre-trained tiny model, built once per session (about 2 minutes on 2 cores)."""
    from lab import tiny

    cache = str(tmp_path_factory.mktemp("tiny_cache"))
    tiny.ensure_pretrained(cache)
    return cache


# a short rollout for the end-to-end runs on the random tiny pipelines, of every method (QUICK_ANY) and of G2RPO
QUICK_ANY = ["--resolution", "32", "--num-steps", "4", "--group-size", "3", "--sde-steps", "0", "1",
             "--prompts-per-iteration", "2", "--rewards", "shapes=1.0",
             "--prompt-file", os.path.join(ROOT, "prompts", "tiny_train.txt"),
             "--eval-prompt-file", os.path.join(ROOT, "prompts", "tiny_eval.txt"), "--eval-seeds", "1",
             "--max-sequence-length", "16", "--mixed-precision", "no", "--no-gradient-checkpointing",
             "--eval-rewards"]  # none: --model flux would score clip and pickscore, whose weights no test downloads
QUICK = [*QUICK_ANY, "--granularities", "1", "2"]


def override(argv, extra):
    """`argv` with the flags `extra` gives replaced by extra's (a list flag given twice is refused, so a test that
    changes one of QUICK's lists drops QUICK's first)."""
    given = {a for a in extra if a.startswith("--")}
    kept, skipping = [], False
    for a in argv:
        if a.startswith("--"):
            skipping = a in given
        if not skipping:
            kept.append(a)
    return [*kept, *extra]


class Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def run_train(args, timeout=600, torchrun=0, check=True, env=None, subprocess_=False):
    """Run train.py with `args`: in this process (the default: it saves ~8 s of imports a run), in a subprocess,
    or under torchrun with `torchrun` CPU ranks. Returns an object with returncode, stdout and stderr."""
    if torchrun or subprocess_:
        cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"]
               if torchrun else [sys.executable]) + [os.path.join(ROOT, "train.py"), *args]
        full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1" if torchrun else "2", **(env or {})}
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env)
        result = Result(proc.returncode, proc.stdout, proc.stderr)
    else:
        import contextlib
        import io

        import train

        out, err, code = io.StringIO(), io.StringIO(), 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                train.main(train.parse_args(list(args)))
            except SystemExit as exit_info:
                code = exit_info.code if isinstance(exit_info.code, int) else 1
                if not isinstance(exit_info.code, int):
                    print(exit_info.code, file=sys.stderr)
        result = Result(code, out.getvalue(), err.getvalue())
    if check and result.returncode != 0:
        raise AssertionError(f"train.py failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return result
