"""gRPC channels the client reuses: one per address, all with the project's message limit."""

from __future__ import annotations

import grpc

from protos.dialing import DATA_WINDOW, DIAL_OPTIONS

CHANNEL_OPTIONS: list[tuple[str, int]] = [*DIAL_OPTIONS, *DATA_WINDOW]


def open_channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


class ChannelPool:
    """Channels keyed by HOST:PORT. Must be used from a single event loop."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = open_channel(address)
        return channel

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
