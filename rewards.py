"""Reward models, all behind one signature: fn(images, prompts) -> scores (N,).

images: float tensor (N, 3, H, W) in [0, 1] on the reward's device; prompts: N strings. Images stay in memory:
resizing, cropping and normalising are done in torch on the batch. `load_reward(name, ...)` builds a reward by
name from `REWARDS`; each factory imports its heavy packages inside, so an unused reward needs no install.
Each registry entry declares the paths its factory reads (field name, default, help); `path_fields()` lists them
for the command lines, which make one flag per field. Adding a reward = a factory + its entry in `REWARDS`.

| name          | model                                                        | score                             |
|---------------|--------------------------------------------------------------|-----------------------------------|
| hps           | open_clip ViT-H-14 + HPS-v2.1 state dict (hub xswu/HPSv2)    | cos(image, text), ~0.25-0.40      |
| clip          | open_clip model (default apple/DFN5B-CLIP-ViT-H-14)          | cos(image, text)                  |
| pickscore     | transformers CLIPModel yuvalkirstain/PickScore_v1            | logit_scale.exp() * cos, ~20-23   |
| aesthetic     | transformers CLIP ViT-L/14 + the LAION aesthetic v2 MLP head | MLP(normalised image features)    |
| imagereward   | the `image-reward` package (BLIP backbone)                   | its standardised score            |
| hpsv3         | transformers Qwen2-VL-7B + HPSv3's MLP head (MizzenAI/HPSv3) | its mu, ~10 for FLUX.1-dev        |
| unifiedreward | a VLM judge on an OpenAI-compatible server (HTTP, stdlib)    | its 'Final Score', 1-5            |
| shapes        | none: the tiny world's pixel rule (lab/tiny.py)              | colour, position, shape in [0, 1] |
| shapes-strict | none: the tiny world's strict pass (lab/tiny.py)             | 1 or 0 an image: a success rate   |
| colour-area   | none: the named colour's share of the picture (lab/tiny.py)  | 4 x that share, at most 1; hackable |

Several rewards are combined by the method's advantage. G2RPO's (advantage.py) normalises each within its group
before the weighted sum, so a reward on a larger scale (PickScore ~20) does not drown one on a smaller scale (HPS
~0.3); Flow-GRPO sums the raw scores first, as its authors do (methods/flow_grpo.py).

Loading never runs remote code and never unpickles arbitrary objects (safetensors or torch.load(weights_only=True)),
except inside the `image-reward` package, whose own loader (ImageReward.load) reads its checkpoint as it chooses.
"""
import math
import os
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

class RewardError(Exception):
    """A reward cannot be built: the message says what is missing and how to get it."""


def _require(module: str, pip_name: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise RewardError(f"this reward needs the '{module}' package: pip install {pip_name}") from None


def preprocess(images, size, mean, std):
    """Resize the shorter side to `size` (bicubic, antialiased), centre-crop size x size, normalise: torch only."""
    h, w = images.shape[-2:]
    scale = size / min(h, w)
    new_h, new_w = max(size, round(h * scale)), max(size, round(w * scale))
    x = F.interpolate(images.float(), size=(new_h, new_w), mode="bicubic", antialias=True, align_corners=False)
    top, left = (new_h - size) // 2, (new_w - size) // 2
    x = x[..., top : top + size, left : left + size].clamp(0, 1)  # (N, 3, size, size)
    mean = torch.tensor(mean, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(std, device=x.device).view(1, 3, 1, 1)
    return (x - mean) / std


def _brief(err) -> str:
    """A library's error message as one line of at most 200 characters (some span several lines)."""
    return " ".join(str(err).split())[:200]


def _resolve_file(path: str, what: str, source: str) -> str:
    """A local file, or 'repo_id/filename' fetched from the hub; a clear error when neither works."""
    if os.path.isfile(path):
        return path
    parts = path.split("/")
    if len(parts) >= 3:
        try:
            from huggingface_hub import hf_hub_download

            return hf_hub_download("/".join(parts[:2]), "/".join(parts[2:]))
        except Exception as err:  # offline, gated, missing
            raise RewardError(f"{what} not found at '{path}' (not a file; hub download failed: "
                              f"{type(err).__name__}). Download it from {source} and pass its path") from None
    raise RewardError(f"{what} not found at '{path}'. Download it from {source} and pass its path")


# the path fields that name one file (a local file or hub repo/filename): what it is, and where to get it
FILES = {"hps_checkpoint": ("the HPS-v2.1 checkpoint", "the hub repo xswu/HPSv2 (file HPS_v2.1_compressed.pt)"),
         "aesthetic_head": ("the aesthetic MLP head", "github.com/christophschuhmann/improved-aesthetic-predictor"),
         "hpsv3_checkpoint": ("the HPSv3 checkpoint", "MizzenAI/HPSv3")}


def _file(paths, field: str) -> str:
    return _resolve_file(paths[field], *FILES[field])


def check_files(name: str, paths=None):
    """Find reward `name`'s files (FILES) before any model loads (fetched from the hub when a hub path is given and
    it is reachable): a RewardError when one is missing, so a run refuses at once, not after loading its models."""
    entry = REWARDS[name]
    resolved = {key: default for key, (default, _) in entry.paths.items()} | (paths or {})
    for key in entry.paths:
        if key in FILES:
            _file(resolved, key)


def _load_state_dict(path: str):
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state.get("state_dict", state) if isinstance(state, dict) else state


def over_frames(fn, every: int = 1, strict: bool = False):
    """An image reward that also scores videos (N, 3, F, H, W): the mean over every `every`-th frame (this project's
    choice, deviation 13; a video-native reward would also see motion and consistency across frames); a strict
    pass (`strict`), the least, so a video passes only when every scored frame does. Images pass through."""

    def reward(images, prompts):
        if images.ndim == 4:
            return fn(images, prompts)
        frames = images[:, :, ::every]  # (N, 3, F_k, H, W)
        N, F = frames.shape[0], frames.shape[2]
        flat = frames.transpose(1, 2).flatten(0, 1)  # (N F_k, 3, H, W)
        scores = fn(flat, [p for p in prompts for _ in range(F)]).view(N, F)
        return scores.amin(1) if strict else scores.mean(1)

    return reward


def _batched(fn, batch_size):
    """Run `fn(images, prompts)` in inference mode on micro-batches of at most `batch_size` images."""

    @torch.inference_mode()
    def reward(images, prompts):
        if images.shape[0] != len(prompts):
            raise ValueError(f"{images.shape[0]} images but {len(prompts)} prompts")
        return torch.cat([fn(images[i : i + batch_size], prompts[i : i + batch_size]).float()
                          for i in range(0, len(prompts), batch_size)])

    return reward


def _open_clip_model(name: str, device, dtype, checkpoint: str | None = None):
    open_clip = _require("open_clip", "open-clip-torch")
    if os.path.isdir(name):
        name = "local-dir:" + name
    try:
        model = open_clip.create_model(name, pretrained=None, load_weights=checkpoint is None, device="cpu")
    except (FileNotFoundError, RuntimeError, OSError) as err:
        raise RewardError(f"could not load the open_clip model '{name}': {_brief(err)}") from None
    if checkpoint is not None:
        model.load_state_dict(_load_state_dict(checkpoint))
    tokenizer = open_clip.get_tokenizer(name)
    return model.to(device, dtype).eval().requires_grad_(False), tokenizer


def _open_clip_cosine(model, tokenizer, device, dtype):
    cfg = model.visual.preprocess_cfg

    def score(images, prompts):
        pixels = preprocess(images.to(device), cfg["size"][0], cfg["mean"], cfg["std"]).to(dtype)
        image = F.normalize(model.encode_image(pixels).float(), dim=-1)  # (n, E)
        text = F.normalize(model.encode_text(tokenizer(prompts).to(device)).float(), dim=-1)  # (n, E)
        return (image * text).sum(-1)  # cos(image, text)

    return score


def hps(device, dtype, batch_size, paths):
    """HPS-v2.1: the HPS state dict replaces every weight of an open_clip ViT-H-14; the score is the cosine."""
    checkpoint = _file(paths, "hps_checkpoint")
    model, tokenizer = _open_clip_model(paths["hps_arch"], device, dtype, checkpoint)
    return _batched(_open_clip_cosine(model, tokenizer, device, dtype), batch_size)


def clip(device, dtype, batch_size, paths):
    """CLIP score: cosine of normalised image and text features of an open_clip model."""
    model, tokenizer = _open_clip_model(paths["clip_model"], device, dtype)
    return _batched(_open_clip_cosine(model, tokenizer, device, dtype), batch_size)


def _projected(output):
    """transformers >= 5 returns a model output whose pooler_output holds the projected features."""
    return getattr(output, "pooler_output", output).float()


def _transformers_clip(path, device, dtype, what):
    transformers = _require("transformers", "transformers")
    try:
        return transformers.CLIPModel.from_pretrained(path, dtype=dtype).to(device).eval().requires_grad_(False)
    except OSError as err:
        raise RewardError(f"could not load {what} from '{path}': {_brief(err)}") from None


def pickscore(device, dtype, batch_size, paths):
    """PickScore: logit_scale.exp() * cos(image, text) with PickScore_v1's CLIP (~20-23; papers often report /100)."""
    transformers = _require("transformers", "transformers")
    model = _transformers_clip(paths["pickscore_model"], device, dtype, "the PickScore model")
    try:
        processor = transformers.CLIPProcessor.from_pretrained(paths["pickscore_processor"])
    except OSError as err:
        raise RewardError(f"could not load the PickScore processor from '{paths['pickscore_processor']}': "
                          f"{_brief(err)}") from None
    ip = processor.image_processor
    tokenize = lambda prompts: processor.tokenizer(prompts, padding=True, truncation=True, max_length=77,
                                                   return_tensors="pt")
    return _batched(clip_logit_score(model, tokenize, ip.crop_size["height"], ip.image_mean, ip.image_std, device,
                                     dtype), batch_size)


def clip_logit_score(model, tokenize, size, mean, std, device, dtype):
    """PickScore's computation for a transformers CLIPModel: logit_scale.exp() * cos(image, text) of its projected
    features; `tokenize(prompts)` gives the text model's inputs (also used by plan.py on a model built from config)."""

    def score(images, prompts):
        pixels = preprocess(images.to(device), size, mean, std).to(dtype)
        image = F.normalize(_projected(model.get_image_features(pixel_values=pixels)), dim=-1)
        text = F.normalize(_projected(model.get_text_features(**tokenize(prompts).to(device))), dim=-1)
        return model.logit_scale.exp().float() * (image * text).sum(-1)

    return score


class AestheticHead(torch.nn.Module):
    """The LAION aesthetic predictor v2 MLP (keys layers.0 ... layers.7, as in its released .pth file)."""

    def __init__(self, dim=768):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(dim, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128), torch.nn.Dropout(0.2),
            torch.nn.Linear(128, 64), torch.nn.Dropout(0.1), torch.nn.Linear(64, 16), torch.nn.Linear(16, 1))

    def forward(self, x):
        return self.layers(x)


def aesthetic(device, dtype, batch_size, paths):
    """LAION aesthetic v2: MLP(normalised CLIP ViT-L/14 image features), roughly 1-10."""
    from transformers import CLIPImageProcessor

    model = _transformers_clip(paths["aesthetic_clip"], device, dtype, "the aesthetic CLIP model")
    head_path = _file(paths, "aesthetic_head")
    head = AestheticHead(model.config.projection_dim)
    head.load_state_dict(_load_state_dict(head_path))
    head = head.to(device).eval().requires_grad_(False)
    ip = CLIPImageProcessor()  # the OpenAI CLIP preprocessing (224, bicubic, centre crop)

    def score(images, prompts):
        pixels = preprocess(images.to(device), ip.crop_size["height"], ip.image_mean, ip.image_std).to(dtype)
        features = F.normalize(_projected(model.get_image_features(pixel_values=pixels)), dim=-1)
        return head(features).squeeze(-1)

    return _batched(score, batch_size)


def imagereward(device, dtype, batch_size, paths):
    """ImageReward through its own package; images go to it as in-memory PIL images."""
    reward_module = _require("ImageReward", "image-reward")
    from PIL import Image

    model = reward_module.load("ImageReward-v1.0", device=device)

    def score(images, prompts):
        arrays = (images.permute(0, 2, 3, 1).clamp(0, 1) * 255).round().byte().cpu().numpy()
        return torch.tensor([float(model.score(p, [Image.fromarray(a)])) for p, a in zip(prompts, arrays)])

    return _batched(score, batch_size)


HPSV3_INSTRUCTION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts", "hpsv3_instruction.txt")
HPSV3_PIXELS = 256 * 28 * 28  # every image is resized to this many pixels (448 x 448 for a square one)


def _qwen2vl_size(h: int, w: int, pixels: int = HPSV3_PIXELS, factor: int = 28) -> tuple[int, int]:
    """Qwen2-VL's resize rule at min = max pixels: the aspect ratio kept, each side a multiple of `factor`."""
    scale = math.sqrt(pixels / (h * w))
    return max(factor, round(h * scale / factor) * factor), max(factor, round(w * scale / factor) * factor)


def hpsv3(device, dtype, batch_size, paths):
    """HPSv3 (MizzenAI/HPSv3): a Qwen2-VL-7B-Instruct whose hidden state at an added <|Reward|> token, read by an MLP
    head (hidden -> 1024 -> 16 -> 2, ReLU), gives (mu, log sigma) of a preferred-ness score; the reward is mu (~10
    for FLUX.1-dev). Its input is one chat turn: the image, then the rubric HPSv3 was trained with
    (prompts/hpsv3_instruction.txt, its authors' wording, kept as is because the scores depend on it) around the
    caption. The checkpoint holds the whole model; its configuration and processor are Qwen2-VL's (--hpsv3-base).
    Positions are sequential, as in the model's training code (not the 3-D ones of Qwen2-VL's own forward)."""
    transformers = _require("transformers", "transformers")
    from safetensors.torch import load_file

    checkpoint = _file(paths, "hpsv3_checkpoint")
    try:
        processor = transformers.AutoProcessor.from_pretrained(paths["hpsv3_base"])
        config = transformers.Qwen2VLConfig.from_pretrained(paths["hpsv3_base"])
    except OSError as err:
        raise RewardError(f"could not load Qwen2-VL's configuration and processor from '{paths['hpsv3_base']}' "
                          f"(--hpsv3-base): {_brief(err)}") from None
    tokenizer = processor.tokenizer
    tokenizer.padding_side = "right"
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|Reward|>"]}, replace_extra_special_tokens=False)
    reward_token = tokenizer.convert_tokens_to_ids("<|Reward|>")
    state = load_file(checkpoint)
    head_state = {k.removeprefix("rm_head."): state.pop(k) for k in [k for k in state if k.startswith("rm_head.")]}
    if not head_state:
        raise RewardError(f"{checkpoint} holds no rm_head.* weights: it is not an HPSv3 checkpoint")
    embeddings = state.get("model.embed_tokens.weight", state.get("model.language_model.embed_tokens.weight"))
    if embeddings is None:
        raise RewardError(f"{checkpoint} holds no token embeddings (model.embed_tokens.weight): it is not an HPSv3 "
                          f"checkpoint")
    config.text_config.vocab_size = embeddings.shape[0]  # Qwen2-VL's vocabulary and the <|Reward|> token
    model, loaded = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
        None, config=config, state_dict=state, dtype=dtype, output_loading_info=True)  # (its 4.45 key names too)
    if loaded["missing_keys"]:
        raise RewardError(f"{checkpoint} lacks {len(loaded['missing_keys'])} weights of the Qwen2-VL of --hpsv3-base "
                          f"(e.g. {sorted(loaded['missing_keys'])[0]}): the checkpoint and the base do not match")
    model = model.to(device).eval().requires_grad_(False)
    hidden = config.text_config.hidden_size
    head = torch.nn.Sequential(torch.nn.Linear(hidden, 1024), torch.nn.ReLU(), torch.nn.Dropout(0.05),
                               torch.nn.Linear(1024, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    head.load_state_dict(head_state)
    head = head.float().to(device).eval().requires_grad_(False)  # fp32, as trained
    with open(HPSV3_INSTRUCTION, encoding="utf-8") as f:
        instruction = f.read()
    inner = model.model

    def score(images, prompts):
        size = _qwen2vl_size(*images.shape[-2:])
        pixels = F.interpolate(images.float(), size=size, mode="bicubic", antialias=True, align_corners=False)
        texts = [processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                               "text": instruction.format(text_prompt=p)}]}],
            tokenize=False, add_generation_prompt=True) for p in prompts]
        batch = processor(text=texts, images=list(pixels.clamp(0, 1).cpu()), padding=True, return_tensors="pt",
                          do_resize=False, do_rescale=False).to(device)
        ids = batch["input_ids"]
        embeds = inner.get_input_embeddings()(ids)
        features = inner.get_image_features(batch["pixel_values"].to(dtype), batch["image_grid_thw"])
        features = torch.cat(list(getattr(features, "pooler_output", features)), 0).to(embeds.dtype)
        image_slots = (ids == config.image_token_id).unsqueeze(-1).expand_as(embeds)
        embeds = embeds.masked_scatter(image_slots, features)
        hidden_states = inner.language_model(inputs_embeds=embeds, attention_mask=batch["attention_mask"])[0]
        at_token = hidden_states[ids == reward_token]  # (N, hidden): one <|Reward|> per caption
        return head(at_token.float())[:, 0]

    return _batched(score, batch_size)


def shapes(device, dtype, batch_size, paths):
    """The tiny world's rule: does the image show the colour, shape and position its prompt names (lab/tiny.py), a
    smooth score in [0, 1] that training climbs."""
    from lab.tiny import shape_reward

    return _batched(lambda images, prompts: shape_reward(images.to(device), prompts), batch_size)


def shapes_strict(device, dtype, batch_size, paths):
    """The tiny world's strict pass, GenEval-style: 1 when the image shows exactly what its prompt names, else 0
    (lab/tiny.py), so its mean is a success rate. The tiny preset holds it out (--eval-rewards): no run trains on it,
    and the reward-hacking watch reads it as it reads FLUX's held-out CLIP and PickScore."""
    from lab.tiny import shape_success

    return _batched(lambda images, prompts: shape_success(images.to(device), prompts), batch_size)


def colour_area(device, dtype, batch_size, paths):
    """The tiny world's hackable reward: the named colour's share of the picture (lab/tiny.py), for showing the
    reward-hacking watch: train on it (--rewards colour-area=1.0) and the tiny preset holds out shapes and
    shapes-strict, which it fails."""
    from lab.tiny import colour_area as area

    return _batched(lambda images, prompts: area(images.to(device), prompts), batch_size)


def unifiedreward(device, dtype, batch_size, paths):
    """UnifiedReward: a vision-language judge behind an OpenAI-compatible chat-completions server (vLLM, SGLang);
    its HTTP client is lab/judge.py. Each image goes to the server as a PNG beside the scoring question, and the score
    (1-5) is parsed from the reply; `batch_size` requests are in flight at once. A reply without a score gives NaN."""
    from lab import judge

    question = judge.QUESTION
    if paths["unifiedreward_question_file"]:
        with open(_resolve_file(paths["unifiedreward_question_file"], "the judge's question file", "your own copy"),
                  encoding="utf-8") as f:
            question = f.read()
        if "{prompt}" not in question:
            raise RewardError("the judge's question file must mark the caption with {prompt}")
    try:
        client = judge.Judge(paths["unifiedreward_url"], paths["unifiedreward_model"], question)
    except judge.JudgeError as err:
        raise RewardError(str(err)) from None
    return _batched(client, batch_size)


@dataclass(frozen=True)
class Reward:
    """A registry entry: the factory `factory(device, dtype, batch_size, paths) -> fn(images, prompts) -> (N,)`
    and the paths it reads, `{field: (default, one-line help)}`. The CLIs turn each field into a flag
    (`hps_checkpoint` -> `--hps-checkpoint`), so a path is declared here and nowhere else."""

    factory: Callable
    paths: dict[str, tuple[str, str]] = field(default_factory=dict)
    strict: bool = False  # a pass of 1 or 0 an image: a video passes only when every scored frame does


# Adding a reward: write its factory above, then add its entry here.
REWARDS: dict[str, Reward] = {
    "hps": Reward(hps, {
        "hps_checkpoint": ("xswu/HPSv2/HPS_v2.1_compressed.pt",
                           "HPS-v2.1 state dict: a local file or hub repo/filename."),
        "hps_arch": ("ViT-H-14", "open_clip architecture of HPS (or an open_clip folder)."),
    }),
    "clip": Reward(clip, {
        "clip_model": ("hf-hub:apple/DFN5B-CLIP-ViT-H-14",
                       "open_clip model of the CLIP score: an open_clip folder, hf-hub:id or architecture name."),
    }),
    "pickscore": Reward(pickscore, {
        "pickscore_model": ("yuvalkirstain/PickScore_v1", "PickScore CLIPModel folder or hub id."),
        "pickscore_processor": ("laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
                                "PickScore CLIPProcessor folder or hub id."),
    }),
    "aesthetic": Reward(aesthetic, {
        "aesthetic_clip": ("openai/clip-vit-large-patch14",
                           "CLIP ViT-L/14 of the aesthetic reward: a folder or hub id."),
        "aesthetic_head": ("sac+logos+ava1-l14-linearMSE.pth",
                           "The LAION aesthetic v2 MLP head file (improved-aesthetic-predictor)."),
    }),
    "imagereward": Reward(imagereward),
    "unifiedreward": Reward(unifiedreward, {
        "unifiedreward_url": ("http://127.0.0.1:8000/v1",
                              "OpenAI-compatible server of the UnifiedReward judge: base URL or chat-completions URL."),
        "unifiedreward_model": ("CodeGoat24/UnifiedReward-7b-v1.5",
                                "The judge's model name as the server knows it (vLLM: the served model name)."),
        "unifiedreward_question_file": ("", "A text file with the judge's question, {prompt} marking the caption; "
                                            "empty: this project's wording."),
    }),
    "hpsv3": Reward(hpsv3, {
        "hpsv3_checkpoint": ("MizzenAI/HPSv3/HPSv3.safetensors",
                             "HPSv3 weights (the whole model and its head): a local file or hub repo/filename."),
        "hpsv3_base": ("Qwen/Qwen2-VL-7B-Instruct", "Qwen2-VL folder or hub id whose configuration and processor "
                                                    "HPSv3 was trained on."),
    }),
    "shapes": Reward(shapes),
    "shapes-strict": Reward(shapes_strict, strict=True),
    "colour-area": Reward(colour_area),
}


def path_fields() -> list[tuple[str, str, str]]:
    """(field, default, help) of every reward's paths, in registry order, each field once.

    Two rewards may declare the same field only with the same default and help (they then mean the same file)."""
    seen = {}
    for name, entry in REWARDS.items():
        for key, spec in entry.paths.items():
            if key in seen and seen[key] != spec:
                raise ValueError(f"reward '{name}' redeclares path field '{key}' with another default or help")
            seen[key] = spec
    return [(key, default, help_) for key, (default, help_) in seen.items()]


def _unknown(name) -> RewardError:
    return RewardError(f"unknown reward '{name}'; known rewards: {', '.join(REWARDS)}")


def _weight(spec: str, text: str) -> float:
    try:
        weight = float(text)
    except ValueError:
        raise RewardError(f"reward weight in '{spec}' is not a number; write name=weight, e.g. hps=1.0") from None
    if not math.isfinite(weight):
        raise RewardError(f"reward weight in '{spec}' is not finite; give a finite number, e.g. hps=1.0")
    if weight == 0:
        raise RewardError(f"reward weight in '{spec}' is 0, so the reward would do nothing; drop it or give a "
                          f"non-zero weight (a negative weight minimises the reward)")
    return weight


def parse_rewards(specs, weighted=True) -> dict[str, float]:
    """['hps=1.0', 'clip=0.5'] -> {'hps': 1.0, 'clip': 0.5}; a bare name has weight 1. `weighted`: whether the
    list takes weights (--rewards), which its messages then suggest, or names alone (--eval-rewards).

    A weight may be negative (the reward is then minimised) but not 0 or non-finite; each reward appears once."""
    out = {}
    for spec in specs:
        name, sep, text = spec.partition("=")
        if name not in REWARDS:
            raise _unknown(name)
        if name in out:
            raise RewardError(f"reward '{name}' is given twice; give each reward once, e.g. "
                              f"{name + '=1.0' if weighted else name}")
        if sep and not text:
            raise RewardError(f"reward '{spec}' has no weight after '='; write name=weight, e.g. {name}=1.0")
        out[name] = _weight(spec, text) if sep else 1.0
    if not out:
        raise RewardError("no reward given; pass e.g. --rewards hps=1.0")
    return out


def load_reward(name, device="cpu", dtype=torch.float32, batch_size=32, paths=None, frames_every=1):
    """Build the reward `name`: fn(images (N, 3, H, W) in [0, 1], prompts) -> (N,) float32; videos (N, 3, F, H, W)
    score the mean over every `frames_every`-th frame (`over_frames`), a strict pass the least.

    `paths` maps path fields to values; a field it lacks takes the registry's default. Extra fields are ignored,
    so a CLI may pass every path field it has."""
    if name not in REWARDS:
        raise _unknown(name)
    entry = REWARDS[name]
    resolved = {key: default for key, (default, _) in entry.paths.items()} | (paths or {})
    return over_frames(entry.factory(torch.device(device), dtype, batch_size, resolved), frames_every, entry.strict)
