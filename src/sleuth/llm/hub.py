"""Whether a hub model ("org/name") can load here: in the local Hugging Face cache, or the hub reachable.

Checked before transformers loads it, so a machine without network hears one line naming the model and
what to set, within seconds, instead of a long traceback after a minute of transformers' retries."""

from __future__ import annotations

import os
import urllib.error
import urllib.request

from huggingface_hub import constants, try_to_load_from_cache

from sleuth.errors import ConfigError

PROBE_TIMEOUT_S = 5.0  # a reachable hub answers a HEAD request well within this
_TRUE = {"1", "on", "yes", "true"}


def _fixes(name: str) -> str:
    return (
        f"download it where there is network (`hf download {name}`) into this machine's Hugging Face cache "
        f"(HF_HOME, now {constants.HF_HOME}), or set the model (model.policy / --model) to a local directory, "
        "a .gguf file or an alias (`sleuth models`)"
    )


def require_hub_model(name: str) -> None:
    """Raise a one-line ConfigError when hub model `name` is neither cached nor downloadable now."""
    try:
        cached = isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # not a valid repo id (HFValidationError): transformers will say so
        return
    if cached:
        return
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE:
        raise ConfigError(
            f"model {name!r} is not a local directory and not in the local Hugging Face cache, and "
            f"HF_HUB_OFFLINE is set: {_fixes(name)}"
        )
    endpoint = (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    request = urllib.request.Request(f"{endpoint}/api/models/{name}", method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=PROBE_TIMEOUT_S):
            return
    except urllib.error.HTTPError:
        return  # the hub answered (gated, private or unknown: transformers says which, with its own message)
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise ConfigError(
            f"model {name!r} is not a local directory and not in the local Hugging Face cache, and "
            f"the hub ({endpoint}) is unreachable ({reason}): {_fixes(name)}"
        ) from None
