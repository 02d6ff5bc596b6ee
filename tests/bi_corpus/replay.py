"""The BI corpus: loading its files, replaying them through the proxy, and the coverage table.

Each YAML file of this directory holds what one tool sends over the demo
schema (``public.adult``): entries of one kind each —

- ``catalog``: schema browsing, metadata, session setup; must be answered;
- ``aggregate``: a chart's query; must be answered by a gated role;
- ``row-level``: returns per-person rows; must be refused.

An entry is one statement (``sql``) or a sequence sent in order on the same
session (``steps``: a cursor's DECLARE/FETCH/CLOSE, a transaction), in the
tool's protocol: ``simple`` (a Query message, which may hold several
statements) or ``extended`` (Parse/Bind/Describe/Execute of an unnamed
statement, as pgjdbc and Npgsql send it). ``params`` are bound in the
extended protocol, written ``%s`` in the text (a list), or ``%(name)s`` (a
mapping, as SQLAlchemy binds them). ``<<adult_oid>>`` stands for the oid of
``public.adult``, which psql, DBeaver and pgAdmin read first and then put
into their next statements; ``<<database>>`` for the connected database,
which dbt and Lightdash write as the first part of three-part names. ``refused_by_design`` maps a mode to
the documented rule that refuses an aggregate in that mode (min/max in
suppress mode, say): there it must be refused like a row-level statement,
and it does not count among the aggregates to answer. A statement's text is
sent as written, without the line break that ends a YAML block.

A file's ``corpus`` is ``established`` (the default: the corpus the targets
below were met on) or ``widened`` (issue 19: the SQL of tools the established
corpus does not cover, and time series over ``public.visits``, the demo's dated
table, anonproxy/sample_data.py); an entry marked ``time_series: true`` draws a chart over
time.

Used by tests/test_bi_corpus.py and benchmarks/bi_corpus/run.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psycopg
import yaml
from psycopg import pq

CORPUS_DIR = Path(__file__).resolve().parent
KINDS = ("catalog", "aggregate", "row-level")
PROTOCOLS = ("simple", "extended")
CORPORA = ("established", "widened")
# The SQLSTATEs of a refusal that names its reason: insufficient privilege, feature not supported.
REFUSAL_STATES = ("42501", "0A000")
ADULT_OID_QUERY = ("select c.oid from pg_catalog.pg_class c join pg_catalog.pg_namespace n on n.oid = c.relnamespace "
                   "where n.nspname = 'public' and c.relname = 'adult'")


@dataclass(frozen=True)
class Entry:
    tool: str
    id: str
    kind: str
    source: str
    protocol: str
    steps: tuple[str, ...]
    params: tuple[object, ...] | dict[str, object] | None = None
    refused_by_design: tuple[tuple[str, str], ...] = ()  # (mode, the rule that refuses it there)
    corpus: str = "established"
    time_series: bool = False

    def design_refusal(self, mode: str) -> str | None:
        """The rule that refuses this statement in ``mode`` by design, if any."""
        return dict(self.refused_by_design).get(mode)

    def expected(self, mode: str) -> str:
        """What ``mode`` must do with it: "answer" or "refuse"."""
        return "refuse" if self.kind == "row-level" or self.design_refusal(mode) else "answer"


@dataclass(frozen=True)
class Outcome:
    entry: Entry
    role: str
    mode: str
    error: bool  # some step was refused or failed
    rows: int  # data rows received before the first error
    sqlstate: str | None = None
    message: str | None = None
    connection_lost: bool = False

    @property
    def answered(self) -> bool:
        return not self.error and not self.connection_lost

    @property
    def why(self) -> str:
        return f"{self.sqlstate}: {self.message}" if self.error else ""


class CorpusError(ValueError):
    """A corpus file does not follow the format above."""


def load(directory: Path = CORPUS_DIR) -> list[Entry]:
    """Every entry of every ``*.yaml`` file of ``directory``, file by file, in file order."""
    entries: list[Entry] = []
    for path in sorted(directory.glob("*.yaml")):
        document = yaml.safe_load(path.read_text())
        tool, default_protocol = document["tool"], document.get("protocol", "simple")
        corpus = document.get("corpus", "established")
        if corpus not in CORPORA:
            raise CorpusError(f"{path.name}: corpus must be one of {', '.join(CORPORA)}, got {corpus!r}")
        for raw in document["entries"]:
            entries.append(_entry(path.name, tool, default_protocol, corpus, raw))
    ids = [entry.id for entry in entries]
    duplicates = sorted({name for name in ids if ids.count(name) > 1})
    if duplicates:
        raise CorpusError(f"duplicate entry ids: {', '.join(duplicates)}")
    return entries


def _entry(file: str, tool: str, default_protocol: str, corpus: str, raw: dict[str, object]) -> Entry:
    where = f"{file}: entry {raw.get('id')!r}"
    if ("sql" in raw) == ("steps" in raw):
        raise CorpusError(f"{where}: give either sql or steps")
    steps = (raw["sql"],) if "sql" in raw else tuple(raw["steps"])  # type: ignore[arg-type]
    kind, protocol = raw.get("kind"), raw.get("protocol", default_protocol)
    if kind not in KINDS:
        raise CorpusError(f"{where}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if protocol not in PROTOCOLS:
        raise CorpusError(f"{where}: protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    if not raw.get("source"):
        raise CorpusError(f"{where}: say where the statement comes from (source)")
    params = raw.get("params")
    if params is not None and not isinstance(params, (list, dict)):
        raise CorpusError(f"{where}: params must be a list or a mapping")
    by_design = raw.get("refused_by_design") or {}
    if kind != "aggregate" and by_design:
        raise CorpusError(f"{where}: only aggregates can be refused by design")
    return Entry(tool=tool, id=str(raw["id"]), kind=str(kind), source=str(raw["source"]), protocol=str(protocol),
                 steps=tuple(str(step).rstrip("\n") for step in steps),
                 params=tuple(params) if isinstance(params, list) else params,  # type: ignore[arg-type]
                 refused_by_design=tuple(sorted(by_design.items())),  # type: ignore[union-attr]
                 corpus=corpus, time_series=bool(raw.get("time_series")))


class Session:
    """One tool's session as one role: a connection that is reopened if the proxy closes it."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.conn = self._connect()
        row = self.conn.execute(ADULT_OID_QUERY).fetchone()
        assert row is not None, "public.adult is not visible"
        self.adult_oid = str(row[0])
        self.database = self.conn.info.dbname

    def _connect(self) -> psycopg.Connection:
        return psycopg.connect(self.dsn, autocommit=True)

    def close(self) -> None:
        self.conn.close()

    def run(self, entry: Entry, role: str, mode: str) -> Outcome:
        rows = 0
        try:
            for step in entry.steps:
                rows += self._step(entry, self._fill(step))
        except psycopg.Error as error:
            lost = self.conn.closed or self.conn.pgconn.status != pq.ConnStatus.OK
            outcome = Outcome(entry, role, mode, error=True, rows=rows, sqlstate=error.sqlstate,
                              message=error.diag.message_primary or str(error), connection_lost=lost)
        else:
            outcome = Outcome(entry, role, mode, error=False, rows=rows)
        self._settle()
        return outcome

    def _fill(self, text: str) -> str:
        """``text`` with the session's values in place of ``<<adult_oid>>`` and ``<<database>>``."""
        return text.replace("<<adult_oid>>", self.adult_oid).replace("<<database>>", self.database)

    def _params(self, entry: Entry) -> tuple[object, ...] | dict[str, object] | None:
        """The entry's parameters, placeholders filled in (SQLAlchemy binds an oid it read before)."""
        if isinstance(entry.params, dict):
            return {name: self._fill_value(value) for name, value in entry.params.items()}
        return tuple(map(self._fill_value, entry.params)) if entry.params is not None else None

    def _fill_value(self, value: object) -> object:
        return self._fill(value) if isinstance(value, str) else value

    def _step(self, entry: Entry, sql: str) -> int:
        """Send one step in the entry's protocol; the number of data rows it returned."""
        params = self._params(entry)
        with self.conn.cursor() as cursor:
            if entry.protocol == "extended":
                with self.conn.pipeline():  # Parse/Bind/Describe/Execute of the unnamed statement, then Sync
                    cursor.execute(sql, params)
                return len(cursor.fetchall()) if cursor.description is not None else 0
            cursor.execute(sql, params)  # a Query message (extended if there are parameters)
            rows = 0
            while True:
                if cursor.description is not None:
                    rows += len(cursor.fetchall())
                if not cursor.nextset():
                    return rows

    def _settle(self) -> None:
        """Leave the session idle, as a tool does between two charts: reopen it, or end a transaction left open."""
        if self.conn.closed or self.conn.pgconn.status != pq.ConnStatus.OK:
            self.conn.close()
            self.conn = self._connect()
        elif self.conn.info.transaction_status != pq.TransactionStatus.IDLE:
            self.conn.execute("rollback")


def replay(entries: Iterable[Entry], dsn_of_role: dict[str, str], mode_of_role: dict[str, str]) -> list[Outcome]:
    """Each tool's entries in order on one session per tool and role."""
    by_tool: dict[str, list[Entry]] = {}
    for entry in entries:
        by_tool.setdefault(entry.tool, []).append(entry)
    outcomes: list[Outcome] = []
    for role, dsn in dsn_of_role.items():
        for tool_entries in by_tool.values():
            session = Session(dsn)
            try:
                outcomes.extend(session.run(entry, role, mode_of_role[role]) for entry in tool_entries)
            finally:
                session.close()
    return outcomes


def _count(outcomes: Sequence[Outcome], kind: str) -> tuple[int, int]:
    """(answered, total) for catalog statements and the aggregates to answer; (refused, total) for row-level
    statements and aggregates refused by design ("by design")."""
    if kind == "by design":
        chosen = [o for o in outcomes if o.entry.kind == "aggregate" and o.entry.design_refusal(o.mode)]
    elif kind == "aggregate":
        chosen = [o for o in outcomes if o.entry.kind == "aggregate" and not o.entry.design_refusal(o.mode)]
    else:
        chosen = [o for o in outcomes if o.entry.kind == kind]
    good = [o for o in chosen if o.answered == (o.entry.expected(o.mode) == "answer")]
    return len(good), len(chosen)


def coverage_table(outcomes: Sequence[Outcome]) -> str:
    """Markdown: per tool and role, answered catalog and aggregate statements, refused row-level ones."""
    tools = list(dict.fromkeys(outcome.entry.tool for outcome in outcomes))
    roles = list(dict.fromkeys((outcome.role, outcome.mode) for outcome in outcomes))
    lines = ["| tool | role (mode) | catalog answered | aggregates answered | of which empty "
             "| refused by design | row-level refused |",
             "|---|---|---|---|---|---|---|"]
    for role, mode in roles:
        for tool in [*tools, "all tools"]:
            chosen = [o for o in outcomes if o.role == role and (tool == "all tools" or o.entry.tool == tool)]
            cells = {}
            for kind in ("catalog", "aggregate", "by design", "row-level"):
                good, total = _count(chosen, kind)
                share = f" ({100 * good / total:.0f} %)" if kind == "aggregate" and total else ""
                cells[kind] = f"{good}/{total}{share}" if total else "–"
            empty = sum(1 for o in chosen if o.entry.kind == "aggregate" and o.answered and o.rows == 0)
            name = f"**{tool}**" if tool == "all tools" else tool
            lines.append(f"| {name} | {role} ({mode}) | {cells['catalog']} | {cells['aggregate']} | {empty} "
                         f"| {cells['by design']} | {cells['row-level']} |")
    return "\n".join(lines)


def refusals_table(outcomes: Sequence[Outcome]) -> str:
    """Markdown: the aggregates a role should have been answered but was refused, with SQLSTATE and message."""
    lines = ["| entry | role | SQLSTATE | message |", "|---|---|---|---|"]
    for outcome in outcomes:
        if outcome.entry.kind == "aggregate" and outcome.entry.expected(outcome.mode) == "answer" \
                and not outcome.answered:
            message = (outcome.message or "").replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {outcome.entry.id} | {outcome.role} | {outcome.sqlstate} | {message} |")
    return "\n".join(lines)


# What varies between two refusals for the same cause: quoted names and values, numbers, qualified names.
_SPECIFICS = (re.compile(r'"[^"]*"|\'[^\']*\'|`[^`]*`'), re.compile(r"\b\d+(\.\d+)?\b"),
              re.compile(r"\b\w+\.\w+(\.\w+)?\b"))


def cause(message: str) -> str:
    """A refusal's message with its specifics elided (…): refusals for the same reason read the same."""
    text = message.replace("\n", " ")
    for pattern in _SPECIFICS:
        text = pattern.sub("…", text)
    return text


def _refused(outcomes: Sequence[Outcome]) -> list[Outcome]:
    """The statements to answer that were refused."""
    return [o for o in outcomes if o.entry.expected(o.mode) == "answer" and not o.answered]


def causes_table(outcomes: Sequence[Outcome]) -> str:
    """Markdown: the refusals of statements to answer grouped by SQLSTATE and cause, most frequent first, with the
    count per role and the entries."""
    roles = list(dict.fromkeys((outcome.role, outcome.mode) for outcome in outcomes))
    groups: dict[tuple[str, str], list[Outcome]] = {}
    for outcome in _refused(outcomes):
        groups.setdefault((outcome.sqlstate or "–", cause(outcome.message or "")), []).append(outcome)
    lines = ["| SQLSTATE | cause (names and values elided: …) | "
             + " | ".join(f"{role} ({mode})" for role, mode in roles) + " | entries |",
             "|---|---|" + "---|" * len(roles) + "---|"]
    for (sqlstate, text), chosen in sorted(groups.items(), key=lambda item: (-len(item[1]), item[0])):
        counts = " | ".join(str(sum(1 for o in chosen if o.role == role)) for role, _ in roles)
        ids = ", ".join(dict.fromkeys(o.entry.id for o in chosen))
        lines.append(f"| {sqlstate} | {text.replace('|', chr(92) + '|')} | {counts} | {ids} |")
    return "\n".join(lines)


def aggregate_share(outcomes: Sequence[Outcome], role: str) -> float:
    """The share of the aggregates to answer that ``role`` was answered."""
    good, total = _count([outcome for outcome in outcomes if outcome.role == role], "aggregate")
    return good / total if total else 0.0
