"""Checkpoints that a crash cannot corrupt, and that stock diffusers loads.

Layout of one checkpoint, `<output>/checkpoints/iter_000040/`:
    transformer/   full fine-tune: config.json + diffusion_pytorch_model*.safetensors (FluxTransformer2DModel
                   .from_pretrained(dir) loads it)
    lora/          LoRA: pytorch_lora_weights.safetensors (FluxPipeline.load_lora_weights(dir) loads it)
    trainer.pt     optimizer state, iteration, config (torch.load(weights_only=True) reads it)
Each is written into `iter_000040.tmp/` and renamed when complete, so the newest folder without `.tmp` is always
whole. The data order and every noise are functions of (seed, iteration), so iteration is all a resume needs.
Works without a process group, under DDP and under FSDP2 (full state dicts gathered to rank 0).
"""
import json
import os
import shutil

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

# config fields that must match for a resume to continue the same run
RESUME_KEYS = ["model", "model_path", "lora_rank", "resolution", "group_size", "num_steps", "shift", "sde_steps",
               "granularities", "sampling", "rewards", "seed", "prompts_per_iteration"]


def _is_main():
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def list_checkpoints(output_dir):
    folder = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(folder):
        return []
    done = [d for d in os.listdir(folder) if d.startswith("iter_") and not d.endswith(".tmp")
            and os.path.isfile(os.path.join(folder, d, "trainer.pt"))]
    return [os.path.join(folder, d) for d in sorted(done)]


def latest_checkpoint(output_dir):
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def read_trainer_state(path):
    return torch.load(os.path.join(path, "trainer.pt"), map_location="cpu", weights_only=True)


def incompatible(saved: dict, current: dict):
    """The first config field that differs between a checkpoint and this run, or None."""
    for key in RESUME_KEYS:
        if json.dumps(saved.get(key)) != json.dumps(current.get(key)):
            return key, saved.get(key), current.get(key)
    return None


def _full_options():
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def save(output_dir, iteration, model, transformer, optimizer, config, lora, pipeline_class, keep=2):
    """Write checkpoint `iteration` atomically. `model` is what was wrapped (DDP / FSDP2 / plain), `transformer`
    the unwrapped diffusers module. All ranks call this (gathering full state dicts is collective)."""
    folder = os.path.join(output_dir, "checkpoints", f"iter_{iteration:06d}")
    tmp = folder + ".tmp"
    if lora:
        from peft import get_peft_model_state_dict

        weights = get_peft_model_state_dict(transformer)  # DDP keeps one full copy per rank
    else:
        weights = get_model_state_dict(model, options=_full_options())
    optim_state = get_optimizer_state_dict(model, optimizer, options=_full_options())
    if _is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        if lora:
            pipeline_class.save_lora_weights(os.path.join(tmp, "lora"), transformer_lora_layers=weights)
        else:
            from huggingface_hub import save_torch_state_dict

            transformer.save_config(os.path.join(tmp, "transformer"))
            save_torch_state_dict({k: v.contiguous() for k, v in weights.items()}, os.path.join(tmp, "transformer"),
                                  filename_pattern="diffusion_pytorch_model{suffix}.safetensors",
                                  max_shard_size="10GB")
        torch.save({"iteration": iteration, "optimizer": optim_state, "config": config},
                   os.path.join(tmp, "trainer.pt"))
        os.replace(tmp, folder)  # atomic: the checkpoint appears whole or not at all
        for old in list_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return folder


def load(path, model, transformer, optimizer, lora):
    """Restore weights and optimizer state from `path`; returns the trainer state dict."""
    from safetensors.torch import load_file

    state = read_trainer_state(path)
    if lora:
        from peft import set_peft_model_state_dict

        saved = load_file(os.path.join(path, "lora", "pytorch_lora_weights.safetensors"))
        set_peft_model_state_dict(transformer, {k.removeprefix("transformer."): v for k, v in saved.items()})
    else:
        folder = os.path.join(path, "transformer")
        weights = {}
        for name in sorted(os.listdir(folder)):
            if name.endswith(".safetensors"):
                weights.update(load_file(os.path.join(folder, name)))
        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(full_state_dict=True))
    return state
