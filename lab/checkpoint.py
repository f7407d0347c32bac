"""The run folder on disk: who owns it, checkpoints that a crash cannot corrupt, and the metrics file.

A run folder, `<output>/`:
    .lock                      `hostname pid` of the run that holds the folder (empty once released cleanly)
    config.json                every flag, and the code version
    metrics.jsonl              one strict-JSON line per logged iteration (non-finite numbers written as null)
    samples/                   evaluation grids
    checkpoints/iter_000040/   one checkpoint:
        transformer/           full fine-tune: config.json + diffusion_pytorch_model*.safetensors
                               (FluxTransformer2DModel.from_pretrained(dir) loads it)
        lora/                  LoRA: pytorch_lora_weights.safetensors (FluxPipeline.load_lora_weights(dir) loads it)
        <name>.safetensors     extra named state dicts (e.g. ema.safetensors)
        trainer.pt             optimizer state, iteration, config (torch.load(weights_only=True) reads it)
        manifest.json          every other file's relative path, size and sha256 (written last)
    checkpoints/iter_000050/   a full fine-tune under torchrun (FSDP2), sharded:
        dcp/                   torch.distributed.checkpoint: .metadata + one __<rank>_0.distcp per rank, holding that
                               rank's shards of the weights, the AdamW state and the EMA (each rank writes its own)
        trainer.json           iteration, config, the transformer's config (small: read without torch.load)
        transformer/, ema.safetensors   at the end of the run, exported from dcp/ (`export`)
    checkpoints/iter_000041.tmp/       a checkpoint being written (ignored; replaced by the next save)
    checkpoints/iter_000042.damaged/   a checkpoint that failed verification, set aside (never deleted; a --resume
                                       that finds no complete checkpoint beside such ones refuses: lab/run.py)

Guarantees:
1. One run at a time: `lock_output` takes an flock on `.lock` before anything else is written. The kernel drops
   the flock when its process dies however it dies, so a crashed run's lock is never stale in effect; its
   leftover `hostname pid` is reported in a one-line warning when the next run takes the folder over.
2. A checkpoint appears whole or not at all: it is written into `iter_N.tmp/`, every file and folder fsynced,
   then renamed to `iter_N/` and the `checkpoints/` folder fsynced, so a power loss leaves either the old state
   or the new one.
3. A checkpoint is verified before it is trusted (`verify`): every file the manifest lists is there with its
   size, files up to HASH_LIMIT match their sha256, trainer.pt opens and safetensors opens every .safetensors
   file (its header describes exactly the file's bytes). `latest_checkpoint` returns the newest checkpoint that
   verifies and sets newer damaged ones aside.
4. Rotation deletes only checkpoints older than the one just written, so the newest good one always survives.
5. metrics.jsonl is appended line by line with fsync; a line cut short by a crash is skipped when read, and
   rows from after the resumed checkpoint are dropped by an atomic rewrite.

The data order and every noise are functions of (seed, iteration), so the iteration is all a resume needs.
Works without a process group and under DDP (the full state, written by rank 0), and under FSDP2, where a full
fine-tune is written with torch.distributed.checkpoint: each rank writes and reads only its own shards, no rank
gathers the model or the optimizer state, and a checkpoint saved on N ranks loads on M (DCP reshards). A sharded
checkpoint's large files are verified by size and by DCP's own metadata (every tensor's file, offset and length
must lie inside the files), not hashed: hashing a FLUX full fine-tune's 143 GB at every save and resume would cost
minutes.

    python -m lab.checkpoint export runs/flux/checkpoints/iter_000050    # writes its transformer/ (and ema.safetensors)
"""
import atexit
import contextlib
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import socket
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

# Configurations written before each method had a file of its own held the algorithm as axis flags, which every
# method now fixes: these are the values every method ran with, and each method's class names the ones it changed
# (its `legacy`, methods/base.py). A checkpoint whose axes differ from its method's is refused on resume.
LEGACY_AXES = {"sde_type": "flow", "decode": "sample", "adv_std": "group", "same_noise": True, "kl_form": "exact",
               "reward_fusion": "advantage", "timestep_fraction": 1.0, "member_chunks": 1}
MANIFEST = "manifest.json"
# Files up to this size get a sha256 in the manifest, larger ones their size only. Why: sha256 runs at 0.5-2 GB/s
# on one core, so hashing every LoRA checkpoint (a few GB) costs seconds, but a full FLUX fine-tune (~48 GB of fp32
# weights + ~96 GB of AdamW state) would add minutes to every save and every resume. What a crash does to a file
# (cut short, or never written) shows in its size; fsync before the rename rules out a right-size file of garbage.
HASH_LIMIT = 4 << 30
LORA_WEIGHTS = os.path.join("lora", "pytorch_lora_weights.safetensors")
DCP = "dcp"  # the folder of a sharded checkpoint
TRAINER_JSON = "trainer.json"  # a sharded checkpoint's small state (the optimizer's is in dcp/)
EXPORT_SHARD_BYTES = 5 << 30  # export writes the weights in safetensors files of at most this size


def _is_main():
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


# ---------------------------------------------------------------- the output-folder lock

class LockedError(RuntimeError):
    """The output folder is held by another run that is still alive."""


class NoSpaceError(OSError):
    """A checkpoint could not be written for lack of space; what it had written was removed."""


FULL_BYTES = 16 << 20  # a filesystem with less than this free for the user counts as full when a write fails


def _no_space(err, folder) -> bool:
    """Whether `err`, raised while writing into `folder`, means the disk (or a quota, or the file-size limit) is
    full. safetensors and DCP report the OS error inside their own exception, by its message; torch.save's zip
    writer reports no error at all, only "unexpected pos" (measured on a full tmpfs, and at the file-size limit), so
    the filesystem and the files' sizes are asked."""
    import errno

    if isinstance(err, (KeyboardInterrupt, SystemExit)):
        return False
    if _errno_in(err, (errno.ENOSPC, errno.EDQUOT)) or _file_size_limit_met(err, folder):
        return True
    while folder and not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    try:
        return shutil.disk_usage(folder or ".").free < FULL_BYTES
    except OSError:
        return False


def _errno_in(err, codes) -> bool:
    """Whether `err` carries one of the OS error `codes`, as its errno or in its message (safetensors, DCP)."""
    return getattr(err, "errno", None) in codes or any(os.strerror(code) in str(err) for code in codes)


def _file_size_limit_met(err, folder) -> bool:
    """Whether a write into `folder` failed at the file-size limit: EFBIG in `err`, or a file there that has grown
    to the limit (torch.save's writer says only "unexpected pos")."""
    import errno

    return _errno_in(err, (errno.EFBIG,)) or _at_file_size_limit(folder) is not None


def _file_size_limit():
    """This process's limit on the size of a file it writes (`ulimit -f`, RLIMIT_FSIZE) in bytes, or None."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def _at_file_size_limit(folder):
    """The file under `folder` (relative to it) that has grown to the file-size limit, or None: a write past the
    limit fails with EFBIG, having written up to it (torch.save's writer then reports only "unexpected pos")."""
    limit = _file_size_limit()
    if limit is None or not os.path.isdir(folder):
        return None
    for root, _, names in os.walk(folder):
        for name in sorted(names):
            full = os.path.join(root, name)
            with contextlib.suppress(OSError):
                if os.path.getsize(full) >= limit:
                    return os.path.relpath(full, folder)
    return None


def _ignore_file_size_signal():
    """A write past the file-size limit sends SIGXFSZ, whose default action ends the process without a word;
    ignored, the write fails with EFBIG instead, which a save reports in one line. Python ignores it from its start,
    but a program embedding it or a library may have restored the default: then it is ignored here (the main thread
    alone can set a handler)."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGXFSZ) == signal.SIG_DFL:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


@contextlib.contextmanager
def _removed_if_full(tmp, iteration):
    """A save that runs out of space (or into the file-size limit) removes its partial `tmp` (which would keep the
    disk full) and says so in one line; the previous checkpoints are untouched (the rename never happened)."""
    try:
        yield
    except BaseException as err:  # DCP wraps a rank's OSError in a CheckpointException (a BaseException)
        if not _no_space(err, tmp):
            raise
        at_limit, limit, full_file = _file_size_limit_met(err, tmp), _file_size_limit(), _at_file_size_limit(tmp)
        where = f" at its {full_file}" if full_file else ""  # (safetensors removes its partial file itself)
        shutil.rmtree(tmp, ignore_errors=True)
        if at_limit:  # this process's limit, or the filesystem's largest file (EFBIG without a limit)
            size, fix = (f"ulimit -f: {limit} bytes", "Raise the limit (ulimit -f unlimited)") if limit is not None \
                else ("the filesystem's largest file", "Move the run to a filesystem that holds larger files")
            raise NoSpaceError(f"the file-size limit ({size}) stopped the write of checkpoint {iteration}{where}; its "
                               f"partial files were removed and the previous checkpoints are intact. {fix}, then run "
                               f"the same command plus --resume") from None
        raise NoSpaceError(f"no space left on the device (or the file-size limit) while writing checkpoint "
                           f"{iteration}; its partial files were removed and the previous checkpoints are intact. "
                           f"Free some space, then run the same command plus --resume") from None


class Lock:
    """An exclusive hold on an output folder, from `lock_output`. A context manager; `release()` is idempotent."""

    def __init__(self, path, fd):
        self.path, self._fd, self._owner = path, fd, os.getpid()
        atexit.register(self.release)  # a sys.exit outside any `with` still empties the file

    def release(self):
        if self._fd is None or os.getpid() != self._owner:  # a forked child must not unlock its parent's folder
            return
        os.ftruncate(self._fd, 0)  # empty = released cleanly, so the next run does not warn about a crash
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
        atexit.unregister(self.release)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.release()


def _holder(fd) -> str:
    """`pid P on host H` from the lock file's `hostname pid` line, or '' if it is empty."""
    fields = os.pread(fd, 4096, 0).decode(errors="replace").split()
    return f"pid {fields[1]} on host {fields[0]}" if len(fields) == 2 else " ".join(fields)


def lock_output(output_dir, log=print) -> Lock:
    """Create `output_dir` if needed and hold it for this process, or raise LockedError naming the holder.

    Why flock rather than O_CREAT|O_EXCL: the kernel releases an flock when its process dies, however it dies, so
    there is no stale-lock guessing (a PID reused by an unrelated process, a holder on another host of a shared
    filesystem); the `hostname pid` written into the file is for the messages. Under torchrun only rank 0 locks."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, ".lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd) or "another process (starting up)"
        os.close(fd)
        raise LockedError(f"output folder '{output_dir}' is in use by {holder}: wait for that run to end or stop "
                          f"it, or choose another output folder") from None
    except OSError as err:  # a filesystem without locks (some network mounts): run, but say so
        os.close(fd)
        log(f"warning: cannot lock '{output_dir}' ({err.strerror}); make sure no other run writes into it")
        return Lock(path, None)
    previous = _holder(fd)
    if previous:
        log(f"warning: taking over '{output_dir}', whose lock was left by {previous}, which is no longer running")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{socket.gethostname()} {os.getpid()}\n".encode(), 0)
    os.fsync(fd)
    return Lock(path, fd)


# ---------------------------------------------------------------- listing and verifying checkpoints

def _iteration_of_folder(path) -> int:
    return int(os.path.basename(path).removeprefix("iter_"))


def list_checkpoints(output_dir):
    """Complete checkpoint folders `iter_N`, oldest first (`.tmp`, `.damaged*` and other suffixes are ignored)."""
    folder = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(folder):
        return []
    done = [d for d in os.listdir(folder) if re.fullmatch(r"iter_\d+", d) and os.path.isdir(os.path.join(folder, d))]
    return sorted((os.path.join(folder, d) for d in done), key=_iteration_of_folder)


def set_aside_checkpoints(output_dir, label="damaged"):
    """The checkpoint folders set aside as `iter_N.<label>` (or `.<label>-2`, ...), oldest first."""
    folder = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(folder):
        return []
    aside = [d for d in os.listdir(folder) if re.fullmatch(rf"iter_\d+\.{re.escape(label)}(-\d+)?", d)
             and os.path.isdir(os.path.join(folder, d))]
    return sorted((os.path.join(folder, d) for d in aside), key=lambda p: os.path.basename(p).split(".")[0])


def _sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _manifest_problem(path):
    """Why the files of `path` differ from its manifest, or None."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as err:
        return f"unreadable {MANIFEST} ({err})"
    for name, expected in files.items():
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return f"missing file {name}"
        if os.path.getsize(full) != expected["size"]:
            return f"size mismatch: {name} holds {os.path.getsize(full)} bytes, {expected['size']} were written"
        if "sha256" in expected and _sha256(full) != expected["sha256"]:
            return f"checksum mismatch: {name} differs from what was written"
    return None


def _safetensors_problem(path):
    """Why a .safetensors file is not whole, or None: safetensors itself refuses a header that does not parse or
    does not describe exactly the file's bytes (a file cut short, padded, or of garbage). It maps the file and
    reads the header alone."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt"):
            return None
    except SafetensorError as err:
        return f"safetensors cannot read it ({str(err).removeprefix('Error while deserializing header: ')})"


def _trainer_state_problem(path):
    """Why trainer.pt does not open, or None. mmap reads the zip directory and pickle, not the tensors."""
    try:
        state = torch.load(os.path.join(path, "trainer.pt"), map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # any failure to open it means the same thing: this checkpoint cannot resume
        return f"unreadable trainer.pt ({type(err).__name__}: {(str(err).splitlines() or [''])[0]})"
    return None if isinstance(state, dict) and "iteration" in state else "unreadable trainer.pt (no iteration)"


def is_sharded(path) -> bool:
    """Whether the checkpoint at `path` was written with torch.distributed.checkpoint (a full fine-tune on FSDP2)."""
    return os.path.isdir(os.path.join(path, DCP))


def _dcp_problem(path):
    """Why a sharded checkpoint cannot be loaded, or None: trainer.json must parse, and DCP's metadata must open and
    place every stored tensor inside a file that holds it (file, offset, length)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        with open(os.path.join(path, TRAINER_JSON)) as f:
            if "iteration" not in json.load(f):
                return f"{TRAINER_JSON} holds no iteration"
        metadata = FileSystemReader(os.path.join(path, DCP)).read_metadata()
    except Exception as err:  # any failure to read them means the same thing: this checkpoint cannot resume
        return f"unreadable {TRAINER_JSON} or {DCP}/.metadata ({type(err).__name__})"
    ends = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        full = os.path.join(path, DCP, name)
        if not os.path.isfile(full):
            return f"missing file {DCP}/{name}"
        if os.path.getsize(full) != end:  # DCP writes each file up to its last tensor, no further
            return f"damaged file {DCP}/{name}: it holds {os.path.getsize(full)} bytes, its tensors end at {end}"
    return None


def _structure_problem(path):
    """Why `path` cannot be loaded, judged from its files alone (all a checkpoint without manifest offers)."""
    if is_sharded(path):
        return _dcp_problem(path)
    if not os.path.isfile(os.path.join(path, "trainer.pt")):
        return "missing file trainer.pt"
    transformer = os.path.join(path, "transformer")
    shards = [os.path.join("transformer", n) for n in sorted(os.listdir(transformer)) if n.endswith(".safetensors")] \
        if os.path.isdir(transformer) else []
    if not shards and not os.path.isfile(os.path.join(path, LORA_WEIGHTS)):
        return f"missing weights (neither transformer/*.safetensors nor {LORA_WEIGHTS})"
    extras = [n for n in os.listdir(path) if n.endswith(".safetensors")]
    for name in shards + extras + ([LORA_WEIGHTS] if not shards else []):
        problem = _safetensors_problem(os.path.join(path, name))
        if problem:
            return f"damaged file {name}: {problem}"
    return _trainer_state_problem(path)


def verify(path):
    """None if the checkpoint at `path` is whole, else a one-line reason (missing file, size mismatch, checksum
    mismatch, unreadable trainer.pt, ...). A checkpoint without manifest (older versions) is judged by its files."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        problem = _manifest_problem(path)
        if problem:
            return problem
    return _structure_problem(path)


def _set_aside(path, label):
    """Rename `path` to `path.label` (or `.label-2`, ...) so it is neither loaded nor deleted; returns the name."""
    target, n = f"{path}.{label}", 1
    while os.path.exists(target):
        n += 1
        target = f"{path}.{label}-{n}"
    os.rename(path, target)
    return target


def latest_checkpoint(output_dir, log=print, set_aside=True):
    """The newest checkpoint that verifies, or None. Newer damaged ones are named in a warning and, with `set_aside`,
    renamed `iter_N.damaged` so they neither block nor are retried (call that from one process, rank 0); readers
    such as evaluate.py, which may look at a run while it trains, pass set_aside=False and rename nothing."""
    for path in reversed(list_checkpoints(output_dir)):
        problem = verify(path)
        if problem is None:
            return path
        if set_aside:
            aside = _set_aside(path, "damaged")
            log(f"warning: checkpoint {path} is damaged ({problem}); set aside as {os.path.basename(aside)}, "
                f"trying an older one")
        else:
            log(f"warning: checkpoint {path} is damaged ({problem}); taking an older one")
    return None


def ema_names(path):
    """The names of the EMA tensors checkpoint `path` holds (a run trained with --ema-decay), or None: its
    ema.safetensors (a sharded checkpoint's export too), else a sharded checkpoint's "ema." tensors in dcp/."""
    from safetensors import safe_open

    if os.path.isfile(os.path.join(path, "ema.safetensors")):
        with safe_open(os.path.join(path, "ema.safetensors"), "pt") as f:
            return sorted(f.keys())
    names = [k.removeprefix("ema.") for k in _dcp_tensors(path) if k.startswith("ema.")]
    return sorted(names) or None


def weight_names(path):
    """The names of the trained weights checkpoint `path` holds: its LoRA's, its transformer/'s, or a sharded
    checkpoint's "model." tensors in dcp/ (read from the files' headers and metadata, no tensor loaded)."""
    from safetensors import safe_open

    if os.path.isfile(os.path.join(path, LORA_WEIGHTS)):
        files = [LORA_WEIGHTS]
    elif os.path.isdir(os.path.join(path, "transformer")):  # a full fine-tune (or a sharded one's export)
        files = [os.path.join("transformer", n) for n in sorted(os.listdir(os.path.join(path, "transformer")))
                 if n.endswith(".safetensors")]
    else:  # sharded, not exported
        return sorted(k.removeprefix("model.") for k in _dcp_tensors(path) if k.startswith("model."))
    names = []
    for name in files:
        with safe_open(os.path.join(path, name), "pt") as f:
            names += list(f.keys())
    return sorted(names)


def read_ema(path) -> dict:
    """The EMA tensors of checkpoint `path` ({name: tensor}, on the CPU), from where `ema_names` finds them."""
    from safetensors.torch import load_file

    if os.path.isfile(os.path.join(path, "ema.safetensors")):
        return load_file(os.path.join(path, "ema.safetensors"))
    import torch.distributed.checkpoint as dcp

    stored = _dcp_tensors(path)
    tensors = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in stored.items() if k.startswith("ema.")}
    dcp.load(tensors, checkpoint_id=os.path.join(path, DCP), no_dist=True)  # this process alone
    return {k.removeprefix("ema."): v for k, v in tensors.items()}


def _dcp_tensors(path) -> dict:
    """A sharded checkpoint's stored tensors ({flattened name: metadata}), {} for another checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not is_sharded(path):
        return {}
    metadata = FileSystemReader(os.path.join(path, DCP)).read_metadata().state_dict_metadata
    return {k: m for k, m in metadata.items() if isinstance(m, TensorStorageMetadata)}


def read_trainer_state(path):
    """The iteration and config of a checkpoint (and, unsharded, the optimizer state): a sharded checkpoint's is a
    small JSON file; an unsharded one's is trainer.pt (small unless a single process trains a large model)."""
    if is_sharded(path):
        with open(os.path.join(path, TRAINER_JSON)) as f:
            return json.load(f)
    return torch.load(os.path.join(path, "trainer.pt"), map_location="cpu", weights_only=True)


def incompatible(saved: dict, current: dict, defaults: dict, keys):
    """The first config field of `keys` that differs between a checkpoint and this run, or None. `defaults`: the
    flags' defaults, for the keys a configuration written before them lacks (it ran with those)."""
    if saved.get("window_random"):  # the flag --window-schedule random replaced
        saved = {**saved, "window_schedule": "random"}
    if "sampling" in saved:  # written before each method had a file: its axes must be those its method runs
        from methods import METHODS

        named = saved.get("method", next(iter(METHODS)))  # (before --method, the first: G2RPO)
        # the method now of that name, or the one whose legacy says it was that method's --sampling then
        method = next((name for name, cls in METHODS.items() if cls.legacy.get("method") == named
                       and cls.legacy.get("sampling") == saved["sampling"]), named)
        legacy = {k: v for k, v in (METHODS[method].legacy if method in METHODS else {}).items() if k != "method"}
        axes = {**LEGACY_AXES, "step_per_sde_step": None, **legacy}
        for key, value in axes.items():
            if value is not None and key in saved and json.dumps(saved[key]) != json.dumps(value):
                return key, saved[key], f"{value} (all that --method {method} runs now)"
        # an axis checked here says no more (one a flag again, --sde-type, ran at its method's default then)
        saved = {**{k: v for k, v in saved.items() if axes.get(k) is None}, "method": method}
    if saved.get("model_path") and os.path.isdir(saved["model_path"]) and os.path.isdir(current.get("model_path", "")) \
            and os.path.samefile(saved["model_path"], current["model_path"]):  # the same folder, spelled otherwise
        saved = {**saved, "model_path": current["model_path"]}
    from methods import METHODS

    for name, cls in METHODS.items():  # a method's flags that every run had before the method owned them
        for key, off in cls.retired_flags.items():
            if key in saved and key not in current and json.dumps(saved[key]) != json.dumps(off):
                return key, saved[key], f"not a flag of --method {current.get('method')} (--method {name}'s now)"
    for key in keys:
        before = saved.get(key, defaults.get(key))
        if json.dumps(before) != json.dumps(current.get(key)):
            return key, before, current.get(key)
    return None


# ---------------------------------------------------------------- writing and loading checkpoints

def _full_options():
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_and_describe(path) -> dict:
    """fsync one written file; its manifest entry: size, and sha256 up to HASH_LIMIT."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    entry = {"size": os.path.getsize(path)}
    if entry["size"] <= HASH_LIMIT:
        entry["sha256"] = _sha256(path)
    return entry


def _file_mode() -> int:
    """The mode a new file gets under this process's umask (0o644 with the usual 022)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def _seal(tmp):
    """Give every file under `tmp` the same mode (a library may write one owner-only), fsync it, then write and
    fsync manifest.json last, then fsync every folder."""
    files, mode = {}, _file_mode()
    for root, _, names in os.walk(tmp):
        for name in names:
            full = os.path.join(root, name)
            os.chmod(full, mode)
            files[os.path.relpath(full, tmp)] = _sync_and_describe(full)
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump({"files": dict(sorted(files.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    for root, _, _ in os.walk(tmp, topdown=False):
        _fsync_dir(root)


def _write_files(tmp, iteration, weights, optim_state, config, transformer, lora, pipeline_class, extra):
    from safetensors.torch import save_file

    if lora:
        # the adapter's config (rank, alpha, targets) goes into the file's metadata, so that stock diffusers'
        # load_lora_weights applies the trained scale alpha / rank rather than assuming alpha = rank
        metadata = transformer.peft_config["default"].to_dict()
        pipeline_class.save_lora_weights(os.path.join(tmp, "lora"), transformer_lora_layers=weights,
                                         transformer_lora_adapter_metadata=metadata)
    else:
        from huggingface_hub import save_torch_state_dict

        transformer.save_config(os.path.join(tmp, "transformer"))
        save_torch_state_dict({k: v.contiguous() for k, v in weights.items()}, os.path.join(tmp, "transformer"),
                              filename_pattern="diffusion_pytorch_model{suffix}.safetensors", max_shard_size="10GB")
    for name, state in (extra or {}).items():
        tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
        save_file(tensors, os.path.join(tmp, f"{name}.safetensors"))
    torch.save({"iteration": iteration, "optimizer": optim_state, "config": config}, os.path.join(tmp, "trainer.pt"))


def _foreign_files(path):
    """The files of checkpoint `path` that its save did not write (its manifest's list), e.g. a transformer/ that
    `python -m lab.checkpoint export` added later; None when it has no manifest (an older version's), which counts
    as its own."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            written = set(json.load(f)["files"]) | {MANIFEST}
    except (OSError, ValueError, KeyError):
        return None
    found = {os.path.relpath(os.path.join(root, name), path) for root, _, names in os.walk(path) for name in names}
    return sorted(found - written)


def _rotate(output_dir, iteration, keep, log=print):
    """Delete all but the newest `keep` checkpoints (0: keep all), counting the one just written at `iteration`, and
    say which. Only older ones are candidates, so neither the one just written nor a newer one is ever removed; one
    holding files its save did not write (an export) is kept, with a line saying so."""
    if keep == 0:
        return
    older = [p for p in list_checkpoints(output_dir) if _iteration_of_folder(p) < iteration]
    for old in older[:max(0, len(older) - (keep - 1))]:
        foreign = _foreign_files(old)
        if foreign:
            log(f"note: kept {old} beyond --keep-checkpoints {keep}: it holds files this run did not write "
                f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); remove it yourself when done")
            continue
        shutil.rmtree(old, ignore_errors=True)
        log(f"removed checkpoint {old} (--keep-checkpoints {keep} keeps the newest {keep}; 0 keeps all)")


def clear(output_dir, log=print):
    """--overwrite: remove the checkpoints a run wrote (`iter_N`, and `iter_N.tmp` being written), nothing else. One
    holding files its save did not write (an export) is set aside as `iter_N.replaced` instead, with a line saying
    so; set-aside ones (`.damaged`, `.replaced`) and any other file stay."""
    folder = os.path.join(output_dir, "checkpoints")
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        path = os.path.join(folder, name)
        if not os.path.isdir(path) or not re.fullmatch(r"iter_\d+(\.tmp)?", name):
            continue
        foreign = None if name.endswith(".tmp") else _foreign_files(path)
        if foreign:
            log(f"note: --overwrite set {path} aside as {os.path.basename(_set_aside(path, 'replaced'))}: it holds "
                f"files this run did not write ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''})")
        else:
            shutil.rmtree(path)


def uses_dcp(model, lora) -> bool:
    """A full fine-tune sharded by FSDP2 is saved with torch.distributed.checkpoint (LoRA and DDP are not)."""
    from torch.distributed.fsdp import FSDPModule

    return not lora and isinstance(model, FSDPModule)


def _diffusers_class(module):
    """The diffusers class of a module that FSDP2 may have wrapped (fully_shard subclasses it as FSDP<name>)."""
    return next(c for c in type(module).__mro__ if c.__module__.startswith("diffusers"))


def save(output_dir, iteration, model, transformer, optimizer, config, lora, pipeline_class, keep=2, extra=None,
         log=print, export_weights=False):
    """Write checkpoint `iteration` atomically and durably, then keep the newest `keep`. `model` is what was wrapped
    (DDP / FSDP2 / plain), `transformer` the unwrapped diffusers module; `extra` maps names to further state dicts
    saved as `<name>.safetensors` (gathered by the caller), or, sharded, to tensors saved in dcp/ as they are.
    `export_weights`: a sharded checkpoint also gets its transformer/ (the end of a run). All ranks call this."""
    if any(not re.fullmatch(r"[A-Za-z0-9_-]+", name) for name in extra or {}):
        raise ValueError(f"extra state names must be letters, digits, '_' or '-': {sorted(extra)}")
    _ignore_file_size_signal()  # a write past `ulimit -f` then fails with EFBIG, reported by _removed_if_full
    folder = os.path.join(output_dir, "checkpoints", f"iter_{iteration:06d}")
    if uses_dcp(model, lora):
        return _save_sharded(output_dir, folder, iteration, model, transformer, optimizer, config, keep, extra, log,
                             export_weights)
    if lora:
        from peft import get_peft_model_state_dict

        weights = get_peft_model_state_dict(transformer)  # DDP keeps one full copy per rank
    else:
        weights = get_model_state_dict(model, options=_full_options())
    optim_state = get_optimizer_state_dict(model, optimizer, options=_full_options())
    if _is_main():
        tmp = folder + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)  # a crash's partial write
        os.makedirs(tmp)
        with _removed_if_full(tmp, iteration):
            _write_files(tmp, iteration, weights, optim_state, config, transformer, lora, pipeline_class, extra)
            _publish(output_dir, tmp, folder, iteration, keep, log)
    _barrier()
    return folder


def _publish(output_dir, tmp, folder, iteration, keep, log):
    """Seal the written `tmp` (fsync, manifest), rename it to `folder` and rotate: rank 0 alone."""
    _seal(tmp)
    if os.path.exists(folder):  # e.g. a damaged checkpoint of this iteration that no resume set aside
        problem = verify(folder)
        aside = _set_aside(folder, "damaged" if problem else "replaced")
        log(f"warning: {folder} already existed ({problem or 'complete'}); set aside as {os.path.basename(aside)}")
    os.replace(tmp, folder)  # atomic: the checkpoint appears whole or not at all
    _fsync_dir(os.path.dirname(folder))
    _fsync_dir(output_dir)  # holds the entry of checkpoints/ itself, new at the first save
    _rotate(output_dir, iteration, keep, log)


def _save_sharded(output_dir, folder, iteration, model, transformer, optimizer, config, keep, extra, log, export_):
    """torch.distributed.checkpoint: every rank writes its own shards of the weights, AdamW state and `extra` into
    `tmp/dcp/` (DCP fsyncs its files), rank 0 the small trainer.json; then rank 0 seals and renames as above."""
    import torch.distributed.checkpoint as dcp

    tmp = folder + ".tmp"
    if _is_main():
        shutil.rmtree(tmp, ignore_errors=True)  # a crash's partial write
        os.makedirs(tmp)
    _barrier()
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer),
             **(extra or {})}  # sharded: DTensors of this rank's shards, nothing gathered
    with _removed_if_full(tmp, iteration):
        dcp.save(state, checkpoint_id=os.path.join(tmp, DCP))
    if _is_main():
        config_json = json.loads(transformer.to_json_string())
        config_json["_class_name"] = _diffusers_class(transformer).__name__
        with open(os.path.join(tmp, TRAINER_JSON), "w") as f:
            json.dump({"iteration": iteration, "config": config, "transformer_config": config_json}, f, indent=1)
        if export_:
            export(tmp, log=log)
        _publish(output_dir, tmp, folder, iteration, keep, log)
    _barrier()
    return folder


def export(path, log=print):
    """From a sharded checkpoint's dcp/, write `path`/transformer/ (diffusers: config.json and safetensors files
    that `from_pretrained` loads) and, if it holds an EMA, `path`/ema.safetensors. On the CPU, without the run's
    GPUs or process group, reading one file of at most EXPORT_SHARD_BYTES of tensors at a time."""
    import torch.distributed.checkpoint as dcp
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not is_sharded(path):
        raise ValueError(f"{path} is not a sharded checkpoint (no {DCP}/): its transformer/ or lora/ is already "
                         f"the diffusers format")
    reader = os.path.join(path, DCP)
    stored = {k: m for k, m in FileSystemReader(reader).read_metadata().state_dict_metadata.items()
              if isinstance(m, TensorStorageMetadata)}

    def read(keys, prefix):
        tensors = {k: torch.empty(stored[k].size, dtype=stored[k].properties.dtype) for k in keys}
        dcp.load(tensors, checkpoint_id=reader, no_dist=True)  # this process alone, whatever the world size
        return {k.removeprefix(prefix): v for k, v in tensors.items()}

    tmp = os.path.join(path, "transformer.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    with open(os.path.join(path, TRAINER_JSON)) as f, open(os.path.join(tmp, "config.json"), "w") as out:
        json.dump(json.load(f)["transformer_config"], out, indent=2)
    # the files and their index as huggingface_hub splits a state dict (its shapes alone, on the meta device);
    # each file's tensors are then read from dcp/ and written, one file in memory at a time
    shapes = {k.removeprefix("model."): torch.empty(m.size, dtype=m.properties.dtype, device="meta")
              for k, m in sorted(stored.items()) if k.startswith("model.")}
    split = split_torch_state_dict_into_shards(shapes, filename_pattern="diffusion_pytorch_model{suffix}.safetensors",
                                               max_shard_size=EXPORT_SHARD_BYTES)
    for name, keys in split.filename_to_tensors.items():
        tensors = read(["model." + k for k in keys], "model.")
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(tmp, name))
    if split.is_sharded:
        with open(os.path.join(tmp, "diffusion_pytorch_model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": split.metadata, "weight_map": split.tensor_to_filename}, f, indent=1)
    total, files = split.metadata["total_size"], len(split.filename_to_tensors)
    ema_tmp = os.path.join(path, "ema.safetensors.tmp")
    if any(k.startswith("ema.") for k in stored):  # written beside, so that both files are replaced or neither
        save_file({k: v.contiguous() for k, v in read([k for k in stored if k.startswith("ema.")], "ema.").items()},
                  ema_tmp)
    shutil.rmtree(os.path.join(path, "transformer"), ignore_errors=True)
    os.replace(tmp, os.path.join(path, "transformer"))
    if os.path.exists(ema_tmp):
        os.replace(ema_tmp, os.path.join(path, "ema.safetensors"))
    log(f"exported transformer/ ({total / 2**30:.2f} GiB in {files} file(s)) from {os.path.join(path, DCP)}")


def load(path, model, transformer, optimizer, lora, extra=None):
    """Restore weights and optimizer state from `path`; returns the trainer state dict, with the extra state dicts
    under "extra" ({name: state_dict}, empty if the checkpoint holds none). `extra` ({name: {key: tensor}}): for a
    sharded checkpoint, tensors to load in place (this rank's shards of an EMA); those found are returned as such."""
    from safetensors.torch import load_file

    if is_sharded(path):
        return _load_sharded(path, model, optimizer, extra or {})
    state = read_trainer_state(path)
    if lora:
        from peft import set_peft_model_state_dict

        saved = load_file(os.path.join(path, LORA_WEIGHTS))
        set_peft_model_state_dict(transformer, {k.removeprefix("transformer."): v for k, v in saved.items()})
    else:
        folder = os.path.join(path, "transformer")
        weights = {}
        for name in sorted(os.listdir(folder)):
            if name.endswith(".safetensors"):
                weights.update(load_file(os.path.join(folder, name)))
        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(full_state_dict=True))
    state["extra"] = {name.removesuffix(".safetensors"): load_file(os.path.join(path, name))
                      for name in sorted(os.listdir(path)) if name.endswith(".safetensors")}
    return state


def _load_sharded(path, model, optimizer, extra):
    """Each rank reads its own shards (DCP reshards when this run has another number of ranks than the saving one,
    or none at all)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    state = read_trainer_state(path)  # trainer.json
    stored = FileSystemReader(os.path.join(path, DCP)).read_metadata().state_dict_metadata
    present = {name: tensors for name, tensors in extra.items() if any(k.startswith(name + ".") for k in stored)}
    full = not dist.is_initialized()  # one process: a plain module, whatever the saving run's world size
    tensors = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer),
               **present}
    dcp.load(tensors, checkpoint_id=os.path.join(path, DCP), no_dist=full)
    set_model_state_dict(model, tensors["model"])
    set_optimizer_state_dict(model, optimizer, tensors["optimizer"])
    state["extra"] = present
    return state


# ---------------------------------------------------------------- metrics.jsonl

def _finite_or_null(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value


def append_metrics(path, row: dict):
    """Append `row` as one strict-JSON line, flushed and fsynced. Non-finite floats (NaN, inf) are written as
    null, since strict JSON has no NaN: a null metric means the value was not finite."""
    line = json.dumps(_finite_or_null(row), allow_nan=False) + "\n"
    with open(path, "a+b") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":  # a line cut short by a crash: do not glue this row onto it
                line = "\n" + line
        f.write(line.encode())
        f.flush()
        os.fsync(f.fileno())


def read_metrics(path) -> list:
    """The rows of a metrics file (a missing file has none), non-finite numbers as None; lines that do not parse
    (cut short by a crash) are skipped."""
    if not os.path.exists(path):
        return []
    rows = []
    with open(path, errors="replace") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(_finite_or_null(row))  # an older version's bare NaN reads as null too
    return rows


def truncate_metrics(path, upto_iteration, log=print) -> list:
    """Keep the rows with iteration <= `upto_iteration` (the resumed checkpoint's), rewritten atomically; returns
    them. A missing file, or one without a row for that iteration, is warned about and rebuilt from what is there
    (possibly empty): the metrics never block a resume."""
    if not os.path.exists(path):
        log(f"warning: {path} is missing; starting a new one (the curve before iteration {upto_iteration} is lost)")
    rows = [r for r in read_metrics(path) if isinstance(r.get("iteration"), int) and r["iteration"] <= upto_iteration]
    if os.path.exists(path) and not any(r["iteration"] == upto_iteration for r in rows):
        log(f"warning: {path} has no row for iteration {upto_iteration}; keeping the {len(rows)} rows before it")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r, allow_nan=False) + "\n" for r in rows)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))
    return rows


def export_command(path, log=print):
    """`python -m lab.checkpoint export PATH`: check the checkpoint, hold it, export; a problem is one `error:` line
    (exit 2) with nothing left half-written."""
    def stop(message):
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)

    if not os.path.isdir(path):
        stop(f"{path} does not exist; pass a checkpoint folder (runs/<name>/checkpoints/iter_XXXXXX)")
    if not is_sharded(path):
        stop(f"{path} holds no {DCP}/ folder; pass a checkpoint of a sharded full fine-tune (its transformer/ or lora/ "
             f"is already the diffusers format)")
    problem = verify(path)
    if problem:
        stop(f"checkpoint {path} is damaged ({problem}); nothing was exported: export an older checkpoint")
    lock = os.path.abspath(path) + ".export.lock"  # beside the checkpoint, not inside it
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        stop(f"another export of {path} is running; wait for it to end")
    try:
        export(path, log)
    except Exception as err:  # a full disk, an unreadable shard (safetensors and DCP raise their own types)
        shutil.rmtree(os.path.join(path, "transformer.tmp"), ignore_errors=True)
        if os.path.exists(os.path.join(path, "ema.safetensors.tmp")):
            os.remove(os.path.join(path, "ema.safetensors.tmp"))
        reason = "no space left on the device" if _no_space(err, path) else \
            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        stop(f"exporting {path} failed ({reason}); its files are as they were")
    finally:
        with contextlib.suppress(OSError):
            os.remove(lock)  # still held: no other export has it, and none is left behind for rotation to orphan
        os.close(fd)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "export":
        raise SystemExit("usage: python -m lab.checkpoint export CHECKPOINT_FOLDER   (writes its transformer/)")
    export_command(sys.argv[2])
