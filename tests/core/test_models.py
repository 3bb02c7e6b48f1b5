"""Model presets: the seeded tiny model, the SmolLM2 GGUF conversion, and the chat template."""

from __future__ import annotations

import threading

import pytest
import torch
from filelock import FileLock

from core.serve.chat import ChatRenderer
from core.config import ModelConfig
from core.models import PRESETS, build_tiny, load, smollm2_folder


def test_tiny_is_deterministic_per_seed():
    a, tok = build_tiny(seed=1)
    b, _ = build_tiny(seed=1)
    c, _ = build_tiny(seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    text = "héllo <tool_call> wörld"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_chat_template_renders_tools_and_is_append_only():
    _, tok = build_tiny()
    r = ChatRenderer(tok)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "1", "content": "ok"}]
    full = tok.apply_chat_template(msgs, tools=tools, tokenize=False)
    assert '"name": "f"' in full and "<tool_response>\nok\n</tool_response>" in full
    for k in range(1, len(msgs)):
        assert full.startswith(tok.apply_chat_template(msgs[:k], tools=tools, tokenize=False))
    assert r.turn_close == "<|im_end|>\n"


def test_unknown_model_source_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="neither a preset"):
        load(ModelConfig(source=str(tmp_path / "missing")))


@pytest.mark.slow
def test_smollm2_loads_from_the_wheel_gguf_and_answers():
    model, tok = load(ModelConfig(source="smollm2-135m"))
    assert "smollm2-135m" in PRESETS
    ids = tok.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True, tokenize=False)
    assert ids.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    x = torch.tensor([tok(ids, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = model.generate(x, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > x.shape[1]
    assert sum(p.numel() for p in model.parameters()) > 100_000_000


def test_a_second_smollm2_converter_waits_for_the_first_and_converts_nothing(tmp_path, monkeypatch):
    """Parallel test workers (or runs) share the model cache: only one converts, the rest reuse it."""
    monkeypatch.setenv("SWARMRL_CACHE", str(tmp_path))
    target = tmp_path / "smollm2-135m-instruct"
    first = FileLock(str(target) + ".lock")  # another process is converting
    first.acquire()
    found = []
    second = threading.Thread(target=lambda: found.append(smollm2_folder()))
    second.start()
    second.join(0.5)
    assert second.is_alive()  # waiting on the lock, not converting alongside
    target.mkdir()
    (target / "config.json").write_text("{}")  # the first converter's finished folder
    first.release()
    second.join(30)
    assert found == [target]
    assert (target / "config.json").read_text() == "{}"  # not converted again, not replaced
