"""Who the store's bots belong to: tenants and their limits, API keys, the audit log, and the
candidate records of bots (shadow and canary versions). The records and their rules here; the
SQL both store backends run for them in `accounts.rows`. Knows nothing of HTTP.
"""
from accounts.candidates import Candidate, CandidateInfo, CandidateMode
from accounts.errors import (
    AccountsError,
    BotOwnedElsewhere,
    InvalidCandidate,
    InvalidLimits,
    InvalidTenant,
    NoCandidate,
    TenantExists,
    TenantLimitExceeded,
    TenantNotEmpty,
    UnknownKey,
    UnknownTenant,
)
from accounts.tenants import (
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

__all__ = [
    "DEFAULT_TENANT", "OPERATOR", "SCOPES", "AccountsError", "ApiKey", "AuditRecord",
    "BotOwnedElsewhere", "Candidate", "CandidateInfo", "CandidateMode", "InvalidCandidate",
    "InvalidLimits", "InvalidTenant", "NoCandidate", "TenantExists", "TenantInfo", "TenantLimits",
    "TenantLimitExceeded", "TenantNotEmpty", "UnknownKey", "UnknownTenant", "parse_token",
    "token_hash", "validate_tenant",
]
