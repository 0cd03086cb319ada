"""The API key check both fronts make: the same comparison and the same
refusal, each front saying how its clients send the key."""

from __future__ import annotations

import hmac


def key_matches(header: str | None, key: str) -> bool:
    """`header` is 'Bearer KEY' for this key (compared in constant time)."""
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer "):].encode(), key.encode())


def refusal(header: str | None, how_to_send: str) -> str:
    """Why a call with this authorization `header` is refused, and what to
    send instead (`how_to_send`: the front's header or metadata)."""
    why = "no API key given" if not header else "the API key is wrong"
    return (f"{why}: send {how_to_send} with the key the deployment was started with "
            "(--api-key or PDSERVE_API_KEY)")
