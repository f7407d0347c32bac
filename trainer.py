"""The training loop behind train.py: models, the iteration (rollout, rewards, advantages, update), evaluation,
checkpoints and logging. Reads the config once, here; the method files it calls take tensors and plain values.

Shapes: B prompts on this rank, G group size, K trained SDE steps, J granularities, R reward models.
"""
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist

import checkpoint
from advantage import granular_advantages
from g2rpo import g2rpo_update
from models import ADAPTERS, ModelLoadError
from rewards import RewardError, load_reward, parse_rewards
from sampler import ode_sample, rollout_full_sde, rollout_g2rpo, sigma_schedule

HERE = os.path.dirname(os.path.abspath(__file__))
LORA_ATTENTION = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
LORA_FEED_FORWARD = ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2", "proj_mlp"]


def fail(message: str):
    """Bad input: one line, exit status 2, nothing written."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def read_prompts(path: str, what: str):
    if not path or not os.path.isfile(path):
        fail(f"{what} '{path}' not found; pass a text file with one prompt a line")
    try:
        with open(path, encoding="utf-8") as f:
            prompts = [line.strip() for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as err:
        fail(f"{what} '{path}' cannot be read ({type(err).__name__}); pass a readable UTF-8 text file")
    if not prompts:
        fail(f"{what} '{path}' holds no prompts; put one prompt on each line")
    return prompts


def code_version():
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=HERE, capture_output=True, text=True, timeout=5)
        return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def generators(seed: int, iteration: int, positions):
    """One CPU generator per prompt, keyed by (seed, iteration, global position in the batch)."""
    return [torch.Generator().manual_seed((seed * 1_000_003 + iteration) * 10_007 + p) for p in positions]


def batch_prompts(prompts, seed, iteration, global_batch, rank, per_rank):
    """This rank's prompts of iteration `iteration` and their global positions; a new shuffle every epoch."""
    per_epoch = max(1, len(prompts) // global_batch)
    epoch, step = divmod(iteration, per_epoch)
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    positions = list(range(rank * per_rank, (rank + 1) * per_rank))
    start = step * global_batch
    return [prompts[order[(start + p) % len(order)]] for p in positions], positions


def _iteration_of(line: str) -> float:
    """The iteration of a metrics.jsonl line; a line cut short by a crash counts as after any checkpoint."""
    try:
        return json.loads(line)["iteration"]
    except (ValueError, KeyError):
        return float("inf")


def all_mean(values: dict, distributed: bool) -> dict:
    """Mean of logged scalars over ranks (nothing else is ever communicated outside the update)."""
    if not distributed:
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return {k: float(v) / dist.get_world_size() for k, v in zip(keys, t)}


class Trainer:
    def __init__(self, args, device, dtype, rank, world, distributed, log):
        self.args, self.device, self.dtype, self.rank, self.world = args, device, dtype, rank, world
        self.distributed, self.master, self.log = distributed, rank == 0, log
        self.prompts = read_prompts(args.prompt_file, "--prompt-file")
        self.eval_prompts = read_prompts(args.eval_prompt_file, "--eval-prompt-file")
        self.global_batch = args.prompts_per_iteration or world
        self.per_rank = self.global_batch // world
        self.sigmas = sigma_schedule(args.num_steps, args.shift)
        self.reward_weights = parse_rewards(args.rewards)
        self.stop_requested = False

        torch.manual_seed(args.seed)  # LoRA's initialisation; everything else draws from per-prompt generators
        # ---- model ----
        model_path = args.model_path
        if args.model == "tiny":
            import tiny

            if self.master:  # pre-trains once; the other ranks wait, then find it cached
                model_path = tiny.ensure_pretrained(args.tiny_cache, log=log)
            if distributed:
                dist.barrier()
            if not self.master:
                model_path = tiny.ensure_pretrained(args.tiny_cache, log=lambda *a: None)
        try:
            self.adapter = ADAPTERS[args.model].load(model_path, device, dtype, guidance=args.guidance,
                                                      max_sequence_length=args.max_sequence_length,
                                                      offload_text_encoders=args.offload_text_encoders,
                                                      # LoRA: the frozen base in the compute dtype (bf16 on GPU);
                                                      # full fine-tune: fp32 master weights
                                                      transformer_dtype=dtype if args.lora_rank > 0 else torch.float32,
                                                      place_transformer=not (distributed and args.lora_rank == 0))
        except ModelLoadError as err:
            fail(str(err))
        if args.resolution % self.adapter.patch_multiple:
            fail(f"--resolution {args.resolution} is not a multiple of {self.adapter.patch_multiple} for this model")
        self._warn_long_prompts()
        transformer = self.transformer = self.adapter.transformer
        if args.lora_rank > 0:
            from peft import LoraConfig

            transformer.requires_grad_(False)
            targets = LORA_ATTENTION + (LORA_FEED_FORWARD if args.lora_feed_forward else [])
            transformer.add_adapter(LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha or args.lora_rank,
                                               init_lora_weights="gaussian", target_modules=targets))
            for p in transformer.parameters():  # the LoRA weights are trained in fp32 (autocast computes in bf16)
                if p.requires_grad:
                    p.data = p.data.float()
        else:
            transformer.requires_grad_(True)
        if args.gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        self.model = transformer  # what the update calls: DDP-wrapped for LoRA, sharded in place by FSDP2
        if distributed and args.lora_rank > 0:
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(transformer, device_ids=[device.index] if device.type == "cuda" else None)
        elif distributed:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
            blocks = [b for name in ("transformer_blocks", "single_transformer_blocks")
                      for b in getattr(transformer, name, [])]
            for block in blocks:
                fully_shard(block, mp_policy=policy)
            fully_shard(transformer, mp_policy=policy)
            transformer.to(device)  # moves only this rank's shards
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=args.lr, betas=(0.9, 0.999), weight_decay=args.weight_decay)

        # ---- rewards ----
        paths = {k: getattr(args, k) for k in ("hps_checkpoint", "hps_arch", "clip_model", "pickscore_model",
                                               "pickscore_processor", "aesthetic_clip", "aesthetic_head")}
        try:
            self.reward_fns = {name: load_reward(name, device, dtype, args.reward_batch_size, paths)
                               for name in self.reward_weights}
        except RewardError as err:
            fail(str(err))

    def _warn_long_prompts(self):
        tok = getattr(self.adapter.pipe, "tokenizer_2", None) or self.adapter.pipe.tokenizer
        limit = self.args.max_sequence_length
        long = [p for p in self.prompts + self.eval_prompts if len(tok(p).input_ids) > limit]
        if long:
            self.log(f"warning: {len(long)} prompts exceed {limit} text tokens and are truncated "
                     f"(first: '{long[0][:60]}...')")

    # ---- one velocity function for the rollout (no grad) and the update (through the wrapped model) ----
    def velocity_fn(self, module, cond):
        return lambda x, sigma, idx: self.adapter.velocity(module, cond, x, sigma, idx, self.args.resolution)

    @torch.no_grad()
    def score(self, latents, prompts):
        """Decode latents (M, ...) in micro-batches and score each chunk with every reward: {name: (M,)}."""
        out = {name: [] for name in self.reward_fns}
        step = self.args.reward_batch_size
        for i in range(0, latents.shape[0], step):
            images = self.adapter.decode(latents[i : i + step], self.args.resolution)
            for name, fn in self.reward_fns.items():
                out[name].append(fn(images, prompts[i : i + step]).cpu())
        return {name: torch.cat(v) for name, v in out.items()}

    def iteration(self, it):
        args, t0 = self.args, time.time()
        prompts, positions = batch_prompts(self.prompts, args.seed, it, self.global_batch, self.rank, self.per_rank)
        cond = self.adapter.encode(prompts)
        gens = generators(args.seed, it, positions)
        noise = self.adapter.noise(gens, args.resolution)  # (B, ...)
        B, G = len(prompts), args.group_size
        if args.sampling == "g2rpo":
            rollout = rollout_g2rpo(self.velocity_fn(self.transformer, cond), noise, self.sigmas, G, args.sde_steps,
                                    args.granularities, args.eta, gens, args.max_batch)
        else:
            rollout = rollout_full_sde(self.velocity_fn(self.transformer, cond), noise, self.sigmas, G,
                                       args.sde_steps, args.eta, gens, args.max_batch)
        t1 = time.time()
        _, J, K, _ = rollout.final_latents.shape[:4]
        finals = rollout.final_latents.flatten(0, 3)  # (B*J*K*G, ...)
        scores = self.score(finals, [p for p in prompts for _ in range(J * K * G)])
        rewards = torch.stack([scores[n] for n in self.reward_fns]).view(-1, B, J, K, G).transpose(1, 2)  # (R, J, B, K, G)
        metrics = {}
        for r, name in enumerate(self.reward_fns):
            metrics[f"train/reward/{name}"] = float(rewards[r].mean())
            for j, g in enumerate(args.granularities if args.sampling == "g2rpo" else []):
                metrics[f"train/reward/{name}/g{g}"] = float(rewards[r, j].mean())
        if rollout.anchor_final is not None:
            for name, v in self.score(rollout.anchor_final, prompts).items():
                metrics[f"train/anchor_reward/{name}"] = float(v.mean())
        t2 = time.time()
        weights = torch.tensor([self.reward_weights[n] for n in self.reward_fns])
        advantages = granular_advantages(rewards, args.adv_clip_max, weights)  # (B, K or 1, G)
        advantages = advantages.expand(B, len(args.sde_steps), G).to(self.device)
        finite = bool(torch.isfinite(rewards).all())
        if self.distributed:  # every rank must take the update together, or none
            flag = torch.tensor([float(finite)])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            finite = bool(flag.item())
        if finite:
            stats = g2rpo_update(self.velocity_fn(self.model, cond), self.params, self.optimizer, rollout, advantages,
                                 self.sigmas, args.eta, args.clip_range, args.adv_clip_max, args.max_grad_norm,
                                 args.step_per_sde_step, args.max_batch)
        else:
            stats = {"skipped_steps": len(args.sde_steps) if args.step_per_sde_step else 1}
        t3 = time.time()
        metrics.update({f"losses/{k}": v for k, v in stats.items() if k not in ("skipped_steps", "optimizer_steps")})
        metrics.update({"faults/skipped_steps": stats["skipped_steps"], "faults/nonfinite_rewards": float(not finite),
                        "perf/nfe": rollout.nfe, "perf/calls": rollout.calls, "time/rollout": t1 - t0,
                        "time/decode_and_reward": t2 - t1, "time/update": t3 - t2, "time/iteration": t3 - t0})
        return metrics

    @torch.no_grad()
    def evaluate(self):
        """Held-out reward of the anchor (ODE) images on fixed seeds. Returns metrics and this rank's images."""
        args = self.args
        items = [(p, s) for s in range(args.eval_seeds) for p in range(len(self.eval_prompts))]
        per_rank = -(-len(items) // self.world)
        mine = items[self.rank * per_rank : (self.rank + 1) * per_rank]
        valid = len(mine)
        mine = mine + [items[-1]] * (per_rank - valid)  # equal work on every rank (FSDP forwards are collective)
        prompts = [self.eval_prompts[p] for p, _ in mine]
        gens = [torch.Generator().manual_seed(1_000_000 + 1000 * s + p) for p, s in mine]
        cond = self.adapter.encode(prompts)
        x0, _, _ = ode_sample(self.velocity_fn(self.transformer, cond), self.adapter.noise(gens, args.resolution),
                              self.sigmas, args.max_batch)
        images = torch.cat([self.adapter.decode(x0[i : i + args.reward_batch_size], args.resolution)
                            for i in range(0, len(mine), args.reward_batch_size)])
        metrics = {}
        for name, fn in self.reward_fns.items():
            scores = fn(images, prompts).cpu()[:valid]
            per_seed = torch.zeros(args.eval_seeds, 2, dtype=torch.float64)  # (sum, count) per seed
            for (_, s), v in zip(mine[:valid], scores):
                per_seed[s] += torch.tensor([float(v), 1.0], dtype=torch.float64)
            if self.distributed:
                dist.all_reduce(per_seed)
            means = per_seed[:, 0] / per_seed[:, 1].clamp_min(1)
            metrics[f"eval/reward/{name}"] = float(per_seed[:, 0].sum() / per_seed[:, 1].sum())
            metrics[f"eval/reward_seed_std/{name}"] = float(means.std()) if args.eval_seeds > 1 else 0.0
        return metrics, images[:valid]

    def save_grid(self, images, name):
        if not self.master:
            return
        from torchvision.utils import save_image

        os.makedirs(os.path.join(self.args.output_dir, "samples"), exist_ok=True)
        n = min(len(images), 2 * len(self.eval_prompts), 24)
        save_image(images[:n], os.path.join(self.args.output_dir, "samples", name), nrow=min(n, 12), padding=1)

    def write_metrics(self, it, metrics):
        if not self.master:
            return
        with open(os.path.join(self.args.output_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"iteration": it, **metrics}) + "\n")
        if self.tracker is not None:
            self.tracker(metrics, it)

    def _open_tracker(self):
        self.tracker = None
        if not self.master or self.args.log_with == "none":
            return
        if self.args.log_with == "wandb":
            import wandb

            run = wandb.init(project="g2rpo", config=dataclasses.asdict(self.args))
            self.tracker = lambda m, it: run.log(m, step=it)
        else:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(os.path.join(self.args.output_dir, "tensorboard"))
            self.tracker = lambda m, it: [writer.add_scalar(k, v, it) for k, v in m.items()]

    def _save(self, it):
        return checkpoint.save(self.args.output_dir, it, self.model, self.transformer, self.optimizer,
                               dataclasses.asdict(self.args), self.args.lora_rank > 0, self.adapter.pipeline_class)

    def _request_stop(self, signum, frame):
        self.stop_requested = True
        self.log(f"\nreceived signal {signum}: saving a checkpoint at the end of this iteration")

    def run(self, resume_from):
        args, out = self.args, self.args.output_dir
        start = 0
        metrics_path = os.path.join(out, "metrics.jsonl")
        if resume_from:
            start = checkpoint.load(resume_from, self.model, self.transformer, self.optimizer,
                                    args.lora_rank > 0)["iteration"]
            self.log(f"resumed from {resume_from} at iteration {start}")
        if self.master:
            if not resume_from:
                for stale in ("metrics.jsonl", "checkpoints", "samples"):
                    path = os.path.join(out, stale)
                    if os.path.isdir(path):
                        shutil.rmtree(path)
                    elif os.path.exists(path):
                        os.remove(path)
            elif os.path.exists(metrics_path):  # drop lines from after the checkpoint (a crash's partial work)
                with open(metrics_path) as f:
                    lines = [l for l in f if _iteration_of(l) <= start]
                with open(metrics_path, "w") as f:
                    f.writelines(lines)
            with open(os.path.join(out, "config.json"), "w") as f:
                json.dump({**dataclasses.asdict(args), "code_version": code_version()}, f, indent=1)
        self._open_tracker()
        previous = {sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            self._loop(start)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _loop(self, start):
        args, out = self.args, self.args.output_dir
        metrics_path = os.path.join(out, "metrics.jsonl")

        if start == 0:
            before, images = self.evaluate()
            self.save_grid(images, "eval_iter_000000.png")
            self.write_metrics(0, before)
        else:
            before = {}
            with open(metrics_path) as f:
                for line in f:
                    row = json.loads(line)
                    if row["iteration"] == 0:
                        before = {k: v for k, v in row.items() if k.startswith("eval/")}
        from tqdm import tqdm

        bar = tqdm(range(start, args.num_iterations), initial=start, total=args.num_iterations, disable=not self.master,
                   dynamic_ncols=True)
        faults, last = 0, {}
        it = start
        for it in bar:
            metrics = all_mean(self.iteration(it), self.distributed)
            faulty = metrics["faults/skipped_steps"] > 0 or metrics["faults/nonfinite_rewards"] > 0
            faults = faults + 1 if faulty else 0
            done = it + 1
            if done % args.eval_every == 0 or done == args.num_iterations:
                eval_metrics, images = self.evaluate()
                metrics.update(eval_metrics)
                self.save_grid(images, f"eval_iter_{done:06d}.png")
            self.write_metrics(done, metrics)
            name = next(iter(self.reward_fns))
            bar.set_postfix(reward=f"{metrics[f'train/reward/{name}']:.4f}", loss=f"{metrics.get('losses/loss', 0):.2e}",
                            s_it=f"{metrics['time/iteration']:.1f}")
            last = metrics
            if faults >= args.max_faults:
                latest = checkpoint.latest_checkpoint(out)
                fail_message = (f"stopping: {faults} iterations in a row had non-finite rewards, loss or gradients; "
                                f"the last good checkpoint is {latest or 'none (no checkpoint yet)'}")
                raise SystemExit(f"error: {fail_message}")
            stop = self.stop_requested
            if self.distributed:
                flag = torch.tensor([float(stop)])
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                stop = bool(flag.item())
            # no periodic checkpoint from a faulty iteration: the last good one must survive the rotation
            if (done % args.checkpoint_every == 0 or done == args.num_iterations) and not faulty or stop:
                self._save(done)
            if stop:
                self.log(f"stopped after iteration {done}; continue with the same command plus --resume")
                return
        bar.close()
        if self.distributed:
            self._check_ranks_agree()
        if self.master and before and last:
            self._summary(before, last)

    def _check_ranks_agree(self):
        """Every rank must hold the same (full) parameters after training; a cheap checksum proves it."""
        with torch.no_grad():
            total = sum(float((p.full_tensor() if hasattr(p, "full_tensor") else p).double().sum())
                        for p in self.params)
        sums = [None] * self.world
        dist.all_gather_object(sums, total)
        if max(sums) - min(sums) > 1e-6 * max(1.0, abs(sums[0])):
            raise RuntimeError(f"ranks disagree on the parameters after training: checksums {sums}")
        self.log(f"{self.world} ranks agree on the parameters (checksum {sums[0]:.6f})")

    def _summary(self, before, after):
        parts = []
        for name in self.reward_fns:
            b, a = before.get(f"eval/reward/{name}"), after.get(f"eval/reward/{name}")
            if b is None or a is None:
                continue
            sb, sa = before.get(f"eval/reward_seed_std/{name}", 0), after.get(f"eval/reward_seed_std/{name}", 0)
            parts.append(f"{name} {b:.4f} (seed std {sb:.4f}) -> {a:.4f} (seed std {sa:.4f})")
        self.log("held-out eval reward: " + "; ".join(parts))
        samples = os.path.join(self.args.output_dir, "samples")
        first, final = os.path.join(samples, "eval_iter_000000.png"), os.path.join(
            samples, f"eval_iter_{self.args.num_iterations:06d}.png")
        if os.path.exists(first) and os.path.exists(final):
            from PIL import Image

            top, bottom = Image.open(first), Image.open(final)
            grid = Image.new("RGB", (max(top.width, bottom.width), top.height + bottom.height + 4), "white")
            grid.paste(top, (0, 0))
            grid.paste(bottom, (0, top.height + 4))
            grid.save(os.path.join(samples, "before_after.png"))
            self.log(f"before (top) / after (bottom) samples: {os.path.join(samples, 'before_after.png')}")
