"""How the demo names a node's layer range."""

from __future__ import annotations

from client.demo_training import layers_text


def test_layer_ranges_read_naturally() -> None:
    assert layers_text(0, 2) == "layers 0-1"
    assert layers_text(3, 6) == "layers 3-5"
    assert layers_text(5, 6) == "layer 5"  # not "layers 5-5"
