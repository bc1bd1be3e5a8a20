"""Policies by name. A policy module registers its class with ``@register_policy("name")``;
the daemon and the replayer build one with ``make_policy(name, **params)``.

A policy class may name the admission rule it is designed to run with in a class attribute
``default_admission`` (see ``kvtier.daemon.policy.admission``); ``"always"`` otherwise. A
class with ``needs_future = True`` (Belady's optimum) only runs in the replayer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from kvtier.daemon.policy.base import EvictionPolicy

T = TypeVar("T")

_POLICIES: dict[str, Callable[..., EvictionPolicy]] = {}


def register_policy(name: str) -> Callable[[T], T]:
    def decorate(cls: T) -> T:
        if name in _POLICIES:
            raise ValueError(f"policy {name!r} is registered twice")
        _POLICIES[name] = cls  # type: ignore[assignment]
        return cls

    return decorate


def policy_names(*, live: bool = False) -> list[str]:
    """Registered policies; with ``live``, only those a running daemon can use."""
    _load_builtin()
    return sorted(
        n for n, f in _POLICIES.items() if not (live and getattr(f, "needs_future", False))
    )


def make_policy(name: str, **params: Any) -> EvictionPolicy:
    return _factory(name)(**params)


def default_admission(name: str) -> str:
    """The admission rule the policy ``name`` is designed to run with."""
    return str(getattr(_factory(name), "default_admission", "always"))


def _factory(name: str) -> Callable[..., EvictionPolicy]:
    _load_builtin()
    try:
        return _POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; one of {', '.join(sorted(_POLICIES))}"
        ) from None


def _load_builtin() -> None:
    # Importing the modules runs their @register_policy decorators.
    from kvtier.daemon.policy import arc, density, heat, lru, opt  # noqa: F401
