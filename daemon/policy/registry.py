"""Policies by name: the daemon and the replayer build one with ``make_policy(name, **params)``.

The built-in policies are named here, each by its module and class, and imported only when
first asked for; the policy modules import nothing of this one, so there is no import cycle.
``register_policy(name, factory)`` adds another (a plugin, a test double); it must implement
the whole ``EvictionPolicy`` protocol (``base.InsertEach`` gives ``insert_many`` as a loop of
``insert``, ``base.OwesNoWork`` the owed-work members, ``Hinted`` the ``hint`` verb over a
``HintTable``): ``make_policy`` refuses one that lacks a member, naming it.

A policy class may name the admission rule it is designed to run with in a class attribute
``default_admission`` (see ``kvtier.daemon.policy.admission``); ``"always"`` otherwise. A
class with ``needs_future = True`` (Belady's optimum) only runs in the replayer.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from kvtier.daemon.errors import ConfigError
from kvtier.daemon.policy.base import EvictionPolicy

Factory = Callable[..., EvictionPolicy]

_BUILTIN: dict[str, tuple[str, str]] = {
    "arc": ("kvtier.daemon.policy.arc", "ARCPolicy"),
    "density": ("kvtier.daemon.policy.density", "DensityPolicy"),
    "heat": ("kvtier.daemon.policy.heat", "HeatPolicy"),
    "lru": ("kvtier.daemon.policy.lru", "LRUPolicy"),
    "opt": ("kvtier.daemon.policy.opt", "BeladyPolicy"),
}
_ADDED: dict[str, Factory] = {}
# What the protocol declares: its attributes and the methods of its body (not those
# ``Protocol`` adds to it, ``__init__``, ``__subclasshook__``).
_PROTOCOL_MEMBERS = sorted(
    {
        *EvictionPolicy.__annotations__,
        *(
            n
            for n, v in vars(EvictionPolicy).items()
            if inspect.isfunction(v) and v.__qualname__ == f"EvictionPolicy.{n}"
        ),
    }
)


def register_policy(name: str, factory: Factory) -> None:
    if name in _BUILTIN or name in _ADDED:
        raise ValueError(f"policy {name!r} is registered twice")
    _ADDED[name] = factory


def policy_names(*, live: bool = False) -> list[str]:
    """Registered policies; with ``live``, only those a running daemon can use."""
    names = sorted({*_BUILTIN, *_ADDED})
    return [n for n in names if not (live and getattr(_factory(n), "needs_future", False))]


def make_policy(name: str, **params: Any) -> EvictionPolicy:
    """A new policy ``name``; ConfigError, naming them, where it lacks members of the
    protocol (a policy written when they were optional, as ``on_owed`` and ``work`` were: the
    daemon would fail on the first call of one, between requests, long after its start; a
    config error, as trying again cannot help)."""
    policy = _factory(name)(**params)
    if missing := [m for m in _PROTOCOL_MEMBERS if not hasattr(policy, m)]:
        raise ConfigError(
            f"policy {name!r} lacks {', '.join(missing)} of the EvictionPolicy protocol "
            "(kvtier.daemon.policy.base; base.OwesNoWork gives on_owed and work to a policy "
            "that owes no work)"
        )
    return policy


def default_admission(name: str) -> str:
    """The admission rule the policy ``name`` is designed to run with."""
    return str(getattr(_factory(name), "default_admission", "always"))


def _factory(name: str) -> Factory:
    if name in _ADDED:
        return _ADDED[name]
    try:
        module, cls = _BUILTIN[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; one of {', '.join(policy_names())}") from None
    factory: Factory = getattr(importlib.import_module(module), cls)
    return factory
