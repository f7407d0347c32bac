"""docs/methods.md's worked example, run from the page: a method file written out, registered with one line, and
trained for 2 iterations on the tiny model with a flag of its own.

Run: python -m pytest -q tests/test_methods_doc.py
"""
import importlib.util
import json
import os
import re
import sys

import torch

from conftest import ROOT, run_train
from methods import METHODS

SMALL = ["--model", "tiny", "--prompts-per-iteration", "2", "--group-size", "4", "--eval-seeds", "1",
         "--eval-prompts", "2", "--final-eval-seeds", "1", "--eval-every", "100", "--checkpoint-every", "2"]


def example_method(tmp_path, monkeypatch):
    """The page's first Python block, written to a file and imported as a module."""
    with open(os.path.join(ROOT, "docs", "methods.md"), encoding="utf-8") as f:
        code = re.search(r"```python\n(.*?)```", f.read(), re.S).group(1)
    path = tmp_path / "rank_g2rpo.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location("rank_g2rpo", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "rank_g2rpo", module)  # as an import would (its flags' help reads its source)
    spec.loader.exec_module(module)
    return module.RankG2RPO


def test_the_page_names_every_hook_of_the_interface():
    """The page's table of hooks is the interface of methods/base.py: every hook its docstring lists is a member of
    `Method`, and a row of the table."""
    import methods.base

    with open(os.path.join(ROOT, "docs", "methods.md"), encoding="utf-8") as f:
        page = f.read()
    table = page[page.index("| hook |"):page.index("The loop calls nothing else")]
    listed = re.findall(r"^    (\w+)(?:\(|\s)", methods.base.__doc__, re.M)
    hooks = [name for name in listed if hasattr(methods.base.Method, name)]
    costs = [name for name in vars(methods.base.Costs) if not name.startswith("_")]
    assert len(hooks) >= 11 and len(costs) == 5, (listed, costs)
    hooks += costs
    for name in hooks:
        assert f"`{name}" in table, name


def test_the_worked_example_trains(tiny_cache, tmp_path, monkeypatch):
    RankG2RPO = example_method(tmp_path, monkeypatch)
    # its advantage on a hand-made group: ranks 0..3 of four members -> -1, -1/3, 1/3, 1 (times the scale)
    method = RankG2RPO(sde_steps=[0], group_size=4, eta=0.7, clip_range=1e-3, adv_clip_max=5.0, max_grad_norm=1.0,
                       max_batch=8, inner_epochs=1, kl_beta=0.0, rank_scale=2.0)
    scores = torch.tensor([0.3, 0.9, 0.1, 0.5]).view(1, 1, 1, 4, 1)  # (B, J, K, G, R)
    torch.testing.assert_close(method.advantages(scores, torch.ones(1)), torch.tensor([[[-2 / 3, 2.0, -2.0, 2 / 3]]]))
    monkeypatch.setitem(METHODS, "rank-g2rpo", RankG2RPO)  # the registry line
    out = str(tmp_path / "run")
    run_train([*SMALL, "--tiny-cache", tiny_cache, "--method", "rank-g2rpo", "--rank-scale", "2", "--output-dir", out,
               "--num-iterations", "2"])
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert all(r["perf/optimizer_steps"] == 4 for r in rows[1:])  # G2RPO's update: one step per trained step
    config = json.load(open(os.path.join(out, "config.json")))
    assert config["method"] == "rank-g2rpo" and config["rank_scale"] == 2.0


def test_no_code_outside_methods_names_a_method():
    """A method owns itself: outside methods/ (and g2rpo.py, whose class is G2RPO) no code names a registered method
    or reads a method's own flag; the scripts ask the interface instead. Docstrings and comments may name them. The
    bench and the GPU check, which compare and time named methods, are outside the rule."""
    import ast
    import dataclasses

    from lab import flags
    from sampler import Rollout

    own = {name for method in METHODS for name in flags.own_flags(method)}
    own -= {f.name for f in dataclasses.fields(Rollout)}  # (a rollout's granularities are its own)
    files = ["train.py", "evaluate.py", "sampler.py", "advantage.py", "rewards.py", "tools/plan.py",
             *(os.path.join("lab", f) for f in sorted(os.listdir(os.path.join(ROOT, "lab"))) if f.endswith(".py"))]
    found = []
    for path in files:
        tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
        docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
        project = {id(node.value) for node in ast.walk(tree)  # wandb's project is named as the project is
                   if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "tracker_project"}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in METHODS and id(node) not in docstrings | project:
                found.append(f"{path}:{node.lineno} names {node.value!r}")
            if isinstance(node, ast.Attribute) and node.attr in own:
                found.append(f"{path}:{node.lineno} reads .{node.attr}")
    assert not found, found


def test_the_reading_list_fits_in_700_lines_of_files_that_hold_them():
    """docs/reading.md: every range lies inside its file, the first line of each named function or section among
    its lines, and the whole list is at most 700 lines."""
    with open(os.path.join(ROOT, "docs", "reading.md"), encoding="utf-8") as f:
        rows = re.findall(r"\[`([^`]+)` (\d+)-(\d+)\]\([^)]*\): ([^|]+)\| (\d+) \|", f.read())
    assert rows
    for path, first, last, what, count in rows:
        lines = open(os.path.join(ROOT, path), encoding="utf-8").read().split("\n")
        first, last = int(first), int(last)
        assert 1 <= first <= last <= len(lines) and last - first + 1 == int(count), (path, first, last)
        for name in re.findall(r"`(\w+)`", what):
            assert any(name in line for line in lines[first - 1 : last]), (path, name, first, last)
    assert sum(int(row[4]) for row in rows) <= 700
