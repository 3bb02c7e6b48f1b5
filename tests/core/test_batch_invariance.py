"""Repeatable sampling to the last bit: under `engine.repeatable_sampling` a request's tokens and logprobs
are the same bits whichever requests share its decode steps (alone, beside prompts of other lengths, with
the batch's tail down to one row, joining late), because prompts are prefilled only beside prompts of
their length, decode attention runs each row over its own columns (`row_attention`) and a short decode
step is padded to the height from which the linear layers are batch-invariant (`invariant_rows`).
Without it the same requests part in their last bits (the control case)."""

from __future__ import annotations

import asyncio

import pytest
import torch
import torch.nn.functional as F

from core.config import EngineConfig
from core.engine import SamplingParams
from core.engine.batch_invariance import ROW_ATTENTION, invariant_rows, row_attention
from core.engine.hf import HFEngine
from core.models import attention_view, build_tiny


@pytest.fixture(scope="module")
def tiny():
    return build_tiny()


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _company(eng: HFEngine, tok, repeatable: bool) -> dict[str, tuple[list[int], list[float]]]:
    """The target request's (tokens, logprobs) in each company it can decode in."""
    target = _ids(tok, "what is 23 + 41? answer")
    others = [_ids(tok, f"what is {i} + {2 * i + 1}?" + " please" * (i % 5)) for i in range(31)]

    def params(key: str, n: int = 24) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=1.0, key=key, seed=None if repeatable else 7)

    async def among(count: int, head_start_s: float = 0.0, length: int = 24):
        rest = [asyncio.ensure_future(eng.generate(o, params(f"other-{i}", length))) for i, o in enumerate(others[:count])]
        if head_start_s:
            await asyncio.sleep(head_start_s)
        mine = await eng.generate(target, params("target"))
        await asyncio.gather(*rest)
        return mine.token_ids, mine.logprobs

    async def run():
        return {"alone": await among(0), "beside one": await among(1), "beside three": await among(3),
                "beside fifteen of other lengths": await among(15), "in a full batch": await among(31),
                "beside short ones (its tail alone)": await among(7, length=3),
                "joining four long ones late": await among(4, head_start_s=0.05, length=200)}

    return asyncio.run(run())


def test_under_repeatable_sampling_a_request_decodes_the_same_bits_in_any_company(tiny):
    model, tok = tiny
    eng = HFEngine(model, tok, EngineConfig(max_batch=32, repeatable_sampling=True), max_context=2048)
    try:
        seen = _company(eng, tok, repeatable=True)
    finally:
        eng.close()
    alone = seen.pop("alone")
    assert len(alone[0]) == 24
    for company, got in seen.items():
        assert got == alone, company  # tokens and logprobs, compared as exact floats


def test_without_it_the_same_seeded_requests_part_in_their_last_bits(tiny):
    # The control: a seeded request (its own generator) in the plain engine draws the same random numbers,
    # yet its logprobs move with its company: the case above is not passing by accident.
    model, tok = tiny
    eng = HFEngine(model, tok, EngineConfig(max_batch=32), max_context=2048)
    try:
        seen = _company(eng, tok, repeatable=False)
    finally:
        eng.close()
    alone = seen.pop("alone")
    assert any(got[1] != alone[1] for got in seen.values())


class _TallerIsOtherBits(torch.nn.Linear):
    """A linear layer whose rows change with the height below 6 rows, as a BLAS's small-matrix kernels would."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + (1e-3 * x.shape[0] if x.shape[0] < 6 else 0.0)


def test_invariant_rows_finds_the_height_from_which_every_linear_layer_repeats(tiny):
    assert invariant_rows(torch.nn.Sequential(torch.nn.Linear(8, 8), _TallerIsOtherBits(8, 4)), 16) == 6
    assert invariant_rows(torch.nn.Sequential(_TallerIsOtherBits(8, 4)), 5) == 5  # none below the cap: the cap
    model, _ = tiny
    height = invariant_rows(model, 32)
    for layer in (m for m in model.modules() if isinstance(m, torch.nn.Linear)):
        rows = torch.randn(32, layer.in_features)
        with torch.inference_mode():
            first = layer(rows[:height])[:1]
            assert all(torch.equal(layer(rows[:h])[:1], first) for h in range(height, 33))


def test_row_attention_is_sdpa_without_the_padding(tiny):
    # Row 0 attends to its last 5 of 9 columns, row 1 to all 9: each equals SDPA over just its own columns
    # exactly, and the padded batch's SDPA to float error; a prefill (several query tokens) is SDPA itself.
    model, _ = tiny
    layer = attention_view(model, ROW_ATTENTION).model.layers[0].self_attn
    torch.manual_seed(0)
    heads, kv_heads, dim = layer.config.num_attention_heads, layer.config.num_key_value_heads, layer.head_dim
    q, k, v = torch.randn(2, heads, 1, dim), torch.randn(2, kv_heads, 9, dim), torch.randn(2, kv_heads, 9, dim)
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[0, ..., :4] = False
    out, _ = row_attention(layer, q, k, v, mask, scaling=layer.scaling)
    groups = heads // kv_heads
    for row, first in ((0, 4), (1, 0)):
        kk, vv = (t[row : row + 1, :, first:].repeat_interleave(groups, 1) for t in (k, v))
        own = F.scaled_dot_product_attention(q[row : row + 1], kk, vv, scale=layer.scaling).transpose(1, 2)
        assert torch.equal(out[row : row + 1], own)
    padded = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                            attn_mask=mask, scale=layer.scaling).transpose(1, 2)
    torch.testing.assert_close(out, padded)
    prefill = torch.randn(1, heads, 3, dim)
    causal = torch.ones(1, 1, 3, 9, dtype=torch.bool)
    assert torch.equal(row_attention(layer, prefill, k[:1], v[:1], causal, scaling=layer.scaling)[0],
                       F.scaled_dot_product_attention(prefill, k[:1].repeat_interleave(groups, 1),
                                                      v[:1].repeat_interleave(groups, 1), attn_mask=causal,
                                                      scale=layer.scaling).transpose(1, 2))
