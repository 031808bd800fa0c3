"""run_files.py: the one reader of a run's JSON-lines files and the one cut a resumed run makes of them."""

from __future__ import annotations

import json

import pytest

from rlhfkit.run_files import EVAL_SAMPLES_FILE, METRICS_FILE, SAMPLES_FILE, drop_rows_after, read_jsonl


def test_a_killed_runs_cut_last_line_is_skipped_and_corruption_elsewhere_is_named(tmp_path):
    path = tmp_path / METRICS_FILE
    path.write_text('{"step": 1}\n\n{"step": 2}\n{"step": 3, "lo')  # the kill cut the last line
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=f"{METRICS_FILE}:2: not valid JSON"):
        read_jsonl(path)
    assert read_jsonl(path, skip_bad_lines=True) == [{"step": 1}, {"step": 3}]


def test_a_resume_drops_every_step_logs_rows_after_its_checkpoint_and_keeps_the_rest_as_written(tmp_path):
    rows = {METRICS_FILE: [{"step": s, "loss": 1 / (s + 1)} for s in range(0, 7)],
            SAMPLES_FILE: [{"step": s, "prompt": "p", "reward": None} for s in (1, 3, 5)],
            EVAL_SAMPLES_FILE: [{"step": s, "prompt": "q", "response": "r", "reward": 0.5} for s in (0, 2, 4, 6)]}
    for name, values in rows.items():
        text = "".join(json.dumps(v, separators=(", ", ": ")) + "\n" for v in values)
        (tmp_path / name).write_text(text + ('{"step": 7, "cut' if name == METRICS_FILE else ""))
    drop_rows_after(tmp_path, 4)
    for name, values in rows.items():
        kept = [v for v in values if v["step"] <= 4]
        assert (tmp_path / name).read_text() == "".join(json.dumps(v, separators=(", ", ": ")) + "\n" for v in kept)
