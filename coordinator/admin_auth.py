"""The admin token check every Admin RPC starts with."""

from __future__ import annotations

import hmac

import grpc

HEADER = "authorization"
SCHEME = "Bearer "


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that authenticates an admin request."""
    return ((HEADER, SCHEME + token),)


async def require_admin(context: grpc.aio.ServicerContext, admin_token: str) -> None:
    """Abort with UNAUTHENTICATED unless the call carries `authorization: Bearer <token>`."""
    presented = None
    for key, value in context.invocation_metadata() or ():
        if key == HEADER:
            presented = value if isinstance(value, str) else value.decode(errors="replace")
            break
    if presented is None:
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            "admin call without credentials: send metadata 'authorization: Bearer <token>' "
            "with the token from the coordinator's DATA_DIR/admin.token",
        )
    if not presented.startswith(SCHEME):
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            "the authorization metadata must look like 'Bearer <token>'",
        )
    # Constant time: the comparison must not reveal how much of a guess was right.
    if not hmac.compare_digest(presented[len(SCHEME) :].encode(), admin_token.encode()):
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            "wrong admin token; use the one in the coordinator's DATA_DIR/admin.token",
        )
