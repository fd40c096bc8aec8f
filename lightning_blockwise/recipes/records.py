"""Instruction records read from JSON or JSONL files, checked field by field before anything is encoded.

Example::

    records = load_records("data/instructions.jsonl")
    records[0]  # {"instruction": "...", "input": "...", "output": "..."}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException

#: What a data file must hold, for the error messages.
_FORMAT = (
    "Give a JSON list of objects or one JSON object per line, each with `instruction`, optional `input`, and `output`."
)


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """Instruction records from a JSON file (a list of objects) or a JSONL file (one object per line).

    The file is UTF-8, a leading byte-order mark allowed. Each record has string fields
    ``instruction`` and ``output``, and optionally ``input``: a string, ``null`` or absent.

    Args:
        path: The JSON or JSONL file.

    Raises:
        MisconfigurationException: If the file is not UTF-8, holds neither JSON nor JSONL (naming the line), or a
            record is not an object with those fields (naming the JSONL line, or the JSON record's index).
    """
    path = Path(path)
    try:
        # `utf-8-sig` drops a leading byte-order mark (Windows editors write one), which `json` would refuse.
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        raise MisconfigurationException(
            f"InstructionDataModule: {path} is not UTF-8 (byte {error.start}: {error.reason}). Save it as UTF-8,"
            " e.g. `iconv -f <its encoding> -t utf-8`."
        ) from None
    # A JSON file is one document; JSONL is one per non-empty line (a one-line JSONL is both).
    located = _parse_json(text, path) if text.lstrip().startswith("[") else _parse_jsonl(text, path)
    for where, record in located:
        _check_record(record, where, path)
    return [record for _, record in located]


def _parse_json(text: str, path: Path) -> list[tuple[str, Any]]:
    try:
        records = json.loads(text)
    except json.JSONDecodeError as error:
        raise MisconfigurationException(
            f"InstructionDataModule: cannot read {path} as JSON: line {error.lineno}, column {error.colno}:"
            f" {error.msg}. {_FORMAT}"
        ) from None
    return [(f"record {index} (counting from 0)", record) for index, record in enumerate(records)]


def _parse_jsonl(text: str, path: Path) -> list[tuple[str, Any]]:
    located = []
    # Split on "\n" only: `str.splitlines` also splits on U+2028 and other separators that JSON strings may hold
    # raw, which would cut a record in two and miscount the lines. A "\r" left by "\r\n" is JSON whitespace.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            located.append((f"line {number}", json.loads(line)))
        except json.JSONDecodeError as error:
            raise MisconfigurationException(
                f"InstructionDataModule: cannot read {path} as JSONL: line {number}, column {error.colno}:"
                f" {error.msg}. {_FORMAT}"
            ) from None
    return located


def _check_record(record: Any, where: str, path: Path) -> None:
    if not isinstance(record, dict) or "instruction" not in record or "output" not in record:
        raise MisconfigurationException(
            f"InstructionDataModule: {where} of {path} needs string fields `instruction` and `output`"
            f" (and optionally `input`), got {str(record)[:100]!r}."
        )
    # A null or a number would otherwise be formatted into the prompt and trained on as the text "None" or "3".
    for field in ("instruction", "output", "input"):
        value = record.get(field)
        if not isinstance(value, str) and not (field == "input" and value is None):
            allowed = "a string, null or absent" if field == "input" else "a string"
            raise MisconfigurationException(
                f"InstructionDataModule: {where} of {path} has `{field}` = {json.dumps(value)[:100]}, which must be"
                f' {allowed}. Write it as a JSON string ("" when empty).'
            )


__all__ = ["load_records"]
