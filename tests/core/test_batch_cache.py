"""The hf engine's preallocated batch cache: decode steps write in place, and what it computes is what
each row computes alone with transformers' own concatenating cache, after admissions and retirements."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from core.engine.batch_cache import MIN_COLUMNS, BatchCache
from core.models import build_tiny


@pytest.fixture(scope="module")
def model():
    return build_tiny()[0].eval()


def prefill(model, prompts: list[list[int]]) -> tuple[DynamicCache, torch.Tensor, torch.Tensor]:
    """Left-padded batched prefill, as the engine runs it: (its cache, its mask, last-token logits)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    cache = DynamicCache()
    out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                past_key_values=cache, use_cache=True)
    return cache, mask, out.logits[:, -1]


def decode(model, cache: BatchCache, tokens: list[int], positions: list[int]) -> torch.Tensor:
    out = model(input_ids=torch.tensor(tokens)[:, None], attention_mask=cache.decode_mask(),
                position_ids=torch.tensor(positions)[:, None], past_key_values=cache, use_cache=True)
    cache.advance(1)
    return out.logits[:, -1]


def alone(model, prompt: list[int], steps: int) -> list[torch.Tensor]:
    """Greedy logits of `prompt` decoded by itself, each step through a plain `DynamicCache`."""
    cache = DynamicCache()
    logits = model(input_ids=torch.tensor([prompt]), past_key_values=cache, use_cache=True).logits[0, -1]
    seen = [logits]
    for step in range(steps):
        out = model(input_ids=logits.argmax()[None, None], position_ids=torch.tensor([[len(prompt) + step]]),
                    past_key_values=cache, use_cache=True)
        logits = out.logits[0, -1]
        seen.append(logits)
    return seen


@torch.inference_mode()
def test_decode_steps_write_in_place_until_the_capacity_doubles_and_match_each_row_alone(model):
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17]]
    steps = MIN_COLUMNS + 16  # past the first capacity, so one growth happens in the run
    expected = [alone(model, p, steps) for p in prompts]
    fresh, mask, logits = prefill(model, prompts)
    cache = BatchCache(max_rows=4)
    cache.append_rows(fresh, mask)
    pointers = set()
    for step in range(steps):
        for row in range(2):
            torch.testing.assert_close(logits[row], expected[row][step], atol=1e-4, rtol=1e-4)
        before = cache.reallocations
        tokens = logits.argmax(-1).tolist()
        logits = decode(model, cache, tokens, [len(p) + step for p in prompts])
        if cache.reallocations == before:  # within capacity the storage is the same: no concatenation
            pointers.add((cache.layers[0].keys_buf.data_ptr(), cache.mask_buf.data_ptr()))
    assert cache.reallocations == 2  # the first admission, then one doubling
    assert len(pointers) == 2


@torch.inference_mode()
def test_retired_rows_leftovers_never_reach_rows_admitted_after_them(model):
    """A retired row's buffer columns may hold NaN (a diverged model's row); columns newly exposed by a
    longer admission must be cleared, or NaN * 0 in the attention poisons every row."""
    first = [[5, 6, 7], [20, 21, 22, 23, 24, 25]]
    fresh, mask, logits = prefill(model, first)
    cache = BatchCache(max_rows=4)
    cache.append_rows(fresh, mask)
    for step in range(12):
        logits = decode(model, cache, logits.argmax(-1).tolist(), [len(p) + step for p in first])
    assert cache.keep_rows([0]) == [0]  # row 1 retires; row 0's dead columns are dropped from the left
    assert cache.start > 0
    for layer in cache.layers:  # everything outside the surviving row's live region is garbage
        for buf in (layer.keys_buf, layer.values_buf):
            live = buf[0, :, cache.start : cache.end].clone()
            buf.fill_(float("nan"))
            buf[0, :, cache.start : cache.end] = live
    survivor_next = logits[0].argmax().item()
    late = [[30, 31], list(range(40, 57))]  # 17 tokens: wider than the live 15 columns, so it extends left
    fresh, mask, late_logits = prefill(model, late)
    cache.append_rows(fresh, mask)
    assert cache.reallocations == 1  # room on the left: the join copied only the new rows
    tokens = [survivor_next] + late_logits.argmax(-1).tolist()
    positions = [len(first[0]) + 12] + [len(p) for p in late]
    out = decode(model, cache, tokens, positions)
    survivor = alone(model, first[0], 13)
    torch.testing.assert_close(out[0], survivor[13], atol=1e-4, rtol=1e-4)
    for row, p in enumerate(late, start=1):
        torch.testing.assert_close(out[row], alone(model, p, 1)[1], atol=1e-4, rtol=1e-4)


def test_keep_rows_moves_the_last_survivors_into_the_holes(model):
    cache = BatchCache(max_rows=8)
    with torch.inference_mode():
        fresh, mask, _ = prefill(model, [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]])
        cache.append_rows(fresh, mask)
        marks = cache.layers[0].keys_buf[:5, 0, cache.start, 0].clone()
        order = cache.keep_rows([1, 3, 4])
    assert order == [3, 1, 4]  # holes 0 and 2 take rows 3 and 4, the survivors past the end; 1 stays
    assert cache.layers[0].keys_buf[:3, 0, cache.start, 0].tolist() == marks[order].tolist()
    assert cache.layers[0].keys.shape[0] == 3
