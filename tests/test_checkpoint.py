"""The run folder on disk (lab/checkpoint.py): the output-folder lock held by real processes, checkpoints written by
`save` from a real tiny FluxTransformer2DModel and AdamW then damaged on disk, and the metrics file.

    python -m pytest -q tests/test_checkpoint.py
"""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from lab import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WEIGHTS = os.path.join("transformer", "diffusion_pytorch_model.safetensors")


# ---------------------------------------------------------------- the lock, with real processes

def start_holder(out):
    """A separate Python process that takes the lock on `out`, says so, and sleeps holding it."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {ROOT!r})
        from lab import checkpoint
        lock = checkpoint.lock_output({str(out)!r})
        print("locked", flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_live_holder_refuses_a_second_run_and_a_killed_one_is_taken_over(tmp_path):
    out = tmp_path / "runs" / "x"  # created by the holder
    holder = start_holder(out)
    try:
        with pytest.raises(checkpoint.LockedError) as refused:
            checkpoint.lock_output(str(out))
        message = str(refused.value)
        assert "\n" not in message and str(out) in message and f"pid {holder.pid}" in message
        assert socket.gethostname() in message
    finally:
        holder.kill()
        holder.wait()
    warnings = []
    with checkpoint.lock_output(str(out), log=warnings.append) as lock:
        assert len(warnings) == 1 and f"pid {holder.pid}" in warnings[0] and "no longer running" in warnings[0]
        assert open(lock.path).read() == f"{socket.gethostname()} {os.getpid()}\n"
    lock.release()  # a second release is harmless
    assert open(lock.path).read() == ""


def test_a_second_process_is_refused_while_this_one_holds_and_a_clean_release_leaves_no_warning(tmp_path):
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {ROOT!r})
        from lab import checkpoint
        try:
            with checkpoint.lock_output({str(tmp_path)!r}):
                print("took it")
        except checkpoint.LockedError as err:
            sys.exit(str(err))
    """)
    lock = checkpoint.lock_output(str(tmp_path))
    refused = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert refused.returncode == 1 and f"pid {os.getpid()}" in refused.stderr and "Traceback" not in refused.stderr
    lock.release()
    taken = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert taken.returncode == 0 and taken.stdout == "took it\n"  # no warning: it was released cleanly
    with checkpoint.lock_output(str(tmp_path), log=pytest.fail):
        pass


def test_a_forked_child_cannot_release_its_parents_lock(tmp_path):
    lock = checkpoint.lock_output(str(tmp_path))
    child = os.fork()
    if child == 0:  # as a data-loader worker would, on its way out
        lock.release()
        os._exit(0)
    os.waitpid(child, 0)
    with pytest.raises(checkpoint.LockedError):
        checkpoint.lock_output(str(tmp_path))
    lock.release()


# ---------------------------------------------------------------- checkpoints written by save

@pytest.fixture
def trained():
    """A tiny real FluxTransformer2DModel and an AdamW that has taken one step (so it holds state)."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                   attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                   pooled_projection_dim=16, axes_dims_rope=[2, 2, 4])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    return model, optimizer


def save(out, iteration, trained, keep=2, extra=None, log=print):
    model, optimizer = trained
    return checkpoint.save(str(out), iteration, model, model, optimizer, {"seed": 0}, False, None, keep=keep,
                           extra=extra, log=log)


def test_save_writes_a_manifest_and_load_restores_everything(tmp_path, trained):
    model, optimizer = trained
    ema = {"w": torch.arange(6.0).reshape(2, 3)}
    path = save(tmp_path, 1, trained, extra={"ema": ema})
    assert os.listdir(tmp_path / "checkpoints") == ["iter_000001"]
    files = json.load(open(os.path.join(path, "manifest.json")))["files"]
    assert sorted(files) == ["ema.safetensors", "trainer.pt", "transformer/config.json", WEIGHTS]
    for name, entry in files.items():
        assert entry["size"] == os.path.getsize(os.path.join(path, name)) and len(entry["sha256"]) == 64
    modes = {os.stat(os.path.join(path, name)).st_mode & 0o777 for name in [*files, "manifest.json"]}
    assert len(modes) == 1  # the weights too, which the hub library writes owner-only
    assert checkpoint.verify(path) is None
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = checkpoint.load(path, model, model, optimizer, lora=False)
    assert state["iteration"] == 1 and state["config"] == {"seed": 0}
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    assert torch.equal(state["extra"]["ema"]["w"], ema["w"])


def test_lora_checkpoints_verify_and_load(tmp_path, trained):
    from diffusers import FluxPipeline
    from peft import LoraConfig

    model, _ = trained
    model.add_adapter(LoraConfig(r=2, lora_alpha=2, init_lora_weights="gaussian", target_modules=["to_q", "to_v"]))
    lora_params = [p for n, p in model.named_parameters() if "lora" in n]
    optimizer = torch.optim.AdamW(lora_params)
    path = checkpoint.save(str(tmp_path), 3, model, model, optimizer, {}, True, FluxPipeline)
    assert checkpoint.verify(path) is None
    saved = [p.detach().clone() for p in lora_params]
    with torch.no_grad():
        for p in lora_params:
            p.zero_()
    assert checkpoint.load(path, model, model, optimizer, lora=True)["extra"] == {}
    assert all(torch.equal(p, s) for p, s in zip(lora_params, saved))


def truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def flip_a_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


DAMAGE = {  # name: (what is done to the newest checkpoint, words of the reason)
    "truncated trainer.pt": (lambda c: truncate(os.path.join(c, "trainer.pt")), "size mismatch: trainer.pt"),
    "truncated weights": (lambda c: truncate(os.path.join(c, WEIGHTS)), f"size mismatch: {WEIGHTS}"),
    "truncated extra": (lambda c: truncate(os.path.join(c, "ema.safetensors")), "size mismatch: ema.safetensors"),
    "missing trainer.pt": (lambda c: os.remove(os.path.join(c, "trainer.pt")), "missing file trainer.pt"),
    "missing weights": (lambda c: os.remove(os.path.join(c, WEIGHTS)), f"missing file {WEIGHTS}"),
    "flipped byte": (lambda c: flip_a_byte(os.path.join(c, WEIGHTS)), f"checksum mismatch: {WEIGHTS}"),
    "missing manifest, truncated trainer.pt": (
        lambda c: (os.remove(os.path.join(c, "manifest.json")), truncate(os.path.join(c, "trainer.pt"))),
        "unreadable trainer.pt"),
    "missing manifest, truncated weights": (
        lambda c: (os.remove(os.path.join(c, "manifest.json")), truncate(os.path.join(c, WEIGHTS))),
        f"damaged file {WEIGHTS}"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_newest_checkpoint_is_set_aside_and_resuming_twice_works(tmp_path, trained, damage):
    model, optimizer = trained
    ema = {"w": torch.ones(3)}
    save(tmp_path, 1, trained, extra={"ema": ema})
    for attempt in (1, 2):  # resume, train, crash-damage again, resume again
        newest = save(tmp_path, 2, trained, extra={"ema": ema})
        harm, reason = DAMAGE[damage]
        harm(newest)
        assert reason in checkpoint.verify(newest)
        warnings = []
        good = checkpoint.latest_checkpoint(str(tmp_path), log=warnings.append)
        assert good.endswith("iter_000001") and len(warnings) == 1
        assert "iter_000002" in warnings[0] and reason in warnings[0] and "\n" not in warnings[0]
        aside = "iter_000002.damaged" + ("" if attempt == 1 else "-2")
        assert os.path.isdir(tmp_path / "checkpoints" / aside) and not os.path.exists(newest)
        assert checkpoint.load(good, model, model, optimizer, lora=False)["iteration"] == 1
    assert checkpoint.latest_checkpoint(str(tmp_path), log=pytest.fail).endswith("iter_000001")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["iter_000001", "iter_000002.damaged",
                                                              "iter_000002.damaged-2"]


def test_save_sets_aside_a_folder_already_at_its_place(tmp_path, trained):
    save(tmp_path, 1, trained)
    os.remove(os.path.join(save(tmp_path, 2, trained), "trainer.pt"))  # damaged, but nobody ran latest_checkpoint
    warnings = []
    path = save(tmp_path, 2, trained, log=warnings.append)  # used to fail: OSError: Directory not empty
    assert checkpoint.verify(path) is None and "missing file trainer.pt" in warnings[0]
    path = save(tmp_path, 2, trained, log=warnings.append)  # a complete one is set aside too, never deleted
    assert checkpoint.verify(path) is None and "complete" in warnings[1]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["iter_000001", "iter_000002", "iter_000002.damaged",
                                                              "iter_000002.replaced"]


def test_a_checkpoint_without_manifest_from_an_older_version_is_accepted(tmp_path, trained):
    path = save(tmp_path, 1, trained)
    os.remove(os.path.join(path, "manifest.json"))
    assert checkpoint.verify(path) is None
    shutil.rmtree(os.path.join(path, "transformer"))
    assert checkpoint.verify(path).startswith("missing weights")


def test_rotation_keeps_the_newest_and_never_a_newer_one(tmp_path, trained):
    for it in (1, 2, 3, 4):
        save(tmp_path, it, trained)
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(tmp_path))] == ["iter_000003", "iter_000004"]
    save(tmp_path, 2, trained)  # a save older than what is there removes nothing newer
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(tmp_path))] == [
        "iter_000002", "iter_000003", "iter_000004"]
    save(tmp_path, 5, trained, keep=1)
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(tmp_path))] == ["iter_000005"]


def test_rotation_says_what_it_removes_keeps_exports_and_keep_0_keeps_all(tmp_path, trained):
    logs = []
    for it in (1, 2):
        save(tmp_path, it, trained, log=logs.append)
    # a file the run did not write (an export into an older checkpoint) keeps that checkpoint, and says so
    extra_file = tmp_path / "checkpoints" / "iter_000001" / "exported" / "config.json"
    extra_file.parent.mkdir()
    extra_file.write_text("{}")
    save(tmp_path, 3, trained, log=logs.append)
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(tmp_path))] == [
        "iter_000001", "iter_000002", "iter_000003"]
    assert any("kept" in line and "iter_000001" in line and "exported/config.json" in line for line in logs)
    shutil.rmtree(extra_file.parent)
    save(tmp_path, 4, trained, log=logs.append)
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(tmp_path))] == ["iter_000003", "iter_000004"]
    assert sum("removed checkpoint" in line for line in logs) == 2
    for it in (5, 6, 7):
        save(tmp_path, it, trained, keep=0, log=logs.append)
    assert len(checkpoint.list_checkpoints(str(tmp_path))) == 5


def test_list_checkpoints_ignores_partial_and_damaged_folders(tmp_path):
    for name in ("iter_000002", "iter_1000000", "iter_000003.tmp", "iter_000004.damaged", "iter_000004.damaged-2",
                 "notes"):
        os.makedirs(tmp_path / "checkpoints" / name)
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(tmp_path))] == ["iter_000002",
                                                                                          "iter_1000000"]
    assert checkpoint.list_checkpoints(str(tmp_path / "elsewhere")) == []


def test_resume_config_checks_still_work(tmp_path, trained):
    path = save(tmp_path, 1, trained)
    assert checkpoint.read_trainer_state(path)["config"] == {"seed": 0}
    keys = ["seed", "method", "timestep_fraction", "model_path"]
    assert checkpoint.incompatible({"seed": 0}, {"seed": 0}, {}, keys) is None
    assert checkpoint.incompatible({"seed": 0}, {"seed": 1}, {}, keys) == ("seed", 0, 1)
    # a configuration written before a flag existed ran with its default
    assert checkpoint.incompatible({}, {"timestep_fraction": 0.6}, {"timestep_fraction": 0.6}, keys) is None
    assert checkpoint.incompatible({}, {"timestep_fraction": 0.5}, {"timestep_fraction": 0.6}, keys) == \
        ("timestep_fraction", 0.6, 0.5)
    # one written when the algorithm was axis flags: it resumes under the method that ran those axes, or is refused
    old_dance = {"method": "dancegrpo", "sampling": "full", "sde_type": "dance", "decode": "x0", "adv_std": "group",
                 "same_noise": True, "kl_form": "exact", "reward_fusion": "advantage", "timestep_fraction": 0.6,
                 "step_per_sde_step": False, "member_chunks": 3}
    assert checkpoint.incompatible(old_dance, {"method": "dancegrpo", "timestep_fraction": 0.6}, {}, keys) is None
    full = {"method": "g2rpo", "sampling": "full", "sde_type": "flow", "timestep_fraction": 1.0}
    assert checkpoint.incompatible(full, {"method": "full-sde"}, {}, ["method"]) is None
    assert checkpoint.incompatible(full, {"method": "g2rpo"}, {}, ["method"]) == ("method", "full-sde", "g2rpo")
    mixed_axes = {**old_dance, "sde_type": "cps"}
    assert checkpoint.incompatible(mixed_axes, {"method": "dancegrpo"}, {}, keys)[0] == "sde_type"
    # the same model folder spelled with a trailing slash or relative to here is the same folder
    folder = tmp_path / "model"
    folder.mkdir()
    relative = os.path.relpath(folder)
    assert checkpoint.incompatible({"model_path": str(folder)}, {"model_path": relative + "/"}, {}, keys) is None
    other = tmp_path / "other"
    other.mkdir()
    assert checkpoint.incompatible({"model_path": str(folder)}, {"model_path": str(other)}, {}, keys)[0] == \
        "model_path"


# ---------------------------------------------------------------- metrics.jsonl

def test_metrics_are_strict_json_and_a_cut_line_is_skipped(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    checkpoint.append_metrics(path, {"iteration": 0, "a": 1.5, "b": float("nan"), "c": float("inf")})
    with open(path, "a") as f:
        f.write('{"iteration": 1, "a": 2')  # a crash mid-line
    checkpoint.append_metrics(path, {"iteration": 1, "a": 2.0})
    for line in open(path):
        if line.startswith('{"iteration": 0') or line.endswith("2.0}\n"):
            json.loads(line, parse_constant=pytest.fail)  # strict: no NaN / Infinity tokens
    assert checkpoint.read_metrics(path) == [{"iteration": 0, "a": 1.5, "b": None, "c": None},
                                             {"iteration": 1, "a": 2.0}]


def test_truncate_metrics_keeps_rows_up_to_the_checkpoint_and_never_blocks(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    with open(path, "w") as f:  # an older version's file: bare NaN, and a line cut short
        f.write('{"iteration": 0, "a": NaN}\n{"iteration": 1}\n{"iteration": 2}\n{"iteration": 3, "a"')
    assert checkpoint.truncate_metrics(path, 2, log=pytest.fail) == [{"iteration": 0, "a": None}, {"iteration": 1},
                                                                     {"iteration": 2}]
    assert checkpoint.read_metrics(path) == [{"iteration": 0, "a": None}, {"iteration": 1}, {"iteration": 2}]
    warnings = []
    assert checkpoint.truncate_metrics(path, 5, log=warnings.append) == checkpoint.read_metrics(path)
    assert "no row for iteration 5" in warnings[0]
    os.remove(path)
    assert checkpoint.truncate_metrics(path, 5, log=warnings.append) == []
    assert "missing" in warnings[1] and len(warnings) == 2 and open(path).read() == ""


# ---------------------------------------------------------------- sharded (DCP) checkpoints of an FSDP2 model

@pytest.fixture
def sharded(trained):
    """The tiny model sharded by FSDP2 over a one-rank gloo process group, as train.py shards a full fine-tune."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    model, _ = trained
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    yield model, optimizer
    dist.destroy_process_group()


def local_weights(model):
    return {k: v.to_local().clone() for k, v in model.state_dict().items()}


SHARD = os.path.join("dcp", "__0_0.distcp")
SHARDED_DAMAGE = {
    "truncated shard": (lambda c: truncate(os.path.join(c, SHARD)), f"size mismatch: {SHARD}"),
    "flipped byte in a shard": (lambda c: flip_a_byte(os.path.join(c, SHARD)), f"checksum mismatch: {SHARD}"),
    "missing metadata": (lambda c: os.remove(os.path.join(c, "dcp", ".metadata")), "missing file dcp/.metadata"),
    "missing manifest, truncated shard": (
        lambda c: (os.remove(os.path.join(c, "manifest.json")), truncate(os.path.join(c, SHARD))),
        f"damaged file {SHARD}"),
    "missing manifest and trainer.json": (
        lambda c: (os.remove(os.path.join(c, "manifest.json")), os.remove(os.path.join(c, "trainer.json"))),
        "unreadable trainer.json"),
}


@pytest.mark.parametrize("damage", list(SHARDED_DAMAGE))
def test_sharded_checkpoints_verify_fall_back_and_load(tmp_path, sharded, damage):
    model, optimizer = sharded
    ema = {name: p.detach().clone() for name, p in model.named_parameters()}  # this rank's shards, as run.EMA holds
    first = checkpoint.save(str(tmp_path), 1, model, model, optimizer, {"seed": 0}, False, None, extra={"ema": ema})
    assert sorted(os.listdir(os.path.join(first, "dcp"))) == [".metadata", "__0_0.distcp"]
    assert checkpoint.verify(first) is None and checkpoint.read_trainer_state(first)["iteration"] == 1
    expected, saved_ema = local_weights(model), {k: v.to_local().clone() for k, v in ema.items()}
    newest = checkpoint.save(str(tmp_path), 2, model, model, optimizer, {"seed": 0}, False, None, extra={"ema": ema})
    harm, reason = SHARDED_DAMAGE[damage]
    harm(newest)
    assert reason in checkpoint.verify(newest)
    good = checkpoint.latest_checkpoint(str(tmp_path), log=lambda m: None)
    assert good == first and os.path.isdir(newest + ".damaged")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for v in ema.values():
            v.zero_()
    state = checkpoint.load(good, model, model, optimizer, lora=False, extra={"ema": ema})
    assert state["iteration"] == 1 and state["extra"]["ema"] is ema  # loaded in place
    assert all(torch.equal(v, expected[k]) for k, v in local_weights(model).items())
    assert all(torch.equal(v.to_local(), saved_ema[k]) for k, v in ema.items())


def test_a_save_at_the_file_size_limit_removes_its_partial_files(tmp_path):
    """A real write failure: the process's file-size limit (RLIMIT_FSIZE, `ulimit -f`) makes a save fail midway,
    in the safetensors weights (checkpoint 2: the OS error, EFBIG, in its message) or in torch.save's trainer.pt
    (checkpoint 3: its writer reports only "unexpected pos"), with SIGXFSZ at its default, which would end the
    process unless the save ignores it. Each time the .tmp is removed, one line names the limit, and the first
    checkpoint stays the newest good one."""
    script = textwrap.dedent(f"""
        import os, resource, signal, sys, torch
        sys.path.insert(0, {ROOT!r})
        from lab import checkpoint
        from diffusers import FluxTransformer2DModel
        model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                       attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                       pooled_projection_dim=16, axes_dims_rope=[2, 2, 4])
        optimizer = torch.optim.AdamW(model.parameters())
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()  # AdamW's two moments: trainer.pt is about twice the weights
        first = checkpoint.save({str(tmp_path)!r}, 1, model, model, optimizer, {{}}, False, None, log=print)
        weights = os.path.getsize(os.path.join(first, {WEIGHTS!r}))
        trainer = os.path.getsize(os.path.join(first, "trainer.pt"))
        assert weights < trainer, (weights, trainer)
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # as a program embedding Python may leave it
        for iteration, limit in [(2, weights // 2), (3, (weights + trainer) // 2)]:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
            try:
                checkpoint.save({str(tmp_path)!r}, iteration, model, model, optimizer, {{}}, False, None, log=print)
            except checkpoint.NoSpaceError as err:
                print("refused:", err)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]  # (SIGXFSZ would have ended it with -25)
    refused = [line for line in proc.stdout.splitlines() if line.startswith("refused: ")]
    assert len(refused) == 2 and all("the file-size limit (ulimit -f: " in line for line in refused), proc.stdout
    assert "checkpoint 2;" in refused[0] and "checkpoint 3 at its trainer.pt;" in refused[1], refused
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["iter_000001"]
    assert checkpoint.latest_checkpoint(str(tmp_path), log=pytest.fail).endswith("iter_000001")


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real filesystem of a given size: a tmpfs mounted for the test (root only; skipped where mounting is not
    allowed). Yields mount(size_bytes) -> its path; every mount is undone at the end."""
    mounted = []

    def mount(size):
        target = tmp_path / f"fs{len(mounted)}"
        target.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(target)],
                              capture_output=True, text=True)
        if proc.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()})")
        mounted.append(target)
        return target

    yield mount
    for target in mounted:
        subprocess.run(["umount", "--lazy", str(target)], capture_output=True)  # lazy: even if a file is open


@pytest.mark.parametrize("fill", [0.1, 0.7])  # runs out in the safetensors file, in torch.save's trainer.pt
def test_a_save_on_a_full_filesystem_removes_its_partial_files(tmp_path, small_tmpfs, fill):
    """A real full disk: a tmpfs with room for one checkpoint and `fill` of a second (its 3.8 MB of weights are
    written first, then the 7.7 MB trainer.pt). Each writer fails in its own way at the end of the disk, safetensors
    with the OS error, torch.save's zip writer with "unexpected pos" and no error code; either way one NoSpaceError,
    the partial iter_2.tmp is gone, and iter_1 is the newest good one."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                   attention_head_dim=32, num_attention_heads=4, joint_attention_dim=64,
                                   pooled_projection_dim=32, axes_dims_rope=[8, 12, 12])
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    trained = model, optimizer
    save(tmp_path / "sizes", 1, trained, log=lambda *_: None)
    first = tmp_path / "sizes" / "checkpoints" / "iter_000001"
    size = sum(os.path.getsize(os.path.join(root, n)) for root, _, names in os.walk(first) for n in names)
    out = small_tmpfs(int(size * (1 + fill)) + (64 << 10))
    save(out, 1, trained, log=lambda *_: None)
    with pytest.raises(checkpoint.NoSpaceError, match="no space left on the device .* checkpoint 2; its partial"):
        save(out, 2, trained, log=lambda *_: None)
    assert sorted(os.listdir(out / "checkpoints")) == ["iter_000001"]
    assert checkpoint.latest_checkpoint(str(out), log=pytest.fail).endswith("iter_000001")


HOST_MEMORY_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    import torch.distributed as dist
    sys.path.insert(0, {root!r})
    from lab import checkpoint
    from diffusers import FluxTransformer2DModel
    from torch.distributed.fsdp import fully_shard

    def peak_mib():  # VmHWM, the peak resident memory, reset before each phase
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) / 1024

    def reset():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=4,
                                   attention_head_dim=64, num_attention_heads=8, joint_attention_dim=256,
                                   pooled_projection_dim=256, guidance_embeds=True, axes_dims_rope=[8, 28, 28])
    full_mib = sum(p.numel() * 4 for p in model.parameters()) * 3 / 2**20  # weights + AdamW's two moments
    for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    reset(); before = peak_mib()
    path = checkpoint.save({out!r}, 1, model, model, optimizer, {{}}, False, None, log=lambda m: None)
    save = peak_mib() - before
    reset(); before = peak_mib()
    checkpoint.load(path, model, model, optimizer, lora=False)
    load = peak_mib() - before
    print(json.dumps({{"rank": dist.get_rank(), "save": save, "load": load, "full": full_mib}}), flush=True)
    dist.destroy_process_group()
""")


def test_a_sharded_save_and_resume_hold_no_gathered_state(tmp_path, ranks=2):
    """Host memory per rank while a 2-rank FSDP2 model (418 MiB of fp32 weights and AdamW state) is saved and
    loaded: each rank's peak grows by far less than the full state, which gathering it on any rank would cost."""
    script = tmp_path / "host_memory.py"
    script.write_text(HOST_MEMORY_SCRIPT.format(root=ROOT, out=str(tmp_path / "run")))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
                           str(script)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the ranks print at once, so their lines may run together: read every {...} object wherever it lies
    figures = [json.loads(found) for found in re.findall(r"\{[^{}]*\}", proc.stdout)]
    assert len(figures) == ranks
    for f in figures:  # measured: +5 to +6 MiB to save, +0.6 to +1.4 MiB to load (the same on 1 rank)
        assert f["save"] < 0.25 * f["full"] and f["load"] < 0.25 * f["full"], figures


def test_export_refuses_in_one_line_and_writes_nothing(tmp_path, capsys):
    """`python -m lab.checkpoint export`: a missing folder, a non-sharded one and a damaged one are each one line."""
    damaged = tmp_path / "iter_000001"
    (damaged / "dcp").mkdir(parents=True)
    (damaged / "dcp" / ".metadata").write_bytes(b"garbage")
    for path, words in [(tmp_path / "nope", "does not exist"), (tmp_path, "holds no dcp/ folder"),
                        (damaged, "is damaged")]:
        with pytest.raises(SystemExit) as exit_info:
            checkpoint.export_command(str(path))
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and err.startswith("error: ") and words in err and "\n" not in err, err
    assert sorted(os.listdir(damaged)) == ["dcp"]
