"""Guard: at top_p 0.8 the trainer's ratio to the engine's recorded logprobs, at the same weights, is 1.

TRL measured a mean ratio of 0.896 at top_p 0.8 (its PR #7269): a trainer that scores a nucleus-sampled
token against the full distribution sees only the nucleus' mass. The core scores each token within the
nucleus it was sampled from (`core.train.packing`), so its step telemetry (`train/ratio_mean`,
`train/mismatch_kl`) must read 1 and 0 to float error on episodes the HF engine sampled at top_p 0.8.
"""

from __future__ import annotations

import asyncio

import pytest

from core.config import EngineConfig, TrainerConfig
from core.engine import SamplingParams
from core.engine.hf import HFEngine
from core.models import build_tiny
from core.records import Call, Episode
from core.train.trainer import Trainer

TOP_P = 0.8
FLOAT_ERROR = 1e-5  # float32 logprobs of the same weights, summed over a few dozen tokens


def nucleus_group(model, tok) -> list[Episode]:
    """Four episodes of one task, each a call sampled by the HF engine at top_p 0.8 (T = 1 and 0.7)."""
    engine = HFEngine(model, tok, EngineConfig(), max_context=2048)
    prompt = tok("user: name a colour\nassistant:", add_special_tokens=False)["input_ids"]
    episodes = []
    try:
        for i, temperature in enumerate((1.0, 1.0, 0.7, 0.7)):
            gen = asyncio.run(engine.generate(prompt, SamplingParams(max_tokens=16, temperature=temperature,
                                                                     top_p=TOP_P, seed=10 + i)))
            call = Call(model="policy", version=gen.version, prompt_ids=prompt, completion_ids=gen.token_ids,
                        completion_logprobs=gen.logprobs, temperature=gen.temperature, top_p=gen.top_p)
            episodes.append(Episode(id=f"e{i}", sandbox="s", task_id="t", group_size=4, state="finished",
                                    opened_at=0.0, lease_expires_at=60.0, calls=[call], reward={"policy": float(i % 2)}))
    finally:
        engine.close()
    return episodes


@pytest.mark.parametrize("merge", ["linear", "tree"])
def test_the_top_p_0_8_ratio_at_the_same_weights_stays_one_to_float_error(merge: str):
    model, tok = build_tiny(seed=0)
    group = nucleus_group(model, tok)
    assert all(e.calls[0].top_p == TOP_P for e in group)
    trainer = Trainer(model, TrainerConfig(merge=merge), "policy", lora=False)
    metrics = trainer.step([group])
    assert metrics["train/trained_tokens"] == sum(len(e.calls[0].completion_ids) for e in group)
    assert metrics["train/ratio_mean"] == pytest.approx(1.0, abs=FLOAT_ERROR)
    assert metrics["train/mismatch_kl"] == pytest.approx(0.0, abs=FLOAT_ERROR)
    assert metrics["train/behaviour_logp_diff_max"] < 1e-4
