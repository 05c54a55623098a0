"""The encoder service: vLLM in encoder-only producer mode behind gRPC."""
