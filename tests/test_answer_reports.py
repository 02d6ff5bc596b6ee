"""The one hook through which the gate hears a mode about its answers (anonproxy.route.reports), and the import
contract it keeps: nothing in anonproxy/proxy imports a back-end's report format. No database."""

from __future__ import annotations

import ast
import json
from decimal import Decimal
from pathlib import Path

import anonproxy
from anonproxy.route import reports
from anonproxy.route.decision import (
    ExplainDP,
    ExplainSuppress,
    Intercept,
    Noisy,
    Pass,
    Rewrite,
    SessionSetting,
)
from anonproxy.wire import protocol as pg
from anonproxy.wire.framing import MessageBuffer

PACKAGE = Path(anonproxy.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """The absolute names of the modules a source file imports (relative imports resolved)."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def test_nothing_in_the_proxy_imports_a_back_end() -> None:
    for path in sorted((PACKAGE / "proxy").glob("*.py")):
        wrong = {name for name in imported_modules(path) if name.startswith("anonproxy.suppress")}
        assert not wrong, f"{path.name} imports {sorted(wrong)}"


def suppression_info(**figures: object) -> dict[str, str]:
    report = {"k": 5, "relation": "public.adult", "labels": ["sex"], "groups": None, "complementary": None,
              "total": None, "rest": None, "null_group": None} | figures
    return {"S": "INFO", "V": "INFO", "C": "00000", "M": "anonproxy.suppression_report", "D": json.dumps(report)}


def notice_fields(message: bytes) -> dict[str, str]:
    [(type_, body)] = MessageBuffer().feed(message)
    assert type_ == b"N"
    return pg.parse_fields(body)


def test_suppressions_report_becomes_the_proxys_notice_after_the_answer() -> None:
    report = reports.read_notice(suppression_info(groups=2))
    assert report is not None
    fields = notice_fields(report.notice(rows=3))
    assert fields["S"] == fields["V"] == "NOTICE" and fields["C"] == "00000"
    assert fields["M"].startswith("anonproxy: 2 groups were suppressed")
    assert "k = 5" in fields["D"]


def test_a_report_with_nothing_to_tell_sends_nothing() -> None:
    report = reports.read_notice(suppression_info())
    assert report is not None and report.notice(rows=4) == b""


def test_other_notices_are_not_reports() -> None:
    assert reports.read_notice({"S": "NOTICE", "V": "NOTICE", "C": "00000", "M": "table t does not exist"}) is None
    assert reports.read_notice({"V": "INFO", "M": "anonproxy.suppression_report", "D": "not json"}) is None


def test_what_the_proxy_answers_itself() -> None:
    for decision in (Noisy("q"), ExplainDP("q"), ExplainSuppress(("line",)), SessionSetting("epsilon", Decimal(1)),
                     Intercept("budget"), Intercept("epsilon"), Intercept("delta")):
        assert reports.answered_by_proxy(decision), decision
    for other in (Pass(), Rewrite("q"), Intercept("k")):
        assert not reports.answered_by_proxy(other), other


def test_an_explanation_made_when_decided_is_answered_as_it_is() -> None:
    result = reports.explained(ExplainSuppress(("first", "second")))
    assert result is not None
    assert [column.name for column in result.columns] == ["QUERY PLAN"]
    assert result.rows == ((b"first",), (b"second",))
    assert reports.explained(ExplainDP("q")) is None
    assert reports.fixed_columns(ExplainDP("q")) == result.columns
    assert reports.fixed_columns(Noisy("q")) is None
