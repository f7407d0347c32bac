"""Model adapters: what the method files need from a diffusers text-to-image (or video) flow model, nothing more.

An adapter loads a diffusers pipeline with `from_pretrained`, encodes prompts, draws initial noise in the model's
latent layout, gives the velocity v(x, sigma | prompt) of the transformer being trained, and decodes latents to
images (or videos) in [0, 1]. `velocity` is the one place that calls a transformer. The method files (sampler.py,
g2rpo.py) see only latents, sigmas and prompt indices, so they do not know which model they drive.

  FLUX.1 (`FluxAdapter`): latents packed into 2x2 patches (B, L, 4C) with diffusers' own helpers; the guidance
      value enters as an embedding (FLUX.1-dev, reference 3.5), no CFG. The built-in tiny model is a FLUX pipeline.
  SD3 / SD3.5 (`SD3Adapter`): latents (B, C, h, w); classifier-free guidance inside the velocity, so the
      rollout and the update see the same guided velocity. One velocity evaluation costs 2 image-forwards
      (`forwards_per_velocity`), which the rollout's NFE counts.
  Z-Image (`ZImageAdapter`): latents (B, C, h, w), passed as lists with unpadded captions; the transformer takes the
      time 1 - sigma and predicts -v. Z-Image-Turbo needs no guidance; with `guidance` > 0, CFG as SD3.
  FLUX.2 [klein] (`Flux2KleinAdapter`): the VAE's 2x2 patches as tokens (B, L, 4C), normalised by its batch-norm
      statistics; no guidance in the distilled models, CFG with `guidance` > 0 (the base models).
  Qwen-Image (`QwenImageAdapter`): 2x2 patches (B, L, 4C) as FLUX.1, with the caption's padding mask; true CFG
      above 1 against the card's negative prompt, its norm rescaled as the pipeline does.
  Wan 2.1 / 2.2 (`WanAdapter`): video latents (B, C, F', h, w); CFG as SD3; decodes to videos (M, 3, F, H, W).

Shapes: M samples in a call, B prompts, L packed image tokens, T text tokens, D text width; videos: F frames,
F' latent frames.

How each call runs on the accelerator (autocast, the attention kernels of the phase, checkpointing, compilation,
the gradient self-check) is `kernels.Kernels`, entered around the call as `with self.kernels():`.

Deviations from the reference code (numbers of the README's list): 3 (sigma goes to the transformer exactly;
diffusers' FLUX.1 and FLUX.2 scale it by 1000 inside, SD3 and Wan take t = 1000 sigma, Z-Image 1 - sigma),
4 (VAE scaling from its config). A video decodes to its frames, which rewards.py scores (deviation 13 is there).
"""
import os

import torch

from lab import fail
from lab.kernels import Kernels
from sampler import prompt_noise

LORA_ATTENTION = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
LORA_FEED_FORWARD = ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp"]


def hw(size) -> tuple[int, int]:
    """An image size as (height, width) in pixels; one int is a square's side (TrainArgs.size gives the pair)."""
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


class ModelLoadError(Exception):
    """The weights could not be loaded; the message names the path tried and how to get the weights."""


def missing_weights_message(path: str, err: Exception) -> str:
    where = "a local folder" if os.path.isdir(path) else "a hub id"
    return (f"could not load a diffusers pipeline from '{path}' ({where}): {type(err).__name__}: {str(err)[:200]}. "
            f"Pass --model-path to a folder holding model_index.json and its subfolders, or log in "
            f"(`hf auth login`) and accept the model's license on its hub page, then retry")


def add_lora(transformer, rank: int, alpha: float, feed_forward: bool, targets=None):
    """LoRA (peft) of rank `rank` on the attention projections, and on the feed-forward ones if `feed_forward`.

    The frozen base stays in the dtype it was loaded in (bf16 on a GPU: it is only read); the LoRA weights, the only
    trained ones, are fp32, because autocast computes in bf16 anyway and AdamW's small steps vanish in bf16 weights.
    The LoRA scale is `alpha` / rank (TrainArgs.lora_alpha_applied). The initialisation draws from torch's global
    generator: seed it first.
    `targets`: (attention, feed-forward) module names; FLUX's and SD3's by default.
    """
    from peft import LoraConfig
    from peft.utils.error import NoMatchingPeftModuleError

    transformer.requires_grad_(False)
    attention, ff = targets or (LORA_ATTENTION, LORA_FEED_FORWARD)  # an adapter's `lora_targets`
    if isinstance(attention, str):  # regular expressions, matched against the full module name
        targets = f"(?:{attention})|(?:{ff})" if feed_forward else attention
    else:
        targets = attention + (ff if feed_forward else [])
    try:
        transformer.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights="gaussian",
                                           target_modules=targets))
    except NoMatchingPeftModuleError:  # a transformer configured with no blocks
        fail(f"the {type(transformer).__name__} has none of the modules LoRA adapts ({targets}): its "
             f"configuration builds no attention blocks (a num_layers of 0?); give it blocks, or train it in full "
             f"(--lora-rank 0)")
    for p in transformer.parameters():
        if p.requires_grad:
            p.data = p.data.float()


class Adapter:
    """Common plumbing; subclasses define `pipeline_class`, `encode_prompts`, `noise` and `velocity`. The keyword
    options (attention_backend, rollout_attention_backend, compile) go to `kernels.Kernels`."""

    pipeline_class = None
    cfg = False  # classifier-free guidance in the velocity; a property where it depends on the guidance value
    lora_targets = (LORA_ATTENTION, LORA_FEED_FORWARD)  # module names of the attention and feed-forward layers

    def __init__(self, pipe, device, dtype, offload_text_encoders=False, place_transformer=True, num_frames=1,
                 **options):
        self.pipe, self.device, self.dtype = pipe, torch.device(device), dtype
        self.num_frames = num_frames  # of each sample: 1 for images (a video model's adapter reads it)
        self.transformer = pipe.transformer
        self.offload = offload_text_encoders
        self.kernels = Kernels(self.transformer, self.device, dtype, **options)
        # frozen parts: eval mode, no gradients, the compute dtype; text encoders wait on the CPU if offloading
        for module in self.frozen_modules():
            home = "cpu" if self.offload and module is not pipe.vae else self.device
            module.requires_grad_(False).eval().to(home)
            if module.dtype != dtype:
                module.to(dtype)
        if place_transformer:  # FSDP2 shards the transformer on the CPU first, then moves only the shards
            self.transformer.to(self.device)

    @property
    def forwards_per_velocity(self) -> int:
        """Image-forwards of the transformer in one velocity evaluation: 2 with CFG (unconditional, conditional)."""
        return 2 if self.cfg else 1

    @torch.no_grad()
    def encode(self, prompts):
        """Prompt conditioning on the device: a dict of tensors indexed by prompt (see `encode_prompts`)."""
        if not self.offload:
            return self.encode_prompts(prompts)
        encoders = [m for m in self.frozen_modules() if m is not self.pipe.vae]
        for module in encoders:  # T5-XXL alone is ~9.5 GB in bf16: on the accelerator only while encoding
            module.to(self.device)
        try:
            return self.encode_prompts(prompts)
        finally:
            for module in encoders:
                module.to("cpu")

    @classmethod
    def load(cls, path: str, device, dtype, transformer_dtype=torch.float32, **kwargs):
        try:
            pipe = cls.pipeline_class.from_pretrained(path, dtype=dtype)
        except (OSError, ValueError, EnvironmentError) as err:
            raise ModelLoadError(missing_weights_message(path, err)) from None
        pipe.set_progress_bar_config(disable=True)
        if pipe.transformer.dtype != transformer_dtype:
            pipe.transformer.to(transformer_dtype)  # the trained weights: fp32 master copy by default
        return cls(pipe, device, dtype, **kwargs)

    def frozen_modules(self):
        return [m for m in (getattr(self.pipe, name, None) for name in
                            ("vae", "text_encoder", "text_encoder_2", "text_encoder_3")) if m is not None]

    @torch.no_grad()
    def decode(self, latents, size):
        """latents (M, ...) -> images (M, 3, H, W) in [0, 1], float32."""
        vae = self.pipe.vae
        x = self.unpack(latents, size).to(self.device, vae.dtype)  # (M, C, h, w)
        # the VAE's latent normalisation: z = (x - shift) * scale, so x = z / scale + shift
        x = x / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
        images = vae.decode(x, return_dict=False)[0]  # (M, 3, H, W) in [-1, 1]
        return ((images.float() + 1) / 2).clamp(0, 1)

    def unpack(self, latents, size):
        return latents

    @staticmethod
    def guided(out, weight: float):
        """Classifier-free guidance: `out` (2M, ...) holds the unconditional, then the conditional velocities;
        returns v_u + weight (v_c - v_u), float32."""
        uncond, text = out.float().chunk(2)
        return uncond + weight * (text - uncond)


class FluxAdapter(Adapter):
    from diffusers import FluxPipeline as pipeline_class

    def __init__(self, pipe, device, dtype, guidance: float = 3.5, max_sequence_length: int = 512,
                 offload_text_encoders: bool = False, place_transformer: bool = True, **options):
        super().__init__(pipe, device, dtype, offload_text_encoders, place_transformer, **options)
        self.guidance = guidance
        self.max_sequence_length = min(max_sequence_length, pipe.tokenizer_2.model_max_length)

    def encode_prompts(self, prompts):
        prompt_embeds, pooled, text_ids = self.pipe.encode_prompt(
            prompts, prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": prompt_embeds, "pooled": pooled, "text_ids": text_ids}  # (B, T, D), (B, D'), (T, 3)

    def latent_channels(self):
        return self.transformer.config.in_channels // 4

    def noise(self, generators, size):
        """One standard normal latent per generator: (B, L, 4C)."""
        h, w = (2 * (side // (self.pipe.vae_scale_factor * 2)) for side in hw(size))
        shape = (self.latent_channels(), h, w)
        latents = prompt_noise(generators, shape, "cpu")  # (B, C, h, w)
        return self.pipe._pack_latents(latents, len(generators), shape[0], h, w).to(self.device)  # (B, L, 4C)

    def unpack(self, latents, size):
        return self.pipe._unpack_latents(latents, *hw(size), self.pipe.vae_scale_factor)

    def velocity(self, transformer, cond, latents, sigma, prompt_index, size):
        """v(x, sigma | prompt): latents (M, L, 4C), sigma (M,), prompt_index (M,) -> (M, L, 4C) float32."""
        M = latents.shape[0]
        h, w = (side // self.pipe.vae_scale_factor for side in hw(size))
        image_ids = self.pipe._prepare_latent_image_ids(M, h // 2, w // 2, self.device, latents.dtype)  # (L, 3)
        guidance = (torch.full((M,), self.guidance, device=self.device)
                    if self.transformer.config.guidance_embeds else None)
        embeds, pooled = self.kernels.text_inputs(cond["prompt_embeds"][prompt_index], cond["pooled"][prompt_index])
        with self.kernels():  # autocast, the phase's attention kernels (kernels.py)
            out = transformer(
                hidden_states=latents, timestep=sigma.to(self.device), guidance=guidance,  # scaled by 1000 inside
                pooled_projections=pooled, encoder_hidden_states=embeds,
                txt_ids=cond["text_ids"], img_ids=image_ids, return_dict=False)[0]
        return out.float()


class SD3Adapter(Adapter):
    from diffusers import StableDiffusion3Pipeline as pipeline_class

    def __init__(self, pipe, device, dtype, guidance: float = 4.5, max_sequence_length: int = 256,
                 offload_text_encoders: bool = False, place_transformer: bool = True, **options):
        super().__init__(pipe, device, dtype, offload_text_encoders, place_transformer, **options)
        self.guidance = guidance
        tok3 = getattr(pipe, "tokenizer_3", None)
        self.max_sequence_length = min(max_sequence_length, tok3.model_max_length) if tok3 else max_sequence_length

    @property
    def cfg(self):  # as the pipeline runs it: above 1 (at 0 or 1 the conditional velocity alone)
        return self.guidance > 1

    def encode_prompts(self, prompts):
        embeds, negative, pooled, negative_pooled = self.pipe.encode_prompt(
            prompts, None, None, device=self.device, do_classifier_free_guidance=self.cfg,
            max_sequence_length=self.max_sequence_length)
        return {"prompt_embeds": embeds, "negative_embeds": negative, "pooled": pooled,
                "negative_pooled": negative_pooled}

    def noise(self, generators, size):
        h, w = (side // self.pipe.vae_scale_factor for side in hw(size))
        return prompt_noise(generators, (self.transformer.config.in_channels, h, w), self.device)  # (B, C, h, w)

    def velocity(self, transformer, cond, latents, sigma, prompt_index, size):
        """Guided velocity v_u + w (v_c - v_u), or v_c when guidance <= 1: latents (M, C, h, w) -> (M, C, h, w)
        float32."""
        embeds, pooled = cond["prompt_embeds"][prompt_index], cond["pooled"][prompt_index]
        if self.cfg:
            embeds = torch.cat([cond["negative_embeds"][prompt_index], embeds])
            pooled = torch.cat([cond["negative_pooled"][prompt_index], pooled])
            latents, sigma = torch.cat([latents, latents]), torch.cat([sigma, sigma])
        embeds, pooled = self.kernels.text_inputs(embeds, pooled)
        with self.kernels():  # autocast, the phase's attention kernels (kernels.py)
            out = transformer(hidden_states=latents, timestep=sigma.to(self.device) * 1000,  # SD3 takes t = 1000 sigma
                              encoder_hidden_states=embeds, pooled_projections=pooled, return_dict=False)[0]
        return self.guided(out, self.guidance) if self.cfg else out.float()


class ZImageAdapter(Adapter):
    """Z-Image (Tongyi-MAI, a 6B single-stream transformer; Qwen3 text encoder). The transformer takes lists: one
    latent (C, 1, h, w) and one unpadded caption (T_i, D) per sample, and the time 1 - sigma; it predicts the
    negative velocity. Z-Image-Turbo samples without guidance; `guidance` > 0 runs classifier-free guidance against
    the empty caption, as the base model's pipeline does, at 2 image-forwards per velocity."""
    from diffusers import ZImagePipeline as pipeline_class
    lora_targets = (["to_q", "to_k", "to_v", "to_out.0"], ["w1", "w2", "w3"])

    def __init__(self, pipe, device, dtype, guidance: float = 0.0, max_sequence_length: int = 512,
                 offload_text_encoders: bool = False, place_transformer: bool = True, **options):
        super().__init__(pipe, device, dtype, offload_text_encoders, place_transformer, **options)
        self.guidance, self.max_sequence_length = guidance, max_sequence_length

    @property
    def cfg(self):
        return self.guidance > 0

    def encode_prompts(self, prompts):
        # lists of unpadded (T_i, D), from the second-to-last layer; a copy of the prompts, as diffusers writes the
        # chat-templated ones into the list it is given
        embeds, negative = self.pipe.encode_prompt(list(prompts), device=self.device,
                                                   do_classifier_free_guidance=self.cfg,
                                                   max_sequence_length=self.max_sequence_length)
        cond = {"prompt_embeds": torch.nn.utils.rnn.pad_sequence(embeds, batch_first=True),  # (B, T, D)
                "lengths": torch.tensor([len(e) for e in embeds])}  # (B,)
        if negative:
            cond.update(negative_embeds=torch.nn.utils.rnn.pad_sequence(negative, batch_first=True),
                        negative_lengths=torch.tensor([len(e) for e in negative]))
        return cond

    def noise(self, generators, size):
        h, w = (2 * (side // (self.pipe.vae_scale_factor * 2)) for side in hw(size))
        return prompt_noise(generators, (self.transformer.config.in_channels, h, w), self.device)  # (B, C, h, w)

    def velocity(self, transformer, cond, latents, sigma, prompt_index, size):
        """latents (M, C, h, w) -> (M, C, h, w) float32; guided when `guidance` > 0."""
        index = prompt_index.tolist()
        texts = [cond["prompt_embeds"][i, : cond["lengths"][i]] for i in index]  # M captions (T_i, D)
        x, t = list(latents.unsqueeze(2).unbind(0)), (1 - sigma).to(self.device)  # its time runs from noise (0)
        if self.cfg:  # the empty caption first
            texts = [cond["negative_embeds"][i, : cond["negative_lengths"][i]] for i in index] + texts
            x, t = x + x, torch.cat([t, t])
        texts = list(self.kernels.text_inputs(*texts))
        with self.kernels():  # autocast, the phase's attention kernels (kernels.py)
            out = transformer(x, t, texts, return_dict=False)[0]  # a list of (C, 1, h, w)
        v = -torch.stack(out).squeeze(2).float()  # the transformer predicts -v
        # Z-Image's pipeline guides as v_c + w (v_c - v_u), which is weight 1 + w in the usual form
        return self.guided(v, 1 + self.guidance) if self.cfg else v


class Flux2KleinAdapter(Adapter):
    """FLUX.2 [klein] (4B / 9B; a Qwen3 text encoder whose layers at a quarter, half and three quarters of its depth
    are concatenated per token). Latents are the VAE's 2x2 patches, normalised by its batch-norm statistics and
    flattened to tokens (B, L, 4C), with 4-axis positions; the transformer takes sigma (x1000 inside). The distilled
    klein samples without guidance; for the base models `guidance` > 1 runs CFG against the empty caption, as the
    pipeline does. LoRA on the attention reaches the single-stream blocks' fused attention + MLP projections."""
    from diffusers import Flux2KleinPipeline as pipeline_class
    # regular expressions: in the single-stream blocks `attn.to_out` is a Linear, in the double-stream ones a list
    lora_targets = (r".*(transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|"
                    r"to_add_out)|single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out))",
                    r".*transformer_blocks\.\d+\.(ff|ff_context)\.(linear_in|linear_out)")

    def __init__(self, pipe, device, dtype, guidance: float = 0.0, max_sequence_length: int = 512,
                 offload_text_encoders: bool = False, place_transformer: bool = True, **options):
        super().__init__(pipe, device, dtype, offload_text_encoders, place_transformer, **options)
        self.guidance, self.max_sequence_length = guidance, max_sequence_length
        depth = pipe.text_encoder.config.num_hidden_layers  # 36 in klein 4B and 9B: layers (9, 18, 27)
        self.text_layers = tuple(depth * k // 4 for k in (1, 2, 3))

    @property
    def cfg(self):  # as the pipeline runs it: above 1, and never for the distilled models (it ignores guidance there)
        return self.guidance > 1 and not self.pipe.config.get("is_distilled", False)

    def encode_prompts(self, prompts):
        def encode(texts):  # (B, T, 3 D) and the text positions (T, 4), shared by every prompt
            embeds, ids = self.pipe.encode_prompt(list(texts), device=self.device,
                                                  text_encoder_out_layers=self.text_layers,
                                                  max_sequence_length=self.max_sequence_length)
            return embeds, ids[0]

        embeds, text_ids = encode(prompts)
        cond = {"prompt_embeds": embeds, "text_ids": text_ids}
        if self.cfg:
            cond["negative_embeds"] = encode([""] * len(prompts))[0]
        return cond

    def patch_grid(self, size) -> tuple[int, int]:
        """The rows and columns of the VAE's 2x2 latent patches (the tokens) of an image of `size`."""
        return tuple(side // (self.pipe.vae_scale_factor * 2) for side in hw(size))

    def noise(self, generators, size):
        """Standard normal latents drawn as the VAE's 2x2 patches (4C, h/2, w/2), flattened to (B, L, 4C)."""
        h, w = self.patch_grid(size)
        shape = (self.transformer.config.in_channels, h, w)
        latents = prompt_noise(generators, shape, "cpu")  # (B, 4C, h/2, w/2)
        return self.pipe._pack_latents(latents).to(self.device)  # (B, L, 4C)

    def velocity(self, transformer, cond, latents, sigma, prompt_index, size):
        """v(x, sigma | prompt): latents (M, L, 4C) -> (M, L, 4C) float32; guided with CFG (the base models)."""
        h, w = self.patch_grid(size)
        image_ids = self.pipe._prepare_latent_ids(latents.new_empty(1, 1, h, w))[0].to(self.device)  # (L, 4)
        embeds, sigma = cond["prompt_embeds"][prompt_index], sigma.to(self.device)
        if self.cfg:
            embeds, latents, sigma = (torch.cat([cond["negative_embeds"][prompt_index], embeds]),
                                      torch.cat([latents, latents]), torch.cat([sigma, sigma]))
        embeds, = self.kernels.text_inputs(embeds)
        with self.kernels():  # autocast, the phase's attention kernels (kernels.py)
            out = transformer(hidden_states=latents, encoder_hidden_states=embeds, timestep=sigma,  # x1000 inside
                              img_ids=image_ids, txt_ids=cond["text_ids"], guidance=None, return_dict=False)[0]
        return self.guided(out, self.guidance) if self.cfg else out.float()

    @torch.no_grad()
    def decode(self, latents, size):
        """Tokens (M, L, 4C) -> images (M, 3, H, W) in [0, 1]: undo the batch-norm normalisation, unpatchify, decode."""
        vae, (h, w) = self.pipe.vae, self.patch_grid(size)
        z = latents.transpose(1, 2).reshape(latents.shape[0], -1, h, w).to(self.device, vae.dtype)
        mean = vae.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
        images = vae.decode(self.pipe._unpatchify_latents(z * std + mean), return_dict=False)[0]
        return ((images.float() + 1) / 2).clamp(0, 1)


class QwenImageAdapter(Adapter):
    """Qwen-Image (a 20B MMDiT; Qwen2.5-VL-7B as its text encoder, whose last hidden states after the pipeline's
    34-token system prompt are the caption; the causal video VAE of Wan, 8x, one frame). Latents are 2x2 patches
    (B, L, 4C) as FLUX.1's, with a mask over the padded caption tokens; the transformer takes sigma (x1000 inside).
    Guidance is the pipeline's true CFG against the model card's negative prompt " ", above 1, with its norm
    rescaling: the guided velocity keeps, per token, the conditional velocity's norm."""
    from diffusers import QwenImagePipeline as pipeline_class
    lora_targets = (LORA_ATTENTION, ["img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"])
    negative_prompt = " "  # the model card's

    def __init__(self, pipe, device, dtype, guidance: float = 4.0, max_sequence_length: int = 512,
                 offload_text_encoders: bool = False, place_transformer: bool = True, **options):
        super().__init__(pipe, device, dtype, offload_text_encoders, place_transformer, **options)
        self.guidance, self.max_sequence_length = guidance, max_sequence_length

    @property
    def cfg(self):  # as the pipeline runs it: above 1 (with a negative prompt, which the card gives)
        return self.guidance > 1

    def encode_prompts(self, prompts):
        def encode(texts):  # (B, T, D) and its mask (B, T): 1 on caption tokens, 0 on padding
            embeds, mask = self.pipe.encode_prompt(list(texts), device=self.device,
                                                   max_sequence_length=self.max_sequence_length)
            return embeds, torch.ones(embeds.shape[:2], dtype=torch.long, device=self.device) if mask is None else mask

        embeds, mask = encode(prompts)
        cond = {"prompt_embeds": embeds, "mask": mask}
        if self.cfg:
            cond["negative_embeds"], cond["negative_mask"] = encode([self.negative_prompt] * len(prompts))
        return cond

    def noise(self, generators, size):
        """One standard normal latent per generator, packed into 2x2 patches: (B, L, 4C)."""
        h, w = (2 * (side // (self.pipe.vae_scale_factor * 2)) for side in hw(size))
        shape = (self.transformer.config.in_channels // 4, h, w)
        latents = prompt_noise(generators, shape, "cpu")  # (B, C, h, w)
        return self.pipe._pack_latents(latents, len(generators), *shape).to(self.device)  # (B, L, 4C)

    def velocity(self, transformer, cond, latents, sigma, prompt_index, size):
        """v(x, sigma | prompt): latents (M, L, 4C) -> (M, L, 4C) float32; true CFG with norm rescaling above 1."""
        h, w = (side // self.pipe.vae_scale_factor // 2 for side in hw(size))  # tokens per column and row
        embeds, mask, sigma = cond["prompt_embeds"][prompt_index], cond["mask"][prompt_index], sigma.to(self.device)
        if self.cfg:  # the negative caption first, both padded to one length (masked, as the pipeline's batches are)
            negative, negative_mask = cond["negative_embeds"][prompt_index], cond["negative_mask"][prompt_index]
            length = max(embeds.shape[1], negative.shape[1])
            # the caption axis (dim 1) padded at its end; an embedding's last (feature) axis left as it is
            pad = lambda t: torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, length - t.shape[1]))
            embeds, mask = torch.cat([pad(negative), pad(embeds)]), torch.cat([pad(negative_mask), pad(mask)])
            latents, sigma = torch.cat([latents, latents]), torch.cat([sigma, sigma])
        embeds, = self.kernels.text_inputs(embeds)
        with self.kernels():  # autocast, the phase's attention kernels (kernels.py)
            out = transformer(hidden_states=latents, encoder_hidden_states=embeds,
                              encoder_hidden_states_mask=None if bool(mask.all()) else mask, timestep=sigma,
                              img_shapes=[[(1, h, w)]] * latents.shape[0], return_dict=False)[0]
        if not self.cfg:
            return out.float()
        guided, conditional = self.guided(out, self.guidance), out.float().chunk(2)[1]
        return guided * (conditional.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True))

    @torch.no_grad()
    def decode(self, latents, size):
        """Tokens (M, L, 4C) -> images (M, 3, H, W) in [0, 1]: unpack to one frame, undo the per-channel
        normalisation, decode."""
        vae = self.pipe.vae
        z = self.pipe._unpack_latents(latents, *hw(size), self.pipe.vae_scale_factor)  # (M, C, 1, h, w)
        mean = torch.tensor(vae.config.latents_mean, device=self.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std, device=self.device).view(1, -1, 1, 1, 1)
        images = vae.decode((z.to(self.device) * std + mean).to(vae.dtype), return_dict=False)[0][:, :, 0]
        return ((images.float() + 1) / 2).clamp(0, 1)


class WanAdapter(Adapter):
    """Wan 2.1 / 2.2 text-to-video (UMT5 text encoder; one transformer: 2.1, or 2.2 TI2V 5B). Latents are videos
    (B, C, F', h, w), F' = (F - 1) / 4 + 1 latent frames for F frames; the transformer takes t = 1000 sigma.
    Classifier-free guidance against the empty caption when `guidance` > 1, as the pipeline does, at 2 image-forwards
    per velocity. Decoded samples are videos (M, 3, F, H, W); the rewards score their frames (rewards.over_frames)."""
    from diffusers import WanPipeline as pipeline_class
    lora_targets = (LORA_ATTENTION[:4], ["ffn.net.0.proj", "ffn.net.2"])  # attn1 (self) and attn2 (text) share names

    def __init__(self, pipe, device, dtype, guidance: float = 5.0, max_sequence_length: int = 512, num_frames: int = 81,
                 offload_text_encoders: bool = False, place_transformer: bool = True, **options):
        if getattr(pipe, "transformer_2", None) is not None:
            raise ModelLoadError("Wan 2.2 A14B's two experts (transformer_2) are not supported; use Wan 2.1 T2V or "
                                 "Wan 2.2 TI2V 5B")
        super().__init__(pipe, device, dtype, offload_text_encoders, place_transformer, num_frames, **options)
        self.guidance, self.max_sequence_length = guidance, max_sequence_length
        pipe.vae.to(torch.float32)  # Wan's VAE decodes in fp32 (its model card's advice: bf16 degrades the video)

    @property
    def cfg(self):  # as the pipeline runs it: above 1
        return self.guidance > 1

    def encode_prompts(self, prompts):
        embeds, negative = self.pipe.encode_prompt(list(prompts), negative_prompt="", device=self.device,
                                                   do_classifier_free_guidance=self.cfg,
                                                   max_sequence_length=self.max_sequence_length)  # (B, T, D) each
        return {"prompt_embeds": embeds, **({"negative_embeds": negative} if negative is not None else {})}

    def noise(self, generators, size):
        vae = self.pipe.vae.config
        frames = (self.num_frames - 1) // vae.scale_factor_temporal + 1
        shape = (self.transformer.config.in_channels, frames, *(side // vae.scale_factor_spatial for side in hw(size)))
        return prompt_noise(generators, shape, self.device)  # (B, C, F', h, w)

    def velocity(self, transformer, cond, latents, sigma, prompt_index, size):
        """latents (M, C, F', h, w) -> (M, C, F', h, w) float32; guided v_u + w (v_c - v_u) with CFG."""
        embeds, t = cond["prompt_embeds"][prompt_index], sigma.to(self.device) * 1000  # Wan takes t = 1000 sigma
        if self.cfg:
            embeds = torch.cat([cond["negative_embeds"][prompt_index], embeds])
            latents, t = torch.cat([latents, latents]), torch.cat([t, t])
        embeds, = self.kernels.text_inputs(embeds)
        with self.kernels():  # autocast, the phase's attention kernels (kernels.py)
            out = transformer(hidden_states=latents, timestep=t, encoder_hidden_states=embeds, return_dict=False)[0]
        return self.guided(out, self.guidance) if self.cfg else out.float()

    @torch.no_grad()
    def decode(self, latents, size):
        """latents (M, C, F', h, w) -> videos (M, 3, F, H, W) in [0, 1]: undo the per-channel normalisation, decode."""
        vae = self.pipe.vae
        mean = torch.tensor(vae.config.latents_mean, device=self.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std, device=self.device).view(1, -1, 1, 1, 1)
        video = vae.decode((latents.to(self.device) * std + mean).to(vae.dtype), return_dict=False)[0]
        return ((video.float() + 1) / 2).clamp(0, 1)


ADAPTERS = {"flux": FluxAdapter, "tiny": FluxAdapter, "sd3": SD3Adapter, "zimage": ZImageAdapter,
            "flux2": Flux2KleinAdapter, "qwenimage": QwenImageAdapter, "wan": WanAdapter, "wan22": WanAdapter}
# image sides must be multiples of the VAE factor times the transformer's 2x2 patch (the tiny VAE downsamples by 2)
RESOLUTION_MULTIPLE = {"flux": 16, "sd3": 16, "tiny": 4, "zimage": 16, "flux2": 16, "qwenimage": 16, "wan": 16,
                       "wan22": 32}  # Wan 2.2 TI2V 5B's VAE is 16x
