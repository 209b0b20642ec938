"""Checking a running pair: send the chat completion (`client`) and validate the answer (`validate`).

Import from the submodules (`matrix.check.client`, `matrix.check.validate`): validation needs no HTTP
stack, so importing this package stays free of it.
"""
