"""Faults around checkpoints and ranks, on a tiny real FLUX pipeline (random weights): a --resume whose only
checkpoint is damaged refuses and leaves the run's files as they were; a checkpoint that meets the file-size limit
(`ulimit -f`) is one line, its partial files removed; a collective that times out under torchrun (a rank stuck) is
one line from rank 0 naming --dist-timeout-minutes and the last checkpoint.

Run: python -m pytest -q tests/test_resume_faults.py
"""
import os
import resource
import shutil
import subprocess
import sys
import textwrap

import pytest

import train
from conftest import QUICK, ROOT, run_train
from lab import checkpoint

TRAIN = os.path.join(ROOT, "train.py")


def run_flags(flux_path, out):
    return ["--model", "flux", "--model-path", flux_path, "--output-dir", str(out), *QUICK, "--eval-prompts", "2",
            "--final-eval-seeds", "1"]


@pytest.fixture(scope="module")
def trained_run(flux_path, tmp_path_factory):
    """A finished 3-iteration run with an evaluation at every iteration (metrics.jsonl, samples/eval_iter_*) and
    its one checkpoint, iter_000003; each test takes a copy."""
    out = tmp_path_factory.mktemp("trained") / "run"
    run_train([*run_flags(flux_path, out), "--num-iterations", "3", "--eval-every", "1"])
    return out


def copy_of(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def files_of(out) -> dict:
    """Every file of the folder and its bytes ({relative path: bytes}), the lock aside."""
    found = {}
    for root, _, names in os.walk(out):
        for name in names:
            full = os.path.join(root, name)
            if os.path.relpath(full, out) != ".lock":
                with open(full, "rb") as f:
                    found[os.path.relpath(full, out)] = f.read()
    return found


def error_lines(stderr: str) -> list:
    """The `error:` lines of a run's stderr, from where each begins (a progress bar may precede one)."""
    return [line[line.index("error: "):] for line in stderr.replace("\r", "\n").splitlines() if "error: " in line]


def main_exit(argv, capsys) -> str:
    """train.main on `argv` in this process, which must exit 2 with one `error:` line and no traceback; returns it."""
    with pytest.raises(SystemExit) as exit_info:
        train.main(train.parse_args(argv))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(error_lines(err)) == 1 and "Traceback" not in err, err
    return error_lines(err)[0]


def test_a_resume_whose_only_checkpoint_is_damaged_refuses_and_changes_nothing(flux_path, trained_run, tmp_path,
                                                                              capsys):
    """The run's one checkpoint with 100 bytes flipped: --resume sets it aside and refuses in one line naming it
    and --overwrite, and a second --resume refuses the same way; metrics.jsonl, samples/ and config.json are byte
    for byte as they were (starting afresh would have replaced them)."""
    out = copy_of(trained_run, tmp_path)
    trainer = out / "checkpoints" / "iter_000003" / "trainer.pt"
    data = bytearray(trainer.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 100] = bytes(b ^ 0xFF for b in data[middle : middle + 100])
    trainer.write_bytes(data)
    before = {name.replace("iter_000003/", "iter_000003.damaged/"): data for name, data in files_of(out).items()}
    for _ in range(2):  # a rerun of the same command must not start afresh either
        err = main_exit([*run_flags(flux_path, out), "--num-iterations", "3", "--eval-every", "1", "--resume"], capsys)
        assert "iter_000003.damaged" in err and "--overwrite" in err and "start afresh" in err, err
        assert files_of(out) == before
    assert os.listdir(out / "checkpoints") == ["iter_000003.damaged"]


def test_a_checkpoint_at_the_file_size_limit_is_one_line_and_keeps_the_previous(flux_path, trained_run, tmp_path,
                                                                               capsys):
    """`ulimit -f` between the size of the weights and that of trainer.pt: the resumed run's checkpoint 4 fails in
    torch.save (whose writer reports only "unexpected pos"); one line names the limit, iter_000004.tmp is removed,
    iter_000003 still verifies."""
    out = copy_of(trained_run, tmp_path)
    sizes = {name: len(data) for name, data in files_of(out / "checkpoints" / "iter_000003").items()}
    weights, trainer = sizes[os.path.join("transformer", "diffusion_pytorch_model.safetensors")], sizes["trainer.pt"]
    assert weights < trainer
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, ((weights + trainer) // 2, limits[1]))  # this process's writes
    try:
        err = main_exit([*run_flags(flux_path, out), "--num-iterations", "4", "--eval-every", "100", "--resume"],
                        capsys)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    assert "file-size limit (ulimit -f" in err and "checkpoint 4 at its trainer.pt" in err, err
    assert os.listdir(out / "checkpoints") == ["iter_000003"]
    assert checkpoint.verify(str(out / "checkpoints" / "iter_000003")) is None


STUCK_RANK = textwrap.dedent("""
    # train.py as torchrun runs it, with rank 1 stuck in its second held-out evaluation until torchrun stops it
    # (SIGTERM, once rank 0 has exited: the run's handler asks for a stop), so that torchrun need not wait 30 s
    import os, runpy, sys, time
    sys.path.insert(0, {root!r})
    if os.environ["RANK"] == "1":
        import lab.loop
        calls, evaluate = [], lab.loop.held_out_eval

        def stuck(h, *args, **kwargs):
            calls.append(1)
            while len(calls) == 2 and not h.run.stop_requested:
                time.sleep(0.1)
            return evaluate(h, *args, **kwargs)

        lab.loop.held_out_eval = stuck
    sys.argv = [{train!r}, *sys.argv[1:]]
    runpy.run_path({train!r}, run_name="__main__")
""")


def test_a_stuck_rank_times_out_in_one_line_naming_the_last_checkpoint(flux_path, tmp_path):
    """Two CPU ranks under torchrun, --dist-timeout-minutes 0.1: rank 1 stops answering in the evaluation after
    iteration 2, rank 0's next collective times out after 6 s; rank 0 says so in one line naming the timeout and
    the checkpoint of iteration 1, and no rank prints a traceback of its own (torchrun's report of the failed
    rank follows, as for any rank that exits non-zero). train.py runs its main in lab.run.collective_failures."""
    out = tmp_path / "run"
    script = tmp_path / "stuck_rank.py"
    script.write_text(STUCK_RANK.format(root=ROOT, train=TRAIN))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           *run_flags(flux_path, out), "--lora-rank", "4", "--num-iterations", "3", "--eval-every", "2",
           "--checkpoint-every", "1", "--dist-timeout-minutes", "0.1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr[-5000:]
    line = lines[0]
    assert "timed out after --dist-timeout-minutes 0.1" in line and "stuck or dead" in line, line
    assert os.path.join("checkpoints", "iter_000001") in line, line
    # no frame of this project's code and no gloo message: torchrun's own report names only its files
    assert f'File "{ROOT}' not in proc.stderr and "gloo/transport" not in proc.stderr, proc.stderr[-5000:]



COLLECTIVE = textwrap.dedent("""
    # two ranks of gloo, rank 1 stuck (it joins the collective after rank 0's timeout) or dead (it exits first):
    # rank 0 pickles the exception its collective raised
    import datetime, os, pickle, sys, time
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
    if dist.get_rank() == 1:
        if sys.argv[1] == "dead":
            os._exit(9)
        time.sleep(5)
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as err:
        if dist.get_rank() == 0:
            with open(sys.argv[2], "wb") as f:
                pickle.dump(err, f)
""")


def raised_by_gloo(case, tmp_path):
    """The exception that rank 0's all_reduce raises in two real gloo processes when rank 1 is `case`."""
    import pickle
    import socket

    script = tmp_path / "collective.py"
    script.write_text(COLLECTIVE)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), case, str(tmp_path / "raised.pickle")],
                              env={**env, "RANK": str(rank)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for rank in (0, 1)]
    errors = [procs[0].communicate(timeout=120)[1]]
    procs[1].kill()  # (stuck: no need to wait for it)
    errors.append(procs[1].communicate()[1])
    assert (tmp_path / "raised.pickle").exists(), errors
    with open(tmp_path / "raised.pickle", "rb") as f:
        return pickle.load(f)


@pytest.mark.parametrize("case, words", [("stuck", "timed out after --dist-timeout-minutes 0.05"),
                                         ("dead", "lost its connection to another rank")])
def test_a_collective_that_never_completes_is_one_line_from_rank_0(tmp_path, monkeypatch, capsys, case, words):
    """lab.run.collective_failures on the exception of a real gloo collective between two processes, whose peer
    never joins within the timeout or has died: on rank 0 one line naming the cause and the newest checkpoint, on
    rank 1 none, exit status 1 on both; in one process, or for another error, the exception as it was."""
    import types

    from lab.run import collective_failure, collective_failures

    err = raised_by_gloo(case, tmp_path)
    assert collective_failure(err) == {"stuck": "timeout", "dead": "gone"}[case], err
    (tmp_path / "checkpoints" / "iter_000002").mkdir(parents=True)
    args = types.SimpleNamespace(output_dir=str(tmp_path), dist_timeout_minutes=0.05)
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        with pytest.raises(SystemExit) as exit_info, collective_failures(args):
            raise err
        printed = capsys.readouterr().err
        assert exit_info.value.code == 1 and exit_info.value.__context__ is err
        if rank == 0:
            assert printed.startswith("error: ") and printed.count("\n") == 1 and words in printed, printed
            assert os.path.join("checkpoints", "iter_000002") in printed and "stuck or dead" in printed, printed
        else:
            assert printed == ""
    with pytest.raises(RuntimeError), collective_failures(args):  # another error passes through
        raise RuntimeError("CUDA out of memory")
    monkeypatch.delenv("RANK")
    with pytest.raises(type(err)), collective_failures(args):  # one process has no collectives to time out
        raise err
