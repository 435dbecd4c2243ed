# Anchors are exact source lines, kept whole so that they read as the code reads:
# ruff: noqa: E501
"""Seeded bugs in the critical modules beyond the pool, as exact source rewrites (``make mutate``).

The pool's own table is ``tests/pool_mutants`` (CrossHair and the Hypothesis machine run on
it). This one covers the manager, single-flight, plans, the transport, liveness, the ack
listener, the receiver, the etcd source and its change glue, and the server's validation.
Each :class:`CodeMutant` names one module, the (old, new) text replacements that break it, the
tests meant to catch it, and the bug in words. ``python -m tests.code_mutants`` applies each to
a temporary copy of the tree and runs its tests there (``tests/code_mutants/__main__.py``);
``tests/test_code_mutants.py`` (part of ``make test``) checks that every ``old`` text is found
exactly once in the current sources and every named test exists, so the table cannot rot
silently when the code moves.

Anchors are small and local on purpose: other work reshapes these modules, and a rewrite
should break only when the line it mutates changes. An ``equivalent`` mutant carries the
argument why no test can tell it from the original; ``docs/formal-model.md`` ("Code
mutations") lists those and what each surviving mutant was killed by.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class CodeMutant:
    name: str
    #: the mutated file, relative to the project root
    module: str
    edits: tuple[tuple[str, str], ...]
    #: pytest node ids (``tests/file.py::test_name``) that must fail on the mutant
    tests: tuple[str, ...]
    bug: str
    #: why no test can tell it from the original (then it is expected to survive)
    equivalent: str | None = None


class RewriteNotApplied(AssertionError):
    """A mutant's ``old`` text is not in its module exactly once."""


def mutated_source(mutant: CodeMutant, source: str | None = None) -> str:
    text = (ROOT / mutant.module).read_text() if source is None else source
    for old, new in mutant.edits:
        count = text.count(old)
        if count != 1:
            raise RewriteNotApplied(f"{mutant.name}: {old!r} found {count} times, expected 1")
        text = text.replace(old, new)
    return text


def named_tests(mutant: CodeMutant) -> list[tuple[Path, str]]:
    """(test file, function name) of every node id the mutant names."""
    out = []
    for node in mutant.tests:
        path, _, name = node.partition("::")
        out.append((ROOT / path, re.sub(r"\[.*\]$", "", name)))
    return out


FANOUT = "statemachine/decode/fanout.py"
FETCHER = "statemachine/decode/fetcher.py"
RECEIVER = "statemachine/decode/receiver.py"
FLIGHT = "statemachine/decode/flight.py"
PLAN = "statemachine/decode/plan.py"
TRANSPORT = "statemachine/decode/ranks/transport.py"
SOCKET_CACHE = "statemachine/decode/ranks/socket_cache.py"
BREAKER = "statemachine/decode/ranks/breaker.py"
SOCKETS = "statemachine/decode/ranks/sockets.py"
LIVENESS = "statemachine/decode/ranks/liveness.py"
ACKS = "statemachine/decode/ranks/acks.py"
ZMTP = "statemachine/wire/zmtp.py"
CHANGES = "statemachine/discovery/changes.py"
ETCD = "statemachine/discovery/etcd_source.py"
REGISTRY = "statemachine/prefill/registry.py"
GUARD = "statemachine/prefill/guard.py"
HOLDS = "statemachine/decode/holds.py"
RETENTION = "statemachine/decode/retention.py"
ROOMS = "statemachine/decode/rooms.py"

T_MANAGER = "tests/integration/test_manager.py::"
T_KILL = T_MANAGER + "test_mgr_1_kill_one_rank_fails_every_request_in_flight_on_it"
T_SEND = T_MANAGER + "test_mgr_1_a_failed_send_fails_every_request_in_flight_on_that_rank"
T_VERDICT = T_MANAGER + "test_mgr_1_a_transport_verdict_fails_the_requests_on_that_endpoint"
T_FETCH = T_MANAGER + "test_mgr_1_a_fetch_answered_by_a_new_instance_retires_the_old_one"
T_NOTICE = T_MANAGER + "test_mgr_1_a_restart_notice_leaves_requests_on_the_new_instance_alone"
T_ACKED = T_MANAGER + "test_mgr_1_a_room_whose_acks_all_arrived_succeeds_despite_later_evidence"
T_ENTRY = T_MANAGER + "test_mgr_2_fail_address_and_fail_generations_entry_points"
T_FLIGHT64 = T_MANAGER + "test_mgr_3_64_racing_misses_make_one_fetch"
T_FLIGHT_FAIL = T_MANAGER + "test_mgr_3_a_failed_fetch_fails_every_follower_with_its_reason"
T_PLAN = "tests/integration/test_plan.py::"
T_PLAN_TABLE = T_PLAN + "test_plan_3_to_5_tp_rule_matches_the_worked_table"
T_PLAN_RANK1 = T_PLAN + "test_plan_5_decode_rank_1_of_a_smaller_tp_pulls_its_own_prefill_ranks"
T_FAULTS = "tests/integration/test_transport_faults.py::"
T_HOLD = T_FAULTS + "test_zmq20_a_remembered_verdict_expires_after_down_hold_ms"
T_LIVE = "tests/unit/test_liveness.py::"
T_ETCD = "tests/integration/test_etcd_receiver.py::"
T_MARK = T_ETCD + "test_a_watch_event_marks_a_held_generation_no_longer_in_the_pool"
T_LISTEN = T_ETCD + "test_a_watch_event_fails_a_transfer_on_a_generation_no_longer_in_the_pool"
T_FAST = "tests/integration/test_health_fast_path.py::"

MUTANTS: tuple[CodeMutant, ...] = (
    # --- manager: failure fan-out -------------------------------------------------------------
    CodeMutant(
        "lose_ignores_acked",
        RECEIVER,
        (
            (
                "if self.state in _TERMINAL or self._lost is not None or self._acked:",
                "if self.state in _TERMINAL or self._lost is not None:",
            ),
        ),
        (T_ACKED,),
        "evidence after every ack arrived still fails the room (MGR-14)",
    ),
    CodeMutant(
        "poll_evidence_before_acks",
        RECEIVER,
        (
            (
                "            elif self._acked:  # every response arrived: done, whatever evidence came after\n"
                "                self.fire(life.COMPLETE)\n"
                "                self._end(None)\n"
                "            elif self._lost is not None:\n"
                "                self.fail(life.PEER_LOST, self._lost)\n",
                "            elif self._lost is not None:\n"
                "                self.fail(life.PEER_LOST, self._lost)\n"
                "            elif self._acked:  # every response arrived: done, whatever evidence came after\n"
                "                self.fire(life.COMPLETE)\n"
                "                self._end(None)\n",
            ),
        ),
        (
            "tests/integration/test_complete_before_death.py::"
            "test_mgr_14_a_transfer_complete_before_its_prefill_died_stays_success",
        ),
        "poll weighs the fan-out's evidence before the responses: a transfer whose every status"
        " arrived, after evidence the prefill died, is failed and its finished pages thrown"
        " away (MGR-14)",
    ),
    CodeMutant(
        "restart_fails_every_instance",
        FANOUT,
        (
            (
                "if key.addr == addr and g.instance_id == old_id}",
                "if key.addr == addr}",
            ),
        ),
        (T_NOTICE,),
        "a restart notice fails the requests already running on the new instance",
    ),
    CodeMutant(
        "retire_without_fanout",
        FANOUT,
        (
            (
                '                self.restarted(addr, old, new_id, cause="fetch", spare_room=finder)\n',
                "",
            ),
        ),
        (T_FETCH,),
        "a fetch that sees a new instance retires the old entries but fails nobody using them",
    ),
    CodeMutant(
        "fanout_fails_the_finder",
        FANOUT,
        (
            (
                "                receiver.room != spare_room\n                and ",
                "                ",
            ),
        ),
        (T_FETCH,),
        "the request whose fetch found the restart is failed by its own evidence",
    ),
    CodeMutant(
        "verdict_ignored",
        FANOUT,
        (
            (
                "        if not verdict.alive:\n            self.endpoint_dead(",
                "        if verdict.alive:\n            self.endpoint_dead(",
            ),
        ),
        (T_KILL, T_VERDICT),
        "the transport's dead verdict fails nobody (requests wait out their timeout)",
    ),
    CodeMutant(
        "send_failure_not_evidence",
        FANOUT,
        (
            (
                "        self.endpoint_dead(error.endpoint, str(error))\n",
                "        return None\n",
            ),
        ),
        (T_SEND,),
        "a request's failed send says nothing to the other requests on that rank",
    ),
    CodeMutant(
        "endpoint_match_first_rank_only",
        ROOMS,
        (
            (
                "        for rank in generation.ranks:\n            if endpoint_url(",
                "        for rank in generation.ranks[:1]:\n            if endpoint_url(",
            ),
        ),
        (T_KILL,),
        "a dead rank other than a generation's first is matched to no generation",
    ),
    CodeMutant(
        "reconcile_never_releases",
        RETENTION,
        (
            (
                "dead = [g for g in self._retained if g not in live]",
                "dead = [g for g in self._retained if g in ()]",
            ),
        ),
        (T_KILL,),
        "sockets of generations nothing uses any more stay open (ZMQ-20 leak)",
    ),
    CodeMutant(
        "evidence_never_stamped",
        FANOUT,
        (
            (
                "    if isinstance(error, PeerLost) and error.evidence_at is None:",
                "    if isinstance(error, PeerLost) and error.evidence_at is False:",
            ),
        ),
        (T_KILL,),
        "fan-out failures carry no evidence time: detection latency is never measured",
    ),
    CodeMutant(
        "fail_address_wrong_rooms",
        FANOUT,
        (
            (
                "            if receiver.addr == addr:\n                used.update(",
                "            if receiver.addr != addr:\n                used.update(",
            ),
        ),
        (T_ENTRY,),
        "an address declared dead fails every other address's requests instead",
    ),
    # --- receiver -------------------------------------------------------------------------------
    CodeMutant(
        "stale_key_not_refetched",
        FETCHER,
        (("                fresh.update(self._fetch_keys(addr, plan, stale))\n", ""),),
        (T_FETCH,),
        "after retiring a replaced instance the request keeps its entry of the old one",
    ),
    CodeMutant(
        "fetch_accepts_two_instances",
        FETCHER,
        (("    if len(answered) > 1:\n", "    if False:\n"),),
        (T_MANAGER + "test_mgr_23_a_fetch_whose_keys_two_instances_answered_is_never_accepted",),
        "a fetch whose keys two instances answered is accepted: the request goes on with a "
        "generation of the old instance beside one of the new (MGR-23)",
    ),
    CodeMutant(
        "mark_not_checked_at_start",
        RECEIVER,
        (("        if parts.checks_stale_marks:\n", "        if False:\n"),),
        (T_ETCD + "test_a_marked_generation_fails_its_holder_at_start",),
        "a request starts a transfer on a generation the watch marked (NoStaleStart)",
    ),
    # --- single-flight --------------------------------------------------------------------------
    CodeMutant(
        "no_single_flight",
        FLIGHT,
        (("            if followed:\n", "            if False:\n"),),
        (T_FLIGHT64,),
        "every concurrent miss leads its own fetch (thundering herd)",
    ),
    CodeMutant(
        "leader_failure_not_told",
        FLIGHT,
        (
            (
                "                flight.error = error\n                flight._done.set()\n",
                "                flight.error = error\n",
            ),
        ),
        (T_FLIGHT_FAIL,),
        "followers of a failed leader wait out their deadline instead of failing with its reason",
    ),
    CodeMutant(
        "finished_flight_stays",
        FLIGHT,
        (
            (
                "                    del self._flights[key]\n"
                "        for key, flight in led.items():\n"
                "            flight.generation = published[key]\n",
                "                    pass\n"
                "        for key, flight in led.items():\n"
                "            flight.generation = published[key]\n",
            ),
        ),
        (
            T_FLIGHT64,
            T_FLIGHT_FAIL,
            "tests/integration/test_receiver.py::test_restart_on_new_ports_fails_fast_invalidates_and_next_request_refetches",
        ),
        "a finished flight stays registered: later misses follow it and adopt its old result",
    ),
    # --- plans ----------------------------------------------------------------------------------
    CodeMutant(
        "plan5_span_from_decode_rank",
        PLAN,
        (
            (
                "tp_ranks = tuple(range(rank * span, (rank + 1) * span))",
                "tp_ranks = tuple(range(rank, rank + span))",
            ),
        ),
        (T_PLAN_RANK1, T_PLAN_TABLE),
        "decode rank r of a smaller tp pulls prefill ranks r..r+k-1 (overlapping, half unfetched)",
    ),
    CodeMutant(
        "plan5_key_named_by_decode_rank",
        PLAN,
        (
            (
                "    return tp_ranks, tp_ranks[0], 1, dummy\n",
                "    return tp_ranks, rank, 1, dummy\n",
            ),
        ),
        (T_PLAN_RANK1, T_PLAN_TABLE),
        "the pool key of decode rank r is named r, not its first prefill rank (SGLang's key)",
    ),
    CodeMutant(
        "plan4_share_modulo",
        PLAN,
        (("        target = rank // share\n", "        target = rank % share\n"),),
        (
            T_PLAN + "test_plan_4_no_decode_rank_is_ever_dummy_when_decode_tp_is_larger",
            T_PLAN_TABLE,
        ),
        "decode ranks sharing a prefill rank are spread over the wrong prefill ranks",
    ),
    CodeMutant(
        "pp_every_rank_when_equal",
        PLAN,
        (
            (
                "        return (layout.pp_rank,)\n",
                "        return tuple(range(topology.pp_size))\n",
            ),
        ),
        (T_PLAN + "test_plan_8_pp_rule",),
        "a decode pp rank pulls every prefill pp rank although the pp sizes match",
    ),
    CodeMutant(
        "cp_sharding_switch_ignored",
        PLAN,
        (("        or bool(topology.enable_kv_cache_sharding)\n", ""),),
        (T_PLAN + "test_plan_7_every_switch_pulls_every_cp_rank",),
        "KV-cache sharding on the prefill does not pull every cp rank (under-fetch)",
    ),
    # --- transport ------------------------------------------------------------------------------
    CodeMutant(
        "held_verdict_never_expires",
        BREAKER,
        (
            (
                "        if tomb is not None and time.monotonic() < tomb.until:\n            return tomb.message",
                "        if tomb is not None:\n            return tomb.message",
            ),
        ),
        (T_HOLD,),
        "a port once judged dead fails every send for ever, though a rank listens there again",
    ),
    CodeMutant(
        "hold_in_seconds",
        TRANSPORT,
        (
            (
                "        self._hold_s = down_hold_ms / 1000\n",
                "        self._hold_s = float(down_hold_ms)\n",
            ),
        ),
        (T_HOLD,),
        "down_hold_ms read as seconds: a verdict is held 1000 times too long",
    ),
    CodeMutant(
        "no_immediate",
        SOCKETS,
        (("            socket.setsockopt(zmq.IMMEDIATE, 1)\n", "            pass\n"),),
        (
            "tests/integration/test_transport.py::test_zmq2_immediate_first_send_to_dead_endpoint_fails_and_evicts",
        ),
        "sends to a dead rank queue silently (the SGLang stale-port bug)",
    ),
    CodeMutant(
        "circuit_never_opens",
        TRANSPORT,
        (
            (
                "            if down is not None:  # the circuit is open (ZMQ-19)\n",
                "            if False:\n",
            ),
        ),
        (T_FAULTS + "test_zmq16_a_killed_peer_is_reported_dead_and_its_sends_fail_fast",),
        "sends to an endpoint judged dead wait for a connection instead of failing at once",
        equivalent=(
            "since the monitored send pushes from send() itself (ZMQ-23), an endpoint judged dead "
            "has no connection, so the IMMEDIATE push gets EAGAIN and _send_waiting's first check "
            "of entry.down raises the same SendFailed, counted as a circuit failure: the early "
            "check saves one non-blocking push (a few hundred ns), which no test can observe; "
            "the killed-peer test still asserts the fast failure and the count"
        ),
    ),
    CodeMutant(
        "release_keeps_sockets",
        SOCKET_CACHE,
        (
            (
                "                    entry = self.entries.pop(endpoint, None)\n                    if entry is not None:\n                        retiring.append(entry)\n",
                "                    entry = None\n",
            ),
        ),
        (T_FAULTS + "test_zmq20_release_closes_sockets_and_the_cache_is_bounded",),
        "released endpoints keep their sockets and monitors (resources outlive generations)",
    ),
    # --- liveness -------------------------------------------------------------------------------
    CodeMutant(
        "closed_while_connected_is_dead",
        LIVENESS,
        (
            (
                "        if event == zmq.EVENT_CLOSED and not self.connected:",
                "        if event == zmq.EVENT_CLOSED:",
            ),
        ),
        (T_LIVE + "test_zmq16_closed_while_connected_is_not_a_verdict",),
        "a closed attempt while a connection is up kills a live endpoint",
    ),
    CodeMutant(
        "grace_ignored",
        LIVENESS,
        (
            (
                "        if deadline is not None and now >= deadline:",
                "        if deadline is not None:",
            ),
        ),
        (T_LIVE + "test_zmq16_a_disconnect_alone_is_evidence_not_proof",),
        "a disconnect is judged dead at once, without waiting for a reconnect",
    ),
    CodeMutant(
        "handshake_keeps_verdict",
        LIVENESS,
        (
            (
                "            self.disconnected_at = None\n            self.dead_reason = None\n",
                "            self.disconnected_at = None\n",
            ),
        ),
        (T_LIVE + "test_zmq16_verdicts_alternate_and_follow_the_rule",),
        "an endpoint that came back is never judged dead again (its old verdict stays)",
    ),
    # --- ack listener ---------------------------------------------------------------------------
    CodeMutant(
        "repeat_ack_counts_twice",
        ACKS,
        (("            if event.prefill_rank in pending.ranks:\n", "            if False:\n"),),
        (
            "tests/integration/test_transport.py::test_zmq12_callback_fires_once_after_n_distinct_rank_acks",
        ),
        "a rank acking twice completes a room that needs two distinct ranks",
    ),
    CodeMutant(
        "frame_cap_off",
        ZMTP,
        (
            (
                "            if len(frames) > MAX_FRAMES:\n",
                "            if len(frames) > MAX_FRAMES * 1_000_000:\n",
            ),
        ),
        (
            "tests/integration/test_hostile_acks.py::test_ack2_too_many_frames_cuts_the_sender_and_the_listener_serves_on",
        ),
        "a sender of a many-frame message is never cut (memory grows with its frames)",
    ),
    CodeMutant(
        "repeat_response_counts_twice",
        RECEIVER,
        (("            elif prefill_rank in responses:\n                return False\n", ""),),
        (
            T_MANAGER + "test_mgr_13_a_repeated_report_counts_once_and_complete_says_so",
            "tests/sglang/test_sglang_receiver.py::test_mgr_13_completion_needs_every_distinct_prefill_rank_and_a_repeat_counts_once",
        ),
        "a repeated Success is taken as new: complete() says True (MGR-13; the count is a set)",
    ),
    # --- etcd: the watch's mark, its listener, the watermark -------------------------------------
    CodeMutant(
        "watch_skips_held",
        ETCD,
        (
            (
                "            held = self._held\n            if held is not None:\n                seen = set(retired.values())",
                "            held = None\n            if held is not None:\n                seen = set(retired.values())",
            ),
        ),
        (T_MARK,),
        "a watch event marks only pool entries: a request holding a generation that left the pool starts on it",
    ),
    CodeMutant(
        "listener_ignores_marked",
        CHANGES,
        (
            (
                "        doomed = list(change.marked) or list(change.retired.values())",
                "        doomed = list(change.retired.values())",
            ),
        ),
        (T_LISTEN,),
        "the fan-out fails only users of pool entries: a transfer on a held generation waits out its timeout",
    ),
    CodeMutant(
        "no_watermark",
        ETCD,
        (
            (
                "            if not self.is_current(key, generation):\n                held = pool.get(key)",
                "            if False:\n                held = pool.get(key)",
            ),
        ),
        (T_ETCD + "test_a_fetch_the_watch_overtook_is_not_published",),
        "a fetch the watch overtook is published (the model's NoWatermark)",
    ),
    CodeMutant(
        "stale_fetch_refused_before_adopting",
        ETCD,
        (
            (
                "                if held is not None and self.is_current(key, held):\n",
                "                if False:\n",
            ),
        ),
        (T_ETCD + "test_a_stale_fetch_adopts_a_current_entry_another_request_published",),
        "a stale fetch is refused although the pool holds a current entry to adopt (the model "
        "adopts): the leader fails with RankRetired",
    ),
    # --- issue 17: callbacks, the retry rule --------------------------------------------------
    CodeMutant(
        "callback_not_contained",
        RECEIVER,
        (
            (
                "            try:\n                wake()\n            except Exception as exc:\n"
                "                self._parts.rooms.callback_raised(self, exc)\n",
                "            wake()\n",
            ),
        ),
        (
            "tests/integration/test_user_callbacks.py::test_a_raising_on_change_does_not_stop_the_fan_out",
            "tests/integration/test_user_callbacks.py::"
            "test_another_requests_send_never_raises_the_callbacks_error",
        ),
        "a raising on_change stops the fan-out and surfaces in another request's send (MGR-18)",
    ),
    CodeMutant(
        "known_dead_ranks_not_retryable",
        FETCHER,
        (
            (
                "                _refuse_known_dead(addr, self._transport, fresh.values())\n",
                "                pass\n",
            ),
            (
                '            refused = unreachable(addr, error.endpoint, "registering with it '
                'failed")\n            refused.__cause__ = error\n',
                "            refused = error\n",
            ),
        ),
        (
            "tests/integration/test_retry_rule.py::"
            "test_on_etcd_a_request_after_a_crash_is_retryable_until_the_new_registration",
            "tests/integration/test_retry_rule.py::test_on_http_the_same_request_fails_the_same_way",
        ),
        "a request that meets ranks known dead fails with SendFailed (not retryable) on etcd "
        "where HTTP retries (MGR-19)",
    ),
    # --- KV release of failed rooms (MGR-15, ZMQ-26) ---------------------------------------------
    CodeMutant(
        "release_on_silence",
        TRANSPORT,
        (
            (
                "exited = not entry.exited and proves_exit(reason, endpoint)",
                "exited = not entry.exited",
            ),
        ),
        (
            "tests/integration/test_kv_release.py::"
            "test_mgr_15_a_silence_verdict_is_no_proof_the_room_waits_for_the_timeout",
        ),
        "every dead verdict counts as the rank's exit: a heartbeat expiry of a stopped rank "
        "releases its rooms' KV while it may still resume and write (the model's ReleaseOnSilence)",
    ),
    CodeMutant(
        "release_on_one_rank_gone",
        HOLDS,
        (
            (
                "elif all(writer in self._proofs for writer in hold.writers):",
                "elif any(writer in self._proofs for writer in hold.writers):",
            ),
        ),
        ("tests/integration/test_kv_release.py::test_mgr_15_one_live_rank_keeps_the_room_held",),
        "one rank of the room proven gone releases it while another still runs and may write "
        "(the model's ReleaseOnOneRankGone)",
    ),
    # --- silence (issue 27) ----------------------------------------------------------------------
    CodeMutant(
        "silent_address_not_held_off",
        "statemachine/decode/silent.py",
        (("            silent = self._silent.get(addr)\n", "            silent = None\n"),),
        (
            "tests/integration/test_liveness_bound.py::"
            "test_mgr22_a_request_for_an_address_judged_silent_fails_at_once_until_it_answers",
        ),
        "after the probes judged a bootstrap server dead, each request still fetches from it and "
        "waits out the fetch timeout (MGR-22)",
    ),
    CodeMutant(
        "answer_of_a_dead_address_not_reported",
        "statemachine/decode/health.py",
        (("        if was_dead and self._on_alive is not None:\n", "        if False:\n"),),
        (
            "tests/integration/test_health.py::"
            "test_health6_a_dead_address_is_rechecked_at_once_and_its_answer_reported",
        ),
        "an answer of a bootstrap server judged dead is not reported (HEALTH-6)",
    ),
    CodeMutant(
        "end_of_silence_by_an_answer_not_reported",
        "statemachine/decode/health.py",
        (("        if was_silent and self._on_heard is not None:\n", "        if False:\n"),),
        (
            "tests/integration/test_health.py::test_health7_a_silent_address_that_answers_is_heard_then_alive",
        ),
        "a silent bootstrap server stays held off after it answers again (HEALTH-7)",
    ),
    CodeMutant(
        "refused_probe_taken_for_silence",
        "statemachine/decode/health.py",
        (
            (
                "            instance_id, reason, refused = None, str(exc), connection_refused(exc)\n",
                "            instance_id, reason, refused = None, str(exc), False\n",
            ),
        ),
        (
            "tests/integration/test_health.py::"
            "test_health7_silence_and_its_end_are_reported_refusals_are_not_silence",
            "tests/integration/test_liveness_bound.py::"
            "test_mgr22_a_request_for_an_address_judged_silent_fails_at_once_until_it_answers",
            "tests/integration/test_liveness_bound.py::"
            "test_mgr22_an_address_that_refuses_connections_is_judged_dead_but_not_held_off",
        ),
        "a bootstrap server whose port refuses is held off until the next recheck: requests sent "
        "to a replacement already serving fail with PrefillSilent (HEALTH-7, MGR-22)",
    ),
    CodeMutant(
        "dead_address_probed_at_the_interval",
        "statemachine/decode/health.py",
        (
            (
                "            while not stop.wait(self._recheck_s if watch.dead else self._interval_s):\n",
                "            while not stop.wait(self._interval_s):\n",
            ),
        ),
        (
            "tests/integration/test_health.py::"
            "test_health6_a_dead_address_is_rechecked_at_once_and_its_answer_reported",
        ),
        "a server judged dead is probed only every interval_s: its return is seen late (HEALTH-6)",
    ),
    # --- server validation ----------------------------------------------------------------------
    CodeMutant(
        "bool_is_an_int",
        REGISTRY,
        ((" or (kind is int and isinstance(value, bool)) or ", " or "),),
        ("tests/integration/test_server.py::test_http63_json_true_is_not_an_integer_field",),
        'the server takes "page_size": true as page size 1 and pins it for the address',
    ),
    # --- server: the /health fast path (HTTP-74) -------------------------------------------------
    CodeMutant(
        "fast_path_ignores_what_aiohttp_holds",
        GUARD,
        (
            (
                'if self.handed == b"" and not self.paused and self.owner.answer_health(',
                "if not self.paused and self.owner.answer_health(",
            ),
        ),
        (
            T_FAST + "test_http74_a_body_that_looks_like_a_probe_is_a_body",
            T_FAST + "test_http74_pipelined_requests_are_answered_in_order_by_aiohttp",
        ),
        "a body that reads as a probe is answered as one (a second reply on the connection)",
    ),
    CodeMutant(
        "settle_ignores_the_body_length",
        GUARD,
        ((" and body == (request.content_length or 0)", ""),),
        (T_FAST + "test_http74_a_body_that_looks_like_a_probe_is_a_body",),
        "aiohttp is taken to hold nothing while the body of a request it answered is still due",
    ),
    # --- SGLang 0.5.23's decode classes (decode_worker/: conn.py and its bases) -----------------
    CodeMutant(
        "memory_release_keeps_the_rooms",
        "statemachine/sglang/v0_5_23/decode_worker/kv_manager.py",
        (
            (
                "            for receiver in manager.in_flight():\n                receiver.abort()",
                "            for receiver in manager.in_flight()[:0]:\n                receiver.abort()",
            ),
        ),
        (
            "tests/sglang/test_sglang_decode_surface.py::test_a_memory_release_leaves_no_room_held_and_the_room_serves_again_after_resume",
        ),
        "SGLang drops its queues at a memory release without clear(): the rooms stay held",
    ),
    CodeMutant(
        "prefill_complete_duplicate_spares_the_first",
        "statemachine/sglang/v0_5_23/decode_worker/kv_receiver.py",
        (("            live.mark_lost(error)\n", ""),),
        (
            "tests/sglang/test_sglang_decode_surface.py::test_prefill_complete_a_duplicate_room_fails_both_requests_as_sglang_does",
        ),
        "under prefill_complete a duplicate room fails only the newcomer, unlike SGLang",
    ),
    CodeMutant(
        "nixl_registration_keeps_the_constructors_metadata",
        "statemachine/sglang/v0_5_23/decode_worker/conn.py",
        (("        backend.refresh_agent_metadata(self.agent_metadata())\n", "        pass\n"),),
        (
            "tests/sglang/test_sglang_decode_surface.py::test_nixl_registrations_after_a_resume_carry_the_agents_metadata_of_then",
        ),
        "NIXL registrations after a memory release carry the metadata taken at construction",
    ),
    CodeMutant(
        "mooncake_factory_skips_the_read_back",
        "statemachine/sglang/v0_5_23/mooncake.py",
        (("            _verify_session(reader, session_id, kv_args)\n", "            pass\n"),),
        (
            "tests/sglang/test_public_path_mistakes.py::test_sgw12_mooncake_mistake_is_refused_locally_and_sglangs_decode_completes_after",
        ),
        "MooncakeBackend.factory lets an unregistered buffer or a wrong session through",
    ),
    CodeMutant(
        "mooncake_engine_paths_skip_the_read_back",
        "statemachine/sglang/v0_5_23/mooncake.py",
        (("        _verify_session(engine, session_id, kv_args)\n", "        pass\n"),),
        (
            "tests/sglang/test_public_path_mistakes.py::test_sgw12_mooncake_mistake_is_refused_locally_and_sglangs_decode_completes_after",
            "tests/sglang/test_sglang_decode_surface.py::test_sgw12_mooncake_manager_reads_its_buffers_back_before_any_frame",
        ),
        "from_engine and the drop-in manager accept buffers their engine does not serve",
    ),
    CodeMutant(
        "mooncake_read_back_skips_the_last_byte",
        "statemachine/sglang/v0_5_23/mooncake.py",
        (
            (
                "        for offset in ((0, length - 1) if length > 1 else (0,))\n",
                "        for offset in (0,)\n",
            ),
        ),
        (
            "tests/sglang/test_public_path_mistakes.py::test_sgw12_mooncake_mistake_is_refused_locally_and_sglangs_decode_completes_after",
        ),
        "a buffer registered shorter than kv_args claims passes the read-back",
    ),
    CodeMutant(
        "mooncake_constructor_takes_no_witness",
        "statemachine/sglang/v0_5_23/mooncake.py",
        (("        if _witness is not _VERIFIED:\n", "        if False:\n"),),
        (
            "tests/sglang/test_public_path_mistakes.py::test_sgw12_mooncake_mistake_is_refused_locally_and_sglangs_decode_completes_after",
        ),
        "MooncakeBackend(...) builds a registration nobody read back",
    ),
    CodeMutant(
        "nixl_constructor_takes_no_witness",
        "statemachine/sglang/v0_5_23/nixl.py",
        (("        if _witness is not _VERIFIED:\n", "        if False:\n"),),
        (
            "tests/sglang/test_public_path_mistakes.py::test_sgw12_nixl_constructor_is_refused_and_sglangs_decode_completes_after",
        ),
        "NixlBackend(...) sends metadata nobody read back, which can end a prefill's bootstrap thread",
    ),
    CodeMutant(
        "kill_window_retried_by_class",
        "statemachine/demo/loops.py",
        (
            (
                "if failure is not None and failure.retryable and clock() < deadline:\n",
                "if type(failure).__name__ in ('NotReady', 'TransportFailure') and clock() < deadline:\n",
            ),
        ),
        (
            "tests/integration/test_kill_window.py::test_a_request_started_while_the_prefill_is_down_retries_on_every_source",
        ),
        "the demo's router retries a failed bootstrap by two error classes, HTTP's: etcd's "
        "RanksUnreachable in the kill window fails the request (MGR-24)",
    ),
)

BY_NAME = {m.name: m for m in MUTANTS}
