"""EPD services: encoder, LM, gateway and shared helpers."""
