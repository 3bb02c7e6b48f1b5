"""Streamed text is decoded incrementally: always a prefix of the whole decode, whole at the end, in linear work."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from core.models import byte_tokenizer
from core.engine.detokenize import IncrementalText

TOK = byte_tokenizer()


def decode(ids: list[int]) -> str:
    return TOK.decode(ids, skip_special_tokens=False)


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40))
def test_streamed_text_is_always_a_prefix_and_ends_whole(text: str) -> None:
    ids = TOK(text, add_special_tokens=False)["input_ids"]
    stream = IncrementalText(decode)
    got = ""
    for k, token in enumerate(ids, 1):
        got += stream.add(token)  # only the newly stable text
        assert decode(ids[:k]).startswith(got) or "\ufffd" in decode(ids[:k])
        assert "\ufffd" not in got  # never half a character
    assert got == stream.text == decode(ids)


def test_a_long_completion_decodes_a_bounded_window_per_token() -> None:
    ids = TOK("héllo ✓ wörld " * 200, add_special_tokens=False)["input_ids"]
    decoded = [0]

    def counting(window: list[int]) -> str:
        decoded[0] += len(window)
        return decode(window)

    stream = IncrementalText(counting)
    for token in ids:
        stream.add(token)
    assert stream.text == decode(ids)
    assert decoded[0] <= 10 * len(ids)  # whole-list decoding at every token is ~len(ids)**2 / 2 = 3.6M here
