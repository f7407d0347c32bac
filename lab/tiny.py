"""The built-in tiny world: a small FLUX pipeline, pre-trained on coloured shapes, and a reward that needs no weights.

Images are 32x32: one shape (a circle, a wide bar or a tall pillar) of one colour (red, green, blue or yellow) in
one half of the picture (left, right, top or bottom) on a dark background, captioned "a red bar on the left". The
shapes differ in the height / width of their bounding box (1, 0.4, 2.5), which a model this small can learn; finer
differences (a square's corners against a circle's) it cannot, and they would only measure its capacity. The model
is a real diffusers `FluxPipeline`: a `FluxTransformer2DModel`, an `AutoencoderKL`, CLIP and T5 text encoders and
their tokenizers, all small and built from configs, so `--model tiny` drives the same adapter and code as FLUX.1.

Pre-training (the VAE as an autoencoder, then the transformer by flow matching) takes from under a minute to about
3 minutes on 2 CPU cores, by machine (docs/performance.md). It leaves headroom: the base model draws the named
shape only roughly (a bar not wide enough, a pillar not tall enough) and misses the named half now and then, which
a reward can correct. The result is saved with `save_pretrained` into a cache folder named by its seed and
settings, with a checksum file, and loaded from there with `FluxPipeline.from_pretrained` like any other model.

The reward (`shape_reward`) reads the prompt and scores the pixels, each term in [0, 1], averaged:
  colour:   how close the foreground pixels are to the named colour,
  position: whether the foreground's centre of mass lies in the named half,
  shape:    how close the foreground's bounding box's height / width is to the named shape's (on a log scale).
A flow model cannot saturate it by a global trick: it must get all three attributes of each prompt right at once,
and blur (which pulls a bar's or pillar's height / width toward 1), stray pixels or two blobs lower the shape and
colour terms. `shape_success` is the strict pass, GenEval-style: exactly one object of the named colour, of the named
shape, in the named half; the reward `shapes-strict`, which the tiny preset holds out, so its mean is a success rate
that training never sees.
"""
import hashlib
import itertools
import json
import math
import os
import shutil
import sys
import uuid

import torch

COLOURS = {"red": (0.9, 0.1, 0.1), "green": (0.1, 0.8, 0.1), "blue": (0.15, 0.25, 0.95), "yellow": (0.95, 0.9, 0.1)}
SHAPES = {"circle": 1.0, "bar": 0.4, "pillar": 2.5}  # height / width of the bounding box
POSITIONS = ["left", "right", "top", "bottom"]
RESOLUTION = 32
# `python train.py --model tiny --seed S`, S = 0..4, on two machines of this project's kind (x86_64, 2 cores, torch
# 2.14.1): the held-out success rate before (0.320 on both) and after, on 1,152 images each (standard error <= 0.015):
# 0.605, 0.516, 0.545, 0.640, 0.595 on the first, 0.573, 0.602, 0.576, 0.708, 0.694 on the second. Each CPU's floating
# point takes its own path from the same base model, so a run elsewhere may end outside both ranges.
QUICK_START = dict(base=0.320, seeds=5, machines=((0.516, 0.640), (0.573, 0.708)))  # success, each machine's range
VERSION = 3  # of the pre-training recipe: part of the cache folder's name, so a changed recipe never loads old files
WORDS = ["a", "on", "the", *COLOURS, *SHAPES, *POSITIONS]


def all_prompts():
    return [f"a {c} {s} on the {p}" for c, s, p in itertools.product(COLOURS, SHAPES, POSITIONS)]


def prompt_split():
    """(train, held-out): 36 and 12 of the 48 attribute combinations; RL never sees the held-out ones. Combination
    (colour c, shape s, half h) is held out when c + s + h is a multiple of 4: a Latin square on colour x half whose
    symbols are the shapes (the fourth symbol holds nothing out). Every pair of a held-out prompt's attributes is
    trained, only the triple is new (docs/tiny_world.md, on why a split that holds out one half per colour fails)."""
    held = [f"a {colour} {shape} on the {half}" for (c, colour), (s, shape), (h, half)
            in itertools.product(enumerate(COLOURS), enumerate(SHAPES), enumerate(POSITIONS)) if (c + s + h) % 4 == 0]
    return [p for p in all_prompts() if p not in held], held


def parse(prompt):
    words = prompt.lower().split()
    pick = lambda names: next((w for w in words if w in names), None)
    return pick(COLOURS), pick(SHAPES), pick(POSITIONS)


def render(prompts, generator):
    """Procedural images for captions: (N, 3, 32, 32) in [0, 1]; random size, place within the half, background."""
    n, R = len(prompts), RESOLUTION
    u = torch.rand(n, 4, generator=generator)  # size, two jitters, background
    radius = 4.5 + 2.5 * u[:, 0]  # (N,)
    along, across = 8.5 + 2 * u[:, 1], 10 + 12 * u[:, 2]  # distance from the edge, place along the edge
    ys, xs = torch.meshgrid(torch.arange(R) + 0.5, torch.arange(R) + 0.5, indexing="ij")  # (R, R)
    images = torch.empty(n, 3, R, R)
    for i, prompt in enumerate(prompts):
        colour, shape, position = parse(prompt)
        cx, cy = {"left": (along[i], across[i]), "right": (R - along[i], across[i]),
                  "top": (across[i], along[i]), "bottom": (across[i], R - along[i])}[position]
        r, dx, dy = radius[i], xs - cx, ys - cy
        if shape == "circle":
            mask = dx**2 + dy**2 <= r**2
        elif shape == "bar":  # 2.5 r wide, r high
            mask = (dx.abs() <= r * 1.25) & (dy.abs() <= r * 0.5)
        else:  # a pillar: r wide, 2.5 r high
            mask = (dx.abs() <= r * 0.5) & (dy.abs() <= r * 1.25)
        background = 0.05 + 0.15 * u[i, 3]
        images[i] = torch.where(mask, torch.tensor(COLOURS[colour])[:, None, None], background)
    return images


def _background_distance(images):
    """How far each pixel's colour is from the background's (the median of the border pixels): (N, H, W)."""
    border = torch.cat([images[..., 0, :], images[..., -1, :], images[..., :, 0], images[..., :, -1]], -1)
    return (images - border.median(dim=-1).values[:, :, None, None]).norm(dim=1)


def _pixel_centres(H, W, device):
    """The y and x coordinates of the pixel centres, each (H, W)."""
    return torch.meshgrid(torch.arange(H, device=device) + 0.5, torch.arange(W, device=device) + 0.5, indexing="ij")


def shape_scores(images, prompts):
    """Per-image (colour, position, shape) scores, (N, 3), each in [0, 1]; all 0 for an image with no foreground."""
    images = images.float()
    N, _, H, W = images.shape
    mask = ((_background_distance(images) - 0.2) / 0.2).clamp(0, 1)  # soft foreground, (N, H, W)
    area = mask.sum((1, 2)).clamp_min(1e-6)  # (N,)
    ys, xs = _pixel_centres(H, W, images.device)
    cx, cy = (mask * xs).sum((1, 2)) / area, (mask * ys).sum((1, 2)) / area  # (N,)
    # soft bounding box: how many rows and columns the foreground occupies (a smooth function of the pixels)
    height, width = mask.amax(2).sum(1), mask.amax(1).sum(1)  # (N,), (N,)
    aspect = height.clamp_min(1.0) / width.clamp_min(1.0)  # (N,)
    parsed = [parse(p) for p in prompts]
    valid = torch.tensor([None not in a for a in parsed], device=images.device) & (area >= 4)  # (N,)
    parsed = [a if None not in a else ("red", "circle", "left") for a in parsed]
    target = torch.tensor([COLOURS[c] for c, _, _ in parsed], device=images.device)  # (N, 3)
    aspect_target = torch.tensor([SHAPES[s] for _, s, _ in parsed], device=images.device)  # (N,)
    side = torch.tensor([POSITIONS.index(p) for _, _, p in parsed], device=images.device)  # (N,)
    # colour: mean closeness of the foreground pixels to the named colour
    closeness = torch.exp(-((images - target[:, :, None, None]) ** 2).sum(1) / 0.1)  # (N, H, W)
    colour = (mask * closeness).sum((1, 2)) / area
    # position: the centre of mass at least a few pixels into the named half (left, right, top, bottom)
    offsets = torch.stack([W / 2 - cx, cx - W / 2, H / 2 - cy, cy - H / 2], 1)  # (N, 4)
    position = torch.sigmoid((offsets.gather(1, side[:, None]).squeeze(1) - 3) / 1.5)
    # shape = exp(-(ln(aspect / named aspect) / 0.4)^2): 1 at the named shape, 0.005 at the next (ln 2.5 apart)
    shape = torch.exp(-((torch.log(aspect / aspect_target) / 0.4) ** 2))
    return torch.stack([colour, position, shape], 1) * valid[:, None]  # (N, 3)


def shape_reward(images, prompts):
    """Prompt adherence from pixels: the mean of the colour, position and shape scores, (N,) in [0, 1]."""
    return shape_scores(images, prompts).mean(1)


MIN_AREA = 5  # pixels: a smaller blob of a colour is a speck, not an object


def _blobs(mask):
    """Connected components (8-neighbourhood) of boolean masks (M, H, W): integer labels, 0 for background."""
    M, H, W = mask.shape
    labels = torch.arange(1, H * W + 1, device=mask.device, dtype=torch.float32).view(1, H, W).expand(M, H, W)
    labels = labels * mask
    while True:  # every pixel takes its neighbourhood's largest label until nothing changes
        grown = torch.nn.functional.max_pool2d(labels[:, None], 3, stride=1, padding=1)[:, 0] * mask
        if torch.equal(grown, labels):
            return labels.long()
        labels = grown


def _named_colour(images, prompts):
    """Which pixels show the colour each prompt names, (N, H, W) bool: nearest to it of the palette, and within 0.15
    (squared RGB distance; the palette colours are at least 0.5 apart, the VAE's colour errors on clean shapes under
    0.05). A prompt naming no colour counts red's."""
    N, _, H, W = images.shape
    palette = torch.tensor(list(COLOURS.values()), device=images.device)  # (4, 3)
    distance = ((images[:, None] - palette[None, :, :, None, None]) ** 2).sum(2)  # (N, 4, H, W), squared
    named = torch.tensor([list(COLOURS).index(c) if c in COLOURS else 0 for c, _, _ in map(parse, prompts)],
                         device=images.device)  # (N,)
    near = distance.gather(1, named[:, None, None, None].expand(N, 1, H, W))[:, 0]  # (N, H, W)
    return (near < 0.15) & (distance.argmin(1) == named[:, None, None])


def shape_success(images, prompts):
    """The strict, GenEval-style pass of each image, 1.0 or 0.0, (N,): the named colour shows exactly one object
    (a connected blob of at least MIN_AREA pixels), its bounding box's height / width is nearest the named shape's
    on a log scale, and its centre lies more than 2 pixels into the named half; objects of other colours are not
    counted. NaN for an image with non-finite pixels. Averaged over images, the success rate."""
    device, images = images.device, images.float().cpu()
    N, _, H, W = images.shape
    foreground = _background_distance(images) > 0.2  # (N, H, W), the hard version of shape_scores' soft mask
    ys, xs = _pixel_centres(H, W, "cpu")
    parsed = [parse(p) for p in prompts]
    labels = _blobs(foreground & _named_colour(images, prompts))  # every image at once
    passes = torch.zeros(N)
    for i, (colour, shape, position) in enumerate(parsed):
        if not images[i].isfinite().all():
            passes[i] = float("nan")  # no verdict on a broken image, as the reward gives none
            continue
        if None in (colour, shape, position):
            continue
        blobs = [m for m in (labels[i] == v for v in labels[i].unique() if v > 0) if int(m.sum()) >= MIN_AREA]
        if len(blobs) != 1:
            continue
        m = blobs[0]
        rows, cols = m.any(1).nonzero(), m.any(0).nonzero()
        aspect = float(rows.max() - rows.min() + 1) / float(cols.max() - cols.min() + 1)
        x, y = float(xs[m].mean()), float(ys[m].mean())
        offset = {"left": W / 2 - x, "right": x - W / 2, "top": H / 2 - y, "bottom": y - H / 2}[position]
        nearest = min(SHAPES, key=lambda s: abs(math.log(SHAPES[s] / aspect)))
        passes[i] = float(nearest == shape and offset > 2.0)  # drawn centres sit 5.5-7.5 pixels in
    return passes.to(device)


def colour_area(images, prompts):
    """A reward that can be hacked, to show the reward-hacking watch (lab/watch.py) at work: the share of the
    image's pixels in the named colour (`_named_colour`, as `shape_success` counts them), times 4, at most 1, (N,).
    It pays for more and bigger blobs of that colour whatever their shape and place, which the strict pass (exactly
    one object, of the named shape, in the named half) and `shape_reward` refuse."""
    return (4 * _named_colour(images.float(), prompts).float().mean((1, 2))).clamp(max=1.0)


# --- building the tiny pipeline -------------------------------------------------------------------------------

def quick_start_standing(success: float, changed: list) -> str:
    """One line: where a tiny run's final success rate stands against the quick start's measured ranges."""
    ranges = QUICK_START["machines"]
    low, high = min(r[0] for r in ranges), max(r[1] for r in ranges)
    spans = " and ".join(f"{a:.3f}-{b:.3f}" for a, b in ranges)
    measured = (f"the quick start's {QUICK_START['seeds']} training seeds ended at {spans} (from "
                f"{QUICK_START['base']:.3f}) on two of this project's 2-core machines; another CPU takes its own path")
    if changed:
        named = " ".join(changed[:4]) + (" ..." if len(changed) > 4 else "")
        return f"this run changes {named}, so for reference only: {measured}"
    where = "below" if success < low else "above" if success > high else "within"
    return f"this run ended at {success:.3f}; {measured}: this run is {where} those ranges"


def build_tokenizers():
    """A CLIP BPE tokenizer and a T5 unigram tokenizer over the tiny world's words, built offline."""
    from transformers import CLIPTokenizer, T5Tokenizer

    chars = sorted(set("".join(WORDS)))
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    merges = []
    for c in chars:
        vocab.setdefault(c, len(vocab))
        vocab.setdefault(c + "</w>", len(vocab))
    for word in WORDS:  # merge each word letter by letter into one token
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        while len(pieces) > 1:
            if (pieces[0], pieces[1]) not in merges:
                merges.append((pieces[0], pieces[1]))
            pieces = [pieces[0] + pieces[1]] + pieces[2:]
            vocab.setdefault(pieces[0], len(vocab))
    clip = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    pieces += [("▁" + w, -1.0) for w in WORDS] + [(c, -5.0) for c in chars]
    t5 = T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=16)
    return clip, t5


def build_chat_tokenizer():
    """A word-level tokenizer over the tiny world's words with a chat template, built offline: the stand-in for
    Qwen3's in the tests' tiny Z-Image and FLUX.2 pipelines and in tools/plan.py's (whose pipelines wrap each prompt
    in the template)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>", "user", "assistant", "\n", *sorted(set(WORDS))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", "isolated"),
                                                     pre_tokenizers.WhitespaceSplit()])
    template = ("{% for m in messages %}<|im_start|> {{ m['role'] }}\n{{ m['content'] }} <|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|> assistant\n{% endif %}")
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|endoftext|>", unk_token="<unk>",
                                   eos_token="<|im_end|>", chat_template=template, model_max_length=32)


def build_qwen_tokenizer():
    """A word-level tokenizer for Qwen-Image's prompt template, built offline: the stand-in for Qwen2's in the tests'
    tiny Qwen-Image pipeline and in tools/plan.py's. Like Qwen2's BPE it makes the template's system prefix 34 tokens
    (words, punctuation, line breaks and the chat markers), the count the pipeline drops from every prompt's hidden
    states."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    system = ("Describe the image by detailing the color , shape , size , texture , quantity , text , spatial "
              "relationships of the objects and background :")
    words = ["<|endoftext|>", "<unk>", "\n", "system", "user", "assistant", *dict.fromkeys(system.split()),
             *sorted(set(WORDS) - set(system.split()))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(" ", "removed"),
                                                     pre_tokenizers.Split("\n", "isolated"),
                                                     pre_tokenizers.Punctuation()])
    backend.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|endoftext|>", unk_token="<unk>",
                                   eos_token="<|im_end|>", model_max_length=64)


def build_pipeline(seed: int, hidden: int = 64, layers: int = 2):
    """A randomly initialised tiny FluxPipeline (also used by the tests as a stand-in FLUX.1)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    clip_tok, t5_tok = build_tokenizers()
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(clip_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=77, projection_dim=32, bos_token_id=0, eos_token_id=1, pad_token_id=1))
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(t5_tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=layers, num_single_layers=layers, attention_head_dim=16,
        num_attention_heads=hidden // 16, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
        axes_dims_rope=[4, 6, 6])
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[16, 16], layers_per_block=1, latent_channels=4,
        norm_num_groups=8, use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=False,
        shift_factor=0.0, scaling_factor=1.0)
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder,
                        tokenizer=clip_tok, text_encoder_2=text_encoder_2, tokenizer_2=t5_tok, transformer=transformer)


def _pretrain(seed, vae_steps, flow_steps, log=print):
    from lab.models import FluxAdapter

    pipe = build_pipeline(seed)
    gen = torch.Generator().manual_seed(seed)
    prompts = all_prompts()
    torch.manual_seed(seed)
    # 1. the VAE as an autoencoder (reconstruction + a small KL), then its latent statistics set shift and scale
    vae = pipe.vae
    opt = torch.optim.AdamW(vae.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=vae_steps, pct_start=0.1)
    for step in range(vae_steps):
        batch = [prompts[i] for i in torch.randint(len(prompts), (16,), generator=gen)]
        x = render(batch, gen) * 2 - 1
        posterior = vae.encode(x).latent_dist
        # decoding a posterior sample keeps the decoder robust to small latent errors (clean generated images);
        # the annealed learning rate matters: it is what makes the decoder reproduce all four colours
        recon = vae.decode(posterior.sample(generator=gen)).sample
        loss = (recon - x).pow(2).mean() + 1e-6 * posterior.kl().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    log(f"tiny: VAE pre-trained ({vae_steps} steps, reconstruction mse {loss.item():.4f})")
    with torch.no_grad():
        z = vae.encode(render(prompts * 4, gen) * 2 - 1).latent_dist.mean
    vae.register_to_config(shift_factor=float(z.mean()), scaling_factor=float(1 / z.std()))
    vae.requires_grad_(False).eval()

    # 2. the transformer by flow matching on (image, caption) pairs: x_t = (1 - t) x0 + t eps, target eps - x0
    adapter = FluxAdapter(pipe, "cpu", torch.float32, guidance=3.5, max_sequence_length=16)
    cond = adapter.encode(prompts)
    transformer = adapter.transformer.train()
    opt = torch.optim.AdamW(transformer.parameters(), lr=1e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=flow_steps, pct_start=0.1)
    batch = 32
    for step in range(flow_steps):
        idx = torch.randint(len(prompts), (batch,), generator=gen)
        with torch.no_grad():
            z = vae.encode(render([prompts[i] for i in idx], gen) * 2 - 1).latent_dist.sample(generator=gen)
            z = (z - vae.config.shift_factor) * vae.config.scaling_factor  # (batch, 4, 16, 16)
            x0 = pipe._pack_latents(z, batch, 4, 16, 16)  # (batch, 64, 16)
        t = torch.sigmoid(torch.randn(batch, generator=gen))  # logit-normal times, as SD3 trains
        eps = torch.randn(x0.shape, generator=gen)
        xt = (1 - t[:, None, None]) * x0 + t[:, None, None] * eps
        v = adapter.velocity(transformer, cond, xt, t, idx, RESOLUTION)
        loss = (v - (eps - x0)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    log(f"tiny: transformer pre-trained ({flow_steps} flow-matching steps, last loss {loss.item():.3f})")
    transformer.eval()
    return pipe


def _digest(folder):
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(folder)):
        for name in sorted(files):
            if name == "checksum.json":
                continue
            path = os.path.join(root, name)
            h.update(os.path.relpath(path, folder).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def ensure_pretrained_on_ranks(cache_dir: str, log=print) -> str:
    """`ensure_pretrained` under torchrun: rank 0 pre-trains (once), the other ranks wait, then find it cached."""
    import torch.distributed as dist

    first = not dist.is_initialized() or dist.get_rank() == 0
    path = ensure_pretrained(cache_dir, log=log) if first else None
    if dist.is_initialized():
        dist.barrier()
    return path or ensure_pretrained(cache_dir, log=lambda *a: None)


def ensure_pretrained(cache_dir: str, seed: int = 0, vae_steps: int = 200, flow_steps: int = 700, log=print) -> str:
    """The folder of the pre-trained tiny pipeline for these settings, pre-training it first when it is missing
    or its files fail their checksum (a corrupted cache is rebuilt, never loaded)."""
    folder = os.path.join(os.path.abspath(cache_dir), f"tiny-v{VERSION}-seed{seed}-vae{vae_steps}-flow{flow_steps}")
    if os.path.exists(os.path.join(folder, "checksum.json")):
        if _verified(folder):
            log(f"tiny: using the pre-trained model cached in {folder}")
            return folder
        log(f"tiny: the cache in {folder} fails its checksum; rebuilding it")
    probe = os.path.join(cache_dir, f".writable-{uuid.uuid4().hex[:12]}")  # (another build may probe at once)
    try:  # before minutes of pre-training, not after
        os.makedirs(cache_dir, exist_ok=True)
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as err:
        from lab import fail

        fail(f"--tiny-cache '{cache_dir}' is not writable ({err.strerror}); pass a folder you can write to")
    log(f"tiny: pre-training the tiny model (once; cached in {folder}, change with --tiny-cache)")
    try:
        pipe = _pretrain(seed, vae_steps, flow_steps, log)
    except KeyboardInterrupt:  # one line, not the training loop's traceback
        print("stopped during the tiny model's pre-training; nothing was cached, so the next run starts it again",
              file=sys.stderr)
        raise SystemExit(130) from None
    tmp = f"{folder}.tmp-{uuid.uuid4().hex[:12]}"  # each build its own: two may build one cache at once
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp)
    with open(os.path.join(tmp, "checksum.json"), "w") as f:
        json.dump({"sha256": _digest(tmp)}, f)
    if _verified(folder):  # another build finished first (the same seed and recipe: the same model): keep it
        shutil.rmtree(tmp, ignore_errors=True)
        return folder
    shutil.rmtree(folder, ignore_errors=True)  # (a damaged one)
    try:
        os.replace(tmp, folder)
    except OSError:  # another build's rename came between
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _verified(folder) -> bool:
    """Whether a cached folder's files match its checksum file (an unreadable or damaged one: no)."""
    try:
        with open(os.path.join(folder, "checksum.json")) as f:
            return json.load(f).get("sha256") == _digest(folder)
    except (OSError, ValueError, AttributeError):
        return False
