"""bench/step_log.py reads the engine's debug step lines, plain or JSON-formatted."""

from __future__ import annotations

import json

from bench.step_log import steps, summary


def test_step_lines_are_grouped_by_context() -> None:
    line = ("step: 8 rows decoding, {t} prompt tokens in 1 chunks (context up to {c}), "
            "prefill {p} ms, step {s} ms")
    lines = [
        json.dumps({"level": "debug", "message": line.format(t=512, c=1000, p=40.0, s=50.0)}),
        line.format(t=256, c=5000, p=30.0, s=40.0),
        "an unrelated line",
        json.dumps({"message": line.format(t=512, c=12000, p=80.0, s=90.0)}),
    ]
    found = steps(lines)
    assert [s["context"] for s in found] == [1000, 5000, 12000]
    rows = summary(found, 10_000)
    assert [(r["context_from"], r["steps"]) for r in rows] == [(0, 2), (10_000, 1)]
    assert rows[0]["prompt_tok_s"] == round(768 / 0.09)
    assert rows[1]["step_ms_max"] == 90.0


def test_a_server_log_file_is_summarised_and_one_without_step_lines_gives_nothing(tmp_path) -> None:
    from bench.step_log import from_logs

    line = ("step: 8 rows decoding, 512 prompt tokens in 1 chunks (context up to 40000), "
            "prefill 90.0 ms, step 100.0 ms")
    logged = tmp_path / "ours-1.log"
    logged.write_text(json.dumps({"level": "debug", "message": line}) + "\n")
    quiet = tmp_path / "ours-2.log"
    quiet.write_text(json.dumps({"level": "info", "message": "ready"}) + "\n")
    assert from_logs([quiet]) == []
    (row,) = from_logs([logged, quiet])
    assert row["context_from"] == 40_000 and row["prompt_tok_s"] == 5120
