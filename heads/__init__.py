"""Per-bot heads as data: checkpoint format, registry, resident cache, training, slim import.

A bot is a fully connected head `weights [1536, n]`, `biases [n]` with n labels, applied with
numpy to the shared trunk's features; registering, replacing or removing one never touches the
TF graph. `import heads` does not import TensorFlow (only writing/reading checkpoints does).

    store = open_store("checkpoints")              # or "postgresql://user@host:5432/db"
    store.register("acme", weights, biases, ["cat", "dog"])    # -> version 1
    head = store.get("acme")
    head.top_k(trunk.features(images), k=3)

A store is a directory (SQLite registry + head files, the default) or a PostgreSQL database
(registry and tensors, shared by many machines); psycopg is imported only for the latter.
"""
from heads.candidates import Candidate, CandidateInfo, CandidateMode
from heads.errors import (
                          BotOwnedElsewhere,
                          HeadLoadError,
                          HeadsError,
                          InvalidBotId,
                          InvalidCandidate,
                          InvalidHead,
                          InvalidLimits,
                          InvalidStoreLocation,
                          InvalidTenant,
                          InvalidTrainingData,
                          NoCandidate,
                          StoreUnavailable,
                          TenantExists,
                          TenantNotEmpty,
                          TrunkMismatch,
                          UnknownBot,
                          UnknownKey,
                          UnknownTenant,
                          UnknownVersion,
)
from heads.files import read_labels
from heads.head import Head, top_indices, validate_bot_id
from heads.store import BotInfo, HeadStore, open_store
from heads.tenants import (
                           DEFAULT_TENANT,
                           OPERATOR,
                           SCOPES,
                           ApiKey,
                           AuditRecord,
                           TenantInfo,
                           TenantLimits,
                           parse_token,
                           token_hash,
                           validate_tenant,
)
from heads.train import TrainResult, extract_features, scan_image_folder, train_head

__all__ = [
    "DEFAULT_TENANT", "OPERATOR", "SCOPES", "ApiKey", "AuditRecord", "BotInfo",
    "BotOwnedElsewhere", "Candidate", "CandidateInfo", "CandidateMode", "Head",
    "HeadLoadError", "HeadStore", "HeadsError", "InvalidBotId", "InvalidCandidate",
    "InvalidHead", "InvalidLimits", "InvalidStoreLocation", "InvalidTenant",
    "InvalidTrainingData", "NoCandidate", "StoreUnavailable", "TenantExists", "TenantInfo",
    "TenantLimits", "TenantNotEmpty", "TrainResult", "TrunkMismatch", "UnknownBot", "UnknownKey",
    "UnknownTenant", "UnknownVersion", "extract_features", "open_store", "parse_token",
    "read_labels", "scan_image_folder", "token_hash", "top_indices", "train_head",
    "validate_bot_id", "validate_tenant",
]
