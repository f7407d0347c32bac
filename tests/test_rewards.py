"""Reward models loaded for real from tiny random checkpoints saved in each model's own format: open_clip folders
and HPS state dicts, transformers CLIP models and processors, the aesthetic MLP head file; and their errors.

Run: python -m pytest -q tests/test_rewards.py
"""
import importlib.util
import json
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from lab import judge
import rewards
from rewards import RewardError, load_reward, parse_rewards, preprocess

PROMPTS = ["a red circle on the left", "a blue bar on the top", "a green pillar on the right"]


def smooth_images(n=3, h=64, w=48, seed=0):
    """Low-frequency random images, like decoded samples (interpolation differences stay small)."""
    g = torch.Generator().manual_seed(seed)
    return F.interpolate(torch.rand(n, 3, 8, 6, generator=g), size=(h, w), mode="bilinear", align_corners=False)


def to_pil(images):
    return [Image.fromarray((im.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)) for im in images]


OPEN_CLIP_CFG = {"embed_dim": 32,
                 "vision_cfg": {"image_size": 224, "layers": 1, "width": 32, "head_width": 16, "patch_size": 32},
                 "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}


@pytest.fixture(scope="module")
def open_clip_folder(tmp_path_factory):
    """An open_clip model folder in the hub layout (open_clip_config.json + open_clip_model.safetensors)."""
    import open_clip
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("open_clip")
    cfg = {"model_cfg": OPEN_CLIP_CFG, "preprocess_cfg": {"mean": [0.48145466, 0.4578275, 0.40821073],
                                                          "std": [0.26862954, 0.26130258, 0.27577711]}}
    (folder / "open_clip_config.json").write_text(json.dumps(cfg))
    torch.manual_seed(0)
    model = open_clip.create_model("local-dir:" + str(folder), load_weights=False)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "open_clip_model.safetensors"))
    return str(folder)


def open_clip_reference(model_name, state_dict, images, prompts):
    """The cosine computed the library's way: open_clip's own PIL preprocessing, tokenizer and encoders."""
    import open_clip

    model, _, transform = open_clip.create_model_and_transforms(model_name, load_weights=state_dict is None)
    if state_dict is not None:
        model.load_state_dict(state_dict)
    model.eval()
    with torch.no_grad():
        pixels = torch.stack([transform(im) for im in to_pil(images)])
        img = F.normalize(model.encode_image(pixels), dim=-1)
        txt = F.normalize(model.encode_text(open_clip.get_tokenizer(model_name)(prompts)), dim=-1)
    return (img * txt).sum(-1), pixels


def check_reward(fn, images, prompts):
    a, b = fn(images, prompts), fn(images, prompts)
    assert a.shape == (len(prompts),) and a.dtype == torch.float32
    assert torch.equal(a, b)  # deterministic
    return a


def test_hps_loads_state_dict_and_scores_cosine(open_clip_folder, tmp_path):
    import open_clip

    torch.manual_seed(1)
    hps_model = open_clip.create_model("local-dir:" + open_clip_folder, load_weights=False)
    checkpoint = str(tmp_path / "HPS_v2.1_compressed.pt")
    torch.save({"state_dict": hps_model.state_dict()}, checkpoint)  # the released file's layout
    fn = load_reward("hps", paths={"hps_arch": open_clip_folder, "hps_checkpoint": checkpoint})
    images = smooth_images()
    scores = check_reward(fn, images, PROMPTS)
    assert scores.abs().max() <= 1.0
    expected, lib_pixels = open_clip_reference("local-dir:" + open_clip_folder, hps_model.state_dict(), images, PROMPTS)
    torch.testing.assert_close(scores, expected, atol=2e-3, rtol=0)
    # the torch preprocessing matches open_clip's PIL pipeline
    ours = preprocess(images, 224, (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))
    assert (ours - lib_pixels).abs().mean() < 0.02


def test_clip_score(open_clip_folder):
    fn = load_reward("clip", paths={"clip_model": open_clip_folder})
    images = smooth_images(seed=3)
    scores = check_reward(fn, images, PROMPTS)
    expected, _ = open_clip_reference("local-dir:" + open_clip_folder, None, images, PROMPTS)
    torch.testing.assert_close(scores, expected, atol=2e-3, rtol=0)


@pytest.fixture(scope="module")
def hf_clip_folders(tmp_path_factory):
    """A transformers CLIPModel and a CLIPProcessor saved with save_pretrained."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from lab import tiny

    torch.manual_seed(0)
    tokenizer, _ = tiny.build_tokenizers()
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=77, bos_token_id=0, eos_token_id=1,
                         pad_token_id=1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=224, patch_size=32), projection_dim=24)
    model_dir, proc_dir = tmp_path_factory.mktemp("clip_model"), tmp_path_factory.mktemp("clip_processor")
    CLIPModel(config).save_pretrained(model_dir)
    CLIPProcessor(image_processor=CLIPImageProcessor(), tokenizer=tokenizer).save_pretrained(proc_dir)
    return str(model_dir), str(proc_dir)


def test_pickscore_equals_clip_logits(hf_clip_folders):
    from transformers import CLIPModel, CLIPProcessor

    model_dir, proc_dir = hf_clip_folders
    fn = load_reward("pickscore", paths={"pickscore_model": model_dir, "pickscore_processor": proc_dir})
    images = smooth_images(seed=5)
    scores = check_reward(fn, images, PROMPTS)
    model, processor = CLIPModel.from_pretrained(model_dir).eval(), CLIPProcessor.from_pretrained(proc_dir)
    inputs = processor(images=to_pil(images), text=PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**inputs).logits_per_image  # logit_scale.exp() * cos, every image against every text
    torch.testing.assert_close(scores, logits.diagonal(), atol=0.05, rtol=0)
    ours = preprocess(images, 224, processor.image_processor.image_mean, processor.image_processor.image_std)
    assert (ours - inputs["pixel_values"]).abs().mean() < 0.02


def test_aesthetic_head(hf_clip_folders, tmp_path):
    from transformers import CLIPImageProcessor, CLIPModel

    model_dir, _ = hf_clip_folders
    torch.manual_seed(2)
    head = rewards.AestheticHead(24)
    head_path = str(tmp_path / "sac+logos+ava1-l14-linearMSE.pth")
    torch.save(head.state_dict(), head_path)
    fn = load_reward("aesthetic", paths={"aesthetic_clip": model_dir, "aesthetic_head": head_path})
    images = smooth_images(seed=7)
    scores = check_reward(fn, images, PROMPTS)
    model = CLIPModel.from_pretrained(model_dir).eval()
    pixels = CLIPImageProcessor()(images=to_pil(images), return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        features = model.get_image_features(pixel_values=pixels).pooler_output
        expected = head.eval()(F.normalize(features, dim=-1)).squeeze(-1)
    torch.testing.assert_close(scores, expected, atol=2e-3, rtol=0)


QWEN2VL_CHAT = (  # Qwen2-VL's chat template, the parts an image-then-text user turn uses
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a "
    "helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n{% for content in message['content'] "
    "%}{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'text' "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def hpsv3_files(tmp_path_factory):
    """A tiny random Qwen2-VL (a byte-level tokenizer with Qwen's special tokens, its processor and config) saved as
    --hpsv3-base, and an HPSv3 checkpoint of it with a random head, under the names HPSv3's file uses."""
    import transformers
    from safetensors.torch import save_file
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    folder = tmp_path_factory.mktemp("hpsv3")
    torch.manual_seed(0)
    vocab = {s: i for i, s in enumerate(bytes_to_unicode().values())}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
                "<|image_pad|>", "<|video_pad|>"]
    vocab.update({token: len(vocab) + i for i, token in enumerate(specials)})
    tokenizer = transformers.Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, eos_token="<|im_end|>",
                                            pad_token="<|endoftext|>", additional_special_tokens=specials[1:])
    processor = transformers.Qwen2VLProcessor(image_processor=transformers.Qwen2VLImageProcessor(), tokenizer=tokenizer,
                                              video_processor=transformers.Qwen2VLVideoProcessor(),
                                              chat_template=QWEN2VL_CHAT)
    token = tokenizer.convert_tokens_to_ids
    config = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer) + 1, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]},
                         pad_token_id=token("<|endoftext|>"), eos_token_id=token("<|im_end|>"), bos_token_id=None),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=token("<|image_pad|>"), video_token_id=token("<|video_pad|>"),
        vision_start_token_id=token("<|vision_start|>"), vision_end_token_id=token("<|vision_end|>"),
        tie_word_embeddings=False)  # the vocabulary has one row more: <|Reward|>
    base = str(folder / "qwen2vl")
    processor.save_pretrained(base)
    config.save_pretrained(base)
    model = transformers.Qwen2VLForConditionalGeneration(config).eval()
    head = torch.nn.Sequential(torch.nn.Linear(32, 1024), torch.nn.ReLU(), torch.nn.Dropout(0.05),
                               torch.nn.Linear(1024, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).eval()
    state = {("visual." + k.removeprefix("model.visual.") if k.startswith("model.visual.") else
              "model." + k.removeprefix("model.language_model.") if k.startswith("model.language_model.") else k):
             v.contiguous() for k, v in model.state_dict().items()}
    state.update({f"rm_head.{k}": v for k, v in head.state_dict().items()})
    save_file(state, str(folder / "HPSv3.safetensors"))
    return {"hpsv3_checkpoint": str(folder / "HPSv3.safetensors"), "hpsv3_base": base}, model, head, processor


def test_hpsv3_is_its_head_at_the_reward_token(hpsv3_files):
    """HPSv3 restated: one chat turn (the image, the rubric around the caption, <|Reward|>), the image resized to
    256 x 28 x 28 pixels in multiples of 28, the vision tower's tokens in the image's slots, the language model with
    sequential positions, the head's first output at the <|Reward|> token."""
    paths, model, head, processor = hpsv3_files
    fn = load_reward("hpsv3", paths=paths, batch_size=2)
    images = smooth_images()  # 64 x 48: 504 x 392 after the resize (18 x 14 patches of 28)
    got = fn(images, PROMPTS)
    tokenizer = processor.tokenizer
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|Reward|>"]}, replace_extra_special_tokens=False)
    instruction = open(rewards.HPSV3_INSTRUCTION, encoding="utf-8").read()
    assert instruction.rstrip().endswith("<|Reward|>\n\nEND") and "{text_prompt}" in instruction
    expected = []
    for image, prompt in zip(images, PROMPTS):
        text = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
                "<|image_pad|><|vision_end|>" + instruction.format(text_prompt=prompt) + "<|im_end|>\n"
                "<|im_start|>assistant\n")
        pixels = F.interpolate(image[None], size=(504, 392), mode="bicubic", antialias=True, align_corners=False)
        batch = processor(text=[text], images=[pixels[0].clamp(0, 1)], return_tensors="pt", do_resize=False,
                          do_rescale=False)
        assert batch["image_grid_thw"].tolist() == [[1, 36, 28]]
        with torch.no_grad():
            embeds = model.model.get_input_embeddings()(batch["input_ids"])
            image_tokens = torch.cat(list(model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"])
                                          .pooler_output))
            slots = batch["input_ids"][0] == model.config.image_token_id
            embeds[0, slots] = image_tokens
            positions = torch.arange(embeds.shape[1])[None]
            hidden = model.model.language_model(inputs_embeds=embeds, position_ids=positions).last_hidden_state
            at = batch["input_ids"][0] == tokenizer.convert_tokens_to_ids("<|Reward|>")
            expected.append(float(head(hidden[0, at])[0, 0]))
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-4, rtol=1e-4)
    assert float(got.std()) > 0
    parse_rewards(["hpsv3=1.0"])  # a name of the registry, so --rewards hpsv3=1.0 reaches it


def test_shapes_reward_prefers_the_named_attributes():
    from lab import tiny

    gen = torch.Generator().manual_seed(0)
    prompts = tiny.all_prompts()
    right = tiny.render(prompts, gen)
    fn = load_reward("shapes")
    good = check_reward(fn, right, prompts)
    assert ((good >= 0) & (good <= 1)).all() and good.mean() > 0.85
    # each term answers to its own attribute: (colour, position, shape) scores against the drawn captions' and
    # against captions that change only the colour, only the half or only the shape
    change = {"red": "green", "green": "blue", "blue": "yellow", "yellow": "red", "left": "right", "right": "left",
              "top": "bottom", "bottom": "top", "circle": "bar", "bar": "pillar", "pillar": "circle"}
    scores = tiny.shape_scores(right, prompts)
    for column, words in enumerate([tiny.COLOURS, tiny.POSITIONS, tiny.SHAPES]):
        changed = [" ".join(change[w] if w in words else w for w in p.split()) for p in prompts]
        other = tiny.shape_scores(right, changed)
        assert (other[:, column] < scores[:, column] - 0.3).all(), (column, other[:, column], scores[:, column])
        others = [c for c in range(3) if c != column]
        assert torch.allclose(other[:, others], scores[:, others])
    # the shape term in closed form on solid rectangles: exp(-(ln(height / width / named) / 0.4)^2)
    for h, w, shape in [(6, 15, "bar"), (12, 5, "pillar"), (9, 9, "circle"), (9, 9, "bar")]:
        image = torch.full((1, 3, 32, 32), 0.1)
        image[0, :, 2:2 + h, 3:3 + w] = torch.tensor(tiny.COLOURS["blue"])[:, None, None]
        expected = math.exp(-((math.log(h / w / tiny.SHAPES[shape]) / 0.4) ** 2))
        score = tiny.shape_scores(image, [f"a blue {shape} on the left"])[0, 2].item()
        assert score == pytest.approx(expected, abs=1e-5), (h, w, shape)
    assert fn(torch.zeros(2, 3, 32, 32), prompts[:2]).eq(0).all()  # no foreground, no reward


def test_shapes_strict_is_a_strict_pass_on_hand_made_images():
    from lab import tiny

    prompts = tiny.all_prompts()  # 48: colour-major, then shape, then position
    images = tiny.render(prompts, torch.Generator().manual_seed(0))
    success = load_reward("shapes-strict")
    assert success(images, prompts).eq(1).all()  # every drawn caption passes
    swap = lambda i, a, b: prompts[i].replace(a, b)
    # each failure mode fails the pass: the wrong shape, half or colour, no object, two objects
    assert success(images[:4], [swap(i, "circle", "bar") for i in range(4)]).eq(0).all()
    # the nearest shape on a log scale: 5 high x 3 wide (1.67) is a pillar (a circle on a linear scale), 3 x 5 a bar
    for (h, w), shape in [((5, 3), "pillar"), ((3, 5), "bar")]:
        box = torch.full((1, 3, 32, 32), 0.1)
        box[0, :, 14:14 + h, 4:4 + w] = torch.tensor(tiny.COLOURS["red"])[:, None, None]
        passes = [success(box, [f"a red {s} on the left"]).item() for s in tiny.SHAPES]
        assert passes == [float(s == shape) for s in tiny.SHAPES], (h, w, passes)
    opposite = {"left": "right", "right": "left", "top": "bottom", "bottom": "top"}
    assert success(images[:4], [swap(i, p, opposite[p]) for i, p in enumerate(opposite)]).eq(0).all()
    assert success(images[:4], [swap(i, "red", "blue") for i in range(4)]).eq(0).all()
    assert success(torch.full((1, 3, 32, 32), 0.1), prompts[:1]).eq(0).all()
    both = torch.maximum(images[0], images[1])  # a red circle on the left and one on the right
    assert success(both[None], prompts[:1]).eq(0).all()
    speck = images[0].clone()
    speck[:, 30:32, 30:32] = torch.tensor(tiny.COLOURS["red"])[:, None, None]  # 4 pixels: a speck, not an object
    assert success(speck[None], prompts[:1]).eq(1).all()
    broken = images[:2].clone()
    broken[0, 0, 0, 0] = float("nan")
    assert success(broken, prompts[:2]).isnan().tolist() == [True, False]  # no verdict, as the reward gives none
    video = torch.stack([images[:2], torch.full_like(images[:2], 0.1)], 2)  # (2, 3, F 2, H, W): a blank 2nd frame
    assert success(video, prompts[:2]).eq(0).all()  # every frame must pass
    assert load_reward("shapes")(video, prompts[:2]).gt(0).all()  # where the smooth reward takes their mean


def test_reward_errors(tmp_path):
    with pytest.raises(RewardError, match="unknown reward 'hsp'; known rewards: hps, clip"):
        load_reward("hsp")
    with pytest.raises(RewardError, match="unknown reward"):
        parse_rewards(["hps=1", "nope=2"])
    with pytest.raises(RewardError, match="not a number"):
        parse_rewards(["hps=heavy"])
    assert parse_rewards(["hps=1.0", "clip"]) == {"hps": 1.0, "clip": 1.0}
    assert parse_rewards(["shapes=-0.5"]) == {"shapes": -0.5}  # a negative weight minimises the reward
    for specs, message in [(["hps=nan"], "not finite"), (["hps=inf"], "not finite"), (["hps=0"], "is 0"),
                           (["shapes=1", "shapes=2"], "given twice"), ([], "no reward given"), (["hps="], "no weight")]:
        with pytest.raises(RewardError, match=message):
            parse_rewards(specs)
    missing = str(tmp_path / "missing.pt")
    with pytest.raises(RewardError, match=f"HPS-v2.1 checkpoint not found at '{missing}'.*xswu/HPSv2"):
        load_reward("hps", paths={"hps_checkpoint": missing})
    with pytest.raises(RewardError, match="hub download failed"):  # offline: the hub id cannot be fetched
        load_reward("hps")
    if importlib.util.find_spec("ImageReward") is None:  # not installed here: the message says how
        with pytest.raises(RewardError, match="pip install image-reward"):
            load_reward("imagereward")


def test_no_unsafe_loading_in_sources():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in os.listdir(root):
        if name.endswith(".py"):
            text = open(os.path.join(root, name)).read()
            assert "trust_remote_code=True" not in text, name
            assert "weights_only=False" not in text, name
            for line in text.splitlines():
                if "torch.load(" in line and "def " not in line:
                    assert "weights_only=True" in line, (name, line)


def test_registry_declares_each_path_once(monkeypatch):
    """Every factory's paths come from its registry entry; path_fields lists each field once, in registry order."""
    fields = rewards.path_fields()
    names = [name for name, _, _ in fields]
    assert len(names) == len(set(names))
    assert names[:3] == ["hps_checkpoint", "hps_arch", "clip_model"]
    assert all(isinstance(default, str) and help_ for _, default, help_ in fields)  # "" = optional file
    assert set(names) == {key for entry in rewards.REWARDS.values() for key in entry.paths}
    seen = {}

    def spy(device, dtype, batch_size, paths):
        seen.update(paths)
        return lambda images, prompts: torch.zeros(len(prompts))

    clip_paths = rewards.REWARDS["clip"].paths
    monkeypatch.setitem(rewards.REWARDS, "clip", rewards.Reward(spy, clip_paths))
    load_reward("clip", paths={"hps_arch": "not-read-by-clip"})  # a missing field takes its default
    assert seen["clip_model"] == clip_paths["clip_model"][0]


class JudgeServer:
    """A stand-in for an OpenAI-compatible VLM server: it checks each request as vLLM would receive it and replies
    with a score it can recompute (the image's mean brightness mapped to 1-5), or no score for an empty caption."""

    def __init__(self, fail_first=0):
        import http.server
        import threading

        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._send(200, {"object": "list", "data": [{"id": "judge"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append((self.path, body))
                if len(server.requests) <= fail_first:
                    return self._send(503, {"error": "busy"})
                self._send(200, {"choices": [{"message": {"role": "assistant", "content": server.reply(body)}}]})

            def _send(self, code, payload):
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.requests = []
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/v1"

    @staticmethod
    def reply(body):
        import base64
        import io

        image_part, text_part = body["messages"][0]["content"]
        header, data = image_part["image_url"]["url"].split(",", 1)
        assert header == "data:image/png;base64"
        pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB"), dtype=np.float64)
        caption = text_part["text"].rsplit("Text Caption: [", 1)[1].rstrip("]")
        if not caption:
            return "I cannot judge this."
        return f"The image shows {caption}.\nFinal Score: {1 + 4 * pixels.mean() / 255:.4f}"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_unifiedreward_client_against_a_local_server(monkeypatch):
    monkeypatch.setattr("time.sleep", lambda seconds: None)  # retries without waiting
    server = JudgeServer(fail_first=1)  # the first request gets a 503 and is retried
    try:
        fn = load_reward("unifiedreward", batch_size=2,
                         paths={"unifiedreward_url": server.url, "unifiedreward_model": "judge"})
        images = smooth_images(n=3, h=32, w=32)
        scores = fn(images, ["a red circle", "", "a blue square"])
        expected = 1 + 4 * (images * 255).round() / 255
        assert scores.shape == (3,) and scores[1].isnan()  # no "Final Score:" in the reply: NaN, never 0
        torch.testing.assert_close(scores[[0, 2]], expected.mean(dim=(1, 2, 3))[[0, 2]], atol=1e-4, rtol=0)
        path, body = server.requests[-1]
        assert path == "/v1/chat/completions" and body["model"] == "judge" and body["temperature"] == 0
        assert len(server.requests) == 4
    finally:
        server.close()
    with pytest.raises(RewardError, match="no judge answering at http://127.0.0.1:9/v1/chat/completions"):
        load_reward("unifiedreward", paths={"unifiedreward_url": "http://127.0.0.1:9/v1"})
    assert judge.parse_judge_score("**Final Score:** 4.5\nFinal Score: 3") == 3.0


def test_unifiedreward_question_from_a_file(tmp_path):
    question = tmp_path / "question.txt"
    question.write_text("<image>\nScore this picture of {prompt}.\nText Caption: [{prompt}]")
    server = JudgeServer(fail_first=0)
    try:
        fn = load_reward("unifiedreward", paths={"unifiedreward_url": server.url,
                                                 "unifiedreward_question_file": str(question)})
        fn(smooth_images(n=1, h=32, w=32), ["a red circle"])
        _, body = server.requests[-1]
        assert body["messages"][0]["content"][1]["text"].startswith("<image>\nScore this picture of a red circle.")
    finally:
        server.close()
    question.write_text("no caption marker")
    with pytest.raises(RewardError, match=r"\{prompt\}"):
        load_reward("unifiedreward", paths={"unifiedreward_url": "http://127.0.0.1:9/v1",
                                             "unifiedreward_question_file": str(question)})
