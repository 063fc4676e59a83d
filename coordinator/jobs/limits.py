"""Size limits of the jobs component: what one upload, dataset or checkpoint may hold, and
how much of a caller's string an error message repeats."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class JobLimits:
    max_dataset_bytes: int = 16 << 30
    max_dataset_shards: int = 65_536
    max_example_len: int = 1 << 20
    max_name_chars: int = 128
    # A stage's checkpoint holds fp32 parameters and two AdamW moments of its layers, and
    # never more than this multiple of the whole model in fp32 (plus headers).
    checkpoint_bytes_per_fp32_model: int = 4
    checkpoint_header_slack: int = 16 << 20
    chunk_bytes: int = 1 << 20
    max_steps: int = 10_000_000
    max_batch_size: int = 1 << 16
    max_seq_len: int = 1 << 20
    max_micro_batches: int = 1024
    max_list: int = 1000
    # Open WatchJob streams, all jobs together: each is a bus subscription that every
    # published event is matched against, so their number must not grow without end.
    max_watchers: int = 1000
    # Refuse an upload that would leave less than this free on the store's disk.
    min_free_bytes: int = 256 << 20
