"""nestling export stage: the draft in the engines' layouts (`nestling.export` is `eagle3.export`)."""

from nestling.export.eagle3 import ExportSettings, export

__all__ = ["ExportSettings", "export"]
