"""`swarm swap --ab`: an A/B inside a live run, through the client table's rules.

The old clients keep serving beside the new one (same kind and group size, their summed
concurrency, so open episodes split about 50/50), the server records the swap as an A/B
(`SwapRecord.ab`, step-taggable like any swap) and drains nobody; `--drain-version V` ends it,
draining version V's clients with the other version's client as successor. The server side is the
real `ClientTable`; only HTTP and the new client's process are stood in for.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from core.run import hotswap
from core.episodes.client_table import ClientTable
from core.episodes.credentials import Credentials
from core.episodes.errors import Refusal
from core.episodes.wire import ClientGrant, DrainClients, RegisterClient


def _reg(cid: str, version: str, concurrency: int = 4) -> RegisterClient:
    return RegisterClient(client_id=cid, sandbox="letters", version=version, pid=1, host="h", group_size=2,
                          concurrency=concurrency, spec=f"/code/{version}/letters")


def test_an_ab_order_records_the_swap_and_drains_nobody_until_the_loser_is_drained():
    swaps = []
    table = ClientTable(clock=lambda: 1000.0, on_swap=swaps.append)
    key = table.register(_reg("old", "v1"), "").key
    table.register(_reg("new", "v2"), "")
    record = table.drain(DrainClients(sandbox="letters", client_ids=["old"], successor="new", ab=True))
    assert (record.ab, record.from_versions, record.to_version, record.drained) == (True, ["v1"], "v2", [])
    assert record.to_spec == "/code/v2/letters" and swaps == [record]  # the run tags it with its step
    assert table.register(_reg("old", "v1"), key).drain is False  # the old client serves on
    assert [c["state"] for c in table.listing()] == ["serving", "serving"]
    # The loser (here the new version) drains by an ordinary order naming the winner.
    end = table.drain(DrainClients(sandbox="letters", client_ids=["new"], successor="old"))
    assert (end.ab, end.drained, end.to_version) == (False, ["new"], "v1")
    assert [c["state"] for c in table.listing()] == ["serving", "draining"]
    with pytest.raises(Refusal):  # an A/B against draining clients would split nothing
        table.drain(DrainClients(sandbox="letters", client_ids=["new"], successor="old", ab=True))


class _Server:
    """The swarm routes `swap` calls, over a real ClientTable (every client has finished episodes)."""

    def __init__(self, table: ClientTable):
        self.table = table
        self.credentials = Credentials()  # what `/admin/credentials` issues from

    def __call__(self, url: str, token: str):
        return self

    def clients(self, sandbox: str) -> list[dict]:
        return [{**c, "finished": 1} for c in self.table.listing() if c["sandbox"] == sandbox]

    def credential(self, grant: ClientGrant) -> str:
        self.grants = [*getattr(self, "grants", []), grant]
        return self.credentials.issue(grant)

    def drain(self, sandbox: str, ids: list[str], successor: str = "", ab: bool = False) -> dict | None:
        record = self.table.drain(DrainClients(sandbox=sandbox, client_ids=ids, successor=successor, ab=ab))
        return record.model_dump() if record else None


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch, tmp_path) -> _Server:
    table = ClientTable()
    table.register(_reg("old-a", "v1", concurrency=3), "")
    table.register(_reg("old-b", "v1", concurrency=1), "")
    fake = _Server(table)
    started = []

    def start(spec, python, url, name, version, old, concurrency, *_containment):
        started.append(concurrency)
        table.register(_reg("new", version, concurrency=concurrency or old["concurrency"]).model_copy(
            update={"kind": old["kind"], "group_size": old["group_size"]}), "")
        return hotswap._NewClient("new", SimpleNamespace(pid=2, poll=lambda: None, terminate=lambda: None),
                                  tmp_path / "new.log")

    monkeypatch.setattr(hotswap, "_Admin", fake)
    monkeypatch.setattr(hotswap, "resolve_server", lambda server, token: ("http://x:1", "t"))
    monkeypatch.setattr(hotswap, "locate", lambda spec: spec)
    monkeypatch.setattr(hotswap, "client_python", lambda spec: "python")
    monkeypatch.setattr(hotswap, "_probe", lambda spec, python: ("letters", "v2"))
    monkeypatch.setattr(hotswap, "_start", start)
    fake.started = started
    return fake


def test_swap_ab_keeps_both_versions_serving_with_an_even_split_and_records_the_swap(server, capsys):
    assert hotswap.swap("/code/v2/letters", "http://x:1", ab=True, settle_s=0, drain_wait_s=0) == 0
    clients = {c["client_id"]: c for c in server.clients("letters")}
    assert {c["state"] for c in clients.values()} == {"serving"} and set(clients) == {"old-a", "old-b", "new"}
    assert server.started == [4]  # the old clients' summed concurrency: as many episodes in flight per version
    [grant] = server.grants  # the new client's credential binds the new code's version and the old one's settings
    assert (grant.sandbox, grant.version, grant.kind, grant.group_size, grant.concurrency) == ("letters", "v2", "train", 2, 4)
    assert (clients["new"]["kind"], clients["new"]["group_size"]) == ("train", 2)
    [record] = server.table.swaps
    assert (record.ab, record.drained, record.from_versions, record.to_version) == (True, [], ["v1"], "v2")
    assert "A/B in letters: v1 keep serving beside v2" in capsys.readouterr().out


def test_drain_version_ends_the_ab_with_the_other_version_as_successor(server):
    assert hotswap.swap("/code/v2/letters", "http://x:1", ab=True, settle_s=0, drain_wait_s=0) == 0
    assert hotswap.drain_version("letters", "http://x:1", "v1", drain_wait_s=0) == 0
    states = {c["client_id"]: c["state"] for c in server.clients("letters")}
    assert states == {"old-a": "draining", "old-b": "draining", "new": "serving"}
    end = server.table.swaps[-1]
    assert (end.ab, sorted(end.drained), end.successor) == (False, ["old-a", "old-b"], "new")
    assert hotswap.drain_version("letters", "http://x:1", "v3", drain_wait_s=0) == 0  # nothing of it: nothing to do
    assert len(server.table.swaps) == 2
    assert hotswap.drain_version("letters", "http://x:1", "v2", drain_wait_s=0) == hotswap.EXIT_REFUSED  # the last one


def test_a_plain_swap_still_drains_the_old_clients(server):
    assert hotswap.swap("/code/v2/letters", "http://x:1", settle_s=0, drain_wait_s=0) == 0
    assert server.started == [None]  # the old client's own concurrency
    states = {c["client_id"]: c["state"] for c in server.clients("letters")}
    assert states == {"old-a": "draining", "old-b": "draining", "new": "serving"}
    assert server.table.swaps[-1].ab is False
