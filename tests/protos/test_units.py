"""The byte counts every CLI table prints."""

import pytest

from protos.units import human_bytes


@pytest.mark.parametrize(
    ("count", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (64 * 1024**2, "64.0 MiB"),
        (int(13.5 * 1024**3), "13.5 GiB"),
        (3 * 1024**4, "3.0 TiB"),
        (5000 * 1024**4, "5000.0 TiB"),  # no unit past TiB
    ],
)
def test_binary_units_with_one_decimal(count: int, text: str) -> None:
    assert human_bytes(count) == text
