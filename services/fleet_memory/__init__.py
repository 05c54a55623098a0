"""The fleet's memory: what each instance holds, and how routing weighs it.

One home for the three parts, each owned by one side:

- ``holdings``: on each LM, what its prefix cache holds, by media item, from vLLM's own KV cache events
  (``--kv-events-config``'s ZMQ publisher, on a private socket), served to the gateway by
  ``LMService.Holdings``;
- ``directory``: on the gateway, a bounded directory of every LM's holdings (the LM's last snapshot, plus
  what the gateway sent it since), correct across restarts, lost events and removed LMs: a stale entry
  costs a miss, never a wrong answer (an LM computes whatever it does not hold);
- ``scoring``: pure functions that pick an LM by the items it holds and its load (load wins past a bound).

docs/design.md ("A fleet that remembers") gives the consistency rule and the bounds."""
