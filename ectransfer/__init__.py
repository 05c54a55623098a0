"""ectransfer: moves encoder outputs from an encoder engine to an LM engine.

Modules: ``base`` (the transport interface), ``factory`` (lazy registry),
``grpc_stream`` (chunks over the Transfer stream), ``pool`` (bounded pools),
``protocol`` (item states, compatibility), ``tensors`` (bytes <-> tensors),
``server``/``client`` (the Transfer stream's two ends) and ``connector`` (the
vLLM EC connector that plugs all of this into vLLM). Importing this package
imports neither vLLM nor any CUDA library.
"""
