"""Reports: the structured :class:`Result`, its renderers, and fvcore's printed tables."""

from .fvcore_tables import flop_count_str, flop_count_table, format_size, parameter_count_table
from .html import render_html, write_html
from .render import FORMATS, render
from .result import ModuleRow, Result, build_result

__all__ = [
    "FORMATS",
    "ModuleRow",
    "Result",
    "build_result",
    "flop_count_str",
    "flop_count_table",
    "format_size",
    "parameter_count_table",
    "render",
    "render_html",
    "write_html",
]
