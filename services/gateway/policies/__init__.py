"""Per-request routing choices as objects, picked once by name when the gateway starts: which encoder
encodes an item (``--encoder-routing``), which LM answers a request (``--lm-routing``).

``base`` declares the two interfaces and the request's routing key, ``factory`` maps each flag value to
its class (loaded on demand), and each policy is one module: ``held`` and ``affinity`` for encoders,
``cache`` and ``load`` for LMs. ``services.gateway.fleet`` holds the chosen objects; no caller compares a
policy's name. Importing this package imports no policy."""
