"""nestling regenerate stage: the target rewrites the assistant turns of the chat data."""

from nestling.regenerate.run import regenerate
from nestling.regenerate.settings import RegenerateSettings

__all__ = ["regenerate", "RegenerateSettings"]
