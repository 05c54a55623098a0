"""The LM service: vLLM (AsyncLLM) as the EC consumer behind gRPC."""
