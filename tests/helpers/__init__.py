"""Code the tests share: catalog builders, the CLI runner, process and port assertions, report seeders.

Test modules import from here, never from another test module (`tests/unit/test_test_imports.py`), so that a
test file can be moved, renamed or run alone without breaking another; fixtures live in the conftest.py of the
directory whose tests use them.
"""
