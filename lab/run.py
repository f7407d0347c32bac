"""Everything around the training loop that is not the method: the output folder, checkpoints and resume, signals,
fault counting, metrics and trackers, sample grids, EMA weights, the check that ranks agree, and the one line of a
collective that never completes (a rank stuck or dead).

train.py calls a `Run` at fixed points of its loop; nothing here knows how a rollout or an update works.
"""
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid

import torch
import torch.distributed as dist

from lab import checkpoint
from lab import fail, flags
from methods.base import FrozenCopy

GRID_IMAGES = 24  # held-out samples in a grid: train.py keeps each evaluation's first this many, across its batches

HERE = os.path.dirname(os.path.abspath(__file__))


def eval_noise_generator(prompt: int, seed: int) -> torch.Generator:
    """The initial noise of held-out image (prompt, seed), the same in train.py's evaluation and evaluate.py.
    Distinct for every pair while there are fewer than 1000 prompts (HPDv2's test set has 400)."""
    return torch.Generator().manual_seed(1_000_000 + 1000 * seed + prompt)


def code_version():
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=HERE, capture_output=True, text=True, timeout=5)
        return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def backend() -> str:
    """The process group's backends: NCCL for CUDA tensors, gloo for the CPU ones (the scalars, metrics and rewards
    that the loop reduces live on the CPU, and NCCL alone cannot reduce them); gloo alone on a machine without CUDA."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def all_mean(values: dict, distributed: bool) -> dict:
    """Mean of logged scalars over ranks."""
    if not distributed:
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return {k: float(v) / dist.get_world_size() for k, v in zip(keys, t)}


def all_gather(tensor: torch.Tensor, distributed: bool) -> torch.Tensor:
    """Every rank's `tensor` (the same shape on each), concatenated along dim 0 in rank order (an advantage over
    every rank's rewards needs them)."""
    if not distributed:
        return tensor
    parts = [torch.empty_like(tensor, device="cpu") for _ in range(dist.get_world_size())]  # through gloo
    dist.all_gather(parts, tensor.cpu().contiguous())
    return torch.cat(parts).to(tensor.device)


def _all_reduce_count(n, distributed: bool, op):
    """The reduction of a number over the ranks, of the number's type (int or float)."""
    if not distributed:
        return n
    t = torch.tensor([float(n)], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return type(n)(t.item())


def all_sum(n: int, distributed: bool) -> int:
    """The sum of every rank's n (a mean over every rank's trained (member, step) pairs needs their count)."""
    return _all_reduce_count(n, distributed, dist.ReduceOp.SUM)


def all_max(n, distributed: bool):
    """The largest of every rank's n: the busiest rank's forward calls, which every rank then makes; the worst
    first-step ratio error, on which every rank then decides."""
    return _all_reduce_count(n, distributed, dist.ReduceOp.MAX)


class Ranks:
    """The run's ranks as a method sees them (methods/base.py's UpdateContext.ranks): the count, and the three
    collectives an update or an advantage may need."""

    def __init__(self, world: int, distributed: bool):
        self.world, self.distributed = world, distributed

    def sum(self, n: int) -> int:
        return all_sum(n, self.distributed)

    def max(self, n):
        return all_max(n, self.distributed)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return all_gather(tensor, self.distributed)


def any_rank(flag: bool, distributed: bool) -> bool:
    if not distributed:
        return flag
    t = torch.tensor([float(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def full_tensor(p):
    """A parameter as one whole tensor (FSDP2 shards are DTensors; gathering them is collective)."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p


class EMA(FrozenCopy):
    """Exponential moving average of the trained parameters: ema <- decay * ema + (1 - decay) * param, at every
    `every`-th iteration that took an optimizer step (lab/loop.py's Harness.update moves it, and skips it after a
    skipped update: averaging in weights that did not move would only pull the average back toward them). Used for
    the held-out evaluation (`swap`) and saved beside the weights: a `methods.base.FrozenCopy` of them, moved by a
    fixed decay."""

    def __init__(self, named_params, decay: float, every: int):
        super().__init__(named_params)
        self.decay, self.every = decay, every

    @property
    def shadow(self):
        return list(self.copies.values())

    def update(self, iteration: int):
        if iteration % self.every == 0:
            self.blend(self.decay)

    def state_dict(self):
        return {name: full_tensor(e).detach().cpu().contiguous() for name, e in self.copies.items()}

    def tensors(self):
        """The averaged weights as they are held ({name: tensor}; FSDP2: this rank's shards), for a sharded
        checkpoint, which saves and loads them in place."""
        return self.copies

    def load_state_dict(self, state):
        self.load(state)


class Preempted(Exception):
    """A stop was asked during a rollout, its scoring or an evaluation (`Run.check_stop`): nothing of the iteration
    in flight has changed the weights, so the run stops there and saves the last completed iteration."""


class UpdateCut(Exception):
    """A stop was asked during an update (`Run.stop_between_steps`): the update stopped after `steps` optimizer steps,
    at a boundary where the weights and the optimizer state agree, so the run stops there at once rather than after
    the whole update (an update of a full fine-tune, or of many inner epochs, can outlast a scheduler's grace)."""

    def __init__(self, steps: int):
        super().__init__(steps)
        self.steps = steps


def checked(check_stop, fn):
    """`fn`, calling `check_stop` (Run.check_stop, or nothing) before each call."""
    def call(*args):
        check_stop()
        return fn(*args)

    return call


# ---- collectives that never complete: a rank stuck (its collective not reached within --dist-timeout-minutes) or
# dead (its connections closed). gloo raises a RuntimeError with one of these messages (measured on torch 2.14:
# "... Timed out waiting 3000ms for recv operation to complete", "... Connection closed by peer [127.0.0.1]:59595.
# This is typically caused by a remote worker crashing ..."); NCCL's watchdog and the rendezvous store say the others
TIMED_OUT = re.compile(r"Timed out waiting|collective operation timeout|Timed out after \d+ seconds")
PEER_GONE = re.compile(r"Connection (closed|reset) by peer")


def collective_failure(err: BaseException) -> str | None:
    """"timeout" when `err` is a collective that timed out, "gone" when one whose peer closed its connection (a rank
    that exited), else None. The exceptions it was raised from or during count too, and a rank's that
    torch.distributed.checkpoint gathered into its CheckpointException (`failures`: {rank: (exception, trace)})."""
    if isinstance(err, (SystemExit, KeyboardInterrupt)):  # an exit already decided, or the user's Ctrl-C
        return None
    seen, stack, found = set(), [err], None
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen or not isinstance(e, BaseException):
            continue
        seen.add(id(e))
        if isinstance(e, RuntimeError):  # torch's DistBackendError and DistStoreError are RuntimeErrors
            if TIMED_OUT.search(str(e)):
                return "timeout"
            found = found or ("gone" if PEER_GONE.search(str(e)) else None)
        failures = getattr(e, "failures", None) if type(e).__name__ == "CheckpointException" else None
        stack += [e.__cause__, None if e.__suppress_context__ else e.__context__,
                  *(f[0] if isinstance(f, tuple) else f for f in (failures or {}).values())]
    return found


def collective_failure_line(kind: str, output_dir: str, timeout_minutes: float) -> str:
    """The one line that says a collective never completed, why that happens, and where the run can resume."""
    newest = checkpoint.list_checkpoints(output_dir)
    where = (f"the last checkpoint is {newest[-1]}: once the cause is fixed, run the same command plus --resume"
             if newest else "no checkpoint was written yet: a rerun starts afresh")
    if kind == "timeout":
        return (f"a collective among the ranks timed out after --dist-timeout-minutes {timeout_minutes:g}: a rank is "
                f"stuck or dead (its own lines may say which); {where} (a rank that is only slow, in a long load or "
                f"evaluation, needs a larger --dist-timeout-minutes)")
    return (f"a collective lost its connection to another rank, which exited (it died, was killed, or timed out "
            f"waiting for this one; its own lines may say why): a rank is stuck or dead; {where}")


@contextlib.contextmanager
def collective_failures(args):
    """Under torchrun, a collective that never completes (a rank stuck or dead) ends the run with one `error:` line
    from rank 0, naming --dist-timeout-minutes and the last checkpoint, and exit status 1 on every rank, instead of
    each rank's gloo traceback. In one process, and for any other exception, it changes nothing. train.py runs its
    `main` inside it (after main's own teardown: the lock released, the process group destroyed)."""
    try:
        yield
    except BaseException as err:
        kind = collective_failure(err) if int(os.environ.get("RANK", -1)) != -1 else None
        if kind is None:
            raise
        if int(os.environ["RANK"]) == 0:
            print(f"error: {collective_failure_line(kind, args.output_dir, args.dist_timeout_minutes)}",
                  file=sys.stderr, flush=True)
        if dist.is_initialized():  # a process group left with a collective in flight aborts Python's shutdown
            sys.stdout.flush()
            os._exit(1)
        raise SystemExit(1) from None


WANDB_ID = "wandb_run_id.txt"  # the wandb run's id, kept in the run folder so that --resume continues that run
# what a fresh run writes into its folder besides config.json and checkpoints/ (replaced only with --overwrite)
RUN_FILES = ("metrics.jsonl", "samples", "tensorboard", "wandb", WANDB_ID)
# what a run writes in each of those, by name: a run replacing another removes these and nothing else (a file of the
# user's in the same folder stays)
RUN_WRITES = {".": (r"metrics\.jsonl", re.escape(WANDB_ID)),
              "samples": (r"eval_iter_\d+\.(png|gif)", r"before_after\.png"),
              "tensorboard": (r"events\.out\.tfevents\..*",),
              "wandb": (r"(offline-)?run-.*", r"latest-run", r"debug(-internal|-cli\..*)?\.log")}


def clear_run_files(out):
    """Remove the files a run writes (RUN_WRITES) from `out`, and a folder of them left empty; nothing else."""
    for folder, patterns in RUN_WRITES.items():
        path = os.path.join(out, folder)
        for name in os.listdir(path) if os.path.isdir(path) else []:
            if any(re.fullmatch(p, name) for p in patterns):
                full = os.path.join(path, name)
                if os.path.isdir(full) and not os.path.islink(full):
                    shutil.rmtree(full)
                else:
                    os.remove(full)
        if folder != "." and os.path.isdir(path) and not os.listdir(path):
            os.rmdir(path)


# metrics that an earlier version logged under another name (the tiny world's strict pass, once a part of `shapes`):
# read under today's, so a run or a bench resumed across the change keeps its first evaluation
RENAMED = {"eval/success/shapes": "eval/heldout/shapes-strict",
           "eval/success_se/shapes": "eval/heldout_se/shapes-strict"}

class Run:
    """The output folder and the bookkeeping of one training run, on every rank (rank 0 alone writes files)."""

    def __init__(self, args, rank: int, world: int, distributed: bool, log):
        self.args, self.out, self.rank, self.world = args, args.output_dir, rank, world
        self.distributed, self.master, self.log = distributed, rank == 0, log
        self.metrics_path = os.path.join(self.out, "metrics.jsonl")
        self.lock, self.tracker = None, None
        self.stop_requested, self.faults, self.optimizer_steps, self.warned_skip = False, 0, 0, False
        self.skipped_steps = 0  # optimizer steps skipped for a fault (an update that trains nothing skips none)
        self.hacking_stop = False  # whether the stop was the reward-hacking watch's (train.py exits 3 then)
        self.cuts_updates = False  # whether a stop cuts an update at its next optimizer step (stop_between_steps)
        self.stopped_at = None  # the iteration whose checkpoint a requested stop wrote
        self._previous_handlers = {}

    # ---- the folder: locked, refused if it holds another run, resumed from its newest good checkpoint ----
    def open(self, config: dict) -> str | None:
        """Lock the folder and decide where the run starts (rank 0). Returns the checkpoint to resume or None.
        Nothing else is written until `begin`, so a run that fails to load its models leaves the folder as it was."""
        args = self.args
        if os.path.lexists(self.out) and not os.path.isdir(self.out):
            fail(f"--output-dir '{self.out}' is a file, not a folder; choose a folder (or remove the file)")
        if args.resume and not os.path.isdir(self.out):  # before the lock, which would create the folder
            fail(f"--resume but '{self.out}' does not exist, so it holds no complete checkpoint; check --output-dir, "
                 f"or drop --resume to start a new run")
        try:
            self.lock = checkpoint.lock_output(self.out, log=self.log)
        except checkpoint.LockedError as err:
            fail(str(err))
        except OSError as err:
            fail(f"--output-dir '{self.out}' is not writable ({err.strerror}); choose another folder")
        resume_from = checkpoint.latest_checkpoint(self.out, log=self.log) if args.resume else None
        if args.resume and resume_from is None:  # e.g. a run that died before its first checkpoint
            self._refuse_a_damaged_run()
            self.log(f"note: '{self.out}' holds no complete checkpoint to resume; starting afresh in it")
        if resume_from:
            defaults = {f.name: f.default for f in dataclasses.fields(self.args)
                        if f.default is not dataclasses.MISSING}
            diff = checkpoint.incompatible(checkpoint.read_trainer_state(resume_from)["config"], config, defaults,
                                           flags.resume_keys(args.method))
            if diff:
                fail(f"checkpoint {resume_from} is from another configuration ({flags.flag(diff[0])}: {diff[1]} "
                     f"there, {diff[2]} here); resume with the same settings or use a new --output-dir")
            if args.log_with == "wandb":
                self._check_wandb_id()
        elif self.holds_a_run() and not (args.overwrite or args.resume):
            fail(f"--output-dir '{self.out}' already holds a run; pass --resume to continue it, "
                 f"--overwrite to replace it, or choose another folder")
        elif not args.overwrite and not (args.resume and self.holds_a_run()) and (foreign := self.foreign_files()):
            fail(f"--output-dir '{self.out}' holds {', '.join(foreign)}, which a new run would replace; "
                 f"pass --overwrite to replace them, or choose another folder")
        return resume_from

    def _refuse_a_damaged_run(self):
        """--resume found no complete checkpoint: a folder whose checkpoints are all damaged (set aside now or by an
        earlier --resume) held a trained run, whose metrics and samples starting afresh would replace, so that is
        refused, and only --overwrite starts afresh; a folder that never held a checkpoint (a run that died before
        its first) starts afresh."""
        damaged = [os.path.basename(p) for p in checkpoint.set_aside_checkpoints(self.out, "damaged")]
        if damaged:
            fail(f"--resume found no complete checkpoint in '{self.out}': every checkpoint of its run is damaged and "
                 f"set aside ({', '.join(damaged)}, in checkpoints/), and nothing else was changed; pass --overwrite "
                 f"instead of --resume to start afresh (the set-aside checkpoints stay), or put a good checkpoint back "
                 f"as checkpoints/iter_N")

    def _check_wandb_id(self):
        """Before a wandb run resumes (before any model loads): its id file holds an id, or is missing (then a new
        wandb run starts, and this says so)."""
        id_file = os.path.join(self.out, WANDB_ID)
        if not os.path.exists(id_file):
            self.log(f"note: {id_file} is missing, so a new wandb run starts (its curves begin at the checkpoint)")
            return
        try:
            run_id = open(id_file).read().strip()
        except (OSError, UnicodeDecodeError) as err:
            fail(f"{id_file} cannot be read ({type(err).__name__}); delete it to start a new wandb run")
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", run_id):
            fail(f"{id_file} holds no wandb run id ({run_id[:40]!r}); write the run's id into it, or delete it to "
                 f"start a new wandb run")

    def foreign_files(self) -> list:
        """The names a fresh run writes (its samples, tracker files) that the folder already holds."""
        return [name for name in RUN_FILES if os.path.lexists(os.path.join(self.out, name))]

    def holds_a_run(self) -> bool:
        """Whether the folder holds a run's files: its config, metrics, or a checkpoint of a run (iter_N, even
        without a config). Other files in checkpoints/ (the user's own) do not make it a run: --resume must never
        take a folder of someone else's files for its own and clear them."""
        checkpoints = os.path.join(self.out, "checkpoints")
        return (any(os.path.exists(os.path.join(self.out, name)) for name in ("config.json", "metrics.jsonl"))
                or (os.path.isdir(checkpoints) and any(re.match(r"iter_\d+", n) for n in os.listdir(checkpoints))))

    def resumed_flags(self, saved: dict, current: dict, optimizer):
        """On resume, every flag is applied, refused or reported: the configuration's keys (flags.resume_keys) were
        refused if they differ; the optimizer's learning rate and weight decay, which the loaded optimizer state
        brings back, are set to this run's; every other flag applies from now on, and those that changed are said."""
        for group in optimizer.param_groups:
            group["lr"], group["weight_decay"] = self.args.lr, self.args.weight_decay
        keys = flags.resume_keys(self.args.method)
        changed = [f"{flags.flag(k)} {saved[k]} -> {current[k]}" for k in sorted(current)
                   if k in saved and k not in keys and k not in ("resume", "overwrite")
                   and json.dumps(saved[k]) != json.dumps(current[k])]
        if changed:
            self.log(f"note: resuming with flags changed since the checkpoint, applied from now on: "
                     f"{'; '.join(changed)}")

    def begin(self, config: dict, fresh: bool):
        """Once the models have loaded (rank 0): clear a replaced run's files and record the configuration. Only a
        run's own files are cleared: with --overwrite, or after a --resume that found no checkpoint (whose folder held
        this run); `open` refused a folder holding files of that name otherwise."""
        if fresh and (self.args.overwrite or self.args.resume):
            # the replaced run's own files, by name (RUN_WRITES), and with --overwrite its checkpoints; a user's file
            # beside them, a set-aside checkpoint (.damaged) and an export stay (a --resume that found no checkpoint
            # keeps checkpoints/ whole)
            clear_run_files(self.out)
            if self.args.overwrite:
                checkpoint.clear(self.out, log=self.log)
        with open(os.path.join(self.out, "config.json"), "w") as f:
            json.dump({**config, "code_version": code_version()}, f, indent=1)

    def close(self):
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None
        if not self.stop_requested:  # a stopping run keeps its handlers: a repeated Ctrl-C while it exits is no error
            for sig, handler in self._previous_handlers.items():
                signal.signal(sig, handler)
        if self.lock is not None:
            self.lock.release()

    # ---- signals: the first stops the run at the next point where its state is whole and saves it; the second
    # aborts at once. A scheduler's grace (torchrun's 30 s) is shorter than an iteration of a large model, so the
    # stop does not wait for the iteration's end: rollouts, their scoring and evaluations change no state, and a
    # stop asked during one drops the iteration in flight (which reruns the same on --resume, its noise and prompts
    # following the seed and the iteration alone) and saves the last completed one ----
    def catch_signals(self):
        self._previous_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}

    def _on_signal(self, signum, frame):
        if self.stop_requested:
            if self.stopped_at is not None:
                self.log(f"\nsecond signal {signum}: exiting; the checkpoint of iteration {self.stopped_at} is written")
            else:
                earlier = checkpoint.list_checkpoints(self.out)
                self.log(f"\nsecond signal {signum}: aborting now; no checkpoint was written for the current "
                         f"iteration, " + (f"the previous one ({os.path.basename(earlier[-1])}) is intact" if earlier
                                           else "and none exists yet: a rerun starts afresh"))
            if self.distributed:  # at once: unwinding through a collective save would print every rank's traceback
                sys.stdout.flush()
                os._exit(130)
            raise SystemExit(130)
        self.stop_requested = True
        update = "at the next optimizer step of the update" if self.cuts_updates else "after the update"
        torchrun = ("; torchrun itself will then exit 1 with a SignalException traceback, which only reports the "
                    "signal it forwarded: the line 'stopped ...' below is this run's result"
                    if "TORCHELASTIC_RUN_ID" in os.environ else "")
        self.log(f"\nreceived signal {signum}: stopping at the next transformer call or reward batch of the rollout "
                 f"(which is dropped and reruns on --resume), or {update}, and saving a checkpoint (send it again to "
                 f"abort without saving){torchrun}")

    def stop_between_steps(self, optimizer):
        """After every optimizer step, raise UpdateCut once a stop was asked on any rank. Every rank takes the same
        steps (the gradient norm that decides a skip is all-reduced), so all ranks cut the update at the same one.
        `steps_taken` counts the steps since it was last set to 0 (train.py: at each iteration)."""
        self.steps_taken, self.cuts_updates = 0, True

        def after_step(*_):
            self.steps_taken += 1
            if self.should_stop():
                raise UpdateCut(self.steps_taken)

        optimizer.register_step_post_hook(after_step)

    def stopped(self, iteration: int, line: str):
        """The stop's checkpoint (of `iteration`) is written: say so (train.py then leaves with os._exit, since a
        signal during Python's own shutdown, which restores the default handlers, would end the process by it)."""
        self.stopped_at = iteration
        self.log(line)

    def should_stop(self) -> bool:
        return any_rank(self.stop_requested, self.distributed)

    def check_stop(self):
        """Raise Preempted once a stop was asked on any rank. Rollouts and evaluations call it before every
        transformer call and the scoring before every reward batch (`checked`); every rank makes the same calls
        there, so all ranks stop at the same one."""
        if self.should_stop():
            raise Preempted

    # ---- metrics: one strict-JSON line per iteration, an optional tracker ----
    def resume_metrics(self, iteration: int) -> dict:
        """Drop rows from after the checkpoint (a crash's partial work); returns the first evaluation's metrics."""
        rows = checkpoint.truncate_metrics(self.metrics_path, iteration, log=self.log) if self.master else []
        first = next((r for r in rows if r.get("iteration") == 0), {})
        return {RENAMED.get(k, k): v for k, v in first.items() if k.startswith("eval/")}

    def evaluated(self, iteration: int) -> bool:
        """Whether metrics.jsonl records a held-out evaluation at `iteration` (a stop can leave the last one out)."""
        try:
            with open(self.metrics_path) as f:
                rows = [json.loads(line) for line in f if line.strip()]
        except (OSError, ValueError):
            return False
        return any(r.get("iteration") == iteration and any(k.startswith("eval/") for k in r) for r in rows)

    def write_metrics(self, iteration: int, metrics: dict):
        if not self.master:
            return
        checkpoint.append_metrics(self.metrics_path, {"iteration": iteration, **metrics})
        if self.tracker is not None:
            self.tracker.scalars(metrics, iteration)

    def open_tracker(self, config: dict, start: int):
        """The experiment tracker (rank 0): its files in the run folder, one tracker run across resumes."""
        if self.master and self.args.log_with != "none":
            self.tracker = Tracker(self.args, self.out, config, start, self.log)

    # ---- faults: skipped steps warn once, then too many faulty iterations in a row stop the run ----
    def count_faults(self, metrics: dict) -> bool:
        """Count this iteration's faults (the first skipped step warns); returns whether it was faulty."""
        skipped, nonfinite = metrics["faults/skipped_steps"], metrics["faults/nonfinite_rewards"]
        self.optimizer_steps += metrics.get("perf/optimizer_steps", 0)
        self.skipped_steps += skipped
        faulty = skipped > 0 or nonfinite > 0
        if skipped > 0 and not self.warned_skip:
            self.warned_skip = True
            cause = "the rewards were not finite" if nonfinite else "its gradient norm was not finite"
            self.log(f"\nwarning: an optimizer step was skipped: {cause}. Likely causes: an attention kernel with a "
                     f"wrong backward (try --attention-backend math), bf16 overflow (try --mixed-precision no), "
                     f"a learning rate too high, or non-finite rewards")
        self.faults = self.faults + 1 if faulty else 0
        return faulty

    def stop_after_too_many_faults(self):
        """--max-faults faulty iterations in a row stop the run, naming the last good checkpoint."""
        if self.faults >= self.args.max_faults:
            latest = checkpoint.latest_checkpoint(self.out, log=self.log) if self.master else None
            raise SystemExit(f"error: stopping: {self.faults} iterations in a row had non-finite rewards, loss or "
                             f"gradients; the last good checkpoint is {latest or 'none (no checkpoint yet)'}")

    # ---- checkpoints ----
    def save(self, iteration, model, transformer, optimizer, config, pipeline_class, params, ema=None, final=False,
             states=None):
        """Save a checkpoint; weights that are not finite stop the run instead (the last good checkpoint stays the
        newest).
        `final`: the run's last, which a sharded full fine-tune also exports as transformer/. `states`: further
        named state dicts of tensors, the same on every rank (a method's, methods/base.py), saved beside the weights."""
        # each rank checks its own shards (FSDP2) or copy (DDP): no weights are gathered for it
        local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
        finite = not any_rank(any(not bool(torch.isfinite(p).all()) for p in local), self.distributed)
        if not finite:
            raise SystemExit(f"error: the weights are not finite after iteration {iteration} (a learning rate too "
                             f"high?); no checkpoint written, the last good one is "
                             f"{checkpoint.latest_checkpoint(self.out, log=self.log) if self.master else ''}")
        lora = not self.args.full
        sharded = checkpoint.uses_dcp(model, lora)  # then the EMA's shards go into dcp/ as they are
        extra = {"ema": ema.tensors() if sharded else ema.state_dict()} if ema is not None else {}
        extra = {**extra, **(states or {})} or None
        try:
            checkpoint.save(self.out, iteration, model, transformer, optimizer, config, lora, pipeline_class,
                            keep=self.args.keep_checkpoints, extra=extra, log=self.log, export_weights=final)
        except checkpoint.NoSpaceError as err:
            fail(str(err))

    def check_ranks_agree(self, params):
        """Every rank must hold the same (full) parameters after training; a cheap checksum proves it."""
        with torch.no_grad():
            total = sum(float(full_tensor(p).double().sum()) for p in params)
        sums = [None] * self.world
        dist.all_gather_object(sums, total)
        if max(sums) - min(sums) > 1e-6 * max(1.0, abs(sums[0])):
            raise RuntimeError(f"ranks disagree on the parameters after training: checksums {sums}")
        self.log(f"{self.world} ranks agree on the parameters (checksum {sums[0]:.6f})")

    # ---- sample grids and the closing summary ----
    def save_grid(self, images, iteration, eval_prompts, captions):
        """The evaluation's samples: a grid in samples/ and, with a tracker, the images captioned (prompt, seed)."""
        if not self.master:
            return
        from torchvision.utils import save_image

        os.makedirs(os.path.join(self.out, "samples"), exist_ok=True)
        images = images.float() / 255 if images.dtype == torch.uint8 else images
        n = min(len(images), 2 * eval_prompts, GRID_IMAGES)
        name = os.path.join(self.out, "samples", f"eval_iter_{iteration:06d}")
        shown, nrow = frame_strips(images[:n]), min(n, 12 if images.ndim == 4 else 3)  # videos: a strip of frames
        save_image(shown, name + ".png", nrow=nrow, padding=1)
        if images.ndim == 5:  # and one animated grid of them
            save_gif(images[:n], name + ".gif", nrow=min(n, 6))
        if self.tracker is not None:
            self.tracker.images(shown, captions[:n], iteration, nrow)

    def summary(self, before: dict, after: dict, reward_names, held_out_names=()):
        """The closing lines: the trained rewards on the held-out prompts, and the held-out rewards, before and after;
        and the before/after grid."""
        first = self.args.first_eval_seeds or self.args.final_eval_seeds or self.args.eval_seeds
        last = self.args.final_eval_seeds or self.args.eval_seeds
        shared = first != last  # then both are compared on the seeds they share, eval/common/*
        if shared:
            self.log(f"note: the first evaluation scored {first} seeds a prompt and the last {last}: both are compared "
                     f"on the {min(first, last)} they share; evaluate.py scores more on the same seeds")
        # a mean on the shared seeds (when the two differ), else on all; None where an evaluation lacks it
        # (an evaluation of no more seeds than they share has no eval/common/*: its own means are on them)
        mean = lambda m, key: m.get(f"eval/common/{key}", m.get(f"eval/{key}")) if shared else m.get(f"eval/{key}")
        parts = []
        for name in reward_names:
            b, a = mean(before, f"reward/{name}"), mean(after, f"reward/{name}")
            if b is None or a is None:
                continue
            if shared:
                parts.append(f"{name} {b:.4f} -> {a:.4f}")
                continue
            sb, sa = before.get(f"eval/reward_seed_std/{name}") or 0, after.get(f"eval/reward_seed_std/{name}") or 0
            parts.append(f"{name} {b:.4f} (seed std {sb:.4f}) -> {a:.4f} (seed std {sa:.4f})")
        if parts:
            self.log("trained reward on the held-out prompts: " + "; ".join(parts))
        for name in held_out_names:
            b, a = mean(before, f"heldout/{name}"), mean(after, f"heldout/{name}")
            if b is not None and a is not None:
                se = [m.get(f"eval/heldout_se/{name}") for m in (before, after)]
                spread = f" (standard errors {se[0]:.3f}, {se[1]:.3f})" if None not in se and not shared else ""
                self.log(f"held-out reward {name}, never trained on: {b:.3f} -> {a:.3f}{spread}")
        samples = os.path.join(self.out, "samples")
        first, final = (os.path.join(samples, f"eval_iter_{i:06d}.png") for i in (0, self.args.num_iterations))
        if os.path.exists(first) and os.path.exists(final):
            from PIL import Image

            top, bottom = Image.open(first), Image.open(final)
            grid = Image.new("RGB", (max(top.width, bottom.width), top.height + bottom.height + 4), "white")
            grid.paste(top, (0, 0))
            grid.paste(bottom, (0, top.height + 4))
            grid.save(os.path.join(samples, "before_after.png"))
            self.log(f"before (top) / after (bottom) samples: {os.path.join(samples, 'before_after.png')}")


def frame_strips(videos, count: int = 4):
    """Videos (N, 3, F, H, W) -> images (N, 3, H, count W): `count` frames spread over each video, side by side (the
    sample grids of a video model); images (N, 3, H, W) pass through."""
    if videos.ndim == 4:
        return videos
    frames = torch.linspace(0, videos.shape[2] - 1, min(count, videos.shape[2])).round().long()
    return torch.cat(list(videos[:, :, frames].unbind(2)), dim=-1)


def save_gif(videos, path: str, nrow: int, fps: int = 8):
    """Videos (N, 3, F, H, W) in [0, 1] as one animated GIF of their grid (PIL writes it)."""
    from PIL import Image
    from torchvision.utils import make_grid

    frames = [Image.fromarray((make_grid(videos[:, :, t], nrow=nrow, padding=1).permute(1, 2, 0) * 255).round()
                              .byte().numpy()) for t in range(videos.shape[2])]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=1000 // fps, loop=0)


class Tracker:
    """TensorBoard or wandb, as `--log-with` asks: scalars every iteration, the held-out samples at every evaluation,
    the configuration once. Its files live in the run folder, and a resumed run continues the same tracker run:
    TensorBoard drops the events logged after the checkpoint (a crash's partial work), wandb reuses the run id kept
    in the folder."""

    def __init__(self, args, out: str, config: dict, start: int, log):
        name = args.run_name or os.path.basename(os.path.abspath(out))
        self.kind = args.log_with
        if self.kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            folder = os.path.join(out, "tensorboard")
            # purge_step: events from iterations after the checkpoint are dropped, so no curve doubles back
            self.writer = SummaryWriter(folder, purge_step=start + 1 if start else None)
            if not start:
                self.writer.add_text("config", f"```\n{json.dumps(config, indent=1)}\n```", 0)
            log(f"tensorboard: watch with `tensorboard --logdir {folder}`")
        else:
            import wandb

            id_file = os.path.join(out, WANDB_ID)
            run_id = open(id_file).read().strip() if start and os.path.exists(id_file) else uuid.uuid4().hex[:8]
            with open(id_file, "w") as f:
                f.write(run_id + "\n")
            self.wandb = wandb
            self.run = wandb.init(project=args.tracker_project, name=name, id=run_id, resume="allow", dir=out,
                                  config=config)
            where = f"watch at {self.run.url}" if self.run.url else f"offline, files in {os.path.relpath(self.run.dir)}"
            log(f"wandb: run {name} ({run_id}), {where}")

    def scalars(self, metrics: dict, iteration: int):
        if self.kind == "tensorboard":
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, iteration)
        else:
            self.run.log(metrics, step=iteration)

    def images(self, images, captions, iteration: int, nrow: int):
        """One grid (TensorBoard, with the captions as text) or one captioned image per sample (wandb)."""
        if self.kind == "tensorboard":
            from torchvision.utils import make_grid

            self.writer.add_image("eval/samples", make_grid(images, nrow=nrow, padding=1), iteration)
            self.writer.add_text("eval/captions", "  \n".join(captions), iteration)
        else:
            arrays = (images.permute(0, 2, 3, 1).clamp(0, 1) * 255).round().byte().numpy()
            self.run.log({"eval/samples": [self.wandb.Image(a, caption=c) for a, c in zip(arrays, captions)]},
                         step=iteration)

    def close(self):
        if self.kind == "tensorboard":
            self.writer.close()
        else:
            self.run.finish()
