"""evaluate.py and tools/hpdv2.py: the base-vs-checkpoint table on a random tiny FLUX pipeline, with LoRA and
full checkpoints saved in train.py's layout; a run folder resolving to its newest checkpoint; settings read from
the run's config.json; 1 process = 2 torchrun ranks; the UnifiedReward metric against a local server; the HPDv2
prompt script on annotation files in the real format; the training-curve plot; one `error:` line per bad input.

Run: python -m pytest -q tests/test_evaluate.py
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from test_rewards import JudgeServer, hf_clip_folders, open_clip_folder  # noqa: F401 (fixtures)

import evaluate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = os.path.join(ROOT, "prompts", "tiny_eval.txt")
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]


def lora_transformer(flux_path, seed):
    """The pipeline's transformer with a rank-4, alpha-8 LoRA whose B is non-zero (so it changes the output)."""
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    transformer = FluxTransformer2DModel.from_pretrained(os.path.join(flux_path, "transformer"))
    torch.manual_seed(seed)  # LoRA A's gaussian initialisation
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=LORA_TARGETS))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return transformer.eval()


def save_lora_checkpoint(folder, transformer):
    """train.py's LoRA layout: <iter>/lora/pytorch_lora_weights.safetensors, plus extras evaluate.py ignores (a
    method's state; an EMA it would score, ema.safetensors, is a test of its own)."""
    from diffusers import FluxPipeline
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    weights = get_peft_model_state_dict(transformer)
    FluxPipeline.save_lora_weights(os.path.join(folder, "lora"), transformer_lora_layers=weights)
    save_file({"w": torch.zeros(1)}, os.path.join(folder, "state.safetensors"))
    write_trainer_state(folder)


def write_trainer_state(folder, iteration=1):
    """The rest of a checkpoint as train.py writes it (evaluate.py verifies what it loads)."""
    torch.save({"iteration": iteration, "optimizer": {}, "config": {}}, os.path.join(folder, "trainer.pt"))
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump({"files": {}}, f)


@pytest.fixture(scope="module")
def runs(flux_path, tmp_path_factory):
    """A LoRA run folder (iter 1 and 2 complete, a newer .tmp and a .damaged one to skip) and a full fine-tune
    checkpoint holding the base transformer (so its scores must equal the base's)."""
    from diffusers import FluxTransformer2DModel

    root = tmp_path_factory.mktemp("runs")
    lora_run = root / "lora_run"
    config = {"model": "flux", "model_path": flux_path, "num_steps": 3, "shift": 3.0, "guidance": 3.5,
              "resolution": 32, "max_sequence_length": 16, "lora_rank": 4, "lora_alpha": 8.0}
    for it, seed in [(1, 1), (2, 2), (3, 3), (4, 4)]:
        name = {3: "iter_000003.tmp", 4: "iter_000004.damaged"}.get(it, f"iter_{it:06d}")
        save_lora_checkpoint(str(lora_run / "checkpoints" / name), lora_transformer(flux_path, seed))
    (lora_run / "config.json").write_text(json.dumps(config))
    full = root / "full_run" / "checkpoints" / "iter_000005"
    FluxTransformer2DModel.from_pretrained(os.path.join(flux_path, "transformer")).save_pretrained(full / "transformer")
    write_trainer_state(str(full), 5)
    (root / "full_run" / "config.json").write_text(json.dumps({**config, "lora_rank": 0}))
    return {"lora": str(lora_run), "full": str(full), "root": root}


def run_main(argv, main=None):
    """evaluate.main (or another script's `main`) in this process: (exit code, stdout, stderr)."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            (main or evaluate.main)(list(argv))
        except SystemExit as exit_info:
            code = exit_info.code
    return code, out.getvalue(), err.getvalue()


def table_of(stdout):
    return [line for line in stdout.splitlines() if line.startswith("|")]


@pytest.fixture(scope="module")
def judge():
    server = JudgeServer()
    yield server
    server.close()


def common_args(runs, out):
    return ["--checkpoint", runs["lora"], runs["full"], "--prompt-file", PROMPTS, "--num-prompts", "5",
            "--batch-size", "3", "--grid-prompts", "4", "--output-dir", str(out)]


def test_evaluate_restates_no_flag_of_train_py():
    """Every flag evaluate.py shares with train.py carries train.py's type and help. Two names mean another thing
    here, said in their help: --output-dir (the evaluation's folder) and --prompt-file (the prompts evaluated)."""
    import dataclasses
    import typing

    from lab import flags

    train = typing.get_type_hints(flags.TrainArgs, include_extras=True)
    ours = typing.get_type_hints(evaluate.Args, include_extras=True)
    assert sorted(set(train) & set(ours) - {"output_dir", "prompt_file"}) == sorted(evaluate.SHARED)
    for name in evaluate.SHARED:
        assert ours[name].__metadata__[0].help.startswith(flags.flag_help(name)), name
        assert typing.get_args(ours[name])[0] in (train[name], typing.Optional[train[name]]), name
    assert {f.name: f.default for f in dataclasses.fields(evaluate.Args)}["reward_batch_size"] == \
        flags.TrainArgs.reward_batch_size


def test_table_base_vs_checkpoints(runs, judge, open_clip_folder, hf_clip_folders):  # noqa: F811
    out = runs["root"] / "eval_table"
    argv = common_args(runs, out) + ["--metrics", "shapes", "shapes-strict", "clip", "unifiedreward", "pickscore",
                                     "--clip-model", open_clip_folder, "--unifiedreward-url", judge.url,
                                     "--unifiedreward-model", "judge", "--pickscore-model", hf_clip_folders[0],
                                     "--pickscore-processor", hf_clip_folders[1], "--seeds", "2", "--save-images"]
    code, stdout, stderr = run_main(argv)
    assert code in (0, None), stderr
    table = table_of(stdout)
    assert table[0] == "| model | shapes | shapes-strict | clip | unifiedreward | pickscore (/100) |"
    assert [line.split(" | ")[0] for line in table[2:]] == ["| base", "| lora_run/iter_000002",
                                                           "| full_run/iter_000005"]
    assert (out / "table.md").read_text().strip().splitlines() == table
    results = json.loads((out / "results.json").read_text())
    base, lora, full = results["rows"]
    assert lora["checkpoint"].endswith(os.path.join("lora_run", "checkpoints", "iter_000002"))  # newest complete
    assert base["settings"] == lora["settings"] and lora["settings"]["num_steps"] == 3  # from config.json
    assert results["num_images"] == 10 and len(base["scores"]["shapes"]) == 10
    assert set(base["scores"]["shapes-strict"]) <= {0.0, 1.0}  # the strict pass, GenEval-style
    assert base["scores"] == full["scores"]  # the full checkpoint holds the base weights
    assert base["scores"]["clip"] != lora["scores"]["clip"]  # the LoRA changes the images
    for row in results["rows"]:
        for name, summary in row["metrics"].items():
            scores = torch.tensor(row["scores"][name], dtype=torch.float64) * summary["scale"]
            assert summary["n"] == 10
            assert summary["mean"] == pytest.approx(float(scores.mean()))
            assert summary["stderr"] == pytest.approx(float(scores.std() / 10**0.5))
    assert results["rows"][0]["metrics"]["pickscore"]["scale"] == 0.01
    assert (out / "grid.png").is_file()
    assert len(os.listdir(out / "images" / "lora_run_iter_000002")) == 10


def test_lora_checkpoint_loads_with_its_alpha(flux_path, runs):
    """The LoRA that evaluate.py loads gives the transformer that was saved (rank 4, alpha 8: scale 2)."""
    from lab import models

    adapter = models.ADAPTERS["flux"].load(flux_path, "cpu", torch.float32, guidance=3.5, max_sequence_length=16)
    folder = evaluate.resolve_checkpoint(runs["lora"])
    row = evaluate.Row("lora", folder, {}, evaluate.run_config(folder))
    cond = adapter.encode(["a red circle on the left"])
    latents = adapter.noise([torch.Generator().manual_seed(0)], 32)
    sigma, index = torch.tensor([0.7]), torch.tensor([0])
    expected = adapter.velocity(lora_transformer(flux_path, 2), cond, latents, sigma, index, 32)
    base = adapter.velocity(adapter.transformer, cond, latents, sigma, index, 32)
    with evaluate.CheckpointWeights(adapter, row, torch.float32) as module:
        loaded = adapter.velocity(module, cond, latents, sigma, index, 32)
    torch.testing.assert_close(loaded, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(loaded, base)
    torch.testing.assert_close(adapter.velocity(adapter.transformer, cond, latents, sigma, index, 32), base)  # unloaded


def test_torchrun_two_ranks_give_the_same_table(runs, tmp_path):
    """Prompts sharded over 2 gloo ranks, gathered on rank 0: the same table and scores as one process."""
    one, two = tmp_path / "one", tmp_path / "two"
    argv = ["--metrics", "shapes", "--num-prompts", "5", "--seeds", "1"]
    code, stdout, stderr = run_main(common_args(runs, one) + argv)
    assert code in (0, None), stderr
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "evaluate.py"), *common_args(runs, two), *argv]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert table_of(proc.stdout) == table_of(stdout)
    rows_one = json.loads((one / "results.json").read_text())["rows"]
    rows_two = json.loads((two / "results.json").read_text())["rows"]
    for a, b in zip(rows_one, rows_two):
        assert a["scores"]["shapes"] == pytest.approx(b["scores"]["shapes"], abs=1e-5)


def test_settings_flags_override_the_run_config(runs):
    args = evaluate.tyro.cli(evaluate.Args, args=["--checkpoint", runs["lora"], "--num-steps", "5",
                                                  "--resolution", "64"])
    rows = evaluate.plan_rows(args)
    assert [r.name for r in rows] == ["base", "lora_run/iter_000002"]
    assert all(r.settings["num_steps"] == 5 and r.settings["resolution"] == 64 for r in rows)
    assert rows[1].settings["max_sequence_length"] == 16  # not overridden: the run's
    assert evaluate.tyro.cli(evaluate.Args, args=[]).clip_model == "hf-hub:apple/DFN5B-CLIP-ViT-H-14-384"
    folder = evaluate.resolve_checkpoint(os.path.join(runs["lora"], "checkpoints", "iter_000001"))
    assert folder.endswith("iter_000001")  # a checkpoint folder is taken as given


@pytest.mark.parametrize("extra, message", [
    (["--metrics", "hsp"], "unknown metric 'hsp'"),
    (["--metrics", "shapes", "shapes"], "names a metric twice"),
    (["--seeds", "0"], "--seeds 0"),
    (["--batch-size", "0"], "--batch-size 0"),
    (["--num-prompts", "-1"], "--num-prompts -1"),
    (["--resolution", "30"], "not a positive multiple of 16"),
    (["--num-steps", "0"], "num_steps"),
    (["--prompt-file", "missing.txt"], "--prompt-file 'missing.txt' not found"),
    (["--metrics", "unifiedreward", "--unifiedreward-url", "http://127.0.0.1:9/v1"], "no judge answering"),
    (["--model-path", "/nonexistent/flux"], "could not load a diffusers pipeline"),
    (["--model", "sd3"], "is from a --model flux run, not --model sd3"),
    (["--weights", "ema"], "holds no EMA weights (its run had no --ema-decay); pass --weights trained"),
    (["--weights", "emma"], "--weights emma: not one of its values; choose one of ema, trained"),
])
def test_bad_inputs_give_one_error_line(runs, extra, message, tmp_path):
    flags = {"--checkpoint": [runs["lora"]], "--prompt-file": [PROMPTS], "--metrics": ["shapes"],
             "--output-dir": [str(tmp_path / "out")]}
    flag = None
    for word in extra:  # the case's flags replace the defaults above
        if word.startswith("--"):
            flag, flags[word] = word, []
        else:
            flags[flag].append(word)
    code, stdout, stderr = run_main([w for flag, values in flags.items() for w in [flag, *values]])
    assert code == 2, (stdout, stderr)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], stderr
    assert not (tmp_path / "out").exists()  # nothing written


def test_a_moved_checkpoint_names_its_family(runs, tmp_path):
    """Out of its run folder (no config.json above it), a checkpoint's own record of the run names its family."""
    import shutil

    moved = tmp_path / "moved" / "iter_000005"
    shutil.copytree(runs["full"], moved)
    config = {"model": "flux", "num_steps": 3, "resolution": 32}
    torch.save({"iteration": 5, "optimizer": {}, "config": config}, moved / "trainer.pt")
    (moved / "manifest.json").write_text(json.dumps({"files": {}}))
    code, _, stderr = run_main(["--checkpoint", str(moved), "--model", "sd3", "--prompt-file", PROMPTS,
                                "--metrics", "shapes", "--output-dir", str(tmp_path / "out")])
    assert code == 2 and "is from a --model flux run, not --model sd3" in stderr and "Traceback" not in stderr


@pytest.mark.parametrize("argv, message", [
    (["--metrics", "shapes"], "no model: pass --model"),
    (["--checkpoint", "/nonexistent/run"], "neither a checkpoint"),
    (["--model", "flux", "--no-base"], "--no-base needs at least one --checkpoint"),
    (["--model", "flux"], "write it with: python -m tools.hpdv2"),
])
def test_bad_runs_give_one_error_line(argv, message, tmp_path):
    if "tools.hpdv2" in message and os.path.exists(os.path.join(ROOT, "prompts", "hpdv2_test.txt")):
        pytest.skip("the HPDv2 test prompts are written in this checkout")
    code, _, stderr = run_main(argv + ["--output-dir", str(tmp_path / "out")])
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and message in lines[0], stderr


def test_hpdv2_prompt_files_from_annotations(tmp_path):
    """train.json and test.json in HPDv2's layout -> one prompt a line, each once, in order, newlines collapsed."""
    from lab import flags
    from tools import hpdv2

    annotations = tmp_path / "HPDv2"
    annotations.mkdir()
    train = [{"human_preference": [1, 0], "prompt": "a cat on\na mat ", "file_path": ["00001.jpg", "00002.jpg"],
              "user_hash": "u1"},
             {"human_preference": [0, 1], "prompt": "a dog in the snow", "file_path": ["00003.jpg", "00004.jpg"],
              "user_hash": "u2"},
             {"human_preference": [1, 0], "prompt": "a cat on a  mat", "file_path": ["00005.jpg", "00006.jpg"],
              "user_hash": "u3"},
             {"human_preference": [1, 0], "prompt": "東京の夜景, 🌃", "file_path": ["a.jpg", "b.jpg"],
              "user_hash": "u4"}]
    test = [{"prompt": "a red bicycle", "image_path": ["00000.jpg", "00001.jpg"], "rank": [2, 1],
             "raw_annotations": [{"rank": [2, 1], "user_hash": "u9"}]},
            {"prompt": "   ", "image_path": ["00002.jpg"], "rank": [1], "raw_annotations": []}]
    (annotations / "train.json").write_text(json.dumps(train), encoding="utf-8")
    (annotations / "test.json").write_text(json.dumps(test), encoding="utf-8")
    written = hpdv2.main(hpdv2.Args(annotations_dir=str(annotations), out_dir=str(tmp_path / "prompts")))
    train_lines = open(written["train"], encoding="utf-8").read().splitlines()
    assert train_lines == ["a cat on a mat", "a dog in the snow", "東京の夜景, 🌃"]
    assert open(written["test"], encoding="utf-8").read() == "a red bicycle\n"
    assert os.path.basename(written["test"]) == "hpdv2_test.txt"
    assert flags.how_to_write("prompts/hpdv2_train.txt") == "write it with: python -m tools.hpdv2"
    assert flags.how_to_write("prompts/mine.txt") == ""
    # an empty test split: neither file changes (the train file is not replaced beside an old test file)
    before = {split: open(path, encoding="utf-8").read() for split, path in written.items()}
    (annotations / "train.json").write_text(json.dumps(train + [{"prompt": "a new prompt"}]), encoding="utf-8")
    (annotations / "test.json").write_text(json.dumps(test[1:]), encoding="utf-8")
    with pytest.raises(hpdv2.PromptFileError, match="test annotations hold no prompt; nothing was written"):
        hpdv2.main(hpdv2.Args(annotations_dir=str(annotations), out_dir=str(tmp_path / "prompts")))
    assert {split: open(path, encoding="utf-8").read() for split, path in written.items()} == before
    (annotations / "test.json").write_text(json.dumps({"prompt": "not a list"}))
    proc = subprocess.run([sys.executable, "-m", "tools.hpdv2", "--annotations-dir", str(annotations), "--out-dir",
                           str(tmp_path / "x")], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1


def test_a_run_folders_checkpoint_is_picked_and_verified_as_resume_does(runs, tmp_path, capsys):
    """The newest checkpoint that verifies, not the last name in sort order: a damaged iter_N is passed over with a
    warning, and a superseded copy (iter_N.replaced, a user's iter_N.bak) never wins."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(runs["lora"], run)
    checkpoints = run / "checkpoints"
    shutil.copytree(checkpoints / "iter_000002", checkpoints / "iter_000009.replaced")
    shutil.copytree(checkpoints / "iter_000002", checkpoints / "iter_000009.bak")
    assert evaluate.resolve_checkpoint(str(run)).endswith("iter_000002")
    os.remove(checkpoints / "iter_000002" / "trainer.pt")  # damaged: the older one is taken, with a warning
    assert evaluate.resolve_checkpoint(str(run)).endswith("iter_000001")
    assert "iter_000002 is damaged (missing file trainer.pt)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        evaluate.resolve_checkpoint(str(checkpoints / "iter_000002"))
    assert "is damaged" in capsys.readouterr().err


def test_ctrl_c_exits_quietly(tmp_path):
    import signal
    import time

    # SIGINT as a terminal delivers it: a suite started in the background (`cmd &`) ignores SIGINT, and its children
    # would inherit that
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "evaluate.py"), "--model", "tiny", "--tiny-cache",
                             str(tmp_path / "cache")], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert "tiny: pre-training" in proc.stdout.readline()  # it is at work
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and stderr.strip().splitlines() == [
        "stopped during the tiny model's pre-training; nothing was cached, so the next run starts it again"]
    # and while its imports load (torch, diffusers): the same one line
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "evaluate.py"), "--model", "tiny"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(0.5)  # its imports take seconds
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in stderr and "interrupted" in stderr, stderr


def test_evaluations_get_their_own_folder_and_one_at_a_time(runs, tmp_path, monkeypatch):
    """By default a run's evaluation goes into its own eval/; a second evaluation into a folder that one holds is
    refused, not mixed into it."""
    from lab import checkpoint

    args = evaluate.tyro.cli(evaluate.Args, args=["--checkpoint", runs["lora"]])
    assert args.output_dir == ""
    monkeypatch.chdir(tmp_path)
    held = str(tmp_path / "held")
    with checkpoint.lock_output(held):
        code, _, stderr = run_main(["--checkpoint", runs["lora"], "--prompt-file", PROMPTS, "--metrics", "shapes",
                                    "--output-dir", held, "--num-prompts", "1"])
    assert code == 2 and "evaluation folder" in stderr and "is in use by" in stderr
    assert os.listdir(held) == [".lock"]
    code, stdout, stderr = run_main(["--checkpoint", runs["lora"], "--prompt-file", PROMPTS, "--metrics", "shapes",
                                     "--num-prompts", "1", "--grid-prompts", "0", "--no-base"])
    assert code in (0, None), stderr
    assert os.path.isfile(os.path.join(runs["lora"], "eval", "results.json"))


@pytest.mark.parametrize("lora", [4, 0])
def test_a_run_with_an_ema_is_scored_by_its_ema_as_its_evaluations_were(flux_path, tmp_path, lora):
    """A run trained with --ema-decay evaluates its EMA: evaluate.py scores the same weights by default, says so,
    and reproduces the run's final eval/reward/shapes on the CPU (LoRA and full fine-tune); --weights trained
    scores the optimizer's weights, which score otherwise."""
    from conftest import QUICK, run_train

    out = tmp_path / "run"
    train_argv = ["--model", "flux", "--model-path", flux_path, "--output-dir", str(out), *QUICK, "--lora-rank",
                  str(lora), "--lr", "5e-2", "--ema-decay", "0.9", "--num-iterations", "2", "--eval-every", "100",
                  "--eval-prompts", "0", "--final-eval-seeds", "1"]
    run_train(train_argv)
    final = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    argv = ["--checkpoint", str(out), "--no-base", "--prompt-file", PROMPTS, "--seeds", "1", "--metrics", "shapes",
            "--grid-prompts", "0"]
    scored = {}
    for weights in ("ema", "trained"):
        flag = [] if weights == "ema" else ["--weights", "trained"]
        code, stdout, stderr = run_main([*argv, *flag, "--output-dir", str(tmp_path / weights)])
        assert code in (0, None), stderr
        assert f"scoring its {'EMA' if weights == 'ema' else 'trained'} weights" in stdout, stdout
        row = json.loads((tmp_path / weights / "results.json").read_text())["rows"][0]
        assert row["weights"] == weights and row["name"].endswith(" (EMA)") == (weights == "ema"), row["name"]
        scored[weights] = row["metrics"]["shapes"]["mean"]
    assert scored["ema"] == pytest.approx(final["eval/reward/shapes"], abs=1e-5), (scored, final)
    assert abs(scored["trained"] - scored["ema"]) > 1e-4, scored  # measured: 4e-4 to 8e-4 apart


def test_a_sharded_checkpoints_ema_is_read_from_its_dcp_folder(flux_path, tmp_path):
    """A sharded full fine-tune keeps its EMA in dcp/ as "ema." tensors beside "model." (train.py under torchrun,
    not exported): evaluate.py finds it, checks it against the weights, and samples with it."""
    import torch.distributed.checkpoint as dcp
    from diffusers import FluxTransformer2DModel

    from lab import models

    transformer = FluxTransformer2DModel.from_pretrained(os.path.join(flux_path, "transformer"))
    ema = {name: torch.full_like(p, 0.01 * i) for i, (name, p) in enumerate(transformer.named_parameters())}
    folder = tmp_path / "iter_000001"
    dcp.save({"model": transformer.state_dict(), "ema": ema}, checkpoint_id=str(folder / "dcp"), no_dist=True)
    assert evaluate.choose_weights(None, str(folder), "run/iter_000001") == "ema"
    adapter = models.ADAPTERS["flux"].load(flux_path, "cpu", torch.float32, guidance=3.5, max_sequence_length=16)
    row = evaluate.Row("run/iter_000001 (EMA)", str(folder), {}, {}, "ema")
    with evaluate.CheckpointWeights(adapter, row, torch.float32) as module:
        assert all(torch.equal(p, ema[name]) for name, p in module.named_parameters())
