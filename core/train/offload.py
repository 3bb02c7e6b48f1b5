"""A trainer's state in host memory between steps (`models[].trainer.offload`), for colocated GPUs.

With `layout: colocated` a trainer rank and a rollout replica share a GPU. The replica sleeps during
the step (`core.engine.replicas`); with offload the trainer gives the memory back during rollout:
after each optimizer step its weights, fp32 master copies, AdamW moments and KL reference move to
host memory and the GPU's cache is emptied; before the next backward they come back. The plan
counts it (`core.run.plan`, `core.train.memory.device_use`).

The tensors keep their identity: a parameter's `.data` moves, so the optimizer, the engines'
references to the module and the weight sync (which copies host tensors into its device buckets,
`core.engine.weight_sync`) all hold the same objects. A load or save of the trainer's state runs
with the state on the device, as without offload.

Deliberately not here: FSDP2's shards (its `CPUOffloadPolicy` keeps shards on the host all the
time, a different trade; `core.config` refuses offload with fsdp2), and deciding when rollout runs
(the trainer's own calls mark it: `backward` starts a step, `apply` ends it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

HOST = torch.device("cpu")


class HostOffload:
    """Moves one trainer's state between its device and host memory (see the module doc)."""

    def __init__(self, trainer: Any, device: str | torch.device):
        self.trainer, self.device, self.host = trainer, torch.device(device), HOST
        self.on_host = False

    def parameters(self) -> list[torch.Tensor]:
        """Every parameter-like tensor the trainer holds, once each: its policy's, its fp32 master copies
        (the others are the policy's own), its KL reference's."""
        found = [*self.trainer.policy.parameters(), *self.trainer.master.params]
        if self.trainer.reference is not None:
            found += list(self.trainer.reference.parameters())
        return list({id(t): t for t in found}.values())

    def moments(self) -> list[tuple[dict, str]]:
        """(optimizer state, key) of every AdamW moment; its step counters stay where torch keeps them."""
        return [(state, key) for state in self.trainer.optimizer.state.values()
                for key, value in state.items() if torch.is_tensor(value) and value.dim() > 0]

    @torch.no_grad()
    def _move(self, to: torch.device, source: torch.device) -> None:
        for t in self.parameters():
            if t.device == source:
                t.data = t.data.to(to)  # the Parameter object stays: the optimizer and engines hold it
                if t.grad is not None:
                    t.grad = t.grad.to(to)
        for state, key in self.moments():
            if state[key].device == source:
                state[key] = state[key].to(to)

    def to_host(self) -> None:
        if self.on_host or self.device == self.host:
            return
        self._move(self.host, self.device)
        self.on_host = True
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()  # the freed blocks back to the GPU, for the replica that wakes

    def to_device(self) -> None:
        if self.on_host:
            self._move(self.device, self.host)
            self.on_host = False


def around(offload: HostOffload, call: Callable[..., Any], then_host: bool) -> Callable[..., Any]:
    """`call` run with the state on the device; with `then_host`, the state goes back to the host after
    it, whether it returned or raised (a step over, or failed)."""
    @functools.wraps(call)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        offload.to_device()
        try:
            return call(*args, **kwargs)
        finally:
            if then_host:
                offload.to_host()
    return wrapped


def install(trainer: Any, device: str) -> HostOffload:
    """Offload `trainer`'s state between its steps: `backward` brings it to the device, `apply` (and a
    `discard` of a failed step) sends it back, a load runs on the device; it starts on the host, since
    rollout comes first. Returns the offload (its `on_host` says where the state is)."""
    offload = HostOffload(trainer, device)
    trainer.backward = around(offload, trainer.backward, then_host=False)
    trainer.apply = around(offload, trainer.apply, then_host=True)
    trainer.discard = around(offload, trainer.discard, then_host=True)
    trainer.load_state_dict = around(offload, trainer.load_state_dict, then_host=True)
    offload.to_host()
    return offload
