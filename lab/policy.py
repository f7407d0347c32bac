"""The models a run trains and scores with: the policy (the transformer behind its family's adapter, LoRA or full
weights, DDP or FSDP2 across ranks, its AdamW, the EMA, the KL term's base), the reward models, the velocity
functions the method files are given, and the distributed set-up that train.py and evaluate.py share.

`make_policy` is also tools/plan.py's, which builds a CUDA run on fake tensors.
"""
import dataclasses
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

import rewards
from lab import fail, flags
from lab.models import ADAPTERS, ModelLoadError, add_lora
from lab.run import EMA, backend


def setup_distributed(timeout_minutes: float):
    """(distributed, rank, world, device): one short block keyed on RANK, so the same script runs on a laptop and on
    many GPUs; under torchrun a process group (NCCL and gloo on GPUs, gloo on CPUs: lab.run.backend) and this
    rank's GPU."""
    if int(os.environ.get("RANK", -1)) == -1:
        return False, 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dist.init_process_group(backend(), timeout=timedelta(minutes=timeout_minutes))
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
        torch.cuda.set_device(device)
    return True, dist.get_rank(), dist.get_world_size(), device


@dataclass
class Policy:
    """What training changes and what it changes it with: the transformer behind its adapter, its optimizer, the
    EMA, and the KL term's frozen base model."""

    adapter: object  # models.Adapter: encode, noise, velocity, decode
    transformer: torch.nn.Module  # the diffusers module (sharded in place under FSDP2)
    model: torch.nn.Module  # what the update calls: DDP-wrapped for LoRA, else the transformer
    params: list
    optimizer: torch.optim.Optimizer
    kl_base: torch.nn.Module | None = None  # the KL term's frozen base model, in a full fine-tune
    ema: EMA | None = None
    fp8: object | None = None  # kernels.Float8Copy of the transformer, with --rollout-precision fp8


@dataclass
class RewardModels:
    """What scores the policy's images: each reward by name, fn(images, prompts) -> (N,), and its --rewards weight."""

    fns: dict
    weights: dict
    held_out: dict = dataclasses.field(default_factory=dict)  # --eval-rewards: evaluations only, never trained on


def build_policy(args, device, dtype, distributed, log) -> Policy:
    """Load the pipeline and make the trained policy of it (`make_policy`)."""
    torch.manual_seed(args.seed)  # LoRA's initialisation; everything else draws from per-prompt generators
    model_path = args.model_path
    if args.model == "tiny":
        from lab import tiny

        model_path = tiny.ensure_pretrained_on_ranks(args.tiny_cache, log=log)
    try:
        adapter = ADAPTERS[args.model].load(
            model_path, device, dtype, guidance=args.guidance, max_sequence_length=args.max_sequence_length,
            offload_text_encoders=args.offload_text_encoders, attention_backend=args.attention_backend,
            rollout_attention_backend=args.rollout_attention_backend, compile=args.compile,
            # full fine-tune: fp32 master weights; LoRA: the frozen base in the compute dtype (bf16 on GPU)
            transformer_dtype=torch.float32 if args.full else dtype, place_transformer=not (distributed and args.full),
            num_frames=args.num_frames)
    except ModelLoadError as err:
        fail(str(err))
    return make_policy(args, adapter, device, dtype, distributed)


def load_reward_models(args, device, dtype, weights, log=print) -> RewardModels:
    """Every reward model of --rewards (rewards.py), by name, with its weight."""
    load = lambda name: rewards.load_reward(name, device, dtype, args.reward_batch_size, vars(args),
                                            frames_every=args.reward_frames)
    try:
        fns = {name: load(name) for name in weights}
    except rewards.RewardError as err:
        fail(str(err))
    held_out = {}
    for name in rewards.parse_rewards(args.eval_rewards) if args.eval_rewards else {}:  # ("clip=1.0" is "clip")
        try:
            held_out[name] = load(name)
        except rewards.RewardError as err:  # (an offline node without the preset's weights trains without it)
            flags.leave_out_held_out(args, name, err, log)
    return RewardModels(fns, weights, held_out)


def make_policy(args, adapter, device, dtype, distributed, foreach=None, mesh=None) -> Policy:
    """The trained part around a loaded adapter: full weights or LoRA, the KL's base model, gradient checkpointing,
    DDP (LoRA) or FSDP2 (full) across ranks, AdamW and the EMA. `foreach` and `mesh` are tools/plan.py's, and
    train.py passes neither: the planner builds a CUDA run on the CPU, so it asks for the multi-tensor AdamW that
    torch picks on CUDA (foreach=True), and it makes its fake ranks' device mesh before entering fake-tensor mode,
    where FSDP2 could not make the default one."""
    transformer = adapter.transformer
    if args.full:
        transformer.requires_grad_(True)
    else:
        add_lora(transformer, args.lora_rank, args.lora_alpha_applied, args.lora_feed_forward,
                 adapter.lora_targets)
    kl_base = None
    if args.full and args.kl_beta > 0:  # the base model of the KL term: a frozen copy of the starting weights
        import copy

        kl_base = copy.deepcopy(transformer).requires_grad_(False).eval()
    if args.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    model = transformer
    if distributed and not args.full:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(transformer, device_ids=[device.index] if device.type == "cuda" else None)
    elif distributed:
        for module in [transformer] + ([kl_base] if kl_base is not None else []):
            _shard(module, dtype, device, mesh)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), weight_decay=args.weight_decay,
                                  foreach=foreach)
    ema = None
    if args.ema_decay > 0:
        trained = [(name, p) for name, p in transformer.named_parameters() if p.requires_grad]
        ema = EMA(trained, args.ema_decay, args.ema_every)
    return Policy(adapter, transformer, model, params, optimizer, kl_base, ema)


def _shard(module, dtype, device, mesh=None):
    """FSDP2: shard every transformer block (the classes diffusers lists as `_no_split_modules`), then the rest; the
    shards alone move to the device. `mesh`: the ranks' device mesh (default: all ranks of the process group)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    block_classes = set(getattr(module, "_no_split_modules", None) or [])
    for block in [m for m in module.modules() if type(m).__name__ in block_classes]:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(module, mesh=mesh, mp_policy=policy)
    module.to(device)


# On a CPU, a no-grad forward of more rows than this runs as calls of this many: the tiny transformer costs 1.24 to 1.40
# ms an image at 32 to 128 rows and 1.55 to 1.71 at 512 (its activations leave the cache), and each row's velocity is
# the same, bit for bit, in any split (docs/performance.md)
CPU_ROWS = 64


def make_velocity_fn(args, policy, module, cond):
    """v(x, sigma | prompt) of `module` (the transformer, or its DDP wrapper in the update)."""
    velocity = lambda x, sigma, idx: policy.adapter.velocity(module, cond, x, sigma, idx, args.size)
    if policy.adapter.device.type != "cpu":
        return velocity

    def in_cpu_rows(x, sigma, idx):
        if torch.is_grad_enabled() or len(x) <= CPU_ROWS:  # (a forward with gradients keeps its batch's sums)
            return velocity(x, sigma, idx)
        # a row's sigma and prompt index, or one value for every row (methods/base.py's check loss passes one index)
        part = lambda t, i: t[i : i + CPU_ROWS] if torch.is_tensor(t) and t.dim() and len(t) == len(x) else t
        return torch.cat([velocity(x[i : i + CPU_ROWS], part(sigma, i), part(idx, i))
                          for i in range(0, len(x), CPU_ROWS)])

    return in_cpu_rows


def base_velocity_fn(args, policy, cond):
    """The base model's velocity for the KL term: LoRA with its adapter off, or the frozen copy; None without KL."""
    if args.kl_beta == 0:
        return None
    if policy.kl_base is not None:
        return make_velocity_fn(args, policy, policy.kl_base, cond)

    def base_velocity(x, sigma, idx):
        policy.transformer.disable_adapters()
        try:
            return policy.adapter.velocity(policy.transformer, cond, x, sigma, idx, args.size)
        finally:
            policy.transformer.enable_adapters()

    return base_velocity
