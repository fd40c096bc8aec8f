"""`benchmarks/generation_speed.py` on the CPU: each arm generates, rows are written, replies compared across arms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import generation_speed


def test_every_arm_generates_the_same_tokens_and_writes_its_rows(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    args = ["--shape", "tiny", "--device", "cpu", "--arms", "streamed", "resident", "--prompts", "1", "2"]
    rows = generation_speed.main([*args, "--new-tokens", "3", "--work", str(tmp_path), "--out", str(out)])
    assert [(row["arm"], row["prompts"]) for row in rows] == [("streamed", 1), ("streamed", 2), ("resident", 1),
                                                             ("resident", 2)]  # fmt: skip
    assert all(row["same_tokens"] and 0 < row["new_tokens"] <= 3 and row["tokens_per_s"] > 0 for row in rows)
    # The streamed arm measures what it copied per token (nothing on the CPU: the base is in host memory already).
    assert rows[0]["streamed_gb_per_token"] == 0.0 and rows[2]["streamed_gb_per_token"] is None
    assert [json.loads(line)["arm"] for line in out.read_text().splitlines()] == [row["arm"] for row in rows]


def test_replies_that_differ_are_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: the comparison can fail (one arm's replies changed after the fact)."""
    run_arm = generation_speed.run_arm

    def altered(*args: object) -> list[dict[str, object]]:
        rows = run_arm(*args)  # type: ignore[arg-type]
        if args[1] == "resident":
            for row in rows:
                row["replies"] = [[*reply, 0] for reply in row["replies"]]  # type: ignore[union-attr]
        return rows

    monkeypatch.setattr(generation_speed, "run_arm", altered)
    args = ["--shape", "tiny", "--device", "cpu", "--arms", "streamed", "resident", "--prompts", "1"]
    rows = generation_speed.main([*args, "--new-tokens", "2", "--work", str(tmp_path)])
    assert [row["same_tokens"] for row in rows] == [True, False]


def test_an_unknown_arm_is_refused_before_any_model_is_built(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="expected streamed, resident or budget=SIZE"):
        generation_speed.main(["--shape", "tiny", "--device", "cpu", "--arms", "streamd", "--work", str(tmp_path)])
    assert not (tmp_path / "tiny").exists()
