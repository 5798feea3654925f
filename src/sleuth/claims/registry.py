"""The registered claims, by name (a claim's name is its paper's method name, as `sleuth reproduce <name>` takes it).

The built-in claims register when `sleuth.claims` is imported; a plugin registers its own with `register_claim`.
"""

from __future__ import annotations

from sleuth.claims.base import ClaimSpec
from sleuth.errors import ConfigError

CLAIMS: dict[str, ClaimSpec] = {}


def register_claim(spec: ClaimSpec) -> ClaimSpec:
    """Make `spec` runnable as `sleuth reproduce <spec.method>`; a name is taken once."""
    if spec.method in CLAIMS and CLAIMS[spec.method] is not spec:
        raise ConfigError(f"claim name {spec.method!r} is already taken")
    CLAIMS[spec.method] = spec
    return spec


def get_claim(name: str) -> ClaimSpec:
    if name not in CLAIMS:
        raise ConfigError(f"no claim registered for {name!r}; choose one of {', '.join(CLAIMS)}")
    return CLAIMS[name]
