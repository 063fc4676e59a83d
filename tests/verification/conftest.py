"""Verification tests reuse the data-plane fixtures: tiny checkpoint, coordinator key, nodes."""

from __future__ import annotations

from data_plane.conftest import checkpoint, keys, start_node

__all__ = ["checkpoint", "keys", "start_node"]
