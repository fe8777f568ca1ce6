"""The regenerate stage: the target rewrites the assistant turns of the chat data. Callable:
`nestling.regenerate(...)` runs `run.regenerate`."""

from nestling.stage import make_callable

make_callable(__name__, "nestling.regenerate.run:regenerate")
