"""Unit tests: no servers, no engines (``tests/__init__.py`` says why every test folder is a package)."""
