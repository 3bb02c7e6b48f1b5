"""Credentials and confinement: episode keys authorize, path secrets are not ids, the admin token
stays out of params, manifests and logs, and sandbox entries and `latest` pointers stay in their folders."""

from __future__ import annotations

import logging
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from core.run import checkpoint
from core.config_io import flatten, load_config
from core.run.processes import announce_admin_token
from core.clients.sandbox import load_agent
from core.serve.server import Server

ADMIN_TOKEN = "admin-secret-that-must-not-leak-0123456789"


def opened(server) -> dict:
    r = httpx.post(server.url + "/swarm/v1/episodes", json={"task_id": "t"})
    assert r.status_code == 200
    return r.json()


def post(server, episode_id: str, route: str, key: str | None, body: dict | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(f"{server.url}/swarm/v1/episodes/{episode_id}/{route}", json=body, headers=headers)


def test_finish_without_the_key_or_with_another_episodes_key_is_401_and_records_nothing(live_server):
    server = live_server()
    ep, other = opened(server), opened(server)
    for key in (None, other["api_key"], ep["api_key"] + "x", "not-a-swarm-key"):
        r = post(server, ep["episode_id"], "finish", key, {"reward": 1.0})
        assert r.status_code == 401, key
        assert r.json()["error"]["type"] == "authentication_error"
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert server.status()["episodes"]["finished"] == 0
    assert server.registry.get_open(ep["episode_id"]).reward is None
    assert post(server, ep["episode_id"], "finish", ep["api_key"], {"reward": 1.0}).status_code == 200
    assert server.status()["episodes"]["finished"] == 1


def test_heartbeat_without_the_key_does_not_extend_the_lease(live_server):
    server = live_server()
    ep = opened(server)
    before = server.registry.get_open(ep["episode_id"]).lease_expires_at
    assert post(server, ep["episode_id"], "heartbeat", None).status_code == 401
    assert post(server, ep["episode_id"], "heartbeat", "sk-swarm-wrong").status_code == 401
    assert server.registry.get_open(ep["episode_id"]).lease_expires_at == before
    assert post(server, ep["episode_id"], "heartbeat", ep["api_key"]).status_code == 200


def test_abort_without_the_key_leaves_the_episode_open(live_server):
    server = live_server()
    ep = opened(server)
    assert post(server, ep["episode_id"], "abort", None, {"reason": "x"}).status_code == 401
    assert post(server, ep["episode_id"], "abort", "sk-swarm-wrong", {"reason": "x"}).status_code == 401
    assert server.registry.get_open(ep["episode_id"]).state == "open"
    assert post(server, ep["episode_id"], "abort", ep["api_key"], {"reason": "x"}).json()["state"] == "aborted"


def test_an_unknown_episode_id_is_404_whatever_the_key(live_server):
    server = live_server()
    assert post(server, "ep_0000000000000000", "finish", "sk-swarm-x", {"reward": 1.0}).status_code == 404


def test_the_path_form_authorizes_by_its_secret_never_by_the_bare_id(live_server):
    server = live_server()
    ep = opened(server)
    assert ep["episode_id"] not in ep["base_url"]
    assert ep["api_key"] not in ep["base_url"]  # the URL may be logged; it must not carry the key itself
    body = {"model": "policy", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    bare = httpx.post(f"{server.url}/episodes/{ep['episode_id']}/v1/chat/completions", json=body)
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/episodes/{ep['episode_id']}/v1/models").status_code == 401
    assert httpx.post(ep["base_url"] + "/chat/completions", json=body).status_code == 200
    assert len(server.registry.get_open(ep["episode_id"]).calls) == 1


def test_config_params_and_checkpoint_manifests_hold_no_admin_token(tmp_path):
    cfg = load_config(overrides=[f"server.admin_token={ADMIN_TOKEN}"])
    params = flatten(cfg)
    assert ADMIN_TOKEN not in "".join(f"{k}={v}" for k, v in params.items())
    assert params["server.admin_token"] == "<redacted>"
    folder = checkpoint.save(tmp_path / "ckpt", 1, {}, [], {}, cfg.model_dump())
    assert ADMIN_TOKEN not in (folder / checkpoint.MANIFEST).read_text()
    assert cfg.server.admin_token == ADMIN_TOKEN  # redaction copies; the running config keeps its token


def test_the_admin_token_is_never_printed_only_the_path_of_its_file(capsys, caplog, tmp_path):
    server = Server(load_config(overrides=["server.port=0"]), policies={})
    with caplog.at_level(logging.DEBUG):
        announce_admin_token(server, tmp_path / "admin_token")
    out = capsys.readouterr().out
    assert server.admin_token not in out and server.admin_token not in caplog.text
    assert f"in {tmp_path / 'admin_token'}, readable only by you" in out
    configured = Server(load_config(overrides=[f"server.admin_token={ADMIN_TOKEN}"]), policies={})
    announce_admin_token(configured, tmp_path / "admin_token")
    assert ADMIN_TOKEN not in capsys.readouterr().out  # the operator set it: shown masked only


def test_swarm_serve_output_holds_no_admin_token_and_names_its_0600_file(tmp_path):
    """The real command, as the researcher runs it for a smoke test (its output becomes *.serve.log)."""
    env = {**os.environ, "SWARMRL_STATE": str(tmp_path / "state"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "core.run.cli", "serve", "--model", "tiny", "--port", "0",
                             "--no-train"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "serving tiny at" in line:
                break
        url = re.search(r"serving tiny at (\S+)", lines[-1]).group(1)
        for _ in range(100):
            try:
                httpx.get(url + "/swarm/v1/status", timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        token_file = Path(re.search(r"swarm admin token: in (\S+), readable only by you", "".join(lines)).group(1))
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 24
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
    output = "".join(lines) + rest
    assert token not in output, output
    assert not token_file.exists()  # removed when the server stops


def test_a_sandbox_entry_outside_its_folder_is_refused_naming_the_path(tmp_path):
    folder = tmp_path / "escape"
    folder.mkdir()
    (folder / "agent.py").write_text("def tasks(split):\n    return []\n\nasync def rollout(task, llm):\n    return 0.0\n")
    (folder / "sandbox.toml").write_text('name = "escape"\nentry = "../x.py"\n')
    (tmp_path / "x.py").write_text("raise SystemExit('outside code ran')\n")
    with pytest.raises(ValueError, match=r"entry '\.\./x\.py'.*outside the sandbox folder"):
        load_agent(str(folder))


def test_a_latest_pointer_that_leaves_the_checkpoint_dir_is_refused(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / checkpoint.LATEST).write_text("../../etc\n")
    with pytest.raises(checkpoint.CheckpointError, match=r"names '\.\./\.\./etc', not a checkpoint folder"):
        checkpoint.load_latest(root)
