"""The model store: content-addressed checkpoints that nodes fetch tensor by tensor.

`ModelStore` serves the model RPCs (Admin.AddModel/RemoveModel, ClientApi.ListModels/GetModel,
Coordinator.GetManifest/FetchTensors); `open_checkpoint` reads a local Hugging Face style
directory without torch, for `tessera-coordinator models add`.
"""

from coordinator.model_store.checkpoint import Checkpoint, CheckpointTensor, open_checkpoint
from coordinator.model_store.errors import CheckpointError
from coordinator.model_store.layout import ModelLayout
from coordinator.model_store.schema import MIGRATION_NAME, create_model_store_tables
from coordinator.model_store.service import ModelStore, StoreLimits

__all__ = [
    "MIGRATION_NAME",
    "Checkpoint",
    "CheckpointError",
    "CheckpointTensor",
    "ModelLayout",
    "ModelStore",
    "StoreLimits",
    "create_model_store_tables",
    "open_checkpoint",
]
