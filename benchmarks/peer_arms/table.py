"""The markdown table of the peer rows: one line per point and arm, with ratios to Unsloth at the same point."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: The columns, in order.
HEADER = (
    "| shape | cap GiB | point (data:tokens x batch) | arm | status | s/step | tokens/s | peak alloc GB |"
    " peak reserved GB | s/step / unsloth | reserved / unsloth |"
)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of ``path`` (blank lines skipped)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _number(value: Any, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _ratio(ours: Any, theirs: Any) -> str:
    return "-" if ours is None or not theirs else f"{ours / theirs:.2f}x"


def render(rows: list[dict[str, Any]]) -> str:
    """The table; a later row of the same shape, cap, point and arm replaces an earlier one (a rerun)."""
    latest: dict[tuple[Any, ...], dict[str, Any]] = {}
    for row in rows:
        latest[(row.get("shape"), row.get("settings", {}).get("cap_gib"), row["point"], row["arm"])] = row
    groups = sorted({key[:3] for key in latest}, key=lambda k: (str(k[0]), k[1] or 0, _order(k[2])))
    lines = [*_preamble(rows), "", HEADER, "|" + " --- |" * HEADER.count(" | ") + " --- |"]
    for group in groups:
        arms = [row for key, row in latest.items() if key[:3] == group]
        peer = next((r for r in arms if r["arm"] == "unsloth" and r.get("status") == "ok"), None)
        for row in arms:
            ok = row.get("status") == "ok"
            s = row.get("s_per_step") if ok else None
            reserved = row.get("peak_reserved_gb")
            if row is peer:
                ratios = "1x | 1x"
            else:
                theirs = (peer.get("s_per_step"), peer.get("peak_reserved_gb")) if peer else (None, None)
                ratios = f"{_ratio(s, theirs[0])} | {_ratio(reserved, theirs[1])}"
            lines.append(
                f"| {group[0]} | {group[1] or '-'} | {group[2]} | {row['arm']} | {_status(row)} | {_number(s, 3)} |"
                f" {_number(row.get('tokens_per_s') if ok else None, 0)} | {_number(row.get('peak_allocated_gb'), 2)} |"
                f" {_number(reserved, 2)} | {ratios} |"
            )
    return "\n".join(lines)


def _order(key: str) -> tuple[int, str]:
    data, _, size = key.partition(":")
    tokens, _, batch = size.partition("x")
    return int(tokens) * int(batch), data


def _status(row: dict[str, Any]) -> str:
    status = row.get("status", "?")
    return status if status == "ok" else f"{status}: {row.get('error', '')}".replace("|", "/")[:120]


def _preamble(rows: list[dict[str, Any]]) -> list[str]:
    devices = sorted({str(r.get("device")) for r in rows if r.get("device")})
    versions = {}
    for row in rows:
        for name, version in (row.get("versions") or {}).items():
            if version and name in ("torch", "transformers", "peft", "bitsandbytes", "unsloth", "liger_kernel"):
                versions[name] = version
    steps = sorted({(r["step_tokens"], r.get("steps"), r.get("warmup")) for r in rows if r.get("steps")})
    said = "; ".join(f"{t} tokens a step: median of {n} steps after {w} warm-up" for t, n, w in steps)
    return [
        f"Device: {', '.join(devices) or '?'}; " + ", ".join(f"{k} {v}" for k, v in sorted(versions.items())) + ".",
        f"s/step: {said or '-'}. GB are 1e9 bytes; ratios are this arm over Unsloth at the same point.",
    ]
