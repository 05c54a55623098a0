"""Scaling signals every service exports alike, defined once per process (the encoder and the LM
re-export them from their own ``signals`` modules; a process importing both, as the tests do, must not
register a series twice).

- ``epd_instance_draining`` (gauge 0/1): 1 once this instance drains (it finishes what it holds and
  takes no new work), so a scaler leaves it out of the capacity it counts. The drain code sets it.
"""

from __future__ import annotations

from prometheus_client import Gauge

DRAINING = Gauge("epd_instance_draining", "1 while this instance drains (finishes what it holds, takes no new "
                 "work), else 0; scalers leave a draining instance out of the capacity they count")
