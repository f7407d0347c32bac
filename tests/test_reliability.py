"""Reliability: every bad input gives one line and exit status 2 before anything is loaded or overwritten; a run
killed with SIGKILL resumes to the same result; SIGTERM saves and exits 0; non-finite rewards skip updates and
too many stop the run with the last good checkpoint intact.

Run: python -m pytest -q tests/test_reliability.py
"""
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import train
from conftest import QUICK, ROOT, run_train

PROMPTS = os.path.join(ROOT, "prompts", "tiny_train.txt")


def expect_error(capsys, argv, message, env=None, monkeypatch=None):
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exit_info:
        train.main(train.parse_args(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message in err, err
    return err


@pytest.fixture
def base(flux_path, tmp_path):
    return ["--model", "flux", "--model-path", flux_path, "--output-dir", str(tmp_path / "run"), *QUICK]


BAD_INPUTS = [
    (["--sde-steps", "0", "9"], "outside the schedule"),
    (["--sde-steps", "1", "1"], "repeats a step"),
    (["--sde-steps"], "--sde-steps is empty"),
    (["--granularities", "0", "1"], "strides >= 1"),
    (["--group-size", "1"], "at least 2 samples"),
    (["--resolution", "30"], "not a multiple of 16"),
    (["--rewards", "hsp=1"], "unknown reward 'hsp'; known rewards: hps"),
    (["--rewards", "shapes=x"], "not a number"),
    (["--model-path", "/no/such/folder"], "neither a folder nor a hub id"),
    (["--model-path", "nobody/no-such-model"], "could not load a diffusers pipeline from 'nobody/no-such-model'"),
    (["--prompt-file", "/no/such/prompts.txt"], "--prompt-file '/no/such/prompts.txt' not found"),
    (["--eta", "0"], "needs eta > 0"),
]


@pytest.mark.parametrize("extra,message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input(extra, message, base, capsys, tmp_path):
    expect_error(capsys, [*base, *extra], message)
    # nothing was written into the output folder
    out = tmp_path / "run"
    assert not out.exists() or not any(p.name in ("config.json", "metrics.jsonl") for p in out.iterdir())


def test_bad_prompt_files(base, capsys, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    expect_error(capsys, [*base, "--prompt-file", str(empty)], "holds no prompts")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    expect_error(capsys, [*base, "--eval-prompt-file", str(binary)], "cannot be read")


def test_unknown_model_and_world_size(base, capsys, monkeypatch):
    expect_error(capsys, ["--model", "sdxl"], "unknown --model 'sdxl'; choose one of: flux, sd3, tiny")
    expect_error(capsys, [*base, "--prompts-per-iteration", "2"], "does not split over 3 ranks",
                 env={"RANK": "0", "WORLD_SIZE": "3"}, monkeypatch=monkeypatch)


def test_output_folder_rules(base, capsys, tmp_path):
    out = tmp_path / "run"
    expect_error(capsys, [*base, "--resume"], "holds no complete checkpoint")
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    expect_error(capsys, [*base, "--output-dir", str(blocker / "sub")], "is not writable")
    run_train([*base, "--num-iterations", "1"])
    before = {p: os.path.getmtime(p) for p in map(str, out.rglob("*"))}
    expect_error(capsys, [*base], "already holds a run; pass --resume")
    expect_error(capsys, [*base, "--resume", "--group-size", "4"], "another configuration (group_size: 3 there, 4 here)")
    after = {p: os.path.getmtime(p) for p in map(str, out.rglob("*"))}
    assert before == after  # refused runs leave the folder untouched


def test_bad_input_in_a_subprocess_has_no_traceback(base):
    proc = run_train([*base, "--group-size", "1"], check=False, subprocess_=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --group-size 1")
    assert "Traceback" not in proc.stderr


def test_long_prompts_warn_once(base, tmp_path):
    long = tmp_path / "long.txt"
    long.write_text(" ".join(["a red circle"] * 20) + "\n" + "a blue square on the top\n")
    proc = run_train([*base, "--prompt-file", str(long), "--num-iterations", "1", "--eval-every", "100"])
    assert proc.stdout.count("exceed 16 text tokens and are truncated") == 1


def wait_for_iteration(path, iteration, proc, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else "exited"
        if os.path.exists(path):
            with open(path) as f:
                rows = [json.loads(l) for l in f if l.strip()]
            if rows and rows[-1]["iteration"] >= iteration:
                return
        time.sleep(0.2)
    raise TimeoutError


def start_train(args):
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2"})


def read_iteration(out):
    import checkpoint

    return checkpoint.read_trainer_state(checkpoint.latest_checkpoint(out))["iteration"]


def weights(out, iteration):
    return load_file(os.path.join(out, "checkpoints", f"iter_{iteration:06d}", "transformer",
                                  "diffusion_pytorch_model.safetensors"))


def test_sigkill_then_resume_equals_uninterrupted(flux_path, tmp_path):
    common = ["--model", "flux", "--model-path", flux_path, "--lr", "1e-2", "--num-iterations", "20",
              "--checkpoint-every", "1", "--eval-every", "100", *QUICK]
    clean, killed = str(tmp_path / "clean"), str(tmp_path / "killed")
    run_train([*common, "--output-dir", clean])
    proc = start_train([*common, "--output-dir", killed])
    wait_for_iteration(os.path.join(killed, "metrics.jsonl"), 2, proc)
    time.sleep(random.uniform(0.0, 0.5))  # an arbitrary point, possibly mid-checkpoint
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    interrupted_at = read_iteration(killed)
    assert interrupted_at < 20
    proc = run_train([*common, "--output-dir", killed, "--resume"])
    assert "resumed from" in proc.stdout
    a, b = weights(clean, 20), weights(killed, 20)
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = lambda out: [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["train/reward/shapes"] for r in rows(clean)[1:]] == [r["train/reward/shapes"] for r in rows(killed)[1:]]


def test_sigterm_saves_and_exits_zero(flux_path, tmp_path):
    out = str(tmp_path / "run")
    args = ["--model", "flux", "--model-path", flux_path, "--num-iterations", "50", "--checkpoint-every", "100",
            "--eval-every", "100", "--output-dir", out, *QUICK]
    proc = start_train(args)
    wait_for_iteration(os.path.join(out, "metrics.jsonl"), 1, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    assert "--resume" in stdout
    saved = [d for d in os.listdir(os.path.join(out, "checkpoints")) if not d.endswith(".tmp")]
    assert len(saved) == 1 and saved[0] != "iter_000050"


def test_nan_rewards_skip_updates_then_stop(base, tmp_path, monkeypatch, capsys):
    import rewards
    import tiny

    train_prompts = set(open(PROMPTS).read().split("\n"))
    calls = {"train": 0}

    def flaky(device, dtype, batch_size, paths):
        def fn(images, prompts):
            scores = tiny.shape_reward(images, prompts)
            if prompts[0] in train_prompts:
                calls["train"] += 1
                if calls["train"] > 2:  # iteration 1 is fine (rollout + anchor calls); then NaN
                    scores[0] = float("nan")
            return scores
        return rewards._batched(fn, batch_size)

    monkeypatch.setitem(rewards.REWARDS, "shapes", flaky)
    out = tmp_path / "run"
    args = [*base, "--num-iterations", "10", "--checkpoint-every", "1", "--eval-every", "100", "--max-faults", "3",
            "--reward-batch-size", "1000"]
    with pytest.raises(SystemExit) as exit_info:
        train.main(train.parse_args(args))
    assert "3 iterations in a row had non-finite" in str(exit_info.value.code)
    assert "iter_000001" in str(exit_info.value.code)
    rows = [json.loads(l) for l in open(out / "metrics.jsonl")]
    assert [r.get("faults/nonfinite_rewards") for r in rows[1:]] == [0.0, 1.0, 1.0, 1.0]
    assert os.listdir(out / "checkpoints") == ["iter_000001"]
    assert "losses/loss" not in rows[2]  # the update was skipped


def test_a_failing_rank_stops_every_rank(flux_path, tmp_path):
    """SIGKILL one of two torchrun ranks mid-run: the whole job exits with an error, no rank hangs."""
    out = str(tmp_path / "run")
    args = ["--model", "flux", "--model-path", flux_path, "--num-iterations", "500", "--eval-every", "1000",
            "--checkpoint-every", "1000", "--output-dir", out, *QUICK]
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            os.path.join(ROOT, "train.py"), *args], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    wait_for_iteration(os.path.join(out, "metrics.jsonl"), 2, job)
    rank1 = [pid for pid in os.listdir("/proc") if pid.isdigit() and _is_rank(pid, "1", out)]
    assert len(rank1) == 1
    start = time.time()
    os.kill(int(rank1[0]), signal.SIGKILL)
    _, stderr = job.communicate(timeout=180)
    assert job.returncode != 0 and time.time() - start < 180
    assert "train.py FAILED" in stderr or "ChildFailedError" in stderr


def _is_rank(pid, rank, marker):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return env.get(b"RANK") == rank.encode() and marker.encode() in cmdline and b"train.py" in cmdline
