"""Calling another deployment through its Serve handle: what both the ingress and the generator need.

Awaiting a Serve response in a task that gets cancelled (the client went away, or the request's deadline
passed) does not cancel the response by itself, so every caller awaits through `cancelling`, and the
callee drops the request at its next step. This module imports nothing of ours, so any role can use it.
"""

from __future__ import annotations

import asyncio
from typing import Any


async def cancelling(response: Any) -> Any:
    """Await a Serve response; cancel it downstream when this task is cancelled."""
    try:
        return await response
    except asyncio.CancelledError:
        response.cancel()
        raise
