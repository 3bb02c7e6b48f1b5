"""A checkpoint's CUDA RNG states restore on a machine with another GPU count (core/train/rng.py).

The saver had 4 GPUs; the resume sees 1 (a pinned rank process, or a smaller machine): it takes the
first state and never indexes past its own devices. CPU-only here: torch.cuda is stood in for by a
recorder of what would be set (no GPU is touched).
"""

from __future__ import annotations

import pytest
import torch

from core.train import rng


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_cuda_rng_states_restore_across_device_counts(monkeypatch, gpus):
    state = rng.rng_state()
    saved = [torch.full((16,), i, dtype=torch.uint8) for i in range(4)]  # the saver's 4 GPUs
    state["cuda"] = saved
    set_on: dict[int, torch.Tensor] = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)

    def set_rng_state(new_state: torch.Tensor, device: int) -> None:
        if not 0 <= device < gpus:
            raise IndexError(f"no GPU {device} of {gpus}")
        set_on[device] = new_state
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all",
                        lambda states: [set_rng_state(s, i) for i, s in enumerate(states)])
    rng.set_rng_state(state)
    assert sorted(set_on) == list(range(min(gpus, 4)))
    assert all(torch.equal(set_on[i], saved[i]) for i in set_on)
