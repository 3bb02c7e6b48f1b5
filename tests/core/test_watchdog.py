"""The hang watchdog: a client whose rollouts block stalls the run; the watchdog says so, dumps stacks, and clears."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import httpx
import pytest
from typer.testing import CliRunner

from core.run.cli import app
from core.config import EngineConfig
from core.config_io import load_config
from core.engine import SamplingParams
from core.engine.hf import HFEngine
from core.models import build_tiny
from core.run.loop import CoreRun

STALL_S = 1.5


def _status(url: str) -> dict:
    return httpx.get(url + "/swarm/v1/status", timeout=10).json()


def _wait_for(url: str, state: str, timeout: float = 60.0) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        data = _status(url)
        if data["state"] == state:
            return data
        time.sleep(0.1)
    raise AssertionError(f"server never became {state}: {data}")


@pytest.mark.slow
def test_a_hung_client_is_reported_stalled_with_stacks_and_clears_when_it_moves(tmp_path, monkeypatch, caplog):
    flag = tmp_path / "hang"
    flag.touch()
    monkeypatch.setenv("SWARMRL_HANG_FLAG", str(flag))
    cfg = load_config(overrides=[
        "server.port=0", f"server.stall_s={STALL_S}", "trainer.steps=1000", "trainer.batch_groups=1",
        "trainer.group_size=2", f"trainer.checkpoint_dir={tmp_path / 'run' / 'checkpoints'}",
        "clients=[{agent: tests.core.hang_agent, isolate: false, concurrency: 2}]"])
    core = CoreRun(cfg)
    core.server.start()
    url = core.server.url
    trainer = threading.Thread(target=core.train, daemon=True)
    caplog.set_level(logging.INFO, logger="core.run.watchdog")
    try:
        core.start_clients()
        deadline = time.time() + 60
        while _status(url)["open_episodes"] < 2 and time.time() < deadline:  # both rollouts hang from here on
            time.sleep(0.1)
        trainer.start()  # the watchdog watches while the trainer waits
        stalled = _wait_for(url, "stalled")
        line = stalled["stalled"]
        assert line.startswith("stalled: no finished episode and no train step for ")
        for part in ("open episodes 2 (oldest opened", "buffer 0 ready / 0 filling groups", "server not paused",
                     "engine policy: queue 0, active 0, admitting, oldest in-flight request none"):
            assert part in line, line
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert errors == [line]  # one line per stall, however long it lasts
        dumps = list((tmp_path / "run").glob("stall-*.txt"))
        assert len(dumps) == 1 and str(dumps[0]) in line
        stacks = dumps[0].read_text()
        assert stacks.startswith(line) and "most recent call first" in stacks and "watchdog.py" in stacks
        shown = CliRunner().invoke(app, ["status", url])
        assert shown.exit_code == 0 and "stalled" in shown.output and "open episodes 2" in shown.output

        flag.unlink()  # the rollouts move on: episodes finish, the trainer steps
        _wait_for(url, "serving")
        assert any("progress again after" in r.getMessage() for r in caplog.records)
        time.sleep(STALL_S / 2)
        assert len(list((tmp_path / "run").glob("stall-*.txt"))) == 1
    finally:
        core.stop.set()
        trainer.join(timeout=30)
        core.stop_clients()
        core.server.stop()
    assert core.server.stalled is None  # a run that ended is not stalled


def test_the_engine_reports_its_queue_admission_and_oldest_request():
    model, tok = build_tiny()
    engine = HFEngine(model, tok, EngineConfig(), max_context=2048)

    async def go():
        idle = engine.load()
        engine.hold()  # as during a weight sync: requests queue
        await asyncio.sleep(0.2)  # the worker sees the hold (one already blocked on the queue would still admit)
        waiting = asyncio.ensure_future(engine.generate([1, 2, 3], SamplingParams(max_tokens=2)))
        await asyncio.sleep(0.3)
        held = engine.load()
        engine.resume()
        await waiting
        return idle, held, engine.load()

    try:
        idle, held, after = asyncio.run(go())
    finally:
        engine.close()
    assert (idle.queued, idle.active, idle.admitting, idle.oldest_s) == (0, 0, True, None)
    assert (held.queued, held.active, held.admitting) == (1, 0, False) and held.oldest_s >= 0.3
    assert (after.queued, after.active, after.admitting, after.oldest_s) == (0, 0, True, None)
