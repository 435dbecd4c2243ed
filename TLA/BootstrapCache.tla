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
(* lifecycle Machine (statemachine/lifecycle.py); Restart, NodeFailure and *)
(* RetireInstance are environment actions that change no receiver state.   *)
(*                                                                         *)
(* The Python mirror statemachine/model/spec.py has the same variables,    *)
(* actions and property names, and must find the same distinct states.    *)
(*                                                                         *)
(* Abstractions (see spec/model.md):                                       *)
(*  - one key per bootstrap address, and a request sets up one key;        *)
(*  - an address is a port number p, standing for "host:p" on one host, so *)
(*    "host:80" is a string prefix of "host:8000" exactly when 80 is a     *)
(*    decimal prefix of 8000;                                              *)
(*  - a restart is atomic (die and come back in one step);                 *)
(*  - object ids are recycled: a fetch takes the smallest id nothing       *)
(*    references, and the data of unreferenced ids is reset to 0, so every *)
(*    state has one canonical representation.                              *)
(***************************************************************************)
EXTENDS Naturals, FiniteSets

CONSTANTS
    Receivers,    \* decode receivers (model values)
    Addrs,        \* bootstrap addresses, as port numbers > 0 on one host
    MaxRestarts,  \* restarts per address
    MaxFaults,    \* budget of spurious failures and aborts (see Fairness)
    Mode,         \* ZMQ send semantics: "immediate" or "queueing"
    Variant       \* "Correct" or a bug variant (see Invalidate, NodeFailure)

ASSUME
    /\ Receivers # {}
    /\ Addrs # {}
    /\ \A a \in Addrs : a \in Nat /\ a > 0
    /\ MaxRestarts \in Nat
    /\ MaxFaults \in Nat
    /\ Mode \in {"immediate", "queueing"}
    /\ Variant \in {"Correct", "NoInvalidation", "InvalidateByKey", "PrefixNodeFailure"}

VARIABLES
    rstate,    \* rstate[r]: lifecycle state of receiver r
    rkey,      \* rkey[r]: the key (address) r set up, or None
    rgen,      \* rgen[r]: the object r holds and has recorded for rkey[r], or None
    pool,      \* pool[a]: the object cached for key a, or None
    objEpoch,  \* objEpoch[o]: the prefill epoch whose ports object o holds
    epoch,     \* epoch[a]: the current epoch (restart count) of the prefill at a
    faults     \* spurious failures and aborts so far

vars == <<rstate, rkey, rgen, pool, objEpoch, epoch, faults>>

None == 0

\* Enough ids that a fetch always finds a free one: the pool holds at most one
\* object per address and every other receiver at most one.
ObjIds == 1 .. (Cardinality(Addrs) + Cardinality(Receivers))

LifecycleStates == {"idle", "fetching", "fetched", "registered", "cached",
                    "waiting", "done", "failed", "invalidated", "aborted"}
ActiveStates == {"idle", "fetching", "fetched", "registered", "cached", "waiting"}
FinalStates == {"done", "invalidated", "aborted"}

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

-----------------------------------------------------------------------------
(* Receiver actions: one per lifecycle event.                              *)

Hit(r, a) ==
    /\ rstate[r] = "idle"
    /\ pool[a] # None
    /\ rstate' = [rstate EXCEPT ![r] = "cached"]
    /\ rkey' = [rkey EXCEPT ![r] = a]
    /\ rgen' = [rgen EXCEPT ![r] = pool[a]]
    /\ UNCHANGED <<pool, objEpoch, epoch, faults>>

Miss(r, a) ==
    /\ rstate[r] = "idle"
    /\ pool[a] = None
    /\ rstate' = [rstate EXCEPT ![r] = "fetching"]
    /\ rkey' = [rkey EXCEPT ![r] = a]
    /\ UNCHANGED <<rgen, pool, objEpoch, epoch, faults>>

\* The fetch runs outside any lock; it returns the ports of the current epoch.
FetchOk(r) ==
    /\ rstate[r] = "fetching"
    /\ LET o == FreeId
       IN  /\ rgen' = [rgen EXCEPT ![r] = o]
           /\ objEpoch' = [objEpoch EXCEPT ![o] = epoch[rkey[r]]]
    /\ rstate' = [rstate EXCEPT ![r] = "fetched"]
    /\ UNCHANGED <<rkey, pool, epoch, faults>>

\* From idle too: resolving the prefill dp rank is a bootstrap query.  The
\* prefill is never down in a state (restarts are atomic): always spurious.
FetchFail(r) ==
    /\ rstate[r] \in {"idle", "fetching"}
    /\ Failure(FALSE)
    /\ rstate' = [rstate EXCEPT ![r] = "failed"]
    /\ rkey' = [rkey EXCEPT ![r] = None]
    /\ UNCHANGED <<rgen, pool, objEpoch, epoch>>

\* Registering KV args with every rank.  In queueing mode a dead port takes
\* the message silently and loses it.
RegisterOk(r) ==
    /\ rstate[r] = "fetched"
    /\ Mode = "queueing" \/ Live(r)
    /\ rstate' = [rstate EXCEPT ![r] = "registered"]
    /\ UNCHANGED <<rkey, rgen, pool, objEpoch, epoch, faults>>

RegisterFail(r) ==
    /\ rstate[r] = "fetched"
    /\ Failure(Mode = "immediate" /\ ~Live(r))
    /\ rstate' = [rstate EXCEPT ![r] = "failed"]
    /\ UNCHANGED <<rkey, rgen, pool, objEpoch, epoch>>

\* pool.setdefault(key, fresh): publish when empty, else adopt the winner
\* (and record it in place of the fresh object).
Publish(r) ==
    /\ rstate[r] = "registered"
    /\ LET k == rkey[r]
           held == IF pool[k] = None THEN rgen[r] ELSE pool[k]
           newPool == [pool EXCEPT ![k] = held]
           newGen == [rgen EXCEPT ![r] = held]
       IN  /\ pool' = newPool
           /\ rgen' = newGen
           /\ objEpoch' = Collect(newPool, newGen, objEpoch)
    /\ rstate' = [rstate EXCEPT ![r] = "cached"]
    /\ UNCHANGED <<rkey, epoch, faults>>

\* Per-request metadata.  Queueing mode: a dead port swallows it.
SendOk(r) ==
    /\ rstate[r] = "cached"
    /\ Mode = "queueing" \/ Live(r)
    /\ rstate' = [rstate EXCEPT ![r] = "waiting"]
    /\ UNCHANGED <<rkey, rgen, pool, objEpoch, epoch, faults>>

SendFail(r) ==
    /\ rstate[r] = "cached"
    /\ Failure(Mode = "immediate" /\ ~Live(r))
    /\ rstate' = [rstate EXCEPT ![r] = "failed"]
    /\ UNCHANGED <<rkey, rgen, pool, objEpoch, epoch>>

\* The transfer completes only if the metadata reached a live prefill of the
\* epoch r's ports belong to.  Epochs only grow and an object's epoch was
\* current when fetched, so "live now" implies "live when the metadata was
\* sent": no extra variable is needed to remember delivery.
Complete(r) ==
    /\ rstate[r] = "waiting"
    /\ Live(r)
    /\ LET newKey == [rkey EXCEPT ![r] = None]
           newGen == [rgen EXCEPT ![r] = None]
       IN  /\ rkey' = newKey
           /\ rgen' = newGen
           /\ objEpoch' = Collect(pool, newGen, objEpoch)
    /\ rstate' = [rstate EXCEPT ![r] = "done"]
    /\ UNCHANGED <<pool, epoch, faults>>

\* Genuine when the metadata was lost or the prefill died; spurious otherwise.
Timeout(r) ==
    /\ rstate[r] = "waiting"
    /\ Failure(~Live(r))
    /\ rstate' = [rstate EXCEPT ![r] = "failed"]
    /\ UNCHANGED <<rkey, rgen, pool, objEpoch, epoch>>

\* Drop pool[k] only if it *is* the recorded object (identity, under the lock),
\* then forget the record.  Bug variants:
\*   NoInvalidation  - SGLang before PR #36029: nothing is dropped;
\*   InvalidateByKey - delete pool[k] without the identity test.
Invalidate(r) ==
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
    /\ rstate' = [rstate EXCEPT ![r] = "invalidated"]
    /\ UNCHANGED <<epoch, faults>>

\* The owner gives up: no invalidation.  Bounded by the same budget.
Abort(r) ==
    /\ rstate[r] \in ActiveStates
    /\ Failure(FALSE)
    /\ LET newKey == [rkey EXCEPT ![r] = None]
           newGen == [rgen EXCEPT ![r] = None]
       IN  /\ rkey' = newKey
           /\ rgen' = newGen
           /\ objEpoch' = Collect(pool, newGen, objEpoch)
    /\ rstate' = [rstate EXCEPT ![r] = "aborted"]
    /\ UNCHANGED <<pool, epoch>>

\* A finished receiver starts its next request (for any key: chosen at lookup).
NewRequest(r) ==
    /\ rstate[r] \in FinalStates
    /\ rstate' = [rstate EXCEPT ![r] = "idle"]
    /\ UNCHANGED <<rkey, rgen, pool, objEpoch, epoch, faults>>

-----------------------------------------------------------------------------
(* Environment actions: no receiver's lifecycle state changes.             *)

\* The prefill at a restarts: a new epoch; every port of older epochs is dead.
Restart(a) ==
    /\ epoch[a] < MaxRestarts
    /\ epoch' = [epoch EXCEPT ![a] = @ + 1]
    /\ UNCHANGED <<rstate, rkey, rgen, pool, objEpoch, faults>>

\* The heartbeat declares a dead and drops the entries of exactly address a.
\* Bug variant PrefixNodeFailure: SGLang's key.startswith(addr).
NodeFailure(a) ==
    /\ LET newPool == [b \in Addrs |-> IF DropsOnFailure(a, b) THEN None ELSE pool[b]]
       IN  /\ pool' = newPool
           /\ objEpoch' = Collect(newPool, rgen, objEpoch)
    /\ UNCHANGED <<rstate, rkey, rgen, epoch, faults>>

\* The bootstrap server answers with a new instance id: entries fetched from an
\* older instance are dropped (POOL-6).
RetireInstance(a) ==
    /\ pool[a] # None
    /\ objEpoch[pool[a]] < epoch[a]
    /\ LET newPool == [pool EXCEPT ![a] = None]
       IN  /\ pool' = newPool
           /\ objEpoch' = Collect(newPool, rgen, objEpoch)
    /\ UNCHANGED <<rstate, rkey, rgen, epoch, faults>>

-----------------------------------------------------------------------------

Init ==
    /\ rstate = [r \in Receivers |-> "idle"]
    /\ rkey = [r \in Receivers |-> None]
    /\ rgen = [r \in Receivers |-> None]
    /\ pool = [a \in Addrs |-> None]
    /\ objEpoch = [o \in ObjIds |-> 0]
    /\ epoch = [a \in Addrs |-> 0]
    /\ faults = 0

Next ==
    \/ \E r \in Receivers :
        \/ \E a \in Addrs : Hit(r, a)
        \/ \E a \in Addrs : Miss(r, a)
        \/ FetchOk(r)
        \/ FetchFail(r)
        \/ RegisterOk(r)
        \/ RegisterFail(r)
        \/ Publish(r)
        \/ SendOk(r)
        \/ SendFail(r)
        \/ Complete(r)
        \/ Timeout(r)
        \/ Invalidate(r)
        \/ Abort(r)
        \/ NewRequest(r)
    \/ \E a \in Addrs :
        \/ Restart(a)
        \/ NodeFailure(a)
        \/ RetireInstance(a)

\* Fairness.  Spurious failures and aborts are bounded by MaxFaults, and
\* restarts by MaxRestarts, so every behaviour has only finitely many of them
\* and weak fairness on each receiver's own steps (everything but Abort)
\* suffices for progress: no strong fairness on success branches is needed.
\* Strong fairness on lookups of each key says every key keeps receiving
\* requests (from some receiver); without it a stale entry of a key nobody
\* asks for again would never be evicted.  NodeFailure and RetireInstance get
\* no fairness: the heartbeat never fails behind a stable service address, so
\* eviction must not rely on them.
ReceiverStep(r) ==
    \/ \E a \in Addrs : Hit(r, a) \/ Miss(r, a)
    \/ FetchOk(r) \/ FetchFail(r)
    \/ RegisterOk(r) \/ RegisterFail(r)
    \/ Publish(r)
    \/ SendOk(r) \/ SendFail(r)
    \/ Complete(r) \/ Timeout(r)
    \/ Invalidate(r)
    \/ NewRequest(r)

Lookup(a) == \E r \in Receivers : Hit(r, a) \/ Miss(r, a)

Fairness ==
    /\ \A r \in Receivers : WF_vars(ReceiverStep(r))
    /\ \A a \in Addrs : SF_vars(Lookup(a))

Spec == Init /\ [][Next]_vars /\ Fairness

-----------------------------------------------------------------------------
(* Invariants and properties.                                              *)

TypeOK ==
    /\ rstate \in [Receivers -> LifecycleStates]
    /\ rkey \in [Receivers -> Addrs \cup {None}]
    /\ rgen \in [Receivers -> ObjIds \cup {None}]
    /\ pool \in [Addrs -> ObjIds \cup {None}]
    /\ objEpoch \in [ObjIds -> 0 .. MaxRestarts]
    /\ epoch \in [Addrs -> 0 .. MaxRestarts]
    /\ faults \in 0 .. MaxFaults

\* POOL-3: an invalidation removes nothing but the object the invalidating
\* receiver recorded, under the key it recorded it for; a replacement published
\* concurrently by another receiver is never lost.  An action property, since
\* "which object was removed" is a fact about a step, and object ids recycle.
IdentitySafe ==
    [][\A r \in Receivers :
          Invalidate(r) =>
              \A a \in Addrs : pool'[a] # pool[a] => (a = rkey[r] /\ pool[a] = rgen[r])
      ]_vars

\* POOL-1/POOL-2: a receiver that reaches "cached" by Hit or Publish holds
\* the object the pool holds at that step (the hit, its own, or the winner's).
AdoptionCorrect ==
    [][\A r \in Receivers :
          ((\E a \in Addrs : Hit(r, a)) \/ Publish(r)) => rgen'[r] = pool'[rkey'[r]]
      ]_vars

\* No request succeeds on a stale generation: a property of the success step
\* (as a state invariant it would break at the next restart).
NoStaleSuccess ==
    [][\A r \in Receivers : Complete(r) => objEpoch[rgen[r]] = epoch[rkey[r]]]_vars

\* POOL-5, POOL-6: a node failure (or an instance retirement) of a removes
\* entries of address a only.
ExactNodeFailure ==
    [][\A a \in Addrs :
          (NodeFailure(a) \/ RetireInstance(a)) => \A b \in Addrs \ {a} : pool'[b] = pool[b]
      ]_vars

Stale(a) == pool[a] # None /\ objEpoch[pool[a]] < epoch[a]

\* Once restarts stop (they are bounded), a stale entry is eventually evicted.
StaleEntryEvicted == \A a \in Addrs : Stale(a) ~> ~Stale(a)

\* A receiver that starts a request eventually has a request succeed.
RequestsSucceed == \A r \in Receivers : (rstate[r] = "idle") ~> (rstate[r] = "done")

=============================================================================
