"""Pieces every service shares: errors, gRPC server wiring, engine building, media."""
