"""nestling export stage: the draft in the engines' layouts (`nestling.export` is `eagle3.export`)."""

from nestling.export.eagle3 import ExportSettings, export

__all__ = ["ExportSettings", "export"]

from nestling.stage import make_callable  # noqa: E402

make_callable(__name__, "nestling.export.eagle3:export")
