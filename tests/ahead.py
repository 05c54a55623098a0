"""Deployments launched one step ahead: while one e2e module runs its tests, the deployment the next one
needs is already starting, at the lowest CPU priority, so its setup (two vLLM imports of about 8 s of CPU
per service) overlaps the tests in front of it instead of following them.

A module registers a factory for its deployment (``register``: an unstarted ``services.up.Deployment``,
per fixture parameter where its fixture has them), and its fixture asks ``take`` first, starting one
itself only when nothing was launched for it (a run that selects it alone, a launch that failed). The
conftest calls ``step`` when a module's first test begins and after each ``take``: it launches the next
registered deployments the selected tests will use, while fewer than ``AHEAD`` launched earlier wait to be
taken (their memory, and the CPU they take from the tests, bounded).

Priority: a launch runs under ``nice -n 19`` (its engine processes inherit it) and each service's session
group at 19 too (``early.background``: with autogroup scheduling a nice value alone counts only inside a
session), so it takes an idle core and yields a busy one to the tests in front of it; ``take`` puts the
deployment it hands over back at the test process's own priority (that needs root; without it the
deployment stays at 19). Processes only: nothing of this runs on a thread while tests run (tests/early.py
says why).

Who owns what: ``step`` launches; the fixture that ``take``s a deployment owns it and stops it (as before:
``stop_in_background``); ``finish`` (the session's end) stops what no fixture took."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.child import ServiceExited
from tests.early import NICE, background, foreground

AHEAD = 1
"""Deployments launched and not yet taken, at most. Three were tried: the run took 880 s instead of 768
(on a host that was slower that hour too); the ones launched during the unit and integration tiers
got little of the idle core (the reference runs, in the tests' own session group, come first), and
the host's used memory peaked at 14.6 GiB."""


@dataclass
class _Entry:
    fixture: str
    factory: Callable[..., object]  # (param) -> an unstarted Deployment; () without a param
    param: str | None = None  # the fixture's parameter name in callspec, for a parametrized fixture


_REGISTERED: dict[str, _Entry] = {}  # module name -> how its deployment is made
_plan: list[tuple[str, str, object]] = []  # (key, module, param) in the run's order, for the selected tests
_launched: dict[str, object] = {}  # key -> a launched Deployment not taken yet
_done: set[str] = set()  # keys launched (taken or not) or taken by their fixture


def register(module: str, fixture: str, factory: Callable[..., object], param: str | None = None) -> None:
    """``module``'s deployment, which its fixture ``fixture`` takes, is ``factory()`` (``factory(value)`` per
    value of the fixture's parameter ``param``): unstarted."""
    _REGISTERED[module] = _Entry(fixture, factory, param)


def _key(module: str, value: object = None) -> str:
    return module if value is None else f"{module}[{value}]"


def plan(items) -> None:
    """The keys the selected ``items`` will take, in their order (after collection; a no-op when nothing
    registered)."""
    _plan.clear()
    seen = set()
    for item in items:
        module = getattr(getattr(item, "module", None), "__name__", "")
        entry = _REGISTERED.get(module)
        if entry is None or entry.fixture not in getattr(item, "fixturenames", ()):
            continue
        value = getattr(getattr(item, "callspec", None), "params", {}).get(entry.param) if entry.param else None
        key = _key(module, value)
        if key not in seen:
            seen.add(key)
            _plan.append((key, module, value))


def step() -> None:
    """Launches the next planned deployments, up to ``AHEAD`` waiting to be taken."""
    for key, module, value in _plan:
        if len(_launched) >= AHEAD:
            return
        if key in _done:
            continue
        entry = _REGISTERED[module]
        dep = entry.factory(value) if entry.param else entry.factory()
        for svc in dep.services:
            svc.command = [*NICE, *svc.argv]
        _done.add(key)
        try:
            dep.launch()
        except OSError:  # the fixture starts its own and says why if that fails too
            dep.stop()
            return
        for svc in dep.services:
            background(svc.proc.pid)
        _launched[key] = dep


def take(module: str, value: object = None):
    """The deployment launched for ``module`` (and the fixture's parameter ``value``), ready and back at
    this process's priority; None when none was launched or it did not get ready (stopped then, and
    said): the fixture starts its own."""
    key = _key(module, value)
    _done.add(key)
    dep = _launched.pop(key, None)
    if dep is not None:
        try:
            dep.wait_ready()  # stops it if it cannot get ready
            renice(dep)
        except (ServiceExited, TimeoutError, OSError) as e:
            print(f"\n{key}: the deployment launched ahead did not get ready ({e}); the fixture starts one")
            dep = None
    step()
    return dep


def renice(dep) -> None:
    """Every process of ``dep``'s services (engines included) at this process's own priority
    (``early.foreground``)."""
    import psutil

    for svc in dep.services:
        if svc.proc is None:
            continue
        try:
            root = psutil.Process(svc.proc.pid)
            foreground([root, *root.children(recursive=True)])
        except psutil.Error:
            continue


def finish() -> None:
    """Stops what no fixture took."""
    while _launched:
        _, dep = _launched.popitem()
        dep.stop()
