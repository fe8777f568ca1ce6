"""The export stage: the draft in the engines' layouts. Callable: `nestling.export(...)` runs `run.export`."""

from nestling.stage import make_callable

make_callable(__name__, "nestling.export.run:export")
