"""Everything a servicer needs, in one object handed to every service.

`model_store`, `sessions`, `planner` and `jobs` are provided by other parts of the
coordinator and stay None until they are wired in; the servicers answer UNIMPLEMENTED for
their RPCs until then.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlite_utils
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from coordinator.events import EventBus
from coordinator.registry import Registry
from coordinator.settings import Settings
from protos import identity


@dataclass
class CoordinatorContext:
    settings: Settings
    db: sqlite_utils.Database
    registry: Registry
    bus: EventBus
    signing_key: Ed25519PrivateKey
    admin_token: str
    data_dir: Path
    model_store: Any = None
    sessions: Any = None
    planner: Any = None
    ledger: Any = None
    jobs: Any = None
    verifier: Any = None
    relay: Any = None

    @property
    def public_key(self) -> bytes:
        """The coordinator's raw Ed25519 public key; nodes verify capability tokens with it."""
        return identity.public_key_bytes(self.signing_key)
