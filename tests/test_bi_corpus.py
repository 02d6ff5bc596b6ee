"""The BI corpus (tests/bi_corpus/) replayed through the gated proxy as `reporter` (suppress) and `analyst` (dp).

Per statement: catalog statements are answered for both roles; row-level
statements, and aggregates a documented rule refuses in a mode, are refused
there with 42501 or 0A000 before any row; no statement closes the connection
or fails with XX000. Per mode: at least 90 % of the other aggregates of the
established corpus are answered (an answer without rows counts: suppression
withholds whole-table totals). The aggregates of the widened corpus (issue
19: tools the established corpus does not cover, time series over the dated
table ``public.visits`` of the demo data, anonproxy/sample_data.py) are
each answered or refused cleanly, with a SQLSTATE and a message; at least
95 % of them are answered in each mode, and every time series; every
widened statement is valid PostgreSQL (the direct role ``dba`` is answered).
The widened corpus also holds the SQL that analysts' and applications'
libraries sent when run for real (pandas, Polars, Ibis, Peewee, Knex, Kysely:
tests/bi_corpus/capture_libraries.py; test_bi_libraries.py and
test_bi_builders.py drive the libraries themselves through the proxy).
The coverage tables per tool and role are printed, and the refused aggregates
with their SQLSTATE and message, the widened corpus's grouped by cause.

The analyst's budget is raised for the replay and afterwards set so that what
is left is what was left before: other tests of the session see the demo
budget they expect.
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest
from bi_corpus import replay
from conftest import Endpoint, wait_for_current_policy

from anonproxy.embedded import EmbeddedPostgres

ROLES = {"reporter": "suppress", "analyst": "dp"}
ENTRIES = replay.load()
TOOLS = list(dict.fromkeys(entry.tool for entry in ENTRIES))
ESTABLISHED = [entry for entry in ENTRIES if entry.corpus == "established"]
WIDENED = [entry for entry in ENTRIES if entry.corpus == "widened"]
# The tools issue 19 names that the established corpus does not cover, and those of them that draw time.
NEW_TOOLS = {"Redash", "Lightdash", "Cube", "Looker", "Evidence", "dbt", "MetricFlow", "Django", "SQLAlchemy"}
TIME_TOOLS = NEW_TOOLS - {"dbt"} | {"Grafana", "Superset", "Metabase", "Tableau", "Power BI"}
TARGET_AGGREGATE_SHARE = 0.9
TARGET_WIDENED_SHARE = 0.95  # issue 19
# Enough for every dp statement of the corpus (ε 0.5 and δ 1e-7 each, the demo's per-query charge).
EXTRA_EPSILON, EXTRA_DELTA = Decimal(1000), Decimal("0.01")


@pytest.fixture(scope="module")
def analyst_budget(pg_server: EmbeddedPostgres, gated_database: str, gated_proxy: Endpoint) -> Iterator[None]:
    """A large budget for the demo analyst during the replay; then the old one plus what the replay spent, under the
    same accounting (zcdp, the demo's by the default rule: what counts as spent is then the conversion of Σρ at the δ
    left, which the ledger computes, so the budget is set back from its own figures)."""
    with psycopg.connect(pg_server.conninfo(dbname=gated_database), autocommit=True) as owner:
        budget = owner.execute(
            "select epsilon, delta, epsilon_per_query, delta_per_query, refresh_period, accounting, "
            "(anonproxy.remaining_budget(role_name, domain)).epsilon from anonproxy.budgets "
            "where role_name = 'analyst' and domain = anonproxy.budget_domain('public.adult')").fetchone()
        assert budget is not None, "the demo policy gives the analyst a budget on public.adult"
        epsilon, delta, epsilon_per_query, delta_per_query, refresh, accounting, left = budget
        last = owner.execute("select coalesce(max(id), 0) from anonproxy.budget_ledger").fetchone()[0]
        set_budget = "select anonproxy.set_budget('analyst', 'public.adult'::regclass, %s, %s, %s, %s, %s, %s)"
        owner.execute(set_budget, (epsilon + EXTRA_EPSILON, delta + EXTRA_DELTA, refresh, epsilon_per_query,
                                   delta_per_query, accounting))
        wait_for_current_policy(owner, gated_proxy, gated_database)
        try:
            yield
        finally:
            spent_delta = owner.execute(
                f"select coalesce(sum({'delta' if accounting == 'basic' else 'delta_add'}), 0) "
                "from anonproxy.budget_ledger where role_name = 'analyst' and id > %s", (last,)).fetchone()[0]
            owner.execute(set_budget, (epsilon + EXTRA_EPSILON, delta + spent_delta, refresh, epsilon_per_query,
                                       delta_per_query, accounting))
            spent = owner.execute("select epsilon_spent from anonproxy.remaining_budget('analyst', 'public.adult')"
                                  ).fetchone()[0]  # at the δ left before: it does not depend on the ε budget
            owner.execute(set_budget, (left + spent, delta + spent_delta, refresh, epsilon_per_query,
                                       delta_per_query, accounting))


@pytest.fixture(scope="module")
def outcomes(gated_proxy: Endpoint, gated_database: str, analyst_budget: None) -> list[replay.Outcome]:
    dsns = {role: gated_proxy.dsn(gated_database, user=role) for role in ROLES}
    return replay.replay(ENTRIES, dsns, ROLES)


@pytest.fixture(scope="module")
def direct_outcomes(gated_proxy: Endpoint, gated_database: str) -> list[replay.Outcome]:
    """The widened corpus as the direct role dba: what PostgreSQL itself makes of each statement."""
    return replay.replay(WIDENED, {"dba": gated_proxy.dsn(gated_database, user="dba")}, {"dba": "direct"})


def test_the_corpus_is_wide() -> None:
    kinds = [entry.kind for entry in ESTABLISHED]
    assert len(ESTABLISHED) >= 150 and kinds.count("aggregate") >= 60
    tools = {entry.tool for entry in ESTABLISHED}
    assert len(tools) == 8, tools
    for tool in tools:
        assert {entry.kind for entry in ESTABLISHED if entry.tool == tool} >= {"catalog"}, tool


def test_the_widened_corpus_covers_the_next_tools_and_time() -> None:
    from_new_tools = [entry for entry in WIDENED if entry.tool in NEW_TOOLS]
    assert len(from_new_tools) >= 80, len(from_new_tools)
    assert {entry.tool for entry in from_new_tools} == NEW_TOOLS
    assert not NEW_TOOLS & {entry.tool for entry in ESTABLISHED}, "a new tool's statements belong to the widened corpus"
    for tool in TIME_TOOLS:
        assert any(entry.time_series and entry.kind == "aggregate" and entry.tool == tool for entry in WIDENED), tool
    for entry in WIDENED:
        assert entry.source.strip(), entry.id
        if entry.time_series:
            assert "visits" in " ".join(entry.steps), f"{entry.id}: a time series reads the dated table"


@pytest.mark.parametrize(("entry", "problem"), [
    ("{id: x, kind: aggregate, source: s}", "give either sql or steps"),
    ("{id: x, kind: chart, source: s, sql: select 1}", "kind must be one of"),
    ("{id: x, kind: catalog, sql: select 1}", "say where the statement comes from"),
    ("{id: x, kind: catalog, source: s, protocol: binary, sql: select 1}", "protocol must be one of"),
    ("{id: x, kind: catalog, source: s, sql: select 1, refused_by_design: {dp: r}}", "only aggregates"),
    ("{id: x, kind: catalog, source: s, sql: select 1, params: 3}", "params must be a list or a mapping"),
])
def test_a_malformed_corpus_entry_is_named(tmp_path: Path, entry: str, problem: str) -> None:
    (tmp_path / "tool.yaml").write_text(f"tool: T\nentries:\n  - {entry}\n")
    with pytest.raises(replay.CorpusError, match=problem):
        replay.load(tmp_path)


def test_a_corpus_file_names_a_known_corpus(tmp_path: Path) -> None:
    (tmp_path / "tool.yaml").write_text("tool: T\ncorpus: new\nentries: []\n")
    with pytest.raises(replay.CorpusError, match="corpus must be one of established, widened"):
        replay.load(tmp_path)


def test_refusals_for_one_reason_group_together() -> None:
    assert replay.cause('date_trunc unit "week" is not allowed in public.visits') == \
        replay.cause("date_trunc unit 'month' is not allowed in public.adult")
    assert replay.cause("count of 12 rows") != replay.cause("a window function")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("tool", TOOLS)
def test_catalog_answered_row_level_refused(outcomes: list[replay.Outcome], tool: str, role: str) -> None:
    failures = []
    for outcome in outcomes:
        if outcome.entry.tool != tool or outcome.role != role:
            continue
        entry = outcome.entry
        if outcome.connection_lost or outcome.sqlstate == "XX000" or "Traceback" in (outcome.message or ""):
            failures.append(f"{entry.id}: the session broke ({outcome.why})")
        elif entry.kind == "catalog" and not outcome.answered:
            failures.append(f"{entry.id}: catalog statement refused ({outcome.why})")
        elif entry.expected(outcome.mode) == "refuse" and (outcome.answered
                                                         or outcome.sqlstate not in replay.REFUSAL_STATES):
            failures.append(f"{entry.id}: {entry.kind} statement not refused as it should be "
                            f"({outcome.why or f'answered, {outcome.rows} rows'})")
        elif entry.expected(outcome.mode) == "refuse" and outcome.rows:
            failures.append(f"{entry.id}: {outcome.rows} rows reached the client before the refusal")
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("role", ROLES)
@pytest.mark.parametrize("tool", sorted({entry.tool for entry in WIDENED}))
def test_widened_statements_are_handled_cleanly(outcomes: list[replay.Outcome], tool: str, role: str) -> None:
    """Answered, or refused with a SQLSTATE and a message that names the reason; never a broken session."""
    failures = []
    for outcome in outcomes:
        if outcome.entry.corpus != "widened" or outcome.entry.tool != tool or outcome.role != role:
            continue
        if outcome.answered:
            continue
        if outcome.connection_lost or not outcome.sqlstate or outcome.sqlstate == "XX000":
            failures.append(f"{outcome.entry.id}: not a clean refusal ({outcome.why}, connection lost: "
                            f"{outcome.connection_lost})")
        elif not (outcome.message or "").strip() or "Traceback" in (outcome.message or ""):
            failures.append(f"{outcome.entry.id}: refused without a message ({outcome.sqlstate})")
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(900)
def test_widened_statements_are_valid_postgresql(direct_outcomes: list[replay.Outcome]) -> None:
    refused = [f"{o.entry.id}: {o.why}" for o in direct_outcomes if not o.answered]
    assert not refused, "\n".join(refused)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("role", ROLES)
def test_aggregates_answered(outcomes: list[replay.Outcome], role: str, capsys: pytest.CaptureFixture[str]) -> None:
    established = [outcome for outcome in outcomes if outcome.entry.corpus == "established"]
    widened = [outcome for outcome in outcomes if outcome.entry.corpus == "widened"]
    with capsys.disabled():
        if role == next(iter(ROLES)):
            print("\n\nBI corpus coverage (tests/bi_corpus), established corpus:\n")
            print(replay.coverage_table(established))
            print("\nWidened corpus (issue 19):\n")
            print(replay.coverage_table(widened))
            print("\nRefusals of the widened corpus, by cause:\n")
            print(replay.causes_table(widened))
        print(f"\nAggregate statements of the established corpus refused to {role} ({ROLES[role]}):\n")
        print(replay.refusals_table([outcome for outcome in established if outcome.role == role]))
    share = replay.aggregate_share(established, role)
    assert share >= TARGET_AGGREGATE_SHARE, f"{role}: {share:.0%} of the aggregate statements answered"
    share = replay.aggregate_share(widened, role)
    assert share >= TARGET_WIDENED_SHARE, f"{role}: {share:.0%} of the widened corpus's aggregates answered"
    unanswered = [f"{o.entry.id}: {o.why}" for o in widened
                  if o.role == role and o.entry.time_series and not o.answered]
    assert not unanswered, "time series refused:\n" + "\n".join(unanswered)
