"""A decode step reads the model's device back to the host once: the sampled tokens, logprobs and NaN
flags in one piece. Every value that shapes the step (greedy rows, top_p rows, seeds) is known on the
host; a `.tolist()` per tensor, a `bool(mask.any())` or a boolean-mask index would each stall a GPU
pipeline until the step's kernels finish.

The count is taken on the CPU, where every tensor is a host tensor, so it is an upper bound on the
device reads: each Python-level read (`tolist`, `numpy`) and each aten op that must see values on the
host (`_local_scalar_dense` behind `item`/`bool`/`int`/`float`, `nonzero`, `masked_select`, indexing
by a bool mask) made while the engine samples a step counts one."""

from __future__ import annotations

import asyncio

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from core.config import EngineConfig
from core.engine import SamplingParams
from core.engine.hf import HFEngine
from core.models import build_tiny

aten = torch.ops.aten
VALUE_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default}
BOOL_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default}


class HostReads(TorchDispatchMode):
    """Counts reads of tensor values by the host while active (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self._patched: list[tuple[str, object]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in VALUE_OPS:
            self.reads.append(str(func))
        elif func in BOOL_INDEXED and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                          for i in (args[1] if len(args) > 1 else ()) or ()):
            self.reads.append(f"{func} by a bool mask")
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name in ("tolist", "numpy"):  # no aten op: they copy the values out directly
            real = getattr(torch.Tensor, name)
            self._patched.append((name, real))

            def counted(t, *a, _real=real, _name=name, **k):
                self.reads.append(_name)
                return _real(t, *a, **k)

            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, real in self._patched:
            setattr(torch.Tensor, name, real)
        return super().__exit__(*exc)


class CountingEngine(HFEngine):
    """The hf engine with each sampling step's host reads recorded (instrumentation, not a stand-in)."""

    def __init__(self, *args, **kwargs):
        self.steps: list[list[str]] = []
        super().__init__(*args, **kwargs)

    def _sample(self, rows, logits):
        with HostReads() as counter:
            super()._sample(rows, logits)
        self.steps.append(counter.reads)


@pytest.fixture(scope="module")
def tiny():
    return build_tiny()


@pytest.mark.parametrize("repeatable", [False, True], ids=["shared-stream", "repeatable"])
def test_each_decode_step_reads_the_device_once_whatever_the_rows_ask_for(tiny, repeatable):
    model, tok = tiny
    eng = CountingEngine(model, tok, EngineConfig(repeatable_sampling=repeatable), max_context=2048)
    ids = tok("count the reads", add_special_tokens=False)["input_ids"]
    mixed = [SamplingParams(max_tokens=8, temperature=0.0, top_p=0.5),  # greedy with a top_p
             SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9),  # a nucleus row
             SamplingParams(max_tokens=8, temperature=1.0, seed=4),  # its own generator
             SamplingParams(max_tokens=8, temperature=1.0, key="sandbox/task/0/0/0")]

    async def go():
        return await asyncio.gather(*(eng.generate(ids, p) for p in mixed))

    try:
        gens = asyncio.run(go())
    finally:
        eng.close()
    assert all(g.token_ids for g in gens)
    assert len(eng.steps) >= 8  # the first token at admission, then a decode step per token
    assert all(reads == ["tolist"] for reads in eng.steps), eng.steps[:3]


def test_the_counter_sees_the_reads_a_step_could_make():
    """The check above can fail: each kind of read it forbids is counted."""
    probs, mask = torch.rand(3, 5), torch.tensor([True, False, True])
    with HostReads() as counter:
        probs.tolist()
        bool(mask.any())
        float(probs[0, 0])
        _ = probs[mask]
        probs[mask] = 0.0
        mask.nonzero()
    assert len(counter.reads) == 6, counter.reads
