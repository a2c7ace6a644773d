"""The test suite as a package: shared fixtures live in tests/helpers.py (and tests/serving.py),
imported as `from tests.helpers import ...`; pytest finds the package from the repository root."""
