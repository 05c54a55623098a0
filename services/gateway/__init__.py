"""The gateway: OpenAI-compatible REST and a native gRPC API over encoder and LM instances."""
