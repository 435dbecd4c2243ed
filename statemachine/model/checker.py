"""Explicit-state checking of the mirror: breadth-first search, safety, and liveness.

* **States.** Breadth-first from the initial states; a state is a tuple of the spec's
  variables, so "distinct states" is exactly TLC's count for the same constants.
* **Safety.** Invariants on every state; action properties ``[][A]_vars`` on every
  non-stuttering step. Because the search is breadth-first, the first violation found has a
  shortest trace.
* **Liveness.** Each ``P ~> Q`` is checked under the spec's fairness by fair-cycle detection on
  the explored graph (the algorithm of Emerson and Lei): it is violated exactly when some
  reachable ``P /\\ ~Q`` state leads, through ``~Q`` states only, into a set of ``~Q`` states
  that a behaviour can cycle through forever while meeting every fairness condition. Every
  state may stutter, so a single state is such a set when its fair actions are all disabled.
  For a strongly connected component C:

  - ``WF(A)`` holds on C iff C contains an A-step or a state where A is disabled;
  - ``SF(A)`` holds on C iff C contains an A-step or A is disabled everywhere on C; when it
    fails, the states of C where A is enabled are removed and the rest is decomposed again
    (a fair cycle inside C must avoid them).

  A-steps and enabledness are ``<A>_vars``: stuttering steps count for neither.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from statemachine.model.spec import BootstrapCache, LivenessCase, State, Step


@dataclass
class Counterexample:
    """A trace from an initial state: ``steps[k]`` leads from ``states[k]`` to ``states[k+1]``.

    For a liveness violation, ``cycle_start`` is the index in ``states`` where the repeating
    part begins (the last state equals ``states[cycle_start]``, or the trace ends in a state
    that stutters forever when ``steps`` does not return to it).
    """

    property: str
    kind: str  # "invariant", "action", "liveness", "deadlock"
    states: list[State]
    steps: list[Step]
    cycle_start: int | None = None
    detail: str = ""


@dataclass
class Result:
    """What a check found."""

    distinct_states: int
    depth: int
    seconds: float
    #: property name -> held?  (in the order the cfg names them)
    verdicts: dict[str, bool] = field(default_factory=dict)
    counterexamples: dict[str, Counterexample] = field(default_factory=dict)
    #: number of transitions (non-stuttering edges) explored
    transitions: int = 0

    @property
    def ok(self) -> bool:
        return all(self.verdicts.values())

    def first_violation(self) -> Counterexample | None:
        for name, held in self.verdicts.items():
            if not held:
                return self.counterexamples[name]
        return None


#: Called for every step ``(s, step, t)`` found by the search (stuttering steps included).
Observer = Callable[[State, Step, State], None]


class Graph:
    """The explored state graph: states, BFS parents, and fairness-labelled edges."""

    def __init__(self) -> None:
        self.states: list[State] = []
        self.index: dict[State, int] = {}
        self.parent: list[tuple[int, Step] | None] = []
        self.depth: list[int] = []
        #: edges[u][v] = bitmask of fairness conditions the step u -> v satisfies (u != v)
        self.edges: list[dict[int, int]] = []
        #: enabled[u] = bitmask of fairness conditions enabled (non-stuttering) at u
        self.enabled: list[int] = []

    def add(self, state: State, parent: tuple[int, Step] | None, depth: int) -> int:
        k = len(self.states)
        self.states.append(state)
        self.index[state] = k
        self.parent.append(parent)
        self.depth.append(depth)
        self.edges.append({})
        self.enabled.append(0)
        return k

    def trace_to(self, k: int) -> tuple[list[State], list[Step]]:
        states: list[State] = []
        steps: list[Step] = []
        node: int | None = k
        while node is not None:
            states.append(self.states[node])
            link = self.parent[node]
            if link is None:
                node = None
            else:
                steps.append(link[1])
                node = link[0]
        states.reverse()
        steps.reverse()
        return states, steps


def explore(
    model: BootstrapCache,
    *,
    invariants: Iterable[str] = (),
    action_properties: Iterable[str] = (),
    check_deadlock: bool = False,
    fair: bool = True,
    observer: Observer | None = None,
    progress: bool = False,
) -> tuple[Graph, dict[str, Counterexample]]:
    """Breadth-first search of every reachable state; the first violation of each property."""
    invariant_checks = [(name, model.invariant(name)) for name in invariants]
    action_checks = [(name, model.action_property(name)) for name in action_properties]
    fairness = model.fairness() if fair else []
    mask_of: dict[Step, int] = {}
    graph = Graph()
    violations: dict[str, Counterexample] = {}
    queue: deque[int] = deque()
    for state in model.init_states():
        if state not in graph.index:
            queue.append(graph.add(state, None, 0))
    started = last_report = time.monotonic()
    head = 0
    while queue:
        u = queue.popleft()
        head += 1
        s = graph.states[u]
        for name, check in invariant_checks:
            if name not in violations and not check(s):
                states, steps = graph.trace_to(u)
                violations[name] = Counterexample(name, "invariant", states, steps)
        edges = graph.edges[u]
        enabled = 0
        successors = 0
        for step, t in model.successors(s):
            successors += 1
            if observer is not None:
                observer(s, step, t)
            if t == s:
                continue  # stuttering: no new state, no A-step, not "enabled <A>_vars"
            mask = mask_of.get(step)
            if mask is None:
                mask = sum(1 << f for f, cond in enumerate(fairness) if cond.covers(step))
                mask_of[step] = mask
            v = graph.index.get(t)
            if v is None:
                v = graph.add(t, (u, step), graph.depth[u] + 1)
                queue.append(v)
            edges[v] = edges.get(v, 0) | mask
            enabled |= mask
            for name, step_check in action_checks:
                if name not in violations and not step_check(s, t):
                    states, steps = graph.trace_to(u)
                    violations[name] = Counterexample(name, "action", [*states, t], [*steps, step])
        graph.enabled[u] = enabled
        if check_deadlock and successors == 0 and "deadlock" not in violations:
            states, steps = graph.trace_to(u)
            violations["deadlock"] = Counterexample("deadlock", "deadlock", states, steps)
        if progress and head % 2048 == 0:
            now = time.monotonic()
            if now - last_report >= 1.0:
                last_report = now
                print(
                    f"  progress: {len(graph.states)} states so far, {len(queue)} on queue, "
                    f"{now - started:.1f} s",
                    file=sys.stderr,
                )
    return graph, violations


# --- liveness --------------------------------------------------------------------------------


def _sccs(nodes: set[int], edges: list[dict[int, int]]) -> list[list[int]]:
    """Strongly connected components of the subgraph induced by ``nodes`` (iterative Tarjan)."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    on_stack: set[int] = set()
    stack: list[int] = []
    result: list[list[int]] = []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work: list[tuple[int, Iterable[int]]] = []
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        work.append((root, iter([v for v in edges[root] if v in nodes])))
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter([v for v in edges[child] if v in nodes])))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[int] = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == node:
                        break
                result.append(component)
    return result


def _fair_component(
    nodes: set[int], graph: Graph, kinds: list[str]
) -> tuple[set[int], list[tuple[int, int]], list[int]] | None:
    """A set of ``nodes`` a fair behaviour can cycle through forever, or None.

    Returns the set, one witnessing edge per fairness condition met by an A-step, and one
    witnessing state per WF condition met by a disabled state (for printing a lasso).
    """
    for component in _sccs(nodes, graph.edges):
        members = set(component)
        taken = 0
        witness_edge: dict[int, tuple[int, int]] = {}
        for u in component:
            for v, mask in graph.edges[u].items():
                if v in members and mask:
                    fresh = mask & ~taken
                    taken |= mask
                    f = 0
                    while fresh:
                        if fresh & 1:
                            witness_edge[f] = (u, v)
                        fresh >>= 1
                        f += 1
        unfair_sf = None
        for f, kind in enumerate(kinds):
            bit = 1 << f
            if kind == "SF" and not taken & bit:
                enabled_here = {u for u in component if graph.enabled[u] & bit}
                if enabled_here:
                    unfair_sf = enabled_here
                    break
        if unfair_sf is not None:
            inner = _fair_component(members - unfair_sf, graph, kinds)
            if inner is not None:
                return inner
            continue
        witness_states: list[int] = []
        fair = True
        for f, kind in enumerate(kinds):
            bit = 1 << f
            if kind == "WF" and not taken & bit:
                disabled = next((u for u in component if not graph.enabled[u] & bit), None)
                if disabled is None:
                    fair = False
                    break
                witness_states.append(disabled)
        if fair:
            return members, list(witness_edge.values()), witness_states
    return None


def _path_within(graph: Graph, members: set[int], start: int, goal: int) -> list[int]:
    """Shortest path of states from ``start`` to ``goal`` inside ``members`` (inclusive)."""
    if start == goal:
        return [start]
    previous: dict[int, int] = {start: start}
    queue = deque([start])
    while queue:
        u = queue.popleft()
        for v in graph.edges[u]:
            if v in members and v not in previous:
                previous[v] = u
                if v == goal:
                    path = [v]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return path[::-1]
                queue.append(v)
    raise AssertionError("no path inside a strongly connected component")


def _step_between(model: BootstrapCache, s: State, t: State) -> Step:
    for step, successor in model.successors(s):
        if successor == t:
            return step
    raise AssertionError("no step between adjacent graph states")


def check_leads_to(
    model: BootstrapCache, graph: Graph, name: str, case: LivenessCase, kinds: list[str]
) -> Counterexample | None:
    """Check one ``P ~> Q`` under fairness; a lasso counterexample when violated."""
    n = len(graph.states)
    not_q = [not case.conclusion(s) for s in graph.states]
    starts = [k for k in range(n) if not_q[k] and case.premise(graph.states[k])]
    # Everything reachable from a P /\ ~Q state through ~Q states, with BFS parents.
    came_from: dict[int, int | None] = {k: None for k in starts}
    queue = deque(starts)
    while queue:
        u = queue.popleft()
        for v in graph.edges[u]:
            if not_q[v] and v not in came_from:
                came_from[v] = u
                queue.append(v)
    found = _fair_component(set(came_from), graph, kinds)
    if found is None:
        return None
    members, witness_edges, witness_states = found
    entry = min(members, key=lambda k: graph.depth[k])
    # Prefix: init -> some P /\ ~Q state -> entry (through ~Q states).
    tail = [entry]
    while came_from[tail[-1]] is not None:
        previous = came_from[tail[-1]]
        assert previous is not None
        tail.append(previous)
    tail.reverse()
    states, steps = graph.trace_to(tail[0])
    path = tail
    # Cycle: visit every witness, then return to the entry.
    waypoints: list[int] = []
    for u, v in witness_edges:
        waypoints += [u, v]
    waypoints += witness_states
    cycle = [entry]
    for goal in [*waypoints, entry]:
        cycle += _path_within(graph, members, cycle[-1], goal)[1:]
    nodes = path + cycle[1:]
    for a, b in itertools.pairwise(nodes):
        steps.append(_step_between(model, graph.states[a], graph.states[b]))
        states.append(graph.states[b])
    cycle_start = len(states) - len(cycle)
    detail = (
        f"{case.label}: the premise holds at state {len(states) - len(nodes) + 1} and the "
        f"conclusion never holds again; the behaviour then repeats states "
        f"{cycle_start + 1}..{len(states)}"
        + (" forever" if len(cycle) > 1 else " (stuttering) forever")
        + " while meeting every fairness condition"
    )
    return Counterexample(name, "liveness", states, steps, cycle_start, detail)


def check(
    model: BootstrapCache,
    *,
    invariants: list[str],
    properties: list[str],
    check_deadlock: bool = False,
    fair: bool = True,
    observer: Observer | None = None,
    progress: bool = False,
) -> Result:
    """Check ``invariants`` and ``properties`` (action properties and ``~>`` liveness)."""
    started = time.monotonic()
    action_names = [p for p in properties if _is_action_property(model, p)]
    liveness_names = [p for p in properties if p not in action_names]
    for name in liveness_names:
        model.liveness(name)  # raises KeyError for an unknown property
    graph, violations = explore(
        model,
        invariants=invariants,
        action_properties=action_names,
        check_deadlock=check_deadlock,
        fair=fair,
        observer=observer,
        progress=progress,
    )
    kinds = [cond.kind for cond in model.fairness()] if fair else []
    for name in liveness_names:
        for case in model.liveness(name):
            found = check_leads_to(model, graph, name, case, kinds)
            if found is not None:
                violations[name] = found
                break
    result = Result(
        distinct_states=len(graph.states),
        depth=max(graph.depth) + 1 if graph.depth else 0,
        seconds=time.monotonic() - started,
        transitions=sum(len(e) for e in graph.edges),
    )
    names = [*invariants, *properties] + (["deadlock"] if check_deadlock else [])
    for name in names:
        result.verdicts[name] = name not in violations
        if name in violations:
            result.counterexamples[name] = violations[name]
    return result


def _is_action_property(model: BootstrapCache, name: str) -> bool:
    try:
        model.action_property(name)
    except KeyError:
        return False
    return True


def format_counterexample(model: BootstrapCache, cex: Counterexample) -> str:
    """A readable trace: the initial state, then each step with the variables it changed."""
    lines = [f"{cex.property} violated ({cex.kind}). Shortest trace found:"]
    if cex.detail:
        lines.append(cex.detail)
    lines.append("State 1 (initial):")
    lines.append(model.format_state(cex.states[0]))
    for k, (step, before, after) in enumerate(
        zip(cex.steps, cex.states[:-1], cex.states[1:], strict=True)
    ):
        lines.append(f"State {k + 2}: {step}")
        lines.append(model.format_changes(before, after))
        if cex.cycle_start is not None and k + 1 == cex.cycle_start:
            lines.append("  (the cycle starts at this state)")
    if cex.cycle_start is not None:
        lines.append(f"Back to state {cex.cycle_start + 1}; repeat forever.")
    return "\n".join(lines)
