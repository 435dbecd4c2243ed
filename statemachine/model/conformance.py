"""Machine conformance: the model's receiver steps are exactly the lifecycle Machine's.

Every reachable step of the mirror is projected onto the receiver it belongs to: ``(action,
lifecycle state before, lifecycle state after)``. That set must equal the transition set of
``statemachine.lifecycle.MACHINE`` read through ``machine.events[...]`` (trigger names are the
action names). Steps of environment actions (``Restart``, ``NodeFailure``, ``RetireInstance``)
and of the helper actions other threads take for a receiver (``JoinFlight``, ``Ack``) have no
Machine counterpart and must leave every receiver's lifecycle state alone; a receiver action
must leave every *other* receiver's lifecycle state alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transitions import Machine

from statemachine.model.checker import explore
from statemachine.model.spec import (
    ENV_ACTIONS,
    HELPER_ACTIONS,
    RECEIVER_ACTIONS,
    BootstrapCache,
    State,
    Step,
)

#: (action, source state, destination state)
Transition = tuple[str, str, str]


def machine_transitions(machine: Machine) -> set[Transition]:
    """Every (trigger, source, dest) of a Machine, through its public introspection."""
    found: set[Transition] = set()
    for trigger, event in machine.events.items():
        for source, transitions in event.transitions.items():
            for transition in transitions:
                # An internal transition (dest None) stays in its source state.
                dest = source if transition.dest is None else str(transition.dest)
                found.add((trigger, source, dest))
    return found


@dataclass
class Projection:
    """What the model's reachable steps do to receivers' lifecycle states."""

    transitions: set[Transition] = field(default_factory=set)
    #: environment or helper steps that changed a receiver's lifecycle state (must stay empty)
    env_violations: list[tuple[State, Step, State]] = field(default_factory=list)
    #: receiver steps that changed another receiver's lifecycle state (must stay empty)
    cross_violations: list[tuple[State, Step, State]] = field(default_factory=list)


def project(model: BootstrapCache) -> Projection:
    """Explore the model and project every step (stuttering ones too) onto receivers."""
    projection = Projection()
    receivers = model.receivers

    def observe(s: State, step: Step, t: State) -> None:
        if step.action in ENV_ACTIONS or step.action in HELPER_ACTIONS:
            if s.rstate != t.rstate:
                projection.env_violations.append((s, step, t))
            return
        i = receivers.index(str(step.params[0]))
        projection.transitions.add((step.action, s.rstate[i], t.rstate[i]))
        if any(s.rstate[k] != t.rstate[k] for k in range(len(receivers)) if k != i):
            projection.cross_violations.append((s, step, t))

    explore(model, fair=False, observer=observe)
    return projection


@dataclass
class Report:
    """The comparison of the model's projection with the Machine."""

    only_in_model: set[Transition]
    only_in_machine: set[Transition]
    env_violations: int
    cross_violations: int
    unmapped_actions: set[str]

    @property
    def ok(self) -> bool:
        return not (
            self.only_in_model
            or self.only_in_machine
            or self.env_violations
            or self.cross_violations
            or self.unmapped_actions
        )


def compare(model: BootstrapCache, machine: Machine) -> Report:
    """Compare the model's receiver steps with the Machine's transitions, by name."""
    projection = project(model)
    expected = machine_transitions(machine)
    return Report(
        only_in_model=projection.transitions - expected,
        only_in_machine=expected - projection.transitions,
        env_violations=len(projection.env_violations),
        cross_violations=len(projection.cross_violations),
        unmapped_actions=set(RECEIVER_ACTIONS) ^ set(machine.events),
    )
