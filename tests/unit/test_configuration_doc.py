"""docs/CONFIGURATION.md lists every setting, with its real default, and nothing else."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel

from shared.settings import Settings

CONFIGURATION = (Path(__file__).resolve().parents[2] / "docs" / "CONFIGURATION.md").read_text()


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
        for line in CONFIGURATION.splitlines()
        if line.startswith("| `")
    }
    settings = dict(_keys(Settings))
    assert set(rows) == set(settings), "docs/CONFIGURATION.md and Settings name other keys"
    for key, default in settings.items():
        env = "GRANARY_" + key.upper().replace(".", "__")
        assert f"`{env}`" in rows[key], f"the row for {key} lacks {env}"
        if isinstance(default, (int, str)) and not isinstance(default, bool):
            assert f"`{default}`" in rows[key], f"the default for {key} is not {default}"
