"""Every random number generator a training step may draw from, as checkpoint state: torch's (CPU and
each CUDA device's), Python's `random` and numpy's, as tensors and plain Python (so a checkpoint loads
with `weights_only`). Deliberately not here: seeding (`core.train.trainer.seed_everything`) and where
the state is written (`core.run.checkpoint`).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """Every RNG a step may draw from, as tensors and plain Python (loadable with weights_only)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        # One state per GPU the saver saw; a resume on fewer GPUs (or one pinned process seeing one)
        # takes those it has, on more GPUs the rest keep their seeding: never an index past either.
        for index, saved in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(saved, index)
