"""Stand-ins that let SGLang 0.5.23's import chain finish on a CPU-only machine.

SGLang's package ``__init__`` reaches ``torch``, ``triton`` and friends through platform probes,
layers and quantization configs long before the disaggregation code the interop tests run. That
code never calls them at run time, so every name only has to *exist* and say "no GPU here" when
probed. This module holds the one mechanism; each stub package next to it (``torch/``,
``triton/`` ...) calls :func:`stub_package` and pins the few values SGLang reads as facts.

Put on ``sys.path`` only by ``tests/sglang_support.py``; the product never imports any of this.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from abc import ABCMeta
from typing import Any

_UNARY = ("__neg__", "__pos__", "__invert__", "__abs__")
_BINARY = (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul",
    "and", "xor", "lshift", "rshift",
)  # fmt: skip
# Names Python asks for on its own (copy, pickle, inspect, typing); answering them with a
# stand-in would make those protocols misbehave, so they stay missing.
_NO_STAND_IN = frozenset({"__wrapped__", "__origin__", "__args__", "__parameters__"})


def _is_private_protocol(name: str) -> bool:
    return (name.startswith("__") and name.endswith("__")) or name in _NO_STAND_IN


def _returns_self(self: Any, *_: Any) -> Any:
    return self


class _StubMeta(ABCMeta):
    """Metaclass of the stand-in classes (an ABCMeta, so ``class X(nn.Module, ABC)`` works)."""

    def __getattr__(cls, name: str) -> Any:
        if _is_private_protocol(name):
            raise AttributeError(name)
        return stand_in(f"{cls.__qualname__}.{name}", cls.__module__)

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        # Only the stand-ins themselves are decorators; a test's or SGLang's real subclass of
        # one (``class Linear(nn.Module)``) must construct like any class.
        if cls.__dict__.get("_stand_in") and len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # @torch.compile, @triton.jit, @torch.no_grad() leave a function as is
        return super().__call__(*args, **kwargs)

    # Import-time expressions on the classes themselves: torch.Tensor[...], -torch.finfo.max,
    # int(torch.distributed.ReduceOp.SUM).
    def __int__(cls) -> int:
        return 0

    __index__ = __int__

    def __float__(cls) -> float:
        return 0.0

    __getitem__ = _returns_self
    __neg__ = __pos__ = __invert__ = __abs__ = _returns_self
    __add__ = __sub__ = __mul__ = __truediv__ = __floordiv__ = __mod__ = _returns_self
    __radd__ = __rsub__ = __rmul__ = __rtruediv__ = __rpow__ = __pow__ = _returns_self


class _StandIn(metaclass=_StubMeta):
    """Base of every stand-in: accepts anything, is falsy, empty and zero."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        if _is_private_protocol(name):
            raise AttributeError(name)
        return stand_in(f"{type(self).__qualname__}.{name}", type(self).__module__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # torch.compile(dynamic=True)(fn) and similar decorator factories
        return stand_in("result", type(self).__module__)()

    def __bool__(self) -> bool:
        return False  # torch.cuda.is_available() and similar probes answer "no"

    def __len__(self) -> int:
        return 0

    def __iter__(self) -> Any:
        return iter(())

    def __int__(self) -> int:
        return 0

    __index__ = __int__

    def __float__(self) -> float:
        return 0.0

    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def __lt__(self, other: object) -> bool:
        return False

    __le__ = __gt__ = __ge__ = __lt__

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def __getitem__(self, key: object) -> Any:
        return self

    __or__ = __ror__ = __getitem__


for _name in _UNARY:
    setattr(_StandIn, _name, _returns_self)
for _op in _BINARY:
    for _form in ("__{}__", "__r{}__"):
        setattr(_StandIn, _form.format(_op), _returns_self)


def stand_in(qualname: str, module: str) -> type:
    """A fresh stand-in class named ``qualname`` that reports ``module`` as its home."""
    cls = _StubMeta(qualname.rpartition(".")[2], (_StandIn,), {"_stand_in": True})
    cls.__qualname__ = qualname
    cls.__module__ = module
    return cls


def _module_getattr(module: types.ModuleType, absent: frozenset[str]) -> Any:
    def __getattr__(name: str) -> Any:
        if name in absent or _is_private_protocol(name):
            raise AttributeError(f"module {module.__name__!r} has no attribute {name!r} (stub)")
        value = stand_in(name, module.__name__)
        setattr(module, name, value)  # the same object on every access, as a real module gives
        return value

    return __getattr__


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``import torch.anything.deeper`` with a stub module, for the stubbed packages."""

    def __init__(self) -> None:
        self.roots: dict[str, frozenset[str]] = {}

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        root, dot, _ = fullname.partition(".")
        if not dot or root not in self.roots:
            return None
        leaf = fullname.rpartition(".")[2]
        if leaf in self.roots[root]:
            return None  # an absent name stays absent as a submodule too (torch.npu)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        absent = self.roots[module.__name__.partition(".")[0]]
        module.__path__ = []
        module.__getattr__ = _module_getattr(module, absent)  # type: ignore[method-assign]


_FINDER = _SubmoduleFinder()


def stub_package(name: str, *, absent: tuple[str, ...] = ()) -> types.ModuleType:
    """Make the package ``name`` answer any attribute or submodule, except the ``absent`` ones."""
    module = sys.modules[name]
    _FINDER.roots[name] = frozenset(absent)
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
    module.__getattr__ = _module_getattr(module, frozenset(absent))  # type: ignore[method-assign]
    return module
