"""Pause and resume of a training run (``evidence.train --checkpoint PATH --stop-after S``).

A checkpoint is one ``torch.save`` file: ``args`` (the arguments that shape the run, compared on
resume), ``finished``, and either the paused state (``model``, ``optimizer``, the training
stream's position ``data``, the torch and CUDA random states, and ``done``: step, best, history,
gradient norms, last loss, wall time) or, once finished, the run's ``record`` and final ``model``.
A checkpoint written before the gradient norms were recorded resumes with them starting empty.
"""

from __future__ import annotations

import os
import time

import torch

RESUME_FREE = ("checkpoint", "stop_after", "stop_after_steps", "out", "no_progress", "device", "compile")


def run_identity(args, lr: float) -> dict:
    """The arguments that shape a checkpointed run, compared on resume: all but where it runs,
    writes and pauses, with the learning rate as ``lr`` (the one rate of ``--lr`` or ``--lrs``)."""
    kept = {k: v for k, v in vars(args).items() if k not in RESUME_FREE and k != "lrs"}
    return {**kept, "lr": lr}


def save_checkpoint(path: str, state: dict) -> None:
    """``torch.save`` to a temporary file, then renamed: a killed save leaves the old checkpoint."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def load_checkpoint(path: str, args, lr: float) -> dict | None:
    """The checkpoint at ``path`` (``None`` if there is none); a ``ValueError`` names the first
    argument that differs from the run that wrote it."""
    if not os.path.exists(path):
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    saved, now = state["args"], run_identity(args, lr)
    for key in sorted(saved.keys() | now.keys()):
        if saved.get(key) != now.get(key):
            raise ValueError(f"checkpoint {path} was made with --{key.replace('_', '-')} "
                             f"{saved.get(key)!r}, not {now.get(key)!r}")
    return state


def training_state(opt, batches, device: torch.device, done: dict) -> dict:
    """What a paused run needs beside its weights to go on exactly: the optimizer, the data
    stream's position, the random states, and ``done`` (step, best, history, gradient norms, last
    loss, wall time)."""
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return {"optimizer": opt.state_dict(), "data": batches.state_dict(),
            "torch_rng": torch.get_rng_state(), "cuda_rng": cuda_rng, "done": done}


def restore(saved: dict, model, opt, batches, device: torch.device) -> dict:
    """Load a paused checkpoint into ``model``, ``opt``, ``batches`` and the random states;
    returns its ``done`` (with empty gradient-norm lists where the checkpoint predates them)."""
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    batches.load_state_dict(saved["data"])
    torch.set_rng_state(saved["torch_rng"])
    if device.type == "cuda" and saved["cuda_rng"] is not None:
        torch.cuda.set_rng_state(saved["cuda_rng"], device)
    return {"grad_norms": [], "mixer_grad_norms": [], **saved["done"]}


def should_pause(args, steps_here: int, deadline: float | None) -> bool:
    """Whether ``--stop-after`` (or the test-only ``--stop-after-steps``) has been reached."""
    if args.stop_after_steps is not None and steps_here >= args.stop_after_steps:
        return True
    return deadline is not None and time.perf_counter() >= deadline
