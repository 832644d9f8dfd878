"""The README's configuration table must list every setting with its real default."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel

from shared.settings import Settings

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
CONFIG_SECTION = README.split("## Configuration", 1)[1].split("\n## ", 1)[0]


def _keys(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, object]]:
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _keys(annotation, f"{prefix}{name}.")
        else:
            yield prefix + name, field.default


def test_every_setting_is_documented() -> None:
    rows = {
        line.split("|")[1].strip(" `"): line
        for line in CONFIG_SECTION.splitlines()
        if line.startswith("| `")
    }
    for key, default in _keys(Settings):
        assert key in rows, f"README config table lacks {key}"
        env = "GRANARY_" + key.upper().replace(".", "__")
        assert f"`{env}`" in rows[key], f"README row for {key} lacks {env}"
        if isinstance(default, (int, str)) and not isinstance(default, bool):
            assert f"`{default}`" in rows[key], f"README default for {key} is not {default}"
