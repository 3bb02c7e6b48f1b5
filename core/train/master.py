"""fp32 master copies of a policy's low-precision trainable weights, which the optimizer steps instead.

Why: an AdamW step at RL learning rates is smaller than half a bfloat16 ulp for most weights, so
stepping bf16 weights in place rounds the update away. Measured on SmolLM2-135M with a real
gradient: an AdamW step at lr 1e-5 changes 1.4% of its bf16 weights, and nine more steps change
none, so the model keeps 17% of the update (`bench/bf16_update.py`). So,
as in the mixed-precision training of large models, the optimizer owns an fp32 copy of each bf16 or
fp16 parameter; the model keeps running (training and generating) in its own dtype, its gradients
are moved to the copies before each step, and its weights are rounded from the copies after it.
Weights already in fp32 (a CPU run's default, LoRA adapters) are stepped in place, as before, and
so is everything when `trainer.master_weights` is off (a model that only just fits its memory).

Deliberately not: autocast or loss scaling (the forward and backward passes stay in the model's
dtype, and bf16 has fp32's exponent range), nor a copy of anything that does not train.
"""

from __future__ import annotations

import torch

# Dtypes whose spacing is too coarse to hold an optimizer step; fp32 and wider are stepped in place.
LOW_PRECISION = (torch.bfloat16, torch.float16)


class MasterWeights:
    """The tensors the optimizer steps: an fp32 copy for each low-precision parameter, else the parameter."""

    def __init__(self, params: list[torch.nn.Parameter], enabled: bool = True):
        self.params = [torch.nn.Parameter(p.detach().float().clone()) if enabled and p.dtype in LOW_PRECISION else p
                       for p in params]
        # (model parameter, its fp32 copy) for the low-precision ones only
        self.pairs = [(p, m) for p, m in zip(params, self.params) if m is not p]

    def take_grads(self) -> None:
        """Move the model's gradients onto the copies, in fp32; the model keeps none."""
        for p, m in self.pairs:
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    @torch.no_grad()
    def write_back(self) -> None:
        """Round the stepped copies into the model's weights (what the engine generates with)."""
        for p, m in self.pairs:
            p.copy_(m)

    @torch.no_grad()
    def read_model(self) -> None:
        """Set the copies from the model's weights, after something other than the optimizer set them."""
        for p, m in self.pairs:
            m.copy_(p)

    def state(self) -> list[torch.Tensor]:
        """The copies themselves (the bits the model's rounded weights lost), for a checkpoint."""
        return [m.detach().clone() for _, m in self.pairs]

    def check(self, saved: list[torch.Tensor] | None) -> None:
        """Raise ValueError unless `saved` fits these copies. None or empty (a checkpoint of an fp32
        run, or from before master weights), and any saved copies when this policy steps in place,
        are fine: a run may resume in another dtype (a CPU run's fp32 checkpoint on a bf16 GPU)."""
        if not saved or not self.pairs:
            return
        if len(saved) != len(self.pairs) or any(s.shape != m.shape for s, (_, m) in zip(saved, self.pairs)):
            raise ValueError(f"{len(saved)} saved master weights do not fit the policy's {len(self.pairs)} "
                             "low-precision parameters (dtype, master_weights or model changed?)")

    @torch.no_grad()
    def load(self, saved: list[torch.Tensor] | None) -> None:
        """Take the saved copies where both sides have them; otherwise keep the current ones."""
        self.check(saved)
        if saved and self.pairs:
            for s, (_, m) in zip(saved, self.pairs):
                m.copy_(s)
