"""scripts/test_budget.py: each tier's wall time against its budget, and its slowest tests, from JUnit XML."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def budget_script():
    spec = importlib.util.spec_from_file_location("test_budget", ROOT / "scripts" / "test_budget.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def junit(path: Path, wall: float, cases: dict[str, float]) -> Path:
    body = "".join(f'<testcase classname="tests.unit.test_x" name="{name}" time="{t}"/>' for name, t in cases.items())
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="{len(cases)}" '
                    f'time="{wall}">{body}</testsuite></testsuites>')
    return path


def test_a_tier_over_its_budget_is_named_with_its_slowest_tests(tmp_path, capsys):
    script = budget_script()
    fast = junit(tmp_path / "fast.xml", 15 * 60.0, {"test_a": 300.0, "test_b": 20.5, "test_c": 1.0})
    real = junit(tmp_path / "real.xml", 9 * 60.0, {"test_d": 500.0})
    assert script.main([str(fast), str(real), str(tmp_path / "vllm.xml")]) == 0  # a report unless --strict
    out = capsys.readouterr().out
    assert "fast: 15.0 min, 3 tests, 5.4 min of test time (budget 14 min: OVER); the slowest:" in out
    assert out.index("test_a") < out.index("test_b") < out.index("test_c")
    assert "real: 9.0 min, 1 tests, 8.3 min of test time (budget 10 min: within)" in out
    assert "vllm: no " in out and "over budget: fast" in out
    assert script.main([str(fast), str(real), "--strict"]) == 1
    assert script.main([str(real), "--strict"]) == 0
