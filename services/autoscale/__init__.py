"""The local autoscaler: a pure policy (``policy``) and the loop that scrapes signals and acts (``loop``)."""
