"""Fixtures of the jobs tests; the helpers live in jobs_harness.py."""

from __future__ import annotations

from jobs.jobs_harness import jc, start_jobs, tiny_model  # noqa: F401 - fixtures
