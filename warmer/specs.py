"""Declared warm specs: from settings and from a directory of TOML files, read at every run.

Documents are read when a run starts, so files added since the last run are warmed too, and
normalised as the spec's `document_format` says (the warmer loads no model: normalising needs
none). A
spec that cannot be read (bad TOML, a missing or non-UTF-8 file) is reported in the run and
skipped; it never stops the others.
"""

from __future__ import annotations

import glob
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from shared.documents import normalized
from shared.errors import InvalidRequest
from shared.schemas import WarmItem
from shared.settings import WarmerSettings, WarmSpec


@dataclass
class DeclaredItems:
    items: list[WarmItem] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def declared_items(settings: WarmerSettings, cwd: Path) -> DeclaredItems:
    found = DeclaredItems()
    specs = [(spec, cwd) for spec in settings.specs]
    if settings.spec_dir is not None:
        specs += _specs_in(settings.spec_dir.expanduser(), found.errors)
    for spec, base in specs:
        _expand(spec, base, found)
    return found


def _specs_in(directory: Path, errors: list[str]) -> list[tuple[WarmSpec, Path]]:
    if not directory.is_dir():
        errors.append(f"spec_dir {directory} is not a directory")
        return []
    specs = []
    for path in sorted(directory.glob("*.toml")):
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
            specs.append((WarmSpec.model_validate({"name": path.stem, **data}), path.parent))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, ValidationError) as exc:
            errors.append(f"{path}: {exc}")
    return specs


def _expand(spec: WarmSpec, base: Path, found: DeclaredItems) -> None:
    for pattern in spec.documents:
        full = pattern if Path(pattern).is_absolute() else str(base / pattern)
        paths = sorted(glob.glob(full, recursive=True))
        if not paths:
            found.errors.append(f"spec {spec.name}: no file matches {pattern}")
        for path in paths:
            _add(spec, Path(path), found)


def _add(spec: WarmSpec, path: Path, found: DeclaredItems) -> None:
    try:
        text = path.read_text(encoding="utf-8")
        item, _ = normalized(
            WarmItem(
                name=f"{spec.name}:{path.name}",
                document=text,
                instructions=spec.instructions,
                template=spec.template,
                document_format=spec.document_format,
                document_type=spec.document_type,
            )
        )
    except InvalidRequest as exc:  # a binary file, a declared type that does not fit
        found.errors.append(f"spec {spec.name}: {path}: {exc.message}")
        return
    except (OSError, UnicodeDecodeError, ValidationError) as exc:
        found.errors.append(f"spec {spec.name}: {path}: {exc}")
        return
    found.items.append(item)
