"""The HTTP client for matrix's own requests: health probes, the chat request, engines' /metrics."""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def _tls_context() -> ssl.SSLContext:
    # httpx loads the CA bundle for every new client (about 0.3 s of CPU on a small host, twice per cell)
    # even though matrix only speaks plain HTTP to 127.0.0.1; one verifying context per process is enough.
    return ssl.create_default_context()


def loopback_client(timeout_s: float) -> httpx.Client:
    """A client that ignores proxy settings from the environment (`HTTP_PROXY` would send a loopback request
    elsewhere) and reuses one TLS context for the whole process."""
    return httpx.Client(trust_env=False, timeout=timeout_s, verify=_tls_context())
