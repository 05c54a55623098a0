"""A discrete-event model of an EPD fleet, for sizing one past a single host.

``bench/plan.py`` is the entry point. The package is one module per noun:

- ``costs``: per-stage costs (encoder batch, LM step, transfer, front-end latency) read from
  ``bench/sim_inputs.json``, where every figure carries its ``source``.
- ``trace``: request traces, generated with numpy from a seed (the capacity benchmark's workloads
  and a bursty day whose image share shifts).
- ``fleet``: the fleet itself: the gateway's routing, encoder instances (a queue, batches of items),
  transfers, LM instances with continuous batching (chunked prefill, decode step time by batch, a
  sequence and KV bound), colocated LMs that encode inside their own steps, and the event loop.
- ``autoscale``: the simulator's autoscaling policy (hot on queueing time, GPUs moved between roles
  at a fixed budget, hysteresis, cool-down, a provisioning delay).
- ``local_policy``: the project's own decision (``services/autoscale/policy.py``) driven unchanged.
- ``report``: the printed tables and the plots.

Everything is plain Python and deterministic for a given seed; nothing here touches a real service.
"""
