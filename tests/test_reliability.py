"""Reliability: every bad input gives one line and exit status 2 before anything is loaded or overwritten; a run
killed with SIGKILL resumes to the same result; SIGTERM saves and exits 0; non-finite rewards skip updates and
too many stop the run with the last good checkpoint intact.

Run: python -m pytest -q tests/test_reliability.py
"""
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from lab import flags
import train
from conftest import QUICK, ROOT, override, run_train

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
    (["--width", "40"], "--width 40 is not a multiple of 16"),
    (["--rewards", "hsp=1"], "unknown reward 'hsp'; known rewards: hps"),
    (["--rewards", "shapes=x"], "not a number"),
    (["--model-path", "/no/such/folder"], "neither a folder nor a hub id"),
    (["--model-path", "nobody/no-such-model"], "could not load a diffusers pipeline from 'nobody/no-such-model'"),
    (["--prompt-file", "/no/such/prompts.txt"], "--prompt-file '/no/such/prompts.txt' not found"),
    (["--eta", "0"], "needs eta > 0"),
    (["--num-steps", "0"], "--num-steps 0: must be >= 1"),
    (["--rewards", "shapes=1", "shapes=2"], "is given twice"),
    (["--rewards", "shapes=nan"], "finite"),
    (["--rewards", "shapes=0"], "0"),
    (["--reward-frames", "4"], "is for video models (--model wan, wan22)"),
    (["--seed", "2147483647"], "--seed 2147483647: must be in 0..1000000000"),
    (["--rewards", "shapes=1.0", "--rewards", "shapes=-1.0"], "--rewards is given twice"),
    (["--sde-steps", "0", "--sde-steps", "1"], "--sde-steps is given twice"),
    (["--window-schedule", "random"], "unknown flag --window-schedule: each method now runs its own"),
    (["--sampling", "full"], "unknown flag --sampling: use --method full-sde"),
    (["--window-end", "5"], "--window-end is a flag of --method flow-grpo-fast, not of --method g2rpo"),
    (["--rollout-solver", "dpm++2m"], "--rollout-solver is a flag of --method diffusionnft or awm, not of --method "
                                      "g2rpo; drop it, or use one of those methods"),
    (["--rollout-precision", "fp4"], "--rollout-precision fp4: not one of its values; choose one of bf16, fp8"),
    (["--log-with=mlflow"], "--log-with mlflow: not one of its values; choose one of none, wandb, tensorboard"),
]


def test_a_folder_of_another_family_is_named(flux_path, sd3_path, wan22_path, capsys, tmp_path):
    out = ["--output-dir", str(tmp_path / "run"), *QUICK]
    expect_error(capsys, ["--model", "sd3", "--model-path", flux_path, *out], "is a flux folder")
    expect_error(capsys, ["--model", "flux", "--model-path", sd3_path, *out], "use --model sd3")
    # both Wans are WanPipeline folders: Wan 2.2 TI2V 5B's expands its timesteps per token
    expect_error(capsys, ["--model", "wan", "--model-path", wan22_path, *out, "--num-frames", "5"],
                 "is a wan22 folder")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("extra,message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input(extra, message, base, capsys, tmp_path):
    expect_error(capsys, override(base, extra), message)
    # nothing was written into the output folder
    out = tmp_path / "run"
    assert not out.exists() or not any(p.name in ("config.json", "metrics.jsonl") for p in out.iterdir())


def numeric_fields():
    return [f for f in dataclasses.fields(flags.TrainArgs) if f.type in (int, float)]


def test_every_numeric_flag_has_a_range():
    assert sorted(f.name for f in numeric_fields()) == sorted(flags.RULES)


CANDIDATES = ["-1", "0", "nan", "inf", "1.5", "2"]


@pytest.mark.parametrize("name", sorted(flags.RULES))
def test_every_numeric_flag_refuses_a_bad_value(name, base, capsys, tmp_path):
    kind = next(f.type for f in numeric_fields() if f.name == name)
    check = flags.RULES[name][0]
    bad = next(v for v in CANDIDATES if (kind is float or v.lstrip("-").isdigit()) and not check(kind(v)))
    flag = "--" + name.replace("_", "-")
    err = expect_error(capsys, [*base, flag, bad], flag)
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()  # refused before the run opened its folder, so before any model loaded


def test_bad_prompt_files(base, capsys, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    expect_error(capsys, [*base, "--prompt-file", str(empty)], "holds no prompts")
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    expect_error(capsys, [*base, "--eval-prompt-file", str(binary)], "cannot be read")


def test_unknown_model_and_world_size(base, capsys, monkeypatch):
    expect_error(capsys, ["--model", "sdxl"],
                 "unknown --model 'sdxl'; choose one of: flux, sd3, zimage, flux2, qwenimage, wan, wan22, tiny")
    expect_error(capsys, [*base, "--prompts-per-iteration", "2"], "does not split over 3 ranks",
                 env={"RANK": "0", "WORLD_SIZE": "3"}, monkeypatch=monkeypatch)


def test_output_folder_rules(base, capsys, tmp_path):
    out = tmp_path / "run"
    expect_error(capsys, [*base, "--resume"], "holds no complete checkpoint")
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    expect_error(capsys, [*base, "--output-dir", str(blocker / "sub")], "is not writable")
    expect_error(capsys, [*base, "--output-dir", str(blocker)], "is a file, not a folder")
    expect_error(capsys, [*base, "--resume", "--overwrite"], "contradict")
    expect_error(capsys, [*base, "--prompt-file", str(tmp_path)], "is a folder")
    run_train([*base, "--num-iterations", "1"])
    untouched = lambda: {p: os.path.getmtime(p) for p in map(str, out.rglob("*")) if not p.endswith(".lock")}
    before = untouched()
    expect_error(capsys, [*base], "already holds a run; pass --resume")
    expect_error(capsys, [*base, "--resume", "--group-size", "4"],
                 "another configuration (--group-size: 3 there, 4 here)")
    assert before == untouched()  # refused runs leave the run's files untouched (each takes the lock in passing)


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


def start_train(args, env=None):
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2", **(env or {})})


def read_iteration(out):
    from lab import checkpoint

    return checkpoint.read_trainer_state(checkpoint.latest_checkpoint(out))["iteration"]


def weights(out, iteration):
    return load_file(os.path.join(out, "checkpoints", f"iter_{iteration:06d}", "transformer",
                                  "diffusion_pytorch_model.safetensors"))


def test_sigkill_then_resume_equals_uninterrupted(flux_path, tmp_path):
    common = ["--model", "flux", "--model-path", flux_path, "--lr", "1e-2", "--num-iterations", "12",
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
    assert interrupted_at < 12
    proc = run_train([*common, "--output-dir", killed, "--resume"])
    assert "resumed from" in proc.stdout
    a, b = weights(clean, 12), weights(killed, 12)
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = lambda out: [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["train/reward/shapes"] for r in rows(clean)[1:]] == [r["train/reward/shapes"] for r in rows(killed)[1:]]


def test_sigterm_saves_and_the_resume_equals_uninterrupted(flux_path, tmp_path):
    """SIGTERM stops within the iteration in flight (its rollout is dropped) or after its update, saves, exits 0;
    --resume then ends where an uninterrupted run does."""
    common = ["--model", "flux", "--model-path", flux_path, "--num-iterations", "6", "--checkpoint-every", "100",
              "--eval-every", "100", *QUICK]
    clean, out = str(tmp_path / "clean"), str(tmp_path / "run")
    run_train([*common, "--output-dir", clean])
    proc = start_train([*common, "--output-dir", out])
    wait_for_iteration(os.path.join(out, "metrics.jsonl"), 2, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    stopped = re.search(r"stopped (during|after) iteration (\d+)", stdout)
    assert stopped and "--resume" in stdout, stdout
    saved = [d for d in os.listdir(os.path.join(out, "checkpoints")) if not d.endswith(".tmp")]
    assert len(saved) == 1 and saved[0] != "iter_000006"
    run_train([*common, "--output-dir", out, "--resume"])
    a, b = weights(clean, 6), weights(out, 6)
    assert all(torch.equal(a[k], b[k]) for k in a)


# iterations of ~3-6 s on 2 ranks here, longer than the grace given to torchrun below
SLOW_2_RANKS = ["--group-size", "8", "--num-steps", "16", "--sde-steps", *map(str, range(8)),
                "--granularities", "1", "2", "3"]


def test_torchrun_preemption_stops_within_a_grace_shorter_than_an_iteration(flux_path, tmp_path):
    """torchrun forwards SIGTERM and kills its workers a grace later (30 s by default, as most clusters). The ranks
    stop at their next transformer call, before the iteration's update, and save the last completed iteration
    within a grace shorter than one iteration; no rank is killed."""
    out = str(tmp_path / "run")
    args = ["--model", "flux", "--model-path", flux_path, "--num-iterations", "500", "--eval-every", "1000",
            "--checkpoint-every", "1000", "--output-dir", out, *override(QUICK, SLOW_2_RANKS)]
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            os.path.join(ROOT, "train.py"), *args], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                                "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "3"})
    wait_for_iteration(os.path.join(out, "metrics.jsonl"), 1, job)
    job.send_signal(signal.SIGTERM)
    stdout, stderr = job.communicate(timeout=120)
    assert "Unable to shutdown process" not in stderr, stderr[-2000:]  # torchrun's line before its SIGKILL
    stopped = re.search(r"stopped during iteration (\d+), before its update", stdout)
    assert stopped, stdout[-2000:]
    from lab import checkpoint

    logged = [json.loads(l)["iteration"] for l in open(os.path.join(out, "metrics.jsonl"))]
    newest = checkpoint.latest_checkpoint(out)
    assert checkpoint.verify(newest) is None
    assert checkpoint.read_trainer_state(newest)["iteration"] == logged[-1] == int(stopped.group(1)) - 1
    # torchrun itself reports the signal it forwarded with its own traceback and exit 1, whatever its workers did;
    # the run's first line after the signal says so
    assert "SignalException" in stderr and "CheckpointException" not in stderr
    received = next(l for l in stdout.splitlines() if l.startswith("received signal"))
    assert "torchrun itself will then exit 1 with a SignalException traceback" in received, received


def test_torchrun_preemption_during_a_long_update_saves_within_the_grace(flux_path, tmp_path):
    """A 2-rank full fine-tune whose update (20 inner epochs) outlasts torchrun's grace: a SIGTERM 2 s into it cuts
    the update at the next optimizer step on both ranks, which save a verified checkpoint within the grace, the
    update's steps so far in it (the iteration reruns on --resume)."""
    out = str(tmp_path / "run")
    args = ["--model", "flux", "--model-path", flux_path, "--num-iterations", "500", "--eval-every", "1000",
            "--checkpoint-every", "1000", "--inner-epochs", "20", "--output-dir", out, *QUICK]
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                            os.path.join(ROOT, "train.py"), *args], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True,
                           env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                                "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "3"})
    wait_for_iteration(os.path.join(out, "metrics.jsonl"), 1, job)  # iteration 2 has begun: its rollout is short
    time.sleep(2.0)
    signalled = time.time()
    job.send_signal(signal.SIGTERM)
    stdout, stderr = job.communicate(timeout=120)
    assert "Unable to shutdown process" not in stderr, stderr[-2000:]  # torchrun's line before its SIGKILL
    stopped = re.search(r"stopped during iteration (\d+)'s update, after (\d+) optimizer steps", stdout)
    assert stopped and 0 < int(stopped.group(2)) < 40, stdout[-2000:]
    from lab import checkpoint

    newest = checkpoint.latest_checkpoint(out)
    assert checkpoint.verify(newest) is None and os.path.getmtime(newest) - signalled < 3.0
    assert checkpoint.read_trainer_state(newest)["iteration"] == int(stopped.group(1)) - 1


def test_second_sigterm_during_a_two_rank_save_exits_130_quietly(flux_path, tmp_path):
    """A cluster that signals every process (as SLURM does) sends a second SIGTERM while the ranks save: each rank
    exits at once, 130 (or 0 if it had finished), with no traceback, and the newest checkpoint is whole. The ranks
    are started as torchrun starts them (its environment variables), so that each one's exit status is seen."""
    import socket

    from lab import checkpoint

    for attempt in range(3):
        out = str(tmp_path / f"run{attempt}")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        args = ["--model", "flux", "--model-path", flux_path, "--num-iterations", "500", "--eval-every", "1000",
                "--checkpoint-every", "2", "--output-dir", out, *QUICK]
        ranks = [subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "RANK": str(r),
                                       "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                       "MASTER_PORT": str(port)}) for r in range(2)]
        # after iteration 3 (iteration 2's checkpoint written): the first signal stops iteration 4 and saves 3,
        # the second comes while the ranks write it
        wait_for_iteration(os.path.join(out, "metrics.jsonl"), 3, ranks[0])
        for second in (False, True):
            for proc in ranks:
                proc.send_signal(signal.SIGTERM)
            time.sleep(0 if second else 0.1)
        outputs = [proc.communicate(timeout=120) for proc in ranks]
        results = [(proc.returncode, stdout, stderr) for proc, (stdout, stderr) in zip(ranks, outputs)]
        for code, _, stderr in results:
            assert code in (0, 130) and "Traceback" not in stderr, (code, stderr[-2000:])
        newest = checkpoint.latest_checkpoint(out)
        assert newest is not None and checkpoint.verify(newest) is None
        if any(code == 130 for code, _, _ in results):
            assert re.search(r"second signal 15: (aborting now|exiting)", results[0][1]), results[0][1][-2000:]
            return
    pytest.fail("in 3 attempts both ranks had left before their second signal")


def nan_after_iteration_1(monkeypatch):
    """The tiny world's reward, NaN on the training prompts from iteration 2 on (with --reward-batch-size 1000, an
    iteration scores its training prompts in two calls: its rollout's and its anchors')."""
    import rewards
    from lab import tiny

    train_prompts = set(open(PROMPTS).read().split("\n"))
    calls = {"train": 0}

    def flaky(device, dtype, batch_size, paths):
        def fn(images, prompts):
            scores = tiny.shape_reward(images, prompts)
            if prompts[0] in train_prompts:
                calls["train"] += 1
                if calls["train"] > 2:
                    scores[0] = float("nan")
            return scores
        return rewards._batched(fn, batch_size)

    monkeypatch.setitem(rewards.REWARDS, "shapes", rewards.Reward(flaky, {}))


def test_nan_rewards_skip_updates_then_stop(base, tmp_path, monkeypatch, capsys):
    nan_after_iteration_1(monkeypatch)
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
    assert capsys.readouterr().out.count("warning: an optimizer step was skipped: the rewards were not finite") == 1


def test_a_faulty_last_iteration_is_saved_and_the_run_is_complete(base, tmp_path, monkeypatch, capsys):
    """The rewards turn NaN in the last iteration, after no periodic checkpoint: its update is skipped, so its
    weights are the last step's, finite, and they are saved as the run's last checkpoint (before, nothing was, and a
    --resume started afresh over the run's metrics)."""
    from lab import checkpoint

    nan_after_iteration_1(monkeypatch)
    out = tmp_path / "run"
    args = [*base, "--num-iterations", "2", "--checkpoint-every", "100", "--eval-every", "100",
            "--reward-batch-size", "1000"]
    assert train.main(train.parse_args(args)) is None
    assert "iteration 2, the last, was faulty" in capsys.readouterr().out
    rows = [json.loads(l) for l in open(out / "metrics.jsonl")]
    assert [r.get("faults/nonfinite_rewards") for r in rows[1:]] == [0.0, 1.0]
    assert os.listdir(out / "checkpoints") == ["iter_000002"]
    assert checkpoint.verify(str(out / "checkpoints" / "iter_000002")) is None
    assert train.main(train.parse_args([*args, "--resume"])) is None
    assert "the run is complete" in capsys.readouterr().out
    assert [json.loads(l) for l in open(out / "metrics.jsonl")] == rows  # nothing replaced


def test_rewards_equal_in_every_group_are_said_once(base, tmp_path):
    """Prompts the tiny world's reward cannot read (no colour or shape it knows) score 0 for every image: every
    advantage is 0, so nothing trains; one warning names the reward."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n\u732b\n")
    out = run_train([*override(base, ["--prompt-file", str(prompts)]), "--num-iterations", "1", "--eval-every",
                     "100"]).stdout
    assert out.count("every group's rewards under shapes are equal (0)") == 1, out


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


def test_second_run_into_a_held_folder_is_refused(flux_path, tmp_path, capsys):
    out = str(tmp_path / "run")
    args = ["--model", "flux", "--model-path", flux_path, "--num-iterations", "500", "--eval-every", "1000",
            "--checkpoint-every", "1000", "--output-dir", out, *QUICK]
    first = start_train(args)
    try:
        wait_for_iteration(os.path.join(out, "metrics.jsonl"), 0, first)
        err = expect_error(capsys, [*args, "--seed", "7"], f"is in use by pid {first.pid}")
        assert out in err
    finally:
        first.kill()
        first.wait()
    # the killed run's lock is stale: the folder is taken over (and refused only because it holds a run)
    expect_error(capsys, args, "already holds a run")


def test_a_folder_of_other_files_is_never_emptied(flux_path, tmp_path, capsys):
    """A fresh run into a folder that holds samples/ or a tracker's files it did not write stops before writing;
    --overwrite names them, and only then are they replaced."""
    out = tmp_path / "d"
    (out / "wandb" / "offline-run-x").mkdir(parents=True)
    (out / "samples").mkdir()
    (out / "samples" / "mine.png").write_bytes(b"x")
    args = ["--model", "flux", "--model-path", flux_path, "--num-iterations", "1", "--eval-every", "1000",
            "--output-dir", str(out), *QUICK]
    expect_error(capsys, args, "holds samples, wandb, which a new run would replace; pass --overwrite")
    assert (out / "samples" / "mine.png").exists() and (out / "wandb" / "offline-run-x").is_dir()
    run_train([*args, "--overwrite"])  # replaces what a run writes there (wandb's run folders), not the user's file
    assert (out / "samples" / "mine.png").exists() and not (out / "wandb").exists()


def test_second_signal_aborts_at_once_keeping_the_last_checkpoint(flux_path, tmp_path):
    """A person's double Ctrl-C: the second comes when the first's line is shown, while the run stops and saves
    iteration 3 (iteration 2's checkpoint written): it exits 130 at once, says no checkpoint was written for that
    iteration, and the newest checkpoint is whole."""
    import threading

    from lab import checkpoint

    slow = ["--group-size", "8", "--num-steps", "8", "--sde-steps", "0", "1", "2", "3"]  # iterations of ~1 s
    out = str(tmp_path / "run")
    proc = start_train(["--model", "flux", "--model-path", flux_path, "--num-iterations", "500", "--eval-every",
                        "1000", "--checkpoint-every", "2", "--output-dir", out, *override(QUICK, slow)],
                       env={"PYTHONUNBUFFERED": "1"})
    lines, shown = [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "received signal" in line:
                shown.set()

    errors = []
    readers = [threading.Thread(target=read, daemon=True),
               threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True)]  # a full pipe would block
    for reader in readers:
        reader.start()
    wait_for_iteration(os.path.join(out, "metrics.jsonl"), 3, proc)
    proc.send_signal(signal.SIGINT)
    assert shown.wait(60), "".join(lines)[-2000:]
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    for reader in readers:
        reader.join(10)
    stdout = "".join(lines)
    assert proc.returncode == 130, stdout[-2000:]
    assert "second signal 2: aborting now; no checkpoint was written for the current iteration" in stdout, stdout
    newest = checkpoint.latest_checkpoint(out)
    assert newest is not None and checkpoint.verify(newest) is None
    assert "Traceback" not in "".join(errors)


def test_resume_survives_a_damaged_checkpoint_and_lost_metrics(flux_path, tmp_path):
    out = str(tmp_path / "run")
    common = ["--model", "flux", "--model-path", flux_path, "--eval-every", "100", "--checkpoint-every", "1",
              "--output-dir", out, *QUICK]
    run_train([*common, "--num-iterations", "2"])
    newest = os.path.join(out, "checkpoints", "iter_000002", "trainer.pt")
    with open(newest, "r+b") as f:
        f.truncate(100)  # a write cut short
    os.remove(os.path.join(out, "metrics.jsonl"))
    proc = run_train([*common, "--num-iterations", "3", "--resume"])
    assert "resumed from" in proc.stdout and "iter_000001" in proc.stdout
    assert "set aside" in proc.stdout or "damaged" in proc.stdout
    assert os.path.isdir(os.path.join(out, "checkpoints", "iter_000002.damaged"))  # kept, not deleted
    assert read_iteration(out) == 3
    proc = run_train([*common, "--num-iterations", "3", "--resume"])
    assert "the run is complete" in proc.stdout


def test_a_run_that_never_steps_exits_non_zero(base, tmp_path, monkeypatch):
    import rewards

    def broken(device, dtype, batch_size, paths):
        return rewards._batched(lambda images, prompts: torch.full((len(prompts),), float("nan")), batch_size)

    monkeypatch.setitem(rewards.REWARDS, "shapes", rewards.Reward(broken, {}))
    with pytest.raises(SystemExit) as exit_info:
        train.main(train.parse_args([*base, "--num-iterations", "2", "--max-faults", "5"]))
    assert "no optimizer step succeeded" in str(exit_info.value.code)


def test_a_wrong_gradient_stops_the_first_update(base, monkeypatch, tmp_path):
    from test_gpu_check import BrokenKernelProcessor  # right forward, wrong backward unless the math kernel runs

    build = train.build_policy

    def build_with_a_broken_kernel(*args, **kwargs):
        policy = build(*args, **kwargs)
        policy.transformer.set_attn_processor(BrokenKernelProcessor())
        return policy

    monkeypatch.setattr(train, "build_policy", build_with_a_broken_kernel)
    with pytest.raises(SystemExit) as exit_info:
        train.main(train.parse_args([*base, "--num-iterations", "2", "--lora-rank", "4"]))
    message = str(exit_info.value.code)
    assert message.startswith("error: gradient self-check failed") and "--attention-backend math" in message
    assert not (tmp_path / "run" / "checkpoints").exists()  # stopped before the first optimizer step


# ---------------------------------------------------------------- the run folder across runs (round three)

def test_a_folder_with_checkpoints_but_no_config_is_not_wiped(base, capsys, tmp_path):
    out = tmp_path / "run"
    run_train([*base, "--num-iterations", "1"])
    os.remove(out / "config.json")
    kept = sorted(map(str, (out / "checkpoints").rglob("*")))
    expect_error(capsys, base, "already holds a run; pass --resume")
    assert sorted(map(str, (out / "checkpoints").rglob("*"))) == kept and (out / "metrics.jsonl").exists()


def test_resume_applies_a_new_learning_rate_and_says_so(base, tmp_path):
    out = tmp_path / "run"
    run_train([*base, "--num-iterations", "1", "--lr", "1e-2"])
    proc = run_train([*base, "--num-iterations", "2", "--resume", "--lr", "1e-3", "--weight-decay", "0.5"])
    assert "--lr 0.01 -> 0.001" in proc.stdout and "--weight-decay 0.0001 -> 0.5" in proc.stdout
    groups = torch.load(out / "checkpoints" / "iter_000002" / "trainer.pt", weights_only=True)["optimizer"]["param_groups"]
    assert all(g["lr"] == 1e-3 and g["weight_decay"] == 0.5 for g in groups)


def test_a_run_that_died_before_its_first_checkpoint_resumes_afresh(base, capsys, tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints" / "iter_000001.tmp").mkdir(parents=True)  # killed while writing its first checkpoint
    (out / "checkpoints" / "iter_000000.replaced").mkdir()  # set aside by an earlier --overwrite
    (out / "config.json").write_text("{}")
    (out / "metrics.jsonl").write_text('{"iteration": 0}\n')
    expect_error(capsys, base, "already holds a run; pass --resume to continue it")
    proc = run_train([*base, "--num-iterations", "1", "--resume"])
    assert "holds no complete checkpoint to resume; starting afresh" in proc.stdout
    assert sorted(os.listdir(out / "checkpoints")) == ["iter_000000.replaced", "iter_000001"]


def test_resume_into_a_missing_folder_writes_nothing(base, capsys, tmp_path):
    expect_error(capsys, [*base, "--resume"], "does not exist")
    assert not (tmp_path / "run").exists()


def test_prompt_files_a_bom_a_control_character_and_a_fifo(base, capsys, tmp_path):
    from lab.flags import read_prompts

    bom = tmp_path / "bom.txt"
    bom.write_bytes("\ufeffa red circle on the left\nа blue square\n".encode("utf-8"))
    assert read_prompts(str(bom), "--prompt-file")[0] == "a red circle on the left"
    nul = tmp_path / "nul.txt"
    nul.write_bytes(b"a red circle\na blue\x00square\n")
    expect_error(capsys, [*base, "--prompt-file", str(nul)], "line 2 holds the control character '\\x00'")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    expect_error(capsys, [*base, "--eval-prompt-file", str(fifo)], "is a named pipe (FIFO)")
    expect_error(capsys, [*base, "--prompt-file", "/dev/null"], "is a device")


# ---------------------------------------------------------------- round five


def test_a_folder_of_foreign_files_is_never_wiped(flux_path, tmp_path, capsys):
    """A folder whose checkpoints/ holds the user's own files is no run: a fresh run and a --resume are both
    refused, and nothing in it is removed (--resume once took it for a run and cleared wandb/ and samples/)."""
    out = tmp_path / "d"
    for folder in ("checkpoints", "wandb/offline-run-x", "samples"):
        (out / folder).mkdir(parents=True)
    for name in ("checkpoints/model.pt", "samples/mine.png", "wandb/offline-run-x/run.wandb"):
        (out / name).write_text("mine")
    argv = ["--model", "flux", "--model-path", flux_path, "--output-dir", str(out), "--lora-rank", "4", *QUICK]
    for extra in ([], ["--resume"]):
        expect_error(capsys, [*argv, *extra], "which a new run would replace; pass --overwrite")
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p.name != ".lock") == [
        "checkpoints/model.pt", "samples/mine.png", "wandb/offline-run-x/run.wandb"]


def test_good_input_once_refused_runs(flux_path, tmp_path, monkeypatch):
    """G2RPO with fewer steps than a peer's window; a relative model folder, recorded as an absolute one so that the
    run's folder reads the same from anywhere (evaluate.py, a resume from another directory)."""
    flags.check_flags(flags.parse_args(["--model", "flux2", "--num-steps", "3"]), world=1)
    flags.check_flags(flags.parse_args(["--model", "tiny", "--num-steps", "2", "--sde-steps", "0"]), world=1)
    monkeypatch.chdir(os.path.dirname(flux_path))
    out = str(tmp_path / "run")
    run_train(["--model", "flux", "--model-path", os.path.basename(flux_path), "--output-dir", out, "--lora-rank", "4",
               "--num-iterations", "1", "--eval-every", "100", *QUICK])
    assert json.load(open(os.path.join(out, "config.json")))["model_path"] == flux_path


def test_an_error_says_which_values_were_not_given(capsys):
    """A value the recipe or the preset set is named as such: the user gave --method mixgrpo and --group-size 3,
    not the --member-chunks 4 the error is about. A value given is named as given."""
    for argv, said in ((["--method", "mixgrpo", "--group-size", "3"], True),
                       (["--method", "mixgrpo", "--group-size", "3", "--member-chunks", "4"], False)):
        with pytest.raises(SystemExit):
            flags.check_flags(flags.parse_args(["--model", "tiny", *argv]), world=1)
        err = capsys.readouterr().err
        assert "--member-chunks 4: must be in 1..--group-size 3" in err and len(err.splitlines()) == 1
        assert ("(--member-chunks 4: the default of --model tiny --method mixgrpo, not given; give it to change it)"
                in err) == said, err


def test_a_pipeline_of_no_family_is_named(tmp_path, capsys):
    variant = tmp_path / "img2img"
    variant.mkdir()
    (variant / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Img2ImgPipeline"}))
    expect_error(capsys, ["--model", "sd3", "--model-path", str(variant), "--output-dir", str(tmp_path / "run"),
                          *QUICK], "holds a StableDiffusion3Img2ImgPipeline (its model_index.json), which no --model")


def test_evaluate_names_a_folder_of_another_family(sd3_path, capsys):
    import evaluate

    settings = {**evaluate.family_defaults("flux"), "model": "flux", "model_path": sd3_path}
    with pytest.raises(SystemExit):
        evaluate.check_settings(settings, "base")
    err = capsys.readouterr().err.strip()
    assert "is a sd3 folder, not a flux one; pass --model sd3" in err and "\n" not in err
    with pytest.raises(SystemExit):  # a repeated --checkpoint kept only the last
        evaluate.main(["--model", "tiny", "--checkpoint", "A", "--checkpoint", "B"])
    assert "--checkpoint is given twice" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a value not among a flag's: one line, not the parser's box
        evaluate.main(["--model", "tnyi", "--checkpoint", "A"])
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --model tnyi: not one of its values; choose one of flux,") and "\n" not in err


def test_the_closing_lines_say_when_the_evaluations_differ(tmp_path):
    from lab.run import Run

    lines = []
    args = flags.parse_args(["--model", "tiny", "--first-eval-seeds", "60", "--output-dir", str(tmp_path)])
    Run(args, 0, 1, False, lines.append).summary({"eval/reward/shapes": 0.1730}, {"eval/reward/shapes": 0.1673},
                                                 ["shapes"])
    assert lines[0].startswith("note: the first evaluation scored 60 seeds a prompt and the last 96: both are "
                               "compared on the 60 they share")
    # the shared seeds' means (eval/common/*) where an evaluation has more seeds than the other, else its own
    lines.clear()
    Run(args, 0, 1, False, lines.append).summary({"eval/reward/shapes": 0.1730},
                                                 {"eval/reward/shapes": 0.1673, "eval/common/reward/shapes": 0.1801},
                                                 ["shapes"])
    assert lines[1] == "trained reward on the held-out prompts: shapes 0.1730 -> 0.1801"


def test_hpdv2_prompts_lose_their_control_characters():
    from tools import hpdv2

    records = [{"prompt": "a cat\x00 on a\x1b[31m mat"}, {"prompt": "a cat on a [31m mat"}]
    assert hpdv2.unique_prompts(records, "test") == ["a cat on a [31m mat"]


def test_two_builds_of_one_tiny_cache_both_succeed(tmp_path):
    """Two builds of one cache at once (two threads here; two processes alike): each in a folder of its own."""
    from concurrent.futures import ThreadPoolExecutor

    from lab import tiny

    build = lambda _: tiny.ensure_pretrained(str(tmp_path), seed=5, vae_steps=2, flow_steps=2, log=lambda *a: None)
    with ThreadPoolExecutor(2) as pool:
        folders = list(pool.map(build, range(2)))
    assert folders[0] == folders[1] and not list(tmp_path.glob("*.tmp*"))
    assert tiny.ensure_pretrained(str(tmp_path), seed=5, vae_steps=2, flow_steps=2, log=lambda *a: None) == folders[0]


def test_a_resume_into_mixgrpos_empty_window_is_no_fault(tiny_cache, tmp_path):
    """--window-stride 6 --window-every 1 at N 8: iteration 1's window is empty (start N - 2), by design."""
    out = str(tmp_path / "run")
    common = ["--model", "tiny", "--tiny-cache", tiny_cache, "--method", "mixgrpo", "--window-stride", "6",
              "--window-every", "1", "--prompts-per-iteration", "2", "--group-size", "4", "--eval-every", "100",
              "--eval-prompts", "2", "--eval-seeds", "1", "--final-eval-seeds", "1", "--checkpoint-every", "1",
              "--output-dir", out]
    run_train([*common, "--num-iterations", "1"])
    proc = run_train([*common, "--num-iterations", "2", "--resume"], check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert rows[-1]["iteration"] == 2 and rows[-1]["perf/optimizer_steps"] == 0


def test_a_broken_tracker_package_is_one_line_before_loading(base, tmp_path, capsys, monkeypatch):
    stub = tmp_path / "stub" / "tensorboard"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('a stub, not the package')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "stub"))
    for name in ("tensorboard", "torch.utils.tensorboard"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    expect_error(capsys, [*base, "--log-with", "tensorboard"], "its package does not import (ImportError: a stub")


# --- round six: nothing the run did not write is removed; no result is lost to a late stop; the main job offline ---
def planted(out):
    """A user's files in every folder a run touches: {path: text}."""
    files = {"NOTES.txt": "n", "samples/mine.txt": "s", "tensorboard/mine.txt": "t", "wandb/mine.txt": "w",
             "checkpoints/NOTES.txt": "c", "checkpoints/iter_000009.replaced/x": "d"}
    for name, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(out, name)), exist_ok=True)
        with open(os.path.join(out, name), "w") as f:
            f.write(text)
    return files


def still_there(out, files):
    for name, text in files.items():
        with open(os.path.join(out, name)) as f:
            assert f.read() == text, name


def test_no_user_file_is_removed_by_overwrite_resume_or_a_damaged_checkpoint(base, tmp_path, capsys):
    """The user's files in every folder a run touches survive --overwrite, a --resume that finds no complete
    checkpoint (a config alone, or a damaged checkpoint), and a resumed run; --overwrite removes the checkpoints the
    run wrote and sets one holding an export aside, whole."""
    out = str(tmp_path / "run")
    args = [*base, "--checkpoint-every", "1", "--keep-checkpoints", "0", "--eval-every", "100"]
    run_train([*args, "--num-iterations", "2"])
    files = planted(out)
    with open(os.path.join(out, "checkpoints", "iter_000001", "export.txt"), "w") as f:
        f.write("e")  # an export into a checkpoint
    proc = run_train([*args, "--num-iterations", "1", "--overwrite"])
    still_there(out, files)
    assert "set" in proc.stdout and "iter_000001.replaced" in proc.stdout
    assert sorted(n for n in os.listdir(os.path.join(out, "checkpoints")) if n.startswith("iter_")) == \
        ["iter_000001", "iter_000001.replaced", "iter_000009.replaced"]  # (the new run's own iter_000001)
    assert open(os.path.join(out, "checkpoints", "iter_000001.replaced", "export.txt")).read() == "e"
    shutil.rmtree(os.path.join(out, "checkpoints", "iter_000001"))  # a config and no checkpoint: starts afresh
    proc = run_train([*args, "--num-iterations", "1", "--resume"])
    assert "starting afresh" in proc.stdout
    still_there(out, files)
    with open(os.path.join(out, "checkpoints", "iter_000001", "trainer.pt"), "r+b") as f:
        f.truncate(100)  # its only checkpoint damaged: --resume refuses and changes nothing
    expect_error(capsys, [*args, "--num-iterations", "1", "--resume"], "iter_000001.damaged")
    still_there(out, files)
    run_train([*args, "--num-iterations", "1", "--overwrite"])  # starts afresh; the set-aside ones stay
    still_there(out, files)
    run_train([*args, "--num-iterations", "2", "--resume"])  # and a resumed run that writes on
    still_there(out, files)


def test_a_stop_before_the_final_evaluation_is_finished_by_the_resume(base, tmp_path):
    """A stop after the last iteration's update, or in the final evaluation, saves the last iteration without its
    evaluation (its metrics row has no eval/*): --resume takes that evaluation and prints the run's result, and
    only then says the run is complete."""
    out = str(tmp_path / "run")
    args = [*base, "--eval-every", "100"]
    run_train([*args, "--num-iterations", "2"])
    path = os.path.join(out, "metrics.jsonl")
    rows = [json.loads(line) for line in open(path)]
    rows[-1] = {k: v for k, v in rows[-1].items() if not k.startswith("eval/") and not k.startswith("watch/")}
    with open(path, "w") as f:  # what the stop leaves
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.remove(os.path.join(out, "samples", "before_after.png"))
    proc = run_train([*args, "--num-iterations", "2", "--resume"])
    assert "trained reward on the held-out prompts" in proc.stdout and "before (top) / after" in proc.stdout
    assert os.path.exists(os.path.join(out, "samples", "before_after.png"))
    assert any(k.startswith("eval/") for k in json.loads(open(path).readlines()[-1]))
    assert "the run is complete" in run_train([*args, "--num-iterations", "2", "--resume"]).stdout


def test_the_default_quick_start_says_where_it_stands():
    """The tiny preset as given (its held-out rewards less the one it trains on) changes nothing from the preset,
    so the closing line compares the run with the quick start's ranges; a changed flag is named, the held-out list
    it derives is not."""
    assert flags.changed_from_preset(flags.parse_args(["--model", "tiny"])) == []
    assert flags.changed_from_preset(flags.parse_args(["--model", "tiny", "--seed", "3"])) == []
    assert flags.changed_from_preset(flags.parse_args(["--model", "tiny", "--rewards", "colour-area=1.0"])) == \
        ["--rewards"]


def test_the_presets_held_out_rewards_are_left_out_offline_and_named_ones_refused(flux_path, tmp_path, capsys):
    """--model flux with a local FLUX and no hub: the preset's held-out CLIP and PickScore cannot load, so the run
    says so in one line each and trains without them; named with --eval-rewards, the same reward is refused."""
    from conftest import QUICK_ANY

    quick = QUICK_ANY[: QUICK_ANY.index("--eval-rewards")]  # the preset's held-out rewards
    out = str(tmp_path / "run")
    args = ["--model", "flux", "--model-path", flux_path, "--output-dir", out, *quick, "--granularities", "1",
            "--eval-every", "100"]
    proc = run_train([*args, "--num-iterations", "1"])
    assert "note: the held-out reward clip of the --model flux preset is left out" in proc.stdout
    assert "note: the held-out reward pickscore of the --model flux preset is left out" in proc.stdout
    expect_error(capsys, [*args, "--output-dir", str(tmp_path / "named"), "--num-iterations", "1", "--eval-rewards",
                          "pickscore"], "--eval-rewards: could not load")


def test_a_missing_reward_file_is_refused_before_anything_is_written(base, tmp_path, capsys):
    """HPSv3 (or HPS) without its file stops at the flag checks: no model loads, no folder is made."""
    out = tmp_path / "fresh"
    expect_error(capsys, [*override(base, ["--rewards", "hpsv3=1.0"]), "--output-dir", str(out),
                          "--hpsv3-checkpoint", str(tmp_path / "none.safetensors")], "the HPSv3 checkpoint not found")
    assert not out.exists()


def test_ctrl_c_while_the_flags_parse_is_one_line():
    """A Ctrl-C in the first second (imports, then the flags): one line, exit status 130, no traceback."""
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), "--model", "tiny"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip() == "interrupted; nothing was written", err


def test_a_second_signal_before_any_checkpoint_says_none_exists(tmp_path):
    from lab.run import Run

    lines = []
    run = Run(flags.parse_args(["--model", "tiny", "--output-dir", str(tmp_path)]), 0, 1, False, lines.append)
    run.stop_requested = True
    with pytest.raises(SystemExit):
        run._on_signal(signal.SIGINT, None)
    assert lines[-1].endswith("and none exists yet: a rerun starts afresh")


def test_adagrpos_pool_is_bounded_and_its_flags_are_its_own(capsys):
    for pool, words in (("1", "at least 2 candidates"), ("1000000", "at most 1000 candidates")):
        with pytest.raises(SystemExit):
            flags.check_flags(flags.parse_args(["--model", "tiny", "--method", "adagrpo", "--curriculum-pool", pool]),
                              world=1)
        assert words in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a curriculum flag under a method without a curriculum
        flags.parse_args(["--model", "tiny", "--curriculum-ema", "0.5"])
    assert "is a flag of --method adagrpo" in capsys.readouterr().err


def test_a_stop_by_the_watch_exits_3(base, monkeypatch):
    """--stop-on-hacking's stop has an exit status of its own (train.HACKING_EXIT, 3), unlike a finished run (None:
    exit 0) and a signal's stop (0). Under test is the stop and its status, so the watch's verdict is given: that it
    fires on a real hacking run is docs/tiny_world.md's measurement, its rule tests/test_watch.py's."""
    from lab import watch

    verdict = lambda before, after, limits: (["the trained reward rose, a held-out one fell"], {"watch/fired": 1.0})
    monkeypatch.setattr(watch, "check", verdict)
    argv = [*base, "--num-iterations", "3", "--eval-every", "1", "--stop-on-hacking"]
    assert train.main(train.parse_args(argv)) == train.HACKING_EXIT == 3
    assert read_iteration(base[base.index("--output-dir") + 1]) == 1  # stopped at the first evaluation, saved



def test_notes_for_a_watch_without_diversity_and_a_duplicate_held_out_reward(capsys):
    lines = []
    flags.check_flags(flags.parse_args(["--model", "tiny", "--eval-seeds", "1"]), world=1, log=lines.append)
    assert any("the reward-hacking watch has no diversity over seeds there" in line for line in lines)
    with pytest.raises(SystemExit):
        flags.check_flags(flags.parse_args(["--model", "tiny", "--eval-rewards", "shapes-strict", "shapes-strict"]),
                          world=1)
    err = capsys.readouterr().err
    assert "given twice; give each reward once, e.g. shapes-strict" in err and "=1.0" not in err


def test_a_held_out_reward_added_on_resume_gets_a_baseline(base, tmp_path):
    """--resume with a held-out reward the first evaluation did not score: a note, and the watch compares it from
    the next evaluation on (its first value is the baseline) rather than silently not at all."""
    out = base[base.index("--output-dir") + 1]
    run_train([*base, "--num-iterations", "1", "--checkpoint-every", "1"])
    proc = run_train([*override(base, ["--eval-rewards", "shapes-strict"]), "--num-iterations", "3",
                      "--checkpoint-every", "1", "--eval-every", "1", "--resume"])
    assert "the first evaluation has no held-out shapes-strict (added since)" in proc.stdout
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert rows[-1]["watch/heldout_z/shapes-strict"] == rows[-1]["watch/heldout_z/shapes-strict"]  # not nan


def test_the_tools_help_lines(capsys):
    from tools import preemption

    preemption.main(["--help"])
    assert "Seconds from a scheduler's SIGTERM to a verified checkpoint" in capsys.readouterr().out
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "evaluate.py"), "--help"], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"})
    metrics = " ".join(proc.stdout.split())
    assert "shapes-strict colour-area" in metrics and metrics.count("(default: hps clip pickscore imagereward") == 1
