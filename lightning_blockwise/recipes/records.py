"""Training records read from JSON or JSONL files, checked field by field before anything is encoded.

Two kinds, told apart per record: instruction records (``instruction``, optional ``input``,
``output``) and conversation records (``messages``, a list of ``{"role", "content"}`` turns).

Example::

    records = load_records("data/instructions.jsonl")
    records[0]  # {"instruction": "...", "input": "...", "output": "..."}
    is_conversation({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]})
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException

#: What a data file must hold, for the error messages.
_FORMAT = (
    "Give a JSON list of objects or one JSON object per line, each with `instruction`, optional `input`, and `output`,"
    " or with `messages`: a list of {role, content} objects."
)
#: What a record must hold, for the error messages.
_KINDS = (
    "needs string fields `instruction` and `output` (and optionally `input`), or `messages`: a list of"
    ' {"role", "content"} objects with at least one `assistant` turn'
)


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """Records from a JSON file (a list of objects) or a JSONL file (one object per line).

    The file is UTF-8, a leading byte-order mark allowed. Each record is either an instruction
    record, with string fields ``instruction`` and ``output`` and optionally ``input`` (a string,
    ``null`` or absent), or a conversation record, whose ``messages`` is a non-empty list of
    objects with string ``role`` and ``content`` (other keys are kept for the chat template),
    at least one of them an ``assistant`` turn. Kinds may be mixed in one file.

    Args:
        path: The JSON or JSONL file.

    Raises:
        MisconfigurationException: If the file is not UTF-8, holds neither JSON nor JSONL (naming the line), or a
            record is not an object of either kind (naming the JSONL line, or the JSON record's index, and the field).
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


def is_conversation(record: dict[str, Any]) -> bool:
    """Whether ``record`` (as :func:`load_records` returns it) is a conversation record, not an instruction record."""
    return "messages" in record


def _check_record(record: Any, where: str, path: Path) -> None:
    if isinstance(record, dict) and "messages" in record:
        _check_conversation(record, where, path)
        return
    if not isinstance(record, dict) or "instruction" not in record or "output" not in record:
        raise MisconfigurationException(
            f"InstructionDataModule: {where} of {path} {_KINDS}, got {str(record)[:100]!r}."
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


def _check_conversation(record: dict[str, Any], where: str, path: Path) -> None:
    # Which kind a record is must not be a guess: a record with both would train on one and silently drop the other.
    both = [field for field in ("instruction", "input", "output") if field in record]
    if both:
        raise MisconfigurationException(
            f"InstructionDataModule: {where} of {path} has `messages` and also `{both[0]}`: a record is either a"
            " conversation (`messages`) or an instruction record (`instruction`, `input`, `output`). Keep one kind."
        )
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise MisconfigurationException(
            f"InstructionDataModule: {where} of {path} has `messages` = {json.dumps(messages)[:100]}, which must be a"
            ' non-empty list of {"role", "content"} objects.'
        )
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        # Content as a list of parts (images, tool calls) has no text to train on here; a null would render "None".
        if not isinstance(role, str) or not isinstance(content, str):
            raise MisconfigurationException(
                f"InstructionDataModule: {where} of {path}: message {index} (counting from 0) is"
                f" {json.dumps(message)[:100]}, which must be an object with string `role` and `content`"
                ' (e.g. {"role": "user", "content": "Hi"}; "" when empty).'
            )
    if not any(message["role"] == "assistant" for message in messages):
        roles = [message["role"] for message in messages]
        raise MisconfigurationException(
            f"InstructionDataModule: {where} of {path} has no `assistant` message (roles: {roles}), so nothing in it"
            " is trained on. Add the assistant's reply, or drop the record."
        )


__all__ = ["is_conversation", "load_records"]
