"""Write the HPDv2 prompt files: prompts/hpdv2_train.txt and prompts/hpdv2_test.txt (one prompt a line).

HPDv2 (Human Preference Dataset v2, hub dataset `ymhao/HPDv2`, Apache-2.0) ships two annotation files, each a JSON
list of records with a `prompt` field (train.json: `prompt`, `file_path`, `human_preference`, `user_hash`;
test.json: `prompt`, `image_path`, `rank`, `raw_annotations`). Training uses the train prompts, evaluation the
400 test prompts. Each prompt is written once, in the order of first appearance, with any run of whitespace
(newlines included) collapsed to one space, so one line is always one prompt.

Run:
    python -m tools.hpdv2                                # download train.json and test.json from the hub
    python -m tools.hpdv2 --annotations-dir HPDv2/       # or read local copies of them
"""
import json
import os
import sys
from dataclasses import dataclass

HUB_REPO = "ymhao/HPDv2"
SPLITS = {"train": "train.json", "test": "test.json"}  # split -> annotation file name in the dataset
@dataclass
class Args:
    annotations_dir: str = ""
    """A folder holding train.json and test.json; empty: download them from the hub dataset ymhao/HPDv2."""
    out_dir: str = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "prompts")
    """Where hpdv2_train.txt and hpdv2_test.txt are written (default: the repository's prompts/)."""


class PromptFileError(Exception):
    """An annotation file is missing or not in the HPDv2 format; the message says which and how to fix it."""


def unique_prompts(records, source: str) -> list[str]:
    """The `prompt` of every record, whitespace collapsed, empty ones dropped, each once in first-seen order. A control
    character (a NUL, an escape: a few HPDv2 prompts hold them) becomes a space, since train.py refuses them."""
    if not isinstance(records, list):
        raise PromptFileError(f"{source} is not a JSON list of records; is it an HPDv2 annotation file?")
    seen = {}
    for i, record in enumerate(records):
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise PromptFileError(f"record {i} of {source} has no 'prompt' string; is it an HPDv2 annotation file?")
        text = "".join(" " if ord(c) < 32 or ord(c) == 127 else c for c in record["prompt"])
        prompt = " ".join(text.split())
        if prompt:
            seen.setdefault(prompt, None)
    return list(seen)


def annotation_file(name: str, annotations_dir: str) -> str:
    """A local annotation file, or the hub dataset's copy (cached by huggingface_hub)."""
    if annotations_dir:
        path = os.path.join(annotations_dir, name)
        if not os.path.isfile(path):
            raise PromptFileError(f"'{path}' not found; --annotations-dir must hold {' and '.join(SPLITS.values())}")
        return path
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(HUB_REPO, name, repo_type="dataset")
    except Exception as err:  # offline, blocked, moved
        raise PromptFileError(f"could not download {name} from the hub dataset {HUB_REPO} ({type(err).__name__}); "
                              f"download it by hand and pass its folder as --annotations-dir") from None


def read_prompts(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as f:
            return unique_prompts(json.load(f), path)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise PromptFileError(f"{path} is not valid JSON ({type(err).__name__}: {err})") from None


def write_lines(path: str, lines: list[str]):
    """Write atomically: a crash leaves the old file or the new one, never half of one."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))
    os.replace(tmp, path)


def main(args: Args) -> dict[str, str]:
    """Read both splits, then write both files; returns {split: written path}."""
    prompts = {split: read_prompts(annotation_file(name, args.annotations_dir)) for split, name in SPLITS.items()}
    empty = [split for split, lines in prompts.items() if not lines]
    if empty:  # checked for both splits before either file is written: both files change, or neither
        raise PromptFileError(f"the {' and '.join(empty)} annotations hold no prompt; nothing was written")
    os.makedirs(args.out_dir, exist_ok=True)
    written = {}
    for split, lines in prompts.items():
        written[split] = os.path.join(args.out_dir, f"hpdv2_{split}.txt")
        write_lines(written[split], lines)
        print(f"wrote {written[split]} ({len(lines):,} prompts)")
    return written


if __name__ == "__main__":
    import tyro

    try:
        main(tyro.cli(Args, description=__doc__.split("\n\n")[0]))
    except (PromptFileError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2)
