"""The test suite as one package, so that pytest imports every test module and conftest by one name
(``tests.e2e.test_families``), the name the suite's own imports use. Without it pytest named them from
the first folder without an ``__init__.py`` (``e2e.test_families``, ``conftest``), and a conftest that
imported ``tests.e2e.test_families`` got a second copy of the module: its own reference runs and its own
``vllm serve``, started again beside pytest's, and a second run directory that nothing removed."""
