"""Clients are who the server says they are (issue 38.1): attacks over real HTTP on a server that takes no
anonymous use, as a training server does. A client's credential binds its sandbox, code version, kind,
split and group size; what an open states beyond that is refused with the reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from core.clients.retries import SwarmError
from core.clients.sdk import SwarmClient
from core.config_io import load_config
from core.run.loop import CoreRun
from core.episodes.credentials import GRANT_HEADER
from tests.support import credential

ROOT = Path(__file__).resolve().parents[2]
OPEN = "/swarm/v1/episodes"


@pytest.fixture
def server(live_server):
    return live_server(server__allow_anonymous=False, engine__kind="instant")


def _open(server, body: dict, grant: str | None = None, admin: bool = False) -> httpx.Response:
    headers = {GRANT_HEADER: grant} if grant else {}
    if admin:
        headers["Authorization"] = f"Bearer {server.admin_token}"
    return httpx.post(server.url + OPEN, json=body, headers=headers, timeout=60)


def _refused(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code, error
    return error


def test_an_open_with_a_credential_takes_what_the_credential_binds(server):
    grant = credential(server, "letters", version="v1", group_size=3)
    r = _open(server, {"task_id": "t"}, grant)  # it states nothing: it gets what its run declared
    assert r.status_code == 200, r.text
    ep = server.registry.get_open(r.json()["episode_id"])
    assert (ep.sandbox, ep.client_version, ep.group_size, ep.kind) == ("letters", "v1", 3, "train")
    same = _open(server, {"task_id": "t", "sandbox": "letters", "client_version": "v1", "group_size": 3}, grant)
    assert same.status_code == 200, same.text  # stating the bound values is fine


def test_an_undeclared_sandbox_name_is_refused(server):
    grant = credential(server, "letters", version="v1")
    error = _refused(_open(server, {"task_id": "t", "sandbox": "shadow"}, grant), 403, "undeclared_sandbox")
    assert "'shadow'" in error["message"] and "'letters'" in error["message"] and error["param"] == "sandbox"
    assert server.registry.status()["open_episodes"] == 0  # nothing opened


@pytest.mark.parametrize("field,value", [("client_version", "v0-the-other-side"), ("group_size", 7),
                                         ("split", "eval"), ("kind", "eval")])
def test_an_open_that_states_another_version_group_size_split_or_kind_is_a_403_naming_it(server, field, value):
    grant = credential(server, "letters", version="v1", group_size=2)
    error = _refused(_open(server, {"task_id": "t", field: value}, grant), 403, "credential_mismatch")
    assert error["param"] == field and repr(value) in error["message"], error


def test_a_debug_episode_needs_a_persons_key_never_a_clients(server):
    grant = credential(server, "letters", version="v1")
    error = _refused(_open(server, {"task_id": "t", "kind": "debug"}, grant), 403, "debug_needs_person")
    assert "person" in error["message"]
    assert _open(server, {"task_id": "t", "kind": "debug"}, admin=True).status_code == 200  # the admin token
    debug = credential(server, "letters", kind="debug")  # a debug credential: only a person makes one
    assert _open(server, {"task_id": "t", "kind": "debug"}, debug).status_code == 200


def test_a_server_that_takes_no_anonymous_use_takes_no_anonymous_open_or_registration(server):
    _refused(_open(server, {"task_id": "t"}), 401, "credential_required")
    reg = {"client_id": "c", "sandbox": "letters", "pid": 1, "group_size": 2}
    _refused(httpx.post(server.url + "/swarm/v1/clients", json=reg, timeout=60), 401, "credential_required")
    _refused(_open(server, {"task_id": "t"}, "swg-forged"), 401, "invalid_credential")  # a guessed one is no better


def test_a_registration_must_say_what_the_credential_binds(server):
    grant = credential(server, "letters", version="v1", group_size=2, concurrency=4, seed="0/1")
    reg = {"client_id": "c1", "sandbox": "letters", "version": "v1", "pid": 1, "group_size": 2, "concurrency": 4,
           "seed": "0/1"}
    for field, value in (("version", "v2"), ("group_size", 3), ("concurrency", 64), ("seed", "0/9")):
        r = httpx.post(server.url + "/swarm/v1/clients", json={**reg, field: value}, headers={GRANT_HEADER: grant})
        assert _refused(r, 403, "credential_mismatch")["param"] == field
    ok = httpx.post(server.url + "/swarm/v1/clients", json=reg, headers={GRANT_HEADER: grant})
    assert ok.status_code == 200, ok.text


def test_a_client_cannot_open_under_the_client_id_another_credential_registered(server):
    old = credential(server, "letters", version="v1", group_size=2)
    reg = {"client_id": "leader", "sandbox": "letters", "version": "v1", "pid": 1, "group_size": 2}
    assert httpx.post(server.url + "/swarm/v1/clients", json=reg, headers={GRANT_HEADER: old}).status_code == 200
    other = credential(server, "letters", version="v1", group_size=2)
    _refused(_open(server, {"task_id": "t", "client_id": "leader"}, other), 403, "client_id_taken")
    assert _open(server, {"task_id": "t", "client_id": "leader"}, old).status_code == 200


def test_status_shows_a_client_its_own_registration_only(server):
    mine, theirs = (credential(server, "letters", version=v, group_size=2) for v in ("v1", "v2"))
    for cid, grant, version in (("mine", mine, "v1"), ("theirs", theirs, "v2")):
        reg = {"client_id": cid, "sandbox": "letters", "version": version, "pid": 1, "group_size": 2}
        assert httpx.post(server.url + "/swarm/v1/clients", json=reg, headers={GRANT_HEADER: grant}).status_code == 200
    seen = httpx.get(server.url + "/swarm/v1/status", headers={GRANT_HEADER: mine}).json()
    assert [c["client_id"] for c in seen["clients"]] == ["mine"] and seen["swaps"] == []
    assert "v2" not in str(seen)  # no other client's version anywhere
    anonymous = httpx.get(server.url + "/swarm/v1/status").json()
    assert anonymous["clients"] == [] and anonymous["trainer"]["group_size"] >= 1  # what any client needs stays
    admin = httpx.get(server.url + "/swarm/v1/status", headers={"Authorization": f"Bearer {server.admin_token}"})
    assert sorted(c["client_id"] for c in admin.json()["clients"]) == ["mine", "theirs"]


def test_only_the_admin_token_issues_credentials(server):
    grant = {"sandbox": "letters", "group_size": 2}
    for headers in ({}, {GRANT_HEADER: credential(server, "letters")}, {"Authorization": "Bearer nope"}):
        r = httpx.post(server.url + "/swarm/v1/admin/credentials", json=grant, headers=headers)
        assert r.status_code == 401, r.text
    r = httpx.post(server.url + "/swarm/v1/admin/credentials", json=grant,
                   headers={"Authorization": f"Bearer {server.admin_token}"})
    assert r.status_code == 200 and r.json()["credential"].startswith("swg-")
    with SwarmClient(server.url, credential=r.json()["credential"]).episode(task_id="t", sandbox="letters") as ep:
        assert server.registry.get_open(ep.id).sandbox == "letters"
        ep.finish(0.0)
    with pytest.raises(SwarmError) as e:  # an SDK without it is refused, not retried
        SwarmClient(server.url, credential="", deadline_s=2).episode(task_id="t")
    assert e.value.status == 401


def test_a_persons_swarm_client_opens_with_the_admin_token_on_a_training_server(tmp_path):
    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"trainer.checkpoint_dir={tmp_path}", "clients=[]",
                                                       "engine.kind=instant"])
    core = CoreRun(cfg)  # a trainer: no anonymous opens
    core.server.start()
    argv = [sys.executable, "-m", "core.run.cli", "client", "sandbox:letters", "--server", core.server.url,
            "--episodes", "2", "--group-size", "1", "--concurrency", "1"]
    bare = {k: v for k, v in os.environ.items() if k not in ("SWARMRL_ADMIN_TOKEN", "SWARMRL_CLIENT_GRANT")}
    try:
        refused = subprocess.run(argv, cwd=ROOT, env={**bare, "SWARMRL_STATE": str(tmp_path / "state")},
                                 capture_output=True, text=True, timeout=180)
        assert refused.returncode == 2 and "credential" in refused.stderr, refused.stderr[-2000:]
        person = subprocess.run(argv, cwd=ROOT, env={**bare, "SWARMRL_ADMIN_TOKEN": core.server.admin_token},
                                capture_output=True, text=True, timeout=180)
        assert person.returncode == 0, person.stderr[-2000:]
        assert core.server.registry.counters["finished"] >= 2
    finally:
        core.server.stop()
