"""metrics.jsonl -> PNG curves + a self-contained HTML page (`rlhfkit report OUTPUT_DIR`)."""

from rlhfkit.report.metrics import load_metrics
from rlhfkit.report.page import write_report

__all__ = ["load_metrics", "write_report"]
