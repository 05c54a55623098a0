"""Policy names to policy classes: the one place that knows which ``--encoder-routing`` and
``--lm-routing`` values exist. Each class is imported only when its name is chosen (as
``ectransfer``'s factory loads transports), so ``services.gateway.config`` can validate names against
these tables without importing a policy.

Owner: ``Fleet.__init__`` calls ``encoder_policy``/``lm_policy`` once each; the objects are the fleet's."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.fleet_memory.directory import Directory
    from services.gateway.config import GatewayConfig
    from services.gateway.policies.base import EncoderPolicy, LMPolicy

ENCODER_POLICIES: dict[str, tuple[str, str]] = {
    "held": ("services.gateway.policies.held", "HeldPolicy"),
    "affinity": ("services.gateway.policies.affinity", "AffinityPolicy"),
}
"""``--encoder-routing`` values -> (module, class); the first is the default."""

LM_POLICIES: dict[str, tuple[str, str]] = {
    "cache": ("services.gateway.policies.cache", "CachePolicy"),
    "load": ("services.gateway.policies.load", "LoadPolicy"),
}
"""``--lm-routing`` values -> (module, class); the first is the default."""


def allowed(registry: dict[str, tuple[str, str]]) -> str:
    """The names ``registry`` maps, for an error message: "a, b or c"."""
    names = list(registry)
    return " or ".join([", ".join(names[:-1]), names[-1]]) if len(names) > 1 else "".join(names)


def check(flag: str, name: str, registry: dict[str, tuple[str, str]]) -> None:
    """Raises ValueError naming the allowed values unless ``registry`` maps ``name``."""
    if name not in registry:
        raise ValueError(f"{flag} must be {allowed(registry)}, got {name!r}")


def _load(flag: str, name: str, registry: dict[str, tuple[str, str]]) -> type:
    check(flag, name, registry)
    module, cls = registry[name]
    return getattr(importlib.import_module(module), cls)


def encoder_policy(name: str, cfg: GatewayConfig, directory: Directory) -> EncoderPolicy:
    """The ``--encoder-routing`` policy called ``name``, reading ``cfg`` and the fleet's encoder ``directory``."""
    return _load("encoder_routing", name, ENCODER_POLICIES)(cfg, directory)


def lm_policy(name: str, cfg: GatewayConfig, directory: Directory) -> LMPolicy:
    """The ``--lm-routing`` policy called ``name``, reading ``cfg`` and the fleet's LM ``directory``."""
    return _load("lm_routing", name, LM_POLICIES)(cfg, directory)
