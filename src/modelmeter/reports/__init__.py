"""Reports: the structured :class:`Result` and its renderers (tables, CSV, JSON, HTML, fvcore's printed tables).

Renderers take a Result or plain data only; they never run or read an analysis.
"""

from .fvcore_tables import format_size
from .html import render_html, write_html
from .render import FORMATS, render
from .result import ModuleRow, Result

__all__ = [
    "FORMATS",
    "ModuleRow",
    "Result",
    "format_size",
    "render",
    "render_html",
    "write_html",
]
