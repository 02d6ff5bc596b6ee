"""SQL for the service, generated from checked trees (never cut from the client's text).

Every piece of a gated statement that the service runs (select items,
WHERE, GROUP BY, HAVING, ORDER BY, LIMIT, the FROM clause with its joins,
aggregate arguments) is rendered here from the node the analysis checked, so
what PostgreSQL runs is exactly what was proved safe: a word the parser
dropped, a comment, or a spelling PostgreSQL reads otherwise cannot reach
the service.

Rendering is sqlglot's PostgreSQL generator, function names in lower case, with three changes:

* comments are never rendered (a client's comment is text, and ``--`` in
  one could end a rendered ``/* */``);
* ``date_part(...)`` stays ``date_part``: sqlglot reads it and ``extract``
  into one node, but PostgreSQL gives them different result types
  (``double precision`` and ``numeric``) and column names. The classifier's
  parser (:data:`anonproxy.plan.statements.DIALECT`) marks the node;
* a column reference dp mode's no-error proof marked (:mod:`anonproxy.plan.clamp`)
  is rendered clamped into its declared bounds, wherever it is rendered.

Output column names are kept by the callers: a select item PostgreSQL would
have named from the client's spelling gets that name as an explicit alias
(:func:`anonproxy.plan.names.output_name`).
"""

from __future__ import annotations

from sqlglot import exp
from sqlglot.dialects.postgres import Postgres
from sqlglot.generators.postgres import PostgresGenerator

from anonproxy.plan.clamp import clamp_of, clamped
from anonproxy.plan.statements import DATE_PART


class _Postgres(Postgres):
    class Generator(PostgresGenerator):  # Postgres.Generator, named so that a type checker sees a class
        def extract_sql(self, expression: exp.Extract) -> str:
            if expression.meta.get(DATE_PART):
                field = expression.this
                name = field.name if isinstance(field, (exp.Var, exp.Literal, exp.Identifier)) else self.sql(field)
                return f"date_part({exp.Literal.string(name).sql(dialect=Postgres)}, {self.sql(expression, 'expression')})"
            return super().extract_sql(expression)

        def column_sql(self, expression: exp.Column) -> str:
            if clamp_of(expression) is not None:
                return self.sql(clamped(expression))
            return super().column_sql(expression)


class _Written(_Postgres):
    class Generator(_Postgres.Generator):
        def column_sql(self, expression: exp.Column) -> str:
            return PostgresGenerator.column_sql(self, expression)  # as the client wrote it: no clamp


_DIALECT = _Postgres()
_WRITTEN = _Written()


def sql(node: exp.Expression) -> str:
    """``node`` as PostgreSQL SQL, without comments, function names in lower case (as people write them: they
    appear in messages, EXPLAIN and notices)."""
    # copy=False: sqlglot's generator copies the tree first in case a dialect's transforms rewrite it; PostgreSQL's
    # leave the nodes the analysis admits as they are (tests/test_render_fidelity.py checks), and the copy was a
    # fifth of a first-sight decision.
    rendered: str = _DIALECT.generate(node, comments=False, normalize_functions="lower", copy=False)
    return rendered


def written(node: exp.Expression) -> str:
    """``node`` as :func:`sql` renders it, but a clamped column as the bare column the client wrote: for messages."""
    rendered: str = _WRITTEN.generate(node, comments=False, normalize_functions="lower", copy=False)
    return rendered
