"""Harnesses shared by the tests of several tiers and by ``bench/`` (not part of the product)."""
