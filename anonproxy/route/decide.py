"""``decide``: one decision for the whole text of a Query or Parse message.

Deterministic and stateless: no I/O, no clock; the proxy caches the result
by (text, role, policy version). A statement is parsed once: a dp
statement's tree goes, in the same call, to the dp planner
(:func:`anonproxy.dp.plan.measure`), whose measurement the Noisy decision
carries as a value for the proxy to price.

Per statement: a query (SELECT / WITH / VALUES / TABLE) that reaches no
protected or linked table passes (published relations, already anonymized,
among them); one that does is refused if it also reads a published relation,
else answered with its columns and no row when it returns no row whatever the
data (a column discovery: ``LIMIT 0``, ``WHERE false``;
:mod:`anonproxy.route.discovery`), else rewritten (mode ``suppress``) or handed to differential privacy (mode
``dp``: Noisy, measured by :mod:`anonproxy.dp.plan`), or, when a ``$n`` stands where the plan needs a constant,
decided with a representative value there and handed to the gate to decide at each Bind (AtBind, see
:mod:`anonproxy.plan.bind_values`); commands go through
the allowlist of :mod:`anonproxy.route.commands`; ``DECLARE … CURSOR FOR query`` is
DeclareCursor with its query decided as above, FETCH / MOVE / CLOSE are
FetchCursor / CloseCursor (the gate knows which cursors the proxy holds).
Then per message: all statements pass -> Pass; statements that pass, some
with privilege probes redirected (:mod:`anonproxy.route.probes`) ->
Relayed; exactly one statement, rewritten -> Rewrite (or Noisy); one
``SHOW anonproxy.*`` -> Intercept; statements that pass mixed with cursor
statements -> Script (run one by one); any other mixture -> Reject.
"""

from __future__ import annotations

import re

from sqlglot import exp
from sqlglot.tokenizer_core import TokenType

from anonproxy.dp.bound_times import column_types, time_columns
from anonproxy.dp.plan import Packed, measure
from anonproxy.plan.analysis import analyze
from anonproxy.plan.bind_values import Slot, representative_text, slots
from anonproxy.plan.final_sql import verify
from anonproxy.plan.outer import Outer
from anonproxy.plan.refusals import (
    FEATURE_NOT_SUPPORTED,
    Refusal,
    Reject,
    forbidden,
    unsupported,
)
from anonproxy.plan.shape import Nested, prepare
from anonproxy.plan.statements import (
    PARSE_HINT,
    Statement,
    closing_paren,
    parse_statement,
    split,
)
from anonproxy.plan.tables import PolicyIndex, fold, identifier
from anonproxy.policy.model import Policy, RolePolicy, split_policy_name
from anonproxy.route.commands import (
    classify_command,
    cursor_command,
    declare_cursor,
    explained_query,
    is_query,
    refuse_statement,
)
from anonproxy.route.decision import (
    AtBind,
    CloseCursor,
    Control,
    Decision,
    DeclareCursor,
    ExplainDP,
    ExplainSuppress,
    FetchCursor,
    Noisy,
    Pass,
    Relayed,
    Rewrite,
    Script,
    TransactionControl,
)
from anonproxy.route.discovery import discovery
from anonproxy.route.probes import redirect_probes
from anonproxy.suppress.explain import explain_suppression
from anonproxy.suppress.nested import suppressed
from anonproxy.suppress.rewrite import reported, rewrite

# Functions that run SQL given as text, open connections, or act as another role: never passed through.
SQL_RUNNING_FUNCTIONS = frozenset({
    "query_to_xml", "query_to_xml_and_xmlschema", "query_to_xmlschema", "table_to_xml",
    "table_to_xml_and_xmlschema", "table_to_xmlschema", "schema_to_xml", "schema_to_xml_and_xmlschema",
    "schema_to_xmlschema", "database_to_xml", "database_to_xml_and_xmlschema", "database_to_xmlschema",
    "cursor_to_xml", "cursor_to_xmlschema", "ts_stat", "dblink", "dblink_exec", "dblink_open", "dblink_fetch",
    "dblink_send_query", "dblink_get_result", "dblink_connect", "dblink_connect_u",
})  # fmt: skip
# set_config() of these names is SET ROLE / SET SESSION AUTHORIZATION / a lexing change in disguise.
GUARDED_SETTINGS = frozenset({"role", "session_authorization", "client_encoding", "standard_conforming_strings"})
# Extended statistics views: not needed by BI tools, and CVE-2024-4317 showed they can leak column values.
STATISTICS_RELATIONS = frozenset({"pg_stats_ext", "pg_stats_ext_exprs", "pg_statistic_ext_data", "pg_statistic"})

_WRITES = (exp.DML, exp.DDL, exp.Command, exp.Into, exp.Lock, exp.Copy, exp.Merge, exp.TruncateTable, exp.Alter)


def decide(sql: str, role: RolePolicy, policy: Policy) -> Decision:
    """What the proxy does with ``sql`` (a whole Query or Parse message) for ``role``."""
    explained = explained_query(sql)
    if explained is not None:
        return _explain_anonproxy(explained, role, policy)
    if role.mode == "direct":
        return Pass()
    try:
        return _decide(sql, role, policy)
    except Refusal as refusal:
        return refusal.reject
    except RecursionError:
        return Reject(FEATURE_NOT_SUPPORTED, "the statement is nested too deeply to analyze", PARSE_HINT)


def _explain_anonproxy(query: str, role: RolePolicy, policy: Policy) -> Decision:
    """``EXPLAIN (ANONPROXY) query``: the proxy describes how it would answer a query, without running it."""
    if role.mode not in ("dp", "suppress"):
        return Reject(FEATURE_NOT_SUPPORTED, "EXPLAIN (ANONPROXY) explains queries of roles in suppress or dp mode",
                      f'Role "{role.role}" is in {role.mode} mode.')
    inner = decide(query, role, policy)
    if isinstance(inner, AtBind):
        return Reject(FEATURE_NOT_SUPPORTED, f"EXPLAIN (ANONPROXY) needs the constant that parameter "
                      f"${inner.slots[0].number} stands for", "Write the value in the statement explained.")
    if isinstance(inner, Noisy):
        return ExplainDP(inner.sql, inner.plan)
    if isinstance(inner, Rewrite) and inner.discovery:
        return ExplainSuppress(("column discovery: the statement returns no row whatever the data; answered with its "
                                "columns and no row, nothing charged", "SQL the service would run:", f"  {inner.sql}",
                                "nothing was run"))
    if isinstance(inner, Rewrite):
        try:  # decide() rewrote it: one statement, which takes the same shape and analyses as it did there
            statement = next(iter(split(query)))
            index = PolicyIndex(policy)
            shape = prepare(statement, parse_statement(statement), index)
            single = shape.inner if isinstance(shape, Nested) else shape
            analysis = analyze(single.statement, single.tree, index, role.suppression)
        except Refusal as refusal:
            return refusal.reject
        lines = explain_suppression(analysis, role, inner.runs)
        if isinstance(shape, Nested):
            first = ("an outer query over the aggregate query below: it reads only the rows that query releases"
                     if isinstance(shape.post, Outer) else "a series limit: the top groups' query below is asked "
                     "first; the chart's query then reads only the groups it releases, under the same rules")
            if isinstance(shape.post, Outer) and shape.post.combines:
                first = (f"a set operation of the released rows of {1 + len(shape.post.more)} aggregate queries, "
                         "each suppressed on its own as if sent alone; the first one below")
            elif isinstance(shape.post, Outer) and shape.post.more:
                first += (f", and those of the {len(shape.post.more)} other aggregate queries it joins, each "
                          "suppressed on its own as if sent alone")
            lines = (first, *lines)
        return ExplainSuppress(tuple(lines))
    if isinstance(inner, Reject):
        return inner
    return Reject(FEATURE_NOT_SUPPORTED, "EXPLAIN (ANONPROXY) explains aggregate queries over protected tables",
                  "For other statements, use plain EXPLAIN.")


def _decide(sql: str, role: RolePolicy, policy: Policy) -> Decision:
    if role.mode not in ("suppress", "dp"):
        raise forbidden(f"role {role.role} may not query through anonproxy (mode {role.mode})",
                        "Ask the DBA for a role in suppress mode.")
    index = PolicyIndex(policy)
    statements = split(sql)
    decisions = [_statement(statement, role, index) for statement in statements]
    if len(decisions) == 1:
        return decisions[0]
    if not decisions or all(isinstance(d, Pass) for d in decisions):
        # (A DEALLOCATE among several statements is left to PostgreSQL alone: it may fail with the others.
        # Transaction statements among them end every rewritten portal the proxy keeps: it may end more than
        # PostgreSQL does, never fewer.)
        passes = [d for d in decisions if isinstance(d, Pass)]
        ends = TransactionControl(Control.END) if any(d.transaction for d in passes) else None
        return Pass(resets_session=any(d.resets_session for d in passes), transaction=ends)
    if all(isinstance(d, (Pass, Relayed)) for d in decisions):
        # Each statement as it would run alone: the client's own text, or the one generated for its probes.
        return Relayed(";\n".join(d.sql if isinstance(d, Relayed) else s.text
                                   for d, s in zip(decisions, statements, strict=True)))
    if any(isinstance(d, _CURSOR_DECISIONS) for d in decisions) and all(
            isinstance(d, (Pass, Relayed, *_CURSOR_DECISIONS)) for d in decisions):
        # psqlODBC's "BEGIN;declare ... cursor ... for ...;fetch 100 in ...": the proxy runs it statement by
        # statement; a statement with privilege probes runs as its generated text.
        return Script(tuple(_script_part(statement, decision)
                            for statement, decision in zip(statements, decisions, strict=True)))
    raise unsupported(
        "an aggregate query over protected tables, or SHOW anonproxy.*, must be sent on its own, not together "
        "with other statements",
        "Send it as a single statement; other statements can follow in their own messages.",
    )


_CURSOR_DECISIONS = (DeclareCursor, FetchCursor, CloseCursor)


def _script_part(statement: Statement, decision: Decision) -> tuple[str, Pass | DeclareCursor | FetchCursor
                                                                   | CloseCursor]:
    """One statement of a Script: its own text and decision, or the text generated for its privilege probes."""
    if isinstance(decision, Relayed):
        return decision.sql, Pass()
    assert isinstance(decision, (Pass, *_CURSOR_DECISIONS))
    return statement.text, decision


def _statement(statement: Statement, role: RolePolicy, index: PolicyIndex) -> Decision:
    if statement.word(0) == "EXPLAIN":
        return _explain(statement, role, index)
    if statement.word(0) == "DECLARE":
        return _declare(statement, role, index)
    if statement.word(0) in ("FETCH", "MOVE", "CLOSE"):
        return cursor_command(statement)
    if not is_query(statement):
        return classify_command(statement, role.mode)
    tree = parse_statement(statement)
    if not _touches_protected(statement, tree, index):
        _check_passable(statement, tree, role, index)
        return _relayed(tree, role, index)
    _refuse_published(tree, index.policy)
    found_columns = discovery(statement, tree, index)
    if found_columns is not None:  # it returns no row whatever the data: its columns, nothing run, nothing charged
        _check_passable(statement, tree, role, index)
        return found_columns
    # In dp mode HAVING is evaluated on the noisy values in the proxy, and a WHERE bound on a time column narrows
    # the public time domain: their parameters are read as constants too.
    found = _slots(statement, tree, role, index)
    if found:
        return _at_bind(statement, tree, found, role, index)
    if role.mode == "dp":  # measured here, from this one parse; priced when the role's cost is known
        return Noisy(statement.text, Packed.of(measure(statement, tree, role, index.policy)))
    clock = _reads_clock(tree)
    shape = prepare(statement, tree, index)  # derived tables flattened, names normalised
    # PostgreSQL's own parser reads the final SQL again, and says which tables it reads.
    if isinstance(shape, Nested):
        sql = suppressed(shape, index, role.suppression)
        return Rewrite(sql, relations=verify(sql, index.policy, role.role), reads_clock=clock)
    analysis = analyze(shape.statement, shape.tree, index, role.suppression)
    if analysis.outer is not None:  # post-aggregate expressions: computed over the released values
        sql = rewrite(analysis, role.suppression)
        return Rewrite(sql, relations=verify(sql, index.policy, role.role), reads_clock=clock)
    # What runs: the answer and, next to it, what suppression withheld. It holds every CTE and clause of the
    # answer alone, so reading it checks both.
    report = reported(analysis, role.suppression)
    return Rewrite(rewrite(analysis, role.suppression), report, verify(report, index.policy, role.role),
                   reads_clock=clock)


def _slots(statement: Statement, tree: exp.Expression, role: RolePolicy, index: PolicyIndex) -> tuple[Slot, ...]:
    """The parameters of ``tree`` decided at Bind (most statements have no $n: the token scan spares them the
    walk of the tree)."""
    if not any(token.token_type == TokenType.PARAMETER for token in statement.tokens):
        return ()
    if role.mode != "dp":
        return slots(tree)
    return slots(tree, having=True, times=time_columns(tree, index), columns=column_types(tree, index))


# The words of a date or time constant that PostgreSQL reads with the clock: a prepared statement keeps the value
# of its Parse ('now' stays the time it was parsed at).
_CLOCK_WORDS = frozenset({"now", "today", "tomorrow", "yesterday"})


def _reads_clock(tree: exp.Expression) -> bool:
    """Whether a string constant of ``tree`` may be read with the clock: it holds one of those words, or is written
    with Unicode escapes (not read here)."""
    for node in tree.find_all(exp.Literal, exp.ByteString, exp.RawString, exp.UnicodeString, exp.National):
        if isinstance(node, exp.UnicodeString):
            return True
        if isinstance(node, exp.Literal) and not node.is_string:
            continue
        if _CLOCK_WORDS & set(re.findall(r"[a-z]+", node.name.lower())):
            return True
    return False


def _at_bind(statement: Statement, tree: exp.Expression, found: tuple[Slot, ...], role: RolePolicy,
             index: PolicyIndex) -> AtBind:
    """A statement with parameters where constants are needed: decided at each Bind with their values; here with
    a representative value in each place, so that what does not depend on the values is refused at Parse."""
    (representative,) = split(representative_text(tree, found))
    described = _statement(representative, role, index)
    assert isinstance(described, (Rewrite, Noisy))  # it reads the protected tables the statement reads
    return AtBind(statement.text, found, described, representative.text)


def _declare(statement: Statement, role: RolePolicy, index: PolicyIndex) -> DeclareCursor:
    """DECLARE ... CURSOR FOR query: the query is decided exactly like a plain statement."""
    syntax = declare_cursor(statement)
    inner = Statement(statement.source, statement.tokens[syntax.query:])
    if not is_query(inner):
        raise refuse_statement(inner, role.mode)
    query = _statement(inner, role, index)
    if isinstance(query, AtBind):
        raise unsupported(f"parameter ${query.slots[0].number} stands where the query of a cursor needs a constant",
                          "Write the constant in DECLARE ... CURSOR FOR, or run the query as a prepared statement.")
    if isinstance(query, Relayed):
        # A cursor over a catalog query runs the client's own text: its privilege probes get PostgreSQL's answer.
        query = Pass()
    assert isinstance(query, (Pass, Rewrite, Noisy))
    return DeclareCursor(syntax.name, query, syntax.binary, syntax.scroll, syntax.hold)


def _relayed(tree: exp.Expression, role: RolePolicy, index: PolicyIndex) -> Pass | Relayed:
    """A passed statement, with its privilege probes answered as the proxy answers queries (probes.py).

    The generated text must parse back to the rewritten tree, or the client's own text runs (PostgreSQL's own
    answer to the probes); it passes the checks its original passed.
    """
    sql = redirect_probes(tree)
    if sql is None:
        return Pass()
    statements = split(sql)
    if len(statements) != 1:
        return Pass()
    try:
        again = parse_statement(statements[0])
    except Refusal:
        return Pass()
    if again != tree:
        return Pass()
    if _touches_protected(statements[0], again, index):
        raise forbidden("the rewritten privilege probes would read a protected table", PARSE_HINT)
    _check_passable(statements[0], again, role, index)
    return Relayed(sql)


def _explain(statement: Statement, role: RolePolicy, index: PolicyIndex) -> Decision:
    position = 1
    options: list[str | None] = []
    tokens = statement.tokens
    if position < len(tokens) and tokens[position].token_type == TokenType.L_PAREN:
        close = closing_paren(tokens, position)
        options = [statement.word(i) for i in range(position + 1, close)]
        position = close + 1
    else:
        while statement.word(position) in ("ANALYZE", "ANALYSE", "VERBOSE"):
            options.append(statement.word(position))
            position += 1
    if "ANALYZE" in options or "ANALYSE" in options:
        raise forbidden(f"EXPLAIN ANALYZE is not allowed for roles in {role.mode} mode: it runs the statement and "
                        "reports exact row counts", "Plain EXPLAIN of a query over tables that are not protected.")
    if position >= len(tokens):
        raise unsupported("EXPLAIN needs a statement", PARSE_HINT)
    inner = Statement(statement.source, tokens[position:])
    if not is_query(inner):
        raise refuse_statement(inner, role.mode)
    tree = parse_statement(inner)
    if _touches_protected(inner, tree, index):
        raise forbidden("EXPLAIN of a query over protected tables is not allowed: plans show row estimates taken "
                        "from the table's statistics", "Run the aggregate query itself.")
    _check_passable(inner, tree, role, index)
    return Pass()


def _touches_protected(statement: Statement, tree: exp.Expression, index: PolicyIndex) -> bool:
    tables = list(tree.find_all(exp.Table))
    if any(index.touches_protected(table) for table in tables):
        return True
    # Defence in depth: a protected table's name anywhere outside strings and comments (as a column, an
    # alias, a CTE, in a construct sqlglot models loosely) is not passed through. Schema-qualified names of
    # other tables (other_schema.adult) are the only exception.
    elsewhere = {table.this.meta.get("start") for table in tables
                 if isinstance(table.this, exp.Identifier) and table.args.get("db") is not None}
    for position, token in enumerate(statement.tokens):
        name = _name(statement, position)
        if name is not None and index.is_protected_name(name) and token.start not in elsewhere:
            raise forbidden(
                f"the statement mentions {name!r}, the name of a protected table, in a way the proxy cannot analyze",
                "Query a protected table only in the FROM clause of an aggregate SELECT; do not reuse its name.")
    return False


def _refuse_published(tree: exp.Expression, policy: Policy) -> None:
    """Refuse a query over protected tables that also reads a published relation (an anonymized release).

    A release holds rows about the same people as the protected tables, with no declared key to their privacy
    unit, so suppression could not count them and DP could not bound what one person contributes. An
    unqualified name counts when any schema holds a published relation of that name (see ``_touches_protected``).
    """
    published = {split_policy_name(name) for name in policy.published}
    bare = {name for _, name in published}
    for table in tree.find_all(exp.Table):
        name = identifier(table.this if isinstance(table.this, exp.Identifier) else None)
        schema = identifier(table.args.get("db"))
        if name is not None and (name in bare if schema is None else (schema, name) in published):
            raise forbidden(
                f"the statement reads published relation {name if schema is None else f'{schema}.{name}'} together "
                "with protected tables; an anonymized release cannot be combined with protected data",
                "Query the published relation on its own (row by row), and the protected tables in statements of "
                "their own.")


def _check_passable(statement: Statement, tree: exp.Expression, role: RolePolicy, index: PolicyIndex) -> None:
    """A query that reads no protected table: refuse writes and functions that run SQL or switch roles."""
    for node in tree.walk():
        if isinstance(node, _WRITES):
            what = ("SELECT INTO" if isinstance(node, exp.Into) else
                    "FOR UPDATE/SHARE" if isinstance(node, exp.Lock) else type(node).__name__.upper())
            raise forbidden(f"{what} is not allowed for roles in {role.mode} mode", "Only read-only queries pass.")
        if (isinstance(node, exp.Table) and isinstance(node.this, exp.Identifier)
                and (relation := fold(node.this.this, bool(node.this.args.get("quoted")))) in STATISTICS_RELATIONS):
            raise forbidden(f"{relation} is not available to roles in {role.mode} mode: it holds statistics of "
                            "protected columns, their values among them",
                            "pg_stats (which shows the columns you may read), information_schema and the other "
                            "catalogs are available.")
    tokens = statement.tokens
    for position in range(len(tokens) - 1):
        if tokens[position + 1].token_type != TokenType.L_PAREN:
            continue
        name = _name(statement, position)
        if name in SQL_RUNNING_FUNCTIONS:
            raise forbidden(f"{name}() is not allowed for roles in {role.mode} mode: it runs SQL given as text",
                            "Send the query itself.")
        if name == "set_config":
            argument = tokens[position + 2] if position + 2 < len(tokens) else None
            # The name must be one string token and nothing more: PostgreSQL joins 'a'<newline>'b' into one
            # string, and 'a' || 'b' or a cast is computed, so the first token alone would not be the name.
            whole = position + 3 < len(tokens) and tokens[position + 3].token_type == TokenType.COMMA
            setting = argument.text.lower() if argument is not None and argument.token_type == TokenType.STRING \
                and whole else None
            if setting is None or setting in GUARDED_SETTINGS or setting.startswith("anonproxy."):
                raise forbidden(f"set_config({statement.raw(position + 2) if argument else ''}, ...) is not allowed "
                                f"for roles in {role.mode} mode", "set_config() of ordinary settings only.")


def _name(statement: Statement, position: int) -> str | None:
    """The token as a folded identifier, when it is a bare word or a quoted name."""
    token = statement.tokens[position]
    if token.token_type == TokenType.IDENTIFIER:
        return fold(token.text, True)
    word = statement.raw(position)
    return fold(word, False) if statement.word(position) is not None else None
