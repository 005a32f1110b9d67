"""docs/api.md names every public name of the package (``modelmeter.__all__``)."""

from __future__ import annotations

import re
from pathlib import Path

import modelmeter

API = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def undocumented(names: list[str], text: str) -> list[str]:
    """The names that ``text`` never shows as code: `name`, `name(...)`, `name[...]`, `name.attr` or `name `."""
    return [name for name in names if not re.search(rf"`(modelmeter\.)?{re.escape(name)}[`(\[ .]", text)]


def test_every_public_name_is_in_the_api_page() -> None:
    missing = undocumented(modelmeter.__all__, API.read_text())
    assert not missing, f"docs/api.md does not describe: {missing}"


def test_a_name_only_in_prose_or_inside_another_is_missing() -> None:
    text = "`step_time(...)` and `StepTimes`; Communication in prose; `modelmeter.__version__`"
    assert undocumented(["step_time", "StepTime", "Communication", "__version__"], text) == ["StepTime",
                                                                                             "Communication"]
