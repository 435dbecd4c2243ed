--------------------------- MODULE BootstrapCache ---------------------------
(***************************************************************************)
(* Concurrent replacement of cached bootstrap info ("generations") by      *)
(* decode receivers of a prefill/decode disaggregated LLM server.          *)
(*                                                                         *)
(* Receivers share a pool key -> generation object.  A generation is an    *)
(* object: identity, not value, names one fetch, and each object remembers *)
(* which epoch of the prefill's ports it holds.  A prefill restart starts  *)
(* a new epoch: every port of an older epoch is dead while the key stays   *)
(* the same.  The receiver actions are exactly the events of the receiver  *)
(* lifecycle Machine (statemachine/lifecycle.py).  JoinFlight, Ack and    *)
(* LateAck are steps of other threads on a receiver's behalf (the          *)
(* single-flight registry, the ack listener) and change no lifecycle       *)
(* state; Restart, NodeFailure, RetireInstance and WatchEvent are          *)
(* environment actions.                                                    *)
(*                                                                         *)
(* The Python mirror statemachine/model/spec.py has the same variables,    *)
(* actions and property names, and must find the same distinct states.    *)
(*                                                                         *)
(* Abstractions (see spec/model.md):                                       *)
(*  - one key per bootstrap address, and a request sets up one key (the    *)
(*    argument that one key per request suffices is in spec/model.md);     *)
(*  - an address is a port number p, standing for "host:p" on one host, so *)
(*    "host:80" is a string prefix of "host:8000" exactly when 80 is a     *)
(*    decimal prefix of 8000;                                              *)
(*  - a restart is atomic (die and come back in one step); the heartbeat   *)
(*    declares a node dead only in the step its process restarts;          *)
(*  - instance ids are epochs: the instance answering at a is epoch[a];    *)
(*  - object ids are recycled: a fetch takes the smallest id nothing       *)
(*    references, and the data of unreferenced ids is reset, so every      *)
(*    state has one canonical representation;                              *)
(*  - Ranks are the prefill ranks a request needs a transfer response      *)
(*    from (|Ranks| is the plan's required_prefill_response_num); they     *)
(*    live and restart together, as one prefill instance at one address;   *)
(*  - a prefill's answer to the handshake and the poll that sees it are    *)
(*    one step (PrefillReady), taken only while that prefill is alive;     *)
(*  - flight ids are recycled like object ids (the smallest id nothing     *)
(*    references; an unreferenced id's fate is reset to "free");           *)
(*  - KV release (KVRelease = TRUE only): a receiver's room is one slot,   *)
(*    told to every rank at SendOk; rank processes are those of the        *)
(*    current epoch, and their states touch only what the decode hears     *)
(*    from them (Ack, AbortAck, the transport's evidence).                 *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets

CONSTANTS
    Receivers,    \* decode receivers (model values)
    Addrs,        \* bootstrap addresses, as port numbers > 0 on one host
    MaxRestarts,  \* restarts per address
    MaxFaults,    \* budget of spurious failures and aborts (see Fairness)
    Mode,         \* ZMQ send semantics: "immediate" or "queueing"
    Discovery,    \* where rank infos come from: "http" (bootstrap server) or "etcd" (watched)
    Variant,      \* "Correct" or a bug variant (see Invalidate, NodeFailure, ...)
    Ranks,        \* prefill ranks whose transfer responses complete a request (model values)
    Policy,       \* the decode allocation policy: "early" or "prefill_complete" (handshake)
    KVRelease     \* TRUE: model the KV of failed rooms and the rank processes (MCKVRelease)

Variants == {"Correct", "NoInvalidation", "InvalidateByKey", "PrefixNodeFailure",
             "RetireStaleObservation", "ReusedPortAcks", "RetireByKey"}

ASSUME
    /\ Receivers # {}
    /\ Addrs # {}
    /\ \A a \in Addrs : a \in Nat /\ a > 0
    /\ MaxRestarts \in Nat
    /\ MaxFaults \in Nat
    /\ Mode \in {"immediate", "queueing"}
    /\ Discovery \in {"http", "etcd"}
    /\ Variant \in Variants
    /\ Ranks # {}
    /\ Policy \in {"early", "prefill_complete"}
    /\ KVRelease \in BOOLEAN

VARIABLES
    rstate,    \* rstate[r]: lifecycle state of receiver r
    rkey,      \* rkey[r]: the key (address) r set up or follows, or None
    rgen,      \* rgen[r]: the object r holds (its fetch, its record, or its flight's), or None
    pool,      \* pool[a]: the object cached for key a, or None
    objEpoch,  \* objEpoch[o]: the prefill epoch whose ports object o holds
    epoch,     \* epoch[a]: the current epoch (restart count) of the prefill at a
    faults,    \* spurious failures and aborts so far
    acked,     \* acked[r][p]: 0, or 1 + the epoch of the process of rank p that acked r's transfer
    pooled,    \* history: the referenced objects that have been published to the pool
    watched,   \* watched[a]: the newest revision (epoch) of a the etcd watch has delivered
    marked,    \* receivers the fan-out marked failed (their owner's next call fails them)
    notified,  \* receivers whose request sent its ABORT notice to every target rank
    flight,    \* flight[a]: the flight registered for key a (single-flight registry), or None
    rflight,   \* rflight[r]: the flight r leads (fetching..registered) or follows (idle), or None
    fate,      \* fate[f]: "open", "published" or "failed"; "free" for an unused flight id
    kv,        \* kv[r]: r's room's pages: "none", "held", "released" (proof), "expired" (timeout)
    told,      \* told[r]: ranks that may still write r's room (told, neither done nor ABORT_ACK)
    kvAddr,    \* kvAddr[r]: the address whose ranks were told r's room, or None
    kvEpoch,   \* kvEpoch[r]: the epoch whose rank processes were told r's room
    proc,      \* proc[a][p]: rank p's process of epoch[a]: "up", "silent" (stopped, cut), "exited"
    heard      \* heard[a][p]: the decode's evidence about it: "none", "silence", "reset"

vars == <<rstate, rkey, rgen, pool, objEpoch, epoch, faults, acked, pooled, watched, marked,
          notified, flight, rflight, fate, kv, told, kvAddr, kvEpoch, proc, heard>>

\* The variables of the KV-release part, which most actions leave alone.
kvVars == <<kv, told, kvAddr, kvEpoch, proc, heard>>

None == 0

\* Enough ids that a fetch always finds a free one: the pool holds at most one
\* object per address and every receiver at most one.
ObjIds == 1 .. (Cardinality(Addrs) + Cardinality(Receivers))

\* Enough flight ids that a leader always finds a free one: the registry names at
\* most one flight per address and every receiver leads or follows at most one.
FlightIds == 1 .. (Cardinality(Addrs) + Cardinality(Receivers))
FlightFates == {"free", "open", "published", "failed"}

LifecycleStates == {"idle", "fetching", "fetched", "registered", "cached", "handshaking",
                    "ready", "waiting", "done", "failed", "invalidated", "aborted"}
ActiveStates == {"idle", "fetching", "fetched", "registered", "cached", "handshaking",
                 "ready", "waiting"}
FinalStates == {"done", "invalidated", "aborted"}
FlightStates == {"fetching", "fetched", "registered"}
\* States in which the request holds its target ranks (SGLang's bootstrap_infos):
\* an abort from one of them must tell those ranks (ABORT).
Initialized == {"cached", "handshaking", "ready", "waiting", "done"}

NoAcks == [p \in Ranks |-> 0]

KVStates == {"none", "held", "released", "expired"}
ProcStates == {"up", "silent", "exited"}
Evidence == {"none", "silence", "reset"}
\* A new process (a restart): up, and nothing heard about it yet.
FreshProcs == [p \in Ranks |-> "up"]
NothingHeard == [p \in Ranks |-> "none"]

\* Objects referenced by the pool or by a receiver.
Referenced(p, g) == ({p[a] : a \in Addrs} \cup {g[r] : r \in Receivers}) \ {None}

\* Reset the data of every unreferenced id (canonical states).
Collect(p, g, oe) == [o \in ObjIds |-> IF o \in Referenced(p, g) THEN oe[o] ELSE 0]

\* The smallest id that nothing references.
FreeId ==
    LET free == ObjIds \ Referenced(pool, rgen)
    IN  CHOOSE o \in free : \A q \in free : o <= q

\* r holds ports of the prefill's current epoch: its sends reach a live process.
Live(r) == objEpoch[rgen[r]] = epoch[rkey[r]]

LiveEntry(a) == pool[a] # None /\ objEpoch[pool[a]] = epoch[a]
Stale(a) == pool[a] # None /\ objEpoch[pool[a]] < epoch[a]

\* Flight f is led: its leader is still fetching, registering or publishing it.
Led(f) == \E l \in Receivers : rflight[l] = f /\ rstate[l] \in FlightStates

\* r follows a flight: it missed while that flight was registered and waits, idle.
Follows(r) == rstate[r] = "idle" /\ rflight[r] # None

\* r follows a flight whose leader failed: r fails with the leader's reason.
FlightFailed(r) == Follows(r) /\ fate[rflight[r]] = "failed"

\* Flight ids that the registry or a receiver references.
FlightRefs(fl, rf) == ({fl[a] : a \in Addrs} \cup {rf[r] : r \in Receivers}) \ {None}

\* Reset the fate of every unreferenced flight id (canonical states).
CollectFlights(fl, rf, fa) ==
    [f \in FlightIds |-> IF f \in FlightRefs(fl, rf) THEN fa[f] ELSE "free"]

\* The smallest flight id nothing references.
FreeFlight ==
    LET free == FlightIds \ FlightRefs(flight, rflight)
    IN  CHOOSE f \in free : \A g \in free : f <= g

\* r lets go of its flight.  A leader's flight ends with outcome o: it leaves the
\* registry (Flights.resolve / Flights.fail) and its fate tells its followers,
\* which keep it until they take it.  A follower only lets go.
Unflight(r, o) ==
    LET f == rflight[r]
        leads == rstate[r] \in FlightStates /\ f # None
        newFlight == IF leads /\ flight[rkey[r]] = f
                        THEN [flight EXCEPT ![rkey[r]] = None] ELSE flight
        newRflight == [rflight EXCEPT ![r] = None]
        newFate == IF leads THEN [fate EXCEPT ![f] = o] ELSE fate
    IN  /\ flight' = newFlight
        /\ rflight' = newRflight
        /\ fate' = CollectFlights(newFlight, newRflight, newFate)

\* A failure is genuine when the environment forces it; otherwise it is spurious
\* (flaky fetch, slow prefill hitting the timeout, lost send) and spends budget.
Failure(genuine) ==
    IF genuine THEN faults' = faults
               ELSE /\ faults < MaxFaults
                    /\ faults' = faults + 1

\* "host:p" is a prefix of "host:n" (decimal digits, no leading zeros).
DigitPrefix(p, n) == \E k \in 0 .. 9 : n \div (10 ^ k) = p

\* Which entries a node failure of address a drops.
DropsOnFailure(a, b) ==
    IF Variant = "PrefixNodeFailure" THEN DigitPrefix(a, b) ELSE a = b

\* r fails before holding a generation it recorded (idle or fetching): it
\* forgets its key and object, so its invalidation drops nothing.  A leader's
\* flight fails with it; a follower lets go of its flight.
FailEarly(r) ==
    LET newKey == [rkey EXCEPT ![r] = None]
        newGen == [rgen EXCEPT ![r] = None]
    IN  /\ rkey' = newKey
        /\ rgen' = newGen
        /\ objEpoch' = Collect(pool, newGen, objEpoch)
        /\ pooled' = pooled \cap Referenced(pool, newGen)
        /\ marked' = marked \ {r}
        /\ rstate' = [rstate EXCEPT ![r] = "failed"]
        /\ Unflight(r, "failed")

\* KV release.  The process of rank p that was told r's room is still running
\* (up, or silent: stopped or cut off, so it may resume and write).
WriterAlive(r, p) == kvEpoch[r] = epoch[kvAddr[r]] /\ proc[kvAddr[r]][p] # "exited"

\* The decode holds proof that the process of rank p told r's room is gone: a
\* new instance answers at its address (a newer epoch), or its connection was
\* reset or refused (the transport's disconnect evidence).  Silence is no proof.
ProvenGone(r, p) ==
    \/ kvEpoch[r] < epoch[kvAddr[r]]
    \/ heard[kvAddr[r]][p] = "reset"

\* r's request ended without success: its room's pages wait for a release.
RoomEnded(r) == rstate[r] \in {"failed", "invalidated", "aborted"}

\* Some rank of the live process r holds does not answer (stopped, cut off, or
\* exited): a timeout is forced by the environment.
RankDown(r) ==
    rgen[r] # None /\ Live(r) /\ \E p \in Ranks : proc[rkey[r]][p] # "up"

\* The transport reported a reset or refused connection of a rank of the live
\* process r holds: the fan-out's failure is forced by the environment.
RankReset(r) ==
    rgen[r] # None /\ Live(r) /\ \E p \in Ranks : heard[rkey[r]][p] = "reset"

\* r's room is forgotten (its request succeeded, or r starts its next one).
ClearRoom(r) ==
    /\ kv' = [kv EXCEPT ![r] = "none"]
    /\ told' = [told EXCEPT ![r] = {}]
    /\ kvAddr' = [kvAddr EXCEPT ![r] = None]
    /\ kvEpoch' = [kvEpoch EXCEPT ![r] = 0]

-----------------------------------------------------------------------------
(* Receiver actions: one per lifecycle event.                              *)

\* A lookup hit, or (a follower) the generation its flight's leader published.
Hit(r, a) ==
    /\ UNCHANGED kvVars
    /\ rstate[r] = "idle"
    /\ IF rkey[r] = None
          THEN /\ pool[a] # None
               /\ rgen' = [rgen EXCEPT ![r] = pool[a]]
          ELSE /\ rkey[r] = a
               /\ rgen[r] # None
               /\ rgen' = rgen
    /\ rstate' = [rstate EXCEPT ![r] = "cached"]
    /\ rkey' = [rkey EXCEPT ![r] = a]
    /\ Unflight(r, "published")  \* a follower lets go of its flight (r leads none: o unused)
    /\ UNCHANGED <<pool, objEpoch, epoch, faults, acked, pooled, watched, marked, notified>>

\* The fetch begins: its object remembers the epoch that answers first.  With no
\* flight registered for a, r creates one and leads it (Flights.claim).  A miss
\* while a's flight is registered is a fetch the registry does not see (a
\* manager with single_flight=False, or another manager on the same pool): it
\* leads no flight.
Miss(r, a) ==
    /\ UNCHANGED kvVars
    /\ rstate[r] = "idle"
    /\ rkey[r] = None
    /\ pool[a] = None
    /\ LET o == FreeId
       IN  /\ rgen' = [rgen EXCEPT ![r] = o]
           /\ objEpoch' = [objEpoch EXCEPT ![o] = epoch[a]]
    /\ IF flight[a] = None
          THEN LET f == FreeFlight
               IN  /\ flight' = [flight EXCEPT ![a] = f]
                   /\ rflight' = [rflight EXCEPT ![r] = f]
                   /\ fate' = [fate EXCEPT ![f] = "open"]
          ELSE UNCHANGED <<flight, rflight, fate>>
    /\ rstate' = [rstate EXCEPT ![r] = "fetching"]
    /\ rkey' = [rkey EXCEPT ![r] = a]
    /\ UNCHANGED <<pool, epoch, faults, acked, pooled, watched, marked, notified>>

\* The fetch runs outside any lock; it returns the ports of the current epoch.
FetchOk(r) ==
    /\ UNCHANGED kvVars
    /\ rstate[r] = "fetching"
    /\ objEpoch' = [objEpoch EXCEPT ![rgen[r]] = epoch[rkey[r]]]
    /\ rstate' = [rstate EXCEPT ![r] = "fetched"]
    /\ UNCHANGED <<rkey, rgen, pool, epoch, faults, acked, pooled, watched, marked, notified,
                   flight, rflight, fate>>

\* From idle: resolving the dp rank failed or a follower's deadline passed
\* (spurious), or the flight r follows failed (genuine: the leader's reason).
\* From fetching: genuine when the prefill restarted since the fetch began (two
\* rank queries answered by two instances), spurious otherwise.
FetchFail(r) ==
    /\ UNCHANGED kvVars
    /\ rstate[r] \in {"idle", "fetching"}
    /\ Failure(IF rstate[r] = "idle" THEN FlightFailed(r)
                                     ELSE objEpoch[rgen[r]] < epoch[rkey[r]])
    /\ FailEarly(r)
    /\ UNCHANGED <<pool, epoch, acked, watched, notified>>

\* Registering KV args with every rank.  In queueing mode a dead port takes
\* the message silently.
RegisterOk(r) ==
    /\ UNCHANGED kvVars
    /\ rstate[r] = "fetched"
    /\ Mode = "queueing" \/ Live(r)
    /\ rstate' = [rstate EXCEPT ![r] = "registered"]
    /\ UNCHANGED <<rkey, rgen, pool, objEpoch, epoch, faults, acked, pooled, watched, marked,
                   notified, flight, rflight, fate>>

RegisterFail(r) ==
    /\ UNCHANGED kvVars
    /\ rstate[r] = "fetched"
    /\ Failure(Mode = "immediate" /\ ~Live(r))
    /\ rstate' = [rstate EXCEPT ![r] = "failed"]
    /\ Unflight(r, "failed")
    /\ UNCHANGED <<rkey, rgen, pool, objEpoch, epoch, acked, pooled, watched, marked, notified>>

\* pool.setdefault(key, fresh): publish when empty, else adopt the winner
\* (and record it in place of the fresh object).  r's flight ends: its
\* followers are handed what the pool holds now (Flights.resolve).  Watermark:
\* a fresh object older than the newest revision the watch delivered is not
\* published (its receiver was marked by that watch event and keeps it only
\* until it fails); the pool then holds nothing for the followers, and the
\* flight fails (Flights.fail with the refusal).
Publish(r) ==
    /\ UNCHANGED kvVars
    /\ rstate[r] = "registered"
    /\ LET k == rkey[r]
           f == rflight[r]
           fresh == IF objEpoch[rgen[r]] >= watched[k] THEN rgen[r] ELSE None
           held == IF pool[k] = None THEN fresh ELSE pool[k]
           newPool == [pool EXCEPT ![k] = held]
           newGen == [q \in Receivers |->
                        IF held # None /\ (q = r \/ (f # None /\ rflight[q] = f))
                           THEN held ELSE rgen[q]]
       IN  /\ pool' = newPool
           /\ rgen' = newGen
           /\ objEpoch' = Collect(newPool, newGen, objEpoch)
           /\ pooled' = (pooled \cup ({held} \ {None})) \cap Referenced(newPool, newGen)
           /\ Unflight(r, IF held # None THEN "published" ELSE "failed")
    /\ rstate' = [rstate EXCEPT ![r] = "cached"]
    /\ UNCHANGED <<rkey, epoch, faults, acked, watched, marked, notified>>

\* Under the "prefill_complete" policy the decode first tells every target
\* rank it is here (BOOTSTRAP, in init()).  Queueing mode: a dead port takes
\* it silently (and the prefill never answers: Timeout).
Handshake(r) ==
    /\ UNCHANGED kvVars
    /\ rstate[r] = "cached"
    /\ Policy = "prefill_complete"
    /\ r \notin marked
    /\ Mode = "queueing" \/ Live(r)
    /\ rstate' = [rstate EXCEPT ![r] = "handshaking"]
    /\ UNCHANGED <<rkey, rgen, pool, objEpoch, epoch, faults, acked, pooled, watched, marked,
                   notified, flight, rflight, fate>>

\* The prefill answered the handshake (status WaitingForInput) and a poll saw
\* it.  Only a live prefill answers.
PrefillReady(r) ==
    /\ UNCHANGED kvVars
    /\ rstate[r] = "handshaking"
    /\ Live(r)
    /\ rstate' = [rstate EXCEPT ![r] = "ready"]
    /\ UNCHANGED <<rkey, rgen, pool, objEpoch, epoch, faults, acked, pooled, watched, marked,
                   notified, flight, rflight, fate>>

\* Per-request metadata: at once under "early", after the prefill answered
\* the handshake under "prefill_complete".  Queueing mode: a dead port takes
\* it silently.  With KVRelease the metadata tells every rank r's room (its
\* page indices): from now on those ranks' processes may write into it.
SendOk(r) ==
    /\ \/ rstate[r] = "cached" /\ Policy = "early"
       \/ rstate[r] = "ready"
    /\ r \notin marked
    /\ Mode = "queueing" \/ Live(r)
    /\ rstate' = [rstate EXCEPT ![r] = "waiting"]
    /\ IF KVRelease
          THEN /\ kv' = [kv EXCEPT ![r] = "held"]
               /\ told' = [told EXCEPT ![r] = Ranks]
               /\ kvAddr' = [kvAddr EXCEPT ![r] = rkey[r]]
               /\ kvEpoch' = [kvEpoch EXCEPT ![r] = objEpoch[rgen[r]]]
          ELSE UNCHANGED <<kv, told, kvAddr, kvEpoch>>
    /\ UNCHANGED <<rkey, rgen, pool, objEpoch, epoch, faults, acked, pooled, watched, marked,
                   notified, flight, rflight, fate, proc, heard>>

\* From idle (no key yet): send_metadata before a successful init.  From
\* cached, handshaking or ready: the BOOTSTRAP or the metadata send failed.
SendFail(r) ==
    /\ UNCHANGED kvVars
    /\ \/ /\ rstate[r] = "idle"
          /\ rkey[r] = None
          /\ Failure(FALSE)
          /\ FailEarly(r)
          /\ UNCHANGED <<pool, epoch, acked, watched, notified>>
       \/ /\ rstate[r] \in {"cached", "handshaking", "ready"}
          /\ Failure(Mode = "immediate" /\ ~Live(r))
          /\ rstate' = [rstate EXCEPT ![r] = "failed"]
          /\ UNCHANGED <<rkey, rgen, pool, objEpoch, epoch, acked, pooled, watched, marked,
                         notified, flight, rflight, fate>>

\* poll() completes once every target rank has reported its transfer: the
\* responses are counted per rank, so a rank that reports twice counts once.
Complete(r) ==
    /\ rstate[r] = "waiting"
    /\ \A p \in Ranks : acked[r][p] # 0
    /\ LET newKey == [rkey EXCEPT ![r] = None]
           newGen == [rgen EXCEPT ![r] = None]
       IN  /\ rkey' = newKey
           /\ rgen' = newGen
           /\ objEpoch' = Collect(pool, newGen, objEpoch)
           /\ pooled' = pooled \cap Referenced(pool, newGen)
    /\ acked' = [acked EXCEPT ![r] = NoAcks]
    /\ marked' = marked \ {r}
    /\ rstate' = [rstate EXCEPT ![r] = "done"]
    /\ ClearRoom(r)  \* every rank finished writing: the pages serve the request now
    /\ UNCHANGED <<pool, epoch, faults, watched, notified, flight, rflight, fate, proc, heard>>

\* The prefill never answered the handshake, or some rank never reported
\* (poll() looks at the responses first).  Genuine when the metadata or the
\* BOOTSTRAP was lost, the prefill died, or one of its ranks does not answer
\* (RankDown); spurious otherwise.  The request tells every target rank it
\* gave up (ABORT), as SGLang 0.5.23 does.
Timeout(r) ==
    /\ UNCHANGED kvVars
    /\ \/ rstate[r] = "handshaking"
       \/ rstate[r] = "waiting" /\ \E p \in Ranks : acked[r][p] = 0
    /\ Failure(~Live(r) \/ RankDown(r))
    /\ notified' = notified \cup {r}
    /\ acked' = [acked EXCEPT ![r] = NoAcks]
    /\ rstate' = [rstate EXCEPT ![r] = "failed"]
    /\ UNCHANGED <<rkey, rgen, pool, objEpoch, epoch, pooled, watched, marked, flight, rflight,
                   fate>>

\* The manager's fan-out: evidence that the prefill r depends on died or
\* restarted (genuine when r was marked, its object is of a dead epoch, or a
\* rank's connection was reset), or a spurious one.  From done: SGLang's
\* failure_exception() on a succeeded receiver, after another rank of the
\* room failed.
PeerLost(r) ==
    /\ UNCHANGED kvVars
    /\ rstate[r] \in {"idle", "cached", "handshaking", "ready", "waiting", "done"}
    /\ Failure(r \in marked \/ (rgen[r] # None /\ ~Live(r)) \/ RankReset(r))
    /\ IF rstate[r] = "idle"
          THEN /\ FailEarly(r)
               /\ UNCHANGED <<pool, epoch, acked, watched, notified>>
          ELSE /\ rstate' = [rstate EXCEPT ![r] = "failed"]
               /\ acked' = [acked EXCEPT ![r] = NoAcks]
               /\ UNCHANGED <<rkey, rgen, pool, objEpoch, epoch, pooled, watched, marked,
                              notified, flight, rflight, fate>>

\* Drop pool[k] only if it *is* the recorded object (identity, under the lock),
\* then forget the record.  Bug variants:
\*   NoInvalidation  - SGLang before PR #36029: nothing is dropped;
\*   InvalidateByKey - delete pool[k] without the identity test.
Invalidate(r) ==
    /\ UNCHANGED kvVars
    /\ rstate[r] = "failed"
    /\ LET k == rkey[r]
           g == rgen[r]
           drop == (CASE Variant = "NoInvalidation" -> FALSE
                      [] Variant = "InvalidateByKey" -> g # None
                      [] OTHER -> g # None /\ pool[k] = g)
           newPool == IF drop THEN [pool EXCEPT ![k] = None] ELSE pool
           newKey == [rkey EXCEPT ![r] = None]
           newGen == [rgen EXCEPT ![r] = None]
       IN  /\ pool' = newPool
           /\ rkey' = newKey
           /\ rgen' = newGen
           /\ objEpoch' = Collect(newPool, newGen, objEpoch)
           /\ pooled' = pooled \cap Referenced(newPool, newGen)
    /\ marked' = marked \ {r}
    /\ rstate' = [rstate EXCEPT ![r] = "invalidated"]
    /\ UNCHANGED <<epoch, faults, acked, watched, notified, flight, rflight, fate>>

\* The owner gives up: no invalidation.  Bounded by the same budget.  A
\* request that already holds its target ranks tells each of them (ABORT),
\* also before its metadata went out and after its transfer finished.  A
\* leader's flight fails (no follower waits for an abandoned fetch).
Abort(r) ==
    /\ UNCHANGED kvVars
    /\ rstate[r] \in ActiveStates \cup {"done"}
    /\ Failure(FALSE)
    /\ notified' = IF rstate[r] \in Initialized THEN notified \cup {r} ELSE notified
    /\ LET newKey == [rkey EXCEPT ![r] = None]
           newGen == [rgen EXCEPT ![r] = None]
       IN  /\ rkey' = newKey
           /\ rgen' = newGen
           /\ objEpoch' = Collect(pool, newGen, objEpoch)
           /\ pooled' = pooled \cap Referenced(pool, newGen)
    /\ acked' = [acked EXCEPT ![r] = NoAcks]
    /\ marked' = marked \ {r}
    /\ rstate' = [rstate EXCEPT ![r] = "aborted"]
    /\ Unflight(r, "failed")
    /\ UNCHANGED <<pool, epoch, watched>>

\* A finished receiver starts its next request (for any key: chosen at lookup),
\* once its last room's pages are no longer held (r is one room slot).
NewRequest(r) ==
    /\ rstate[r] \in FinalStates
    /\ kv[r] # "held"
    /\ rstate' = [rstate EXCEPT ![r] = "idle"]
    /\ notified' = notified \ {r}
    /\ ClearRoom(r)
    /\ UNCHANGED <<rkey, rgen, pool, objEpoch, epoch, faults, acked, pooled, watched, marked,
                   flight, rflight, fate, proc, heard>>

-----------------------------------------------------------------------------
(* Steps other threads take for a receiver: no lifecycle state changes.    *)

\* Single flight: an idle receiver that misses while a flight for the key is
\* registered follows that very flight instead of fetching (Flights.claim); it
\* stays idle until the flight's fate tells it the leader's result.
JoinFlight(r, a) ==
    /\ UNCHANGED kvVars
    /\ rstate[r] = "idle"
    /\ rkey[r] = None
    /\ pool[a] = None
    /\ flight[a] # None
    /\ rkey' = [rkey EXCEPT ![r] = a]
    /\ rflight' = [rflight EXCEPT ![r] = flight[a]]
    /\ UNCHANGED <<rstate, rgen, pool, objEpoch, epoch, faults, acked, pooled, watched, marked,
                   notified, flight, fate>>

\* The ack listener: rank p of the prefill process now running at r's
\* address finished r's transfer.  Only the epoch r's metadata reached can: a
\* live one.  A second report from the same rank changes nothing (the first
\* is kept).  Bug variant ReusedPortAcks: in queueing mode the frames queued
\* for a dead port reach a new process that bound the same port, and it acks.
\* A stopped, cut-off or exited rank process sends nothing.  The rank has
\* finished writing r's room: it no longer may write it.
Ack(r, p) ==
    /\ rstate[r] = "waiting"
    /\ Live(r) \/ (Variant = "ReusedPortAcks" /\ Mode = "queueing")
    /\ proc[rkey[r]][p] = "up"
    /\ acked' = [acked EXCEPT ![r][p] = IF @ = 0 THEN epoch[rkey[r]] + 1 ELSE @]
    /\ told' = [told EXCEPT ![r] = @ \ {p}]
    /\ UNCHANGED <<rstate, rkey, rgen, pool, objEpoch, epoch, faults, pooled, watched, marked,
                   notified, flight, rflight, fate, kv, kvAddr, kvEpoch, proc, heard>>

\* A rank's report that arrives after r's request failed (its timeout fired,
\* or another rank failed it): Failed is terminal, so nothing changes.
LateAck(r, p) ==
    /\ UNCHANGED kvVars
    /\ rstate[r] = "failed"
    /\ rgen[r] # None
    /\ Live(r)
    /\ rstate' = rstate
    /\ UNCHANGED <<rkey, rgen, pool, objEpoch, epoch, faults, acked, pooled, watched, marked,
                   notified, flight, rflight, fate>>

\* KV release.  Rank p's process acknowledges r's ABORT (ABORT_ACK): it will
\* not write r's room.  Only a running process of the room's epoch that was
\* told both the room and the ABORT answers.
AbortAck(r, p) ==
    /\ kv[r] = "held"
    /\ r \in notified
    /\ p \in told[r]
    /\ kvEpoch[r] = epoch[kvAddr[r]]
    /\ proc[kvAddr[r]][p] = "up"
    /\ told' = [told EXCEPT ![r] = @ \ {p}]
    /\ UNCHANGED <<rstate, rkey, rgen, pool, objEpoch, epoch, faults, acked, pooled, watched,
                   marked, notified, flight, rflight, fate, kv, kvAddr, kvEpoch, proc, heard>>

\* The pages of r's ended room are freed: no rank may write them any more
\* (each finished its transfer or acknowledged the ABORT).
ReleaseOnAbortAck(r) ==
    /\ kv[r] = "held"
    /\ RoomEnded(r)
    /\ told[r] = {}
    /\ kv' = [kv EXCEPT ![r] = "released"]
    /\ UNCHANGED <<rstate, rkey, rgen, pool, objEpoch, epoch, faults, acked, pooled, watched,
                   marked, notified, flight, rflight, fate, told, kvAddr, kvEpoch, proc, heard>>

\* The pages of r's ended room are freed as soon as every rank that may still
\* write them is proven gone (its connection reset or refused, or a new
\* instance at its address), without waiting for the timeout.
ReleaseOnProvenGone(r) ==
    /\ kv[r] = "held"
    /\ RoomEnded(r)
    /\ told[r] # {}
    /\ \A p \in told[r] : ProvenGone(r, p)
    /\ kv' = [kv EXCEPT ![r] = "released"]
    /\ UNCHANGED <<rstate, rkey, rgen, pool, objEpoch, epoch, faults, acked, pooled, watched,
                   marked, notified, flight, rflight, fate, told, kvAddr, kvEpoch, proc, heard>>

\* kv_release_timeout_s passed: the pages are freed whatever the ranks do.  A
\* silent rank that resumes may then write into pages already reused: the
\* risk SGLang 0.5.23 accepts, kept apart ("expired") and outside the
\* property NoReleaseWhileWriterMayWrite.
ReleaseOnTimeout(r) ==
    /\ kv[r] = "held"
    /\ RoomEnded(r)
    /\ kv' = [kv EXCEPT ![r] = "expired"]
    /\ UNCHANGED <<rstate, rkey, rgen, pool, objEpoch, epoch, faults, acked, pooled, watched,
                   marked, notified, flight, rflight, fate, told, kvAddr, kvEpoch, proc, heard>>

-----------------------------------------------------------------------------
(* Environment actions: no receiver's lifecycle state changes.             *)

\* The prefill at a restarts unnoticed: a new epoch; older ports are dead, and
\* so are the older processes (a new instance at their address is their proof).
Restart(a) ==
    /\ epoch[a] < MaxRestarts
    /\ epoch' = [epoch EXCEPT ![a] = @ + 1]
    /\ proc' = [proc EXCEPT ![a] = FreshProcs]
    /\ heard' = [heard EXCEPT ![a] = NothingHeard]
    /\ UNCHANGED <<rstate, rkey, rgen, pool, objEpoch, faults, acked, pooled, watched, marked,
                   notified, flight, rflight, fate, kv, told, kvAddr, kvEpoch>>

\* The prefill at a restarts and the heartbeat notices: the entries of exactly
\* address a are dropped.  Bug variant PrefixNodeFailure: key.startswith(addr).
NodeFailure(a) ==
    /\ epoch[a] < MaxRestarts
    /\ epoch' = [epoch EXCEPT ![a] = @ + 1]
    /\ LET newPool == [b \in Addrs |-> IF DropsOnFailure(a, b) THEN None ELSE pool[b]]
       IN  /\ pool' = newPool
           /\ objEpoch' = Collect(newPool, rgen, objEpoch)
           /\ pooled' = pooled \cap Referenced(newPool, rgen)
    /\ proc' = [proc EXCEPT ![a] = FreshProcs]
    /\ heard' = [heard EXCEPT ![a] = NothingHeard]
    /\ UNCHANGED <<rstate, rkey, rgen, faults, acked, watched, marked, notified, flight, rflight,
                   fate, kv, told, kvAddr, kvEpoch>>

\* An observer (the health probe, or a receiver whose fetch answered) saw
\* instance e answer at a, at some time up to now, after it had seen an older
\* instance there: it retires the entries of that older instance (POOL-6).
\* Bug variant RetireStaleObservation: the code before this rule dropped every
\* entry whose instance differs from e, although e may be stale by now.
RetireInstance(a, e) ==
    /\ UNCHANGED kvVars
    /\ e <= epoch[a]
    /\ pool[a] # None
    /\ IF Variant = "RetireStaleObservation"
          THEN objEpoch[pool[a]] # e
          ELSE objEpoch[pool[a]] < e
    /\ LET newPool == [pool EXCEPT ![a] = None]
       IN  /\ pool' = newPool
           /\ objEpoch' = Collect(newPool, rgen, objEpoch)
           /\ pooled' = pooled \cap Referenced(newPool, rgen)
    /\ UNCHANGED <<rstate, rkey, rgen, epoch, faults, acked, watched, marked, notified, flight,
                   rflight, fate>>

\* The etcd watch delivers the next revision of a's registration, after a delay
\* (revisions order what instance ids cannot).  Entries fetched at an older
\* revision are retired, and the fan-out marks every receiver that holds an
\* object older than it (its owner's next call fails it: PeerLost).  Bug
\* variant RetireByKey: the event drops pool[a] whatever revision it holds.
WatchEvent(a) ==
    /\ UNCHANGED kvVars
    /\ Discovery = "etcd"
    /\ watched[a] < epoch[a]
    /\ LET w == watched[a] + 1
           drop == pool[a] # None /\ (Variant = "RetireByKey" \/ objEpoch[pool[a]] < w)
           newPool == IF drop THEN [pool EXCEPT ![a] = None] ELSE pool
       IN  /\ watched' = [watched EXCEPT ![a] = w]
           /\ pool' = newPool
           /\ objEpoch' = Collect(newPool, rgen, objEpoch)
           /\ pooled' = pooled \cap Referenced(newPool, rgen)
           /\ marked' = marked \cup
                  {r \in Receivers :
                      /\ rkey[r] = a
                      /\ rgen[r] # None
                      /\ rstate[r] \in {"idle", "fetched", "registered", "cached",
                                        "handshaking", "ready", "waiting"}
                      /\ objEpoch[rgen[r]] < w}
    /\ UNCHANGED <<rstate, rkey, rgen, epoch, faults, acked, notified, flight, rflight, fate>>

\* KV release: the rank processes of the current epoch at a, and what the
\* decode's transport tells it about them.  Rank p's process stops (SIGSTOP)
\* or is cut off (a partition dropping every packet): silent, it may resume.
RankStops(a, p) ==
    /\ KVRelease
    /\ proc[a][p] = "up"
    /\ proc' = [proc EXCEPT ![a][p] = "silent"]
    /\ UNCHANGED <<rstate, rkey, rgen, pool, objEpoch, epoch, faults, acked, pooled, watched,
                   marked, notified, flight, rflight, fate, kv, told, kvAddr, kvEpoch, heard>>

\* SIGCONT, or the partition heals: the process runs on, and may write.
RankResumes(a, p) ==
    /\ proc[a][p] = "silent"
    /\ proc' = [proc EXCEPT ![a][p] = "up"]
    /\ UNCHANGED <<rstate, rkey, rgen, pool, objEpoch, epoch, faults, acked, pooled, watched,
                   marked, notified, flight, rflight, fate, kv, told, kvAddr, kvEpoch, heard>>

\* The process exits (SIGKILL, a crash), running or silent: it writes nothing
\* more.  Its address stays with no process until a restart.
RankExits(a, p) ==
    /\ KVRelease
    /\ proc[a][p] \in {"up", "silent"}
    /\ proc' = [proc EXCEPT ![a][p] = "exited"]
    /\ UNCHANGED <<rstate, rkey, rgen, pool, objEpoch, epoch, faults, acked, pooled, watched,
                   marked, notified, flight, rflight, fate, kv, told, kvAddr, kvEpoch, heard>>

\* The transport's disconnect evidence: the connection to an exited process is
\* reset, or a reconnect is refused (no process holds the port).  Only the
\* host's kernel answers that way, and only once nobody holds the port: a
\* stopped process's kernel still accepts, and a cut path answers nothing.
ResetSeen(a, p) ==
    /\ proc[a][p] = "exited"
    /\ heard[a][p] # "reset"
    /\ heard' = [heard EXCEPT ![a][p] = "reset"]
    /\ UNCHANGED <<rstate, rkey, rgen, pool, objEpoch, epoch, faults, acked, pooled, watched,
                   marked, notified, flight, rflight, fate, kv, told, kvAddr, kvEpoch, proc>>

\* Timeouts only (a heartbeat or a probe unanswered): the decode judges a rank
\* that does not answer silent.  It cannot tell stopped or cut off (alive)
\* from exited behind a cut path.
SilenceSeen(a, p) ==
    /\ proc[a][p] # "up"
    /\ heard[a][p] = "none"
    /\ heard' = [heard EXCEPT ![a][p] = "silence"]
    /\ UNCHANGED <<rstate, rkey, rgen, pool, objEpoch, epoch, faults, acked, pooled, watched,
                   marked, notified, flight, rflight, fate, kv, told, kvAddr, kvEpoch, proc>>

-----------------------------------------------------------------------------

Init ==
    /\ rstate = [r \in Receivers |-> "idle"]
    /\ rkey = [r \in Receivers |-> None]
    /\ rgen = [r \in Receivers |-> None]
    /\ pool = [a \in Addrs |-> None]
    /\ objEpoch = [o \in ObjIds |-> 0]
    /\ epoch = [a \in Addrs |-> 0]
    /\ faults = 0
    /\ acked = [r \in Receivers |-> NoAcks]
    /\ pooled = {}
    /\ watched = [a \in Addrs |-> 0]
    /\ marked = {}
    /\ notified = {}
    /\ flight = [a \in Addrs |-> None]
    /\ rflight = [r \in Receivers |-> None]
    /\ fate = [f \in FlightIds |-> "free"]
    /\ kv = [r \in Receivers |-> "none"]
    /\ told = [r \in Receivers |-> {}]
    /\ kvAddr = [r \in Receivers |-> None]
    /\ kvEpoch = [r \in Receivers |-> 0]
    /\ proc = [a \in Addrs |-> FreshProcs]
    /\ heard = [a \in Addrs |-> NothingHeard]

Next ==
    \/ \E r \in Receivers :
        \/ \E a \in Addrs : Hit(r, a)
        \/ \E a \in Addrs : Miss(r, a)
        \/ FetchOk(r)
        \/ FetchFail(r)
        \/ RegisterOk(r)
        \/ RegisterFail(r)
        \/ Publish(r)
        \/ Handshake(r)
        \/ PrefillReady(r)
        \/ SendOk(r)
        \/ SendFail(r)
        \/ Complete(r)
        \/ Timeout(r)
        \/ PeerLost(r)
        \/ Invalidate(r)
        \/ Abort(r)
        \/ NewRequest(r)
        \/ \E a \in Addrs : JoinFlight(r, a)
        \/ \E p \in Ranks : Ack(r, p)
        \/ \E p \in Ranks : LateAck(r, p)
        \/ \E p \in Ranks : AbortAck(r, p)
        \/ ReleaseOnAbortAck(r)
        \/ ReleaseOnProvenGone(r)
        \/ ReleaseOnTimeout(r)
    \/ \E a \in Addrs :
        \/ Restart(a)
        \/ NodeFailure(a)
        \/ \E e \in 0 .. MaxRestarts : RetireInstance(a, e)
        \/ WatchEvent(a)
        \/ \E p \in Ranks : RankStops(a, p)
        \/ \E p \in Ranks : RankResumes(a, p)
        \/ \E p \in Ranks : RankExits(a, p)
        \/ \E p \in Ranks : ResetSeen(a, p)
        \/ \E p \in Ranks : SilenceSeen(a, p)

\* Fairness.  Spurious failures and aborts are bounded by MaxFaults, and
\* restarts by MaxRestarts, so every behaviour has only finitely many of them
\* and weak fairness on each receiver's own steps (every lifecycle step but
\* Abort, plus the acks of its transfer) suffices for progress.  LateAck
\* changes nothing, so fairness on it would mean nothing.
\* Strong fairness on lookups of each key says every key keeps receiving
\* requests (from some receiver); without it a stale entry of a key nobody
\* asks for again would never be evicted.  NodeFailure, RetireInstance and
\* WatchEvent get no fairness: eviction must not rely on a health monitor,
\* a fan-out or etcd being there (PeerLost is fair only as one of the owner's
\* steps: a marked receiver's next call fails it).  With KVRelease a room's
\* release steps are the owner's too: a held room ends (at the latest by the
\* timeout), so NewRequest is not blocked forever.  The rank processes get
\* no fairness: a stopped process need never resume, nor an exited one be
\* restarted.
ReceiverStep(r) ==
    \/ \E a \in Addrs : Hit(r, a) \/ Miss(r, a)
    \/ FetchOk(r) \/ FetchFail(r)
    \/ RegisterOk(r) \/ RegisterFail(r)
    \/ Publish(r)
    \/ Handshake(r) \/ PrefillReady(r)
    \/ SendOk(r) \/ SendFail(r)
    \/ Complete(r) \/ Timeout(r)
    \/ PeerLost(r)
    \/ Invalidate(r)
    \/ NewRequest(r)
    \/ \E p \in Ranks : Ack(r, p)
    \/ ReleaseOnAbortAck(r) \/ ReleaseOnProvenGone(r) \/ ReleaseOnTimeout(r)

Lookup(a) == \E r \in Receivers : Hit(r, a) \/ Miss(r, a)

Fairness ==
    /\ \A r \in Receivers : WF_vars(ReceiverStep(r))
    /\ \A a \in Addrs : SF_vars(Lookup(a))

Spec == Init /\ [][Next]_vars /\ Fairness

-----------------------------------------------------------------------------
(* Invariants and properties: consequences, in terms of epochs.            *)

TypeOK ==
    /\ rstate \in [Receivers -> LifecycleStates]
    /\ rkey \in [Receivers -> Addrs \cup {None}]
    /\ rgen \in [Receivers -> ObjIds \cup {None}]
    /\ pool \in [Addrs -> ObjIds \cup {None}]
    /\ objEpoch \in [ObjIds -> 0 .. MaxRestarts]
    /\ epoch \in [Addrs -> 0 .. MaxRestarts]
    /\ faults \in 0 .. MaxFaults
    /\ acked \in [Receivers -> [Ranks -> 0 .. (MaxRestarts + 1)]]
    /\ pooled \subseteq ObjIds
    /\ watched \in [Addrs -> 0 .. MaxRestarts]
    /\ marked \subseteq Receivers
    /\ notified \subseteq Receivers
    /\ flight \in [Addrs -> FlightIds \cup {None}]
    /\ rflight \in [Receivers -> FlightIds \cup {None}]
    /\ fate \in [FlightIds -> FlightFates]
    /\ kv \in [Receivers -> KVStates]
    /\ told \in [Receivers -> SUBSET Ranks]
    /\ kvAddr \in [Receivers -> Addrs \cup {None}]
    /\ kvEpoch \in [Receivers -> 0 .. MaxRestarts]
    /\ proc \in [Addrs -> [Ranks -> ProcStates]]
    /\ heard \in [Addrs -> [Ranks -> Evidence]]

\* POOL-1/POOL-2: a receiver past setup uses a generation that was published,
\* so other receivers can find it and its own failure can evict it (or it was
\* marked failed by the watch, and its next call fails it).
AdoptionCorrect ==
    \A r \in Receivers :
        rstate[r] \in {"cached", "handshaking", "ready", "waiting"} =>
            (rgen[r] \in pooled \/ r \in marked)

\* Single flight: a follower always has its own leader's result to take, or a
\* leader still working for it.  While its flight is open the flight is led
\* (nobody waits for an abandoned fetch); once the leader published, the
\* follower holds the generation that publish handed it, a pooled one; once
\* the leader failed, it holds nothing and fails with the leader's reason.  A
\* later flight of the same key hands it nothing (no rescue).
FollowerGetsLeaderResult ==
    \A q \in Receivers :
        Follows(q) =>
            LET f == rflight[q]
            IN  \/ fate[f] = "open" /\ Led(f) /\ rgen[q] = None
                \/ fate[f] = "published" /\ rgen[q] \in pooled
                \/ fate[f] = "failed" /\ rgen[q] = None

\* A flight leaves the registry when it ends: a registered flight is open and
\* led by a receiver fetching that key, so nobody joins a finished flight.
FinishedFlightGone ==
    \A a \in Addrs :
        flight[a] # None =>
            /\ fate[flight[a]] = "open"
            /\ \E l \in Receivers :
                  rflight[l] = flight[a] /\ rstate[l] \in FlightStates /\ rkey[l] = a

\* A failure mark belongs to a live request: one that has not ended and still
\* holds the generation it was marked for (a mark never fails a later request).
MarkOfLiveRequest ==
    \A r \in marked : rstate[r] \notin FinalStates /\ rgen[r] # None

\* KV release: a room's pages are never freed (other than by the timeout)
\* while a rank that may still write them is alive, running or silent: once
\* freed, no write of a told rank can land in pages the decode reused.
NoReleaseWhileWriterMayWrite ==
    \A r \in Receivers :
        kv[r] = "released" => \A p \in told[r] : ~WriterAlive(r, p)

\* KV release: a held room's pages are not handed to a new request.  A
\* receiver is one room slot: its next request starts (into idle) only once no
\* told rank may still write the room (released, expired, or served by success).
HeldRoomNotReused ==
    [][\A r \in Receivers :
          (rstate[r] # "idle" /\ rstate'[r] = "idle") => kv[r] # "held"
      ]_vars

\* KV release: a release counts only ABORT_ACKs of ABORTs sent.  A rank leaves
\* the writers of r's room (told) only by reporting its transfer done, or by
\* acknowledging an ABORT the decode sent; an ABORT_ACK of an ABORT never sent
\* proves nothing (nothing told the rank to stop).  Forgetting the room (its
\* success, the next request: kv' = "none") is not a release.  It reads told
\* before and after each step, so it sees what NoReleaseWhileWriterMayWrite,
\* ranging over the told that remain, cannot.
ReleaseCountsOnlyAbortsSent ==
    [][\A r \in Receivers :
          kv'[r] # "none" =>
              \A p \in told[r] \ told'[r] : acked'[r][p] # 0 \/ r \in notified
      ]_vars

\* POOL-3: a receiver's step removes or replaces a live entry only as the
\* invalidation of a receiver that holds that very object: a fresh generation
\* is never lost to another receiver's stale failure or publish.
IdentitySafe ==
    [][\A a \in Addrs :
          (LiveEntry(a) /\ pool'[a] # pool[a] /\ rstate' # rstate) =>
              \E r \in Receivers :
                  /\ rgen[r] = pool[a]
                  /\ rstate[r] = "failed"
                  /\ rstate'[r] = "invalidated"
      ]_vars

\* POOL-5/POOL-6: an environment step (node failure, retirement) removes an
\* entry only if it holds ports of a dead epoch once the step is taken.
ExactNodeFailure ==
    [][\A a \in Addrs :
          (pool[a] # None /\ pool'[a] # pool[a] /\ rstate' = rstate) =>
              objEpoch[pool[a]] < epoch'[a]
      ]_vars

\* No request succeeds on a response from another epoch than the one whose
\* ports it used.
NoStaleSuccess ==
    [][\A r \in Receivers :
          Complete(r) => \A p \in Ranks : acked[r][p] \in {0, objEpoch[rgen[r]] + 1}
      ]_vars

\* No request succeeds before every target rank reported its transfer
\* (required_prefill_response_num distinct ranks; a repeated report counts once).
CompleteNeedsAllResponses ==
    [][\A r \in Receivers : Complete(r) => \A p \in Ranks : acked[r][p] # 0]_vars

\* Failed is terminal: a failed request only has its entries invalidated;
\* no late report, status or call completes or revives it.
FailedIsTerminal ==
    [][\A r \in Receivers :
          rstate[r] = "failed" => rstate'[r] \in {"failed", "invalidated"}
      ]_vars

\* A request that gives up after it learned its target ranks tells them: on
\* its timeout, and on an abort from any state that holds the ranks (before
\* the metadata went out too).
AbortNotified ==
    [][\A r \in Receivers :
          (Timeout(r) \/ (rstate[r] \in Initialized /\ rstate'[r] = "aborted")) =>
              r \in notified'
      ]_vars

\* Under "prefill_complete" the metadata goes out only after the prefill
\* answered the handshake.
HandshakeBeforeSend ==
    [][\A r \in Receivers :
          (rstate[r] # "waiting" /\ rstate'[r] = "waiting") =>
              (Policy = "early" \/ rstate[r] = "ready")
      ]_vars

\* With etcd: no request starts its transfer on a generation older than the
\* newest revision the watch has delivered for its address.
NoStaleStart ==
    [][\A r \in Receivers :
          (rstate[r] \in {"cached", "ready"} /\ rstate'[r] = "waiting") =>
              objEpoch[rgen[r]] >= watched[rkey[r]]
      ]_vars

\* No needless failures: the watch's fan-out marks only receivers whose
\* generation holds a dead epoch's ports (a receiver on the current prefill is
\* never failed for a change that does not concern it).
OnlyStaleMarked ==
    [][\A r \in Receivers :
          (r \notin marked /\ r \in marked') => (rgen[r] # None /\ ~Live(r))
      ]_vars

\* Once restarts stop (they are bounded), a stale entry is eventually evicted.
StaleEntryEvicted == \A a \in Addrs : Stale(a) ~> ~Stale(a)

\* A receiver that starts a request eventually has a request succeed.
RequestsSucceed == \A r \in Receivers : (rstate[r] = "idle") ~> (rstate[r] = "done")

=============================================================================
