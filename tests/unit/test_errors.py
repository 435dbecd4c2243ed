"""The error families (statemachine/errors.py): every public error lives there, in one family
named for the channel that failed, with retryability an attribute (issue 25, item 5)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import statemachine
from statemachine import errors
from statemachine.errors import (
    BootstrapError,
    BootstrapHTTPError,
    PeerLost,
    RanksUnreachable,
    SetupError,
    SourceError,
    ToolError,
    TransportError,
    UnknownRoom,
    UsageError,
)

FAMILIES = (SourceError, TransportError, PeerLost, UsageError, SetupError, ToolError)
PACKAGE = Path(statemachine.__file__).parent


def public_errors() -> list[type[BootstrapError]]:
    return [
        value
        for name, value in vars(errors).items()
        if inspect.isclass(value) and issubclass(value, BootstrapError) and not name.startswith("_")
    ]


@pytest.mark.parametrize("kind", public_errors(), ids=lambda kind: kind.__name__)
def test_every_error_is_in_exactly_one_family_and_says_if_a_retry_helps(
    kind: type[BootstrapError],
) -> None:
    if kind is BootstrapError or kind in FAMILIES:
        return
    assert [family for family in FAMILIES if issubclass(kind, family)] != []
    assert sum(issubclass(kind, family) for family in FAMILIES) == 1, kind.__mro__
    assert isinstance(kind.retryable, bool)


def test_no_library_error_is_defined_outside_errors_py() -> None:
    """A class deriving from an error of errors.py, anywhere else in the package, is a stray."""
    names = {kind.__name__ for kind in public_errors()}
    strays = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "errors.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {base.id for base in node.bases if isinstance(base, ast.Name)}
                if bases & names:
                    strays.append(f"{path.relative_to(PACKAGE)}: {node.name}")
    assert strays == []


def test_ranks_unreachable_is_a_retryable_transport_error_not_an_http_one() -> None:
    error = RanksUnreachable("x", addr="127.0.0.1:1", endpoint="tcp://127.0.0.1:2")
    assert isinstance(error, TransportError) and not isinstance(error, BootstrapHTTPError)
    assert error.retryable and error.addr == "127.0.0.1:1"


def test_unknown_room_carries_no_status_and_is_retryable() -> None:
    error = UnknownRoom("x", addr="127.0.0.1:1", room=7)
    assert error.status is None and error.retryable and error.room == 7
    assert isinstance(error, SourceError)


def test_retryability_is_an_attribute_not_a_base_class() -> None:
    assert PeerLost.retryable and not UsageError.retryable and not SetupError.retryable
    assert errors.NotReady.retryable and not errors.NotFound.retryable
    assert errors.TransportFailure.retryable and not errors.MalformedReply.retryable


#: Public exception classes outside errors.py that stay there, each with why.
KNOWN_STRAYS = {
    # The spec-mutation table's own check (teeth's model tools): an AssertionError on purpose,
    # which the mutation tests expect; not an error the library raises to a caller.
    "model/mutations.py: RewriteNotApplied",
}


def _is_exception_base(base: ast.expr) -> bool:
    name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
    return name in ("Exception", "BaseException") or name.endswith(("Error", "Warning"))


def test_no_public_exception_class_outside_errors_py() -> None:
    """Any public class deriving from an exception (a library error or a builtin one) outside
    errors.py is a stray: in errors.py's families, or private to its module (issue 33.5)."""
    strays = set()
    for path in PACKAGE.rglob("*.py"):
        if path.name == "errors.py" and path.parent == PACKAGE:
            continue
        for node in ast.parse(path.read_text()).body:
            if (
                isinstance(node, ast.ClassDef)
                and not node.name.startswith("_")
                and any(_is_exception_base(base) for base in node.bases)
            ):
                strays.add(f"{path.relative_to(PACKAGE)}: {node.name}")
    assert strays == KNOWN_STRAYS
