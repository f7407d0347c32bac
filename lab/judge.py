"""The UnifiedReward judge's client: a vision-language model behind an OpenAI-compatible server, over HTTP.

rewards.py's `unifiedreward` builds a `Judge`, and imports this file only then; this file imports nothing of the
project. Each image goes to the server as a lossless PNG data URL beside the question, one chat-completions request
per image, `len(prompts)` requests in flight at once; the score is the number after the last "Final Score:" of the
reply. Only the standard library speaks HTTP here. Connection errors and 5xx answers are retried with a growing
pause; anything else is a `JudgeError` that names the server (rewards.py turns one at load time into its
`RewardError`). A server that does not answer fails the load, not the first reward after hours of sampling.
"""
import base64
import io
import json
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch
from PIL import Image


class JudgeError(Exception):
    """The judge cannot be reached or sent no score: the message names the server and what to do."""


# The question, in this project's words: the caption, then the two criteria UnifiedReward is trained to weigh
# (faithfulness to the caption, visual quality) and the "Final Score:" line its replies end with. Its authors publish
# their own wording: pass it with --unifiedreward-question-file to follow their protocol exactly.
QUESTION = (
    "<image>\nThis image was generated from the text caption below. Judge it on two things. First, faithfulness: "
    "does it show what the caption describes, with the right objects, attributes and relations between them? "
    "Second, quality: is it sharp and detailed, with accurate colours and an appealing overall look? Weigh both "
    "and give a score from 1 to 5 after 'Final Score:'.\nText Caption: [{prompt}]")


def chat_completions_url(url: str) -> str:
    """An OpenAI-compatible server's base URL (http://host:8000/v1) or its full chat-completions endpoint."""
    url = url.rstrip("/")
    return url if url.endswith("/chat/completions") else url + "/chat/completions"


def png_data_url(image) -> str:
    """(3, H, W) in [0, 1] -> 'data:image/png;base64,...' (lossless, so the judge sees the sampled pixels)."""
    array = (image.permute(1, 2, 0).clamp(0, 1) * 255).round().byte().cpu().numpy()  # (H, W, 3)
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def parse_judge_score(reply: str) -> float:
    """The number after the last 'Final Score:' in a judge's reply; NaN when there is none (logged, never 0)."""
    found = re.findall(r"Final Score:\s*\**\s*([-+]?\d+(?:\.\d+)?)", reply, flags=re.IGNORECASE)
    return float(found[-1]) if found else float("nan")


def _post_json(url: str, body: dict, timeout: float, attempts: int = 3) -> dict:
    """POST JSON, read JSON; connection errors and 5xx are retried with a growing pause, anything else raises."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            if err.code < 500 or attempt == attempts - 1:
                raise JudgeError(f"the judge at {url} answered HTTP {err.code}: {err.read()[:200]!r}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
            if attempt == attempts - 1:
                raise JudgeError(f"no judge answering at {url} ({getattr(err, 'reason', err)}); start an "
                                  f"OpenAI-compatible server (e.g. vLLM) or pass its URL") from None
        time.sleep(2**attempt)


def _check_server(url: str):
    """Fail at load time, not after hours of sampling, when nothing listens at `url` (any HTTP answer will do)."""
    try:
        urllib.request.urlopen(url.removesuffix("/chat/completions") + "/models", timeout=10).close()
    except urllib.error.HTTPError:
        pass  # a server answered
    except (urllib.error.URLError, TimeoutError, ConnectionError, ValueError) as err:
        raise JudgeError(f"no judge answering at {url} ({getattr(err, 'reason', err)}); start an OpenAI-compatible "
                          f"server for it (e.g. vLLM) or pass its URL") from None


class Judge:
    """fn(images (N, 3, H, W) in [0, 1], prompts) -> scores (N,): one request per image to the server at `url`."""

    def __init__(self, url: str, model: str, question: str):
        self.url, self.model, self.question = chat_completions_url(url), model, question
        _check_server(self.url)

    def ask(self, image, prompt) -> float:
        content = [{"type": "image_url", "image_url": {"url": png_data_url(image)}},
                   {"type": "text", "text": self.question.replace("{prompt}", prompt)}]
        reply = _post_json(self.url, {"model": self.model, "temperature": 0.0, "max_tokens": 1024,
                                      "messages": [{"role": "user", "content": content}]}, timeout=300)
        try:
            return parse_judge_score(reply["choices"][0]["message"]["content"] or "")
        except (KeyError, IndexError, TypeError):
            raise JudgeError(f"the judge at {self.url} sent no chat completion: {str(reply)[:200]}") from None

    def __call__(self, images, prompts):
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            return torch.tensor(list(pool.map(self.ask, images.float().cpu(), prompts)))
