"""nestling regenerate stage: the target rewrites the assistant turns of the chat data."""

from nestling.regenerate.run import regenerate
from nestling.regenerate.settings import RegenerateSettings

__all__ = ["regenerate", "RegenerateSettings"]

from nestling.stage import make_callable  # noqa: E402

make_callable(__name__, "nestling.regenerate.run:regenerate")
