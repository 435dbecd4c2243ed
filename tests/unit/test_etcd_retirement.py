"""The retirement rule, checked over generated histories (docs/etcd.md, "The retirement rule").

A Hypothesis state machine plays registrations (puts, deletes, lease revokes, identical re-puts,
re-registrations on the *same* port) against the source's store, interleaved with fetches whose
publish may come late (after changes the fetch did not see), and with changes the watch misses
altogether, caught up by a re-list and diff (a compacted resume). The watch messages are built here
and handed to the source's apply step, so thousands of histories run in seconds; the same code
path runs against a real etcd in test_etcd_faults.py.

Invariants after every step, for the one pool key:

* **NoStaleEntry**: the pool never holds a generation built from a registration that has
  since changed or gone (compared by registration id, not by endpoint: a rank re-registered on
  the same port is a different registration);
* **NoNeedlessRetirement**: a generation that was current when published stays in the pool for
  as long as every registration it was built from is unchanged.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import event as note_event
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from statemachine.discovery.changes import generation_for, revision_of, still_current
from statemachine.discovery.etcd_source import EtcdBootstrapSource
from statemachine.discovery.gateway import (
    EtcdGateway,
    KeyValue,
    RangeReply,
    WatchEvent,
    WatchMessage,
)
from statemachine.discovery.layout import RankKey, encode_value, rank_key
from statemachine.errors import NotReady
from statemachine.pool import BootstrapPool, Generation, PoolKey, RankInfo
from statemachine.wire.http import route_payload

ADDR = "127.0.0.1:8998"
TP = 2
KEY = PoolKey(ADDR, 0, 0, 0)
PORTS = st.sampled_from((5000, 5001, 5002))  # few ports: same-port re-registrations happen

#: (port, registration id) per tp rank: what a rank's value says
Registration = tuple[int, str]


class _Listing:
    """What a re-list reads: the prefix as etcd holds it now (the only etcd call re-listing
    makes; everything after it is the source's own code)."""

    def __init__(self, revision: int, kvs: list[KeyValue]) -> None:
        self.reply = RangeReply(revision, 7, kvs)  # one cluster id throughout

    def get_prefix(self, prefix: bytes, **_: object) -> RangeReply:
        return self.reply


class RetirementMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        # Never started: the test applies watch messages itself (no etcd, no thread).
        self.pool = BootstrapPool()
        self.source = EtcdBootstrapSource(EtcdGateway(["http://127.0.0.1:9"]), pool=self.pool)
        self.source._synced.set()
        self.source._cluster_id = 7
        self.revision = 1
        self.registrations: dict[int, Registration] = {}
        self.ids = (f"reg-{i}" for i in itertools.count())
        #: what each generation was built from (by identity)
        self.built_from: dict[int, dict[int, Registration]] = {}
        self.pending: list[tuple[Generation, dict[int, Registration]]] = []
        self.kept: Generation | None = None  # published, found current, must stay while so
        self.listed: dict[int, object] = {}  # tp -> (revision, registration) etcd would list
        self.behind = False  # changes were missed: the store is stale until a re-list
        self.missed = 0

    # --- the prefill side: changes, delivered in revision order ---------------------------

    def _message(self, events: list[WatchEvent]) -> None:
        self.source._apply(WatchMessage(self.revision, 0, False, tuple(events)))

    def _event(self, tp: int, registration: Registration | None) -> WatchEvent:
        key = rank_key(self.source.prefix, RankKey(ADDR, 0, 0, tp, 0))
        value = b""
        if registration is not None:
            port, registration_id = registration
            payload = route_payload(rank_ip="127.0.0.1", rank_port=port, tp_rank=tp, tp_size=TP)
            value = encode_value(payload, "instance", registration_id)
        kv = KeyValue(key, value, 1, self.revision, 1, 0)
        return WatchEvent(registration is None, kv, None)

    @precondition(lambda self: not self.behind)
    @rule(tp=st.integers(0, TP - 1), port=PORTS)
    def register(self, tp: int, port: int) -> None:
        """A new registration (a rank start or restart), maybe on the port it had before."""
        self.revision += 1
        self.registrations[tp] = (port, next(self.ids))
        self.listed[tp] = (self.revision, self.registrations[tp])
        self._message([self._event(tp, self.registrations[tp])])

    @precondition(lambda self: self.missed < 3)
    @rule(tp=st.integers(0, TP - 1), port=st.one_of(st.none(), PORTS))
    def missed_change(self, tp: int, port: int | None) -> None:
        """A change the watch never delivers (the source was cut off, then the history was
        compacted): the store is behind until the re-list below."""
        self.revision += 1
        if port is None:
            self.registrations.pop(tp, None)
        else:
            self.registrations[tp] = (port, next(self.ids))
        self.listed[tp] = self.registrations.get(tp) and (self.revision, self.registrations[tp])
        self.behind = True
        self.missed += 1

    @precondition(lambda self: self.behind)
    @rule()
    def relist(self) -> None:
        """The compacted resume: list the prefix and diff the store against it."""
        kvs = []
        for tp in sorted(self.registrations):
            event = self._event(tp, self.registrations[tp])
            entry = self.listed.get(tp)
            revision = entry[0] if entry else event.kv.mod_revision
            kvs.append(KeyValue(event.kv.key, event.kv.value, 1, revision, 1, 0))
        self.source.gateway = _Listing(self.revision, kvs)  # type: ignore[assignment]
        held = self.pool.get(KEY)
        self.source._list_and_diff()
        self.behind = False
        self.missed = 0
        note_event("re-list retired a generation" if held and not self.pool.get(KEY) else "re-list")

    @precondition(lambda self: bool(self.registrations) and not self.behind)
    @rule(data=st.data())
    def re_put_identical(self, data: st.DataObject) -> None:
        """A registrar putting its own bytes again (after a lease regrant): no change."""
        tp = data.draw(st.sampled_from(sorted(self.registrations)))
        self.revision += 1
        self._message([self._event(tp, self.registrations[tp])])

    @precondition(lambda self: bool(self.registrations) and not self.behind)
    @rule(data=st.data())
    def deregister(self, data: st.DataObject) -> None:
        tp = data.draw(st.sampled_from(sorted(self.registrations)))
        self.revision += 1
        del self.registrations[tp]
        self._message([self._event(tp, None)])

    @precondition(lambda self: bool(self.registrations) and not self.behind)
    @rule()
    def revoke(self) -> None:
        """A lease revoke: every key deleted at one revision, in one message."""
        self.revision += 1
        events = [self._event(tp, None) for tp in sorted(self.registrations)]
        self.registrations.clear()
        self._message(events)

    # --- the decode side: fetch (stamp, read), publish later ------------------------------

    @precondition(lambda self: not self.behind)
    @rule()
    def fetch(self) -> None:
        stamp = revision_of(self.source)
        try:
            replies = [
                self.source.get_rank(ADDR, dp_rank=0, cp_rank=0, tp_rank=tp, pp_rank=0)
                for tp in range(TP)
            ]
        except NotReady:
            assert len(self.registrations) < TP
            return
        ranks = tuple(RankInfo(r.rank_ip, r.rank_port, 0) for r in replies)
        assert [r.port for r in ranks] == [self.registrations[tp][0] for tp in range(TP)]
        generation = generation_for(ranks, replies[0].instance_id, stamp)
        self.pending.append((generation, dict(self.registrations)))

    @precondition(lambda self: bool(self.pending) and not self.behind)
    @rule(data=st.data())
    def publish(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.pending) - 1))
        generation, built_from = self.pending.pop(index)
        self.built_from[id(generation)] = built_from
        held = self.pool.publish(KEY, generation)
        current = still_current(self.source, KEY, held)
        if held is generation:
            assert current == (built_from == self.registrations), "check_published is wrong"
        if current:
            self.kept = held
        elif held is generation:
            note_event("late publish caught by check_published")

    # --- invariants ------------------------------------------------------------------------

    @invariant()
    def no_stale_entry(self) -> None:
        if self.behind:
            return  # by design: the store cannot know what it missed until it re-lists
        held = self.pool.get(KEY)
        if held is not None:
            assert self.built_from[id(held)] == self.registrations, "stale generation in pool"

    @invariant()
    def no_needless_retirement(self) -> None:
        if self.behind:
            return
        kept = self.kept
        if kept is not None and self.built_from[id(kept)] == self.registrations:
            assert self.pool.get(KEY) is kept, "a current generation was retired"


TestRetirement = RetirementMachine.TestCase
TestRetirement.settings = settings(max_examples=600, stateful_step_count=50, deadline=None)


def test_change_history_stays_bounded_as_prefills_come_and_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Prefills that vanish leave one floor per group, folded into the source-wide floor past
    MAX_FORGOTTEN; a generation stamped before a fold then counts as stale (never missed)."""
    from statemachine.discovery import rank_store

    monkeypatch.setattr(rank_store, "MAX_FORGOTTEN", 50)
    pool = BootstrapPool()
    source = EtcdBootstrapSource(EtcdGateway(["http://127.0.0.1:9"]), pool=pool)
    source._synced.set()
    revision = 1

    def apply(addr: str, port: int | None) -> None:
        nonlocal revision
        revision += 1
        key = rank_key(source.prefix, RankKey(addr, 0, 0, 0, 0))
        value = b""
        if port is not None:
            value = encode_value(route_payload(rank_ip="127.0.0.1", rank_port=port), "i", "r")
        event = WatchEvent(port is None, KeyValue(key, value, 1, revision, 1, 0), None)
        source._apply(WatchMessage(revision, 0, False, (event,)))

    apply("127.0.0.1:7000", 5000)
    stamp = revision_of(source)
    survivor = generation_for((RankInfo("127.0.0.1", 5000, 0),), "i", stamp)
    pool.publish(PoolKey("127.0.0.1:7000", 0, 0, 0), survivor)
    for i in range(120):  # prefills that start, restart once, and go away
        addr = f"127.0.0.1:{8000 + i}"
        apply(addr, 5000)
        apply(addr, 5001)
        apply(addr, None)
    assert source.store.history.keys() <= {("127.0.0.1:7000", 0, 0)}
    assert len(source.store.history_floor) <= rank_store.MAX_FORGOTTEN
    # The long-lived prefill's generation predates a fold: conservatively stale now.
    assert not source.is_current(PoolKey("127.0.0.1:7000", 0, 0, 0), survivor)
    fresh = generation_for((RankInfo("127.0.0.1", 5000, 0),), "i", revision_of(source))
    assert source.is_current(PoolKey("127.0.0.1:7000", 0, 0, 0), fresh)
