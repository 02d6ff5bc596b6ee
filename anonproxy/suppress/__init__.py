"""The suppression back-end: exact aggregates without any group of fewer than k people.

:mod:`anonproxy.suppress.rewrite` turns the analysis of a statement
(:class:`anonproxy.plan.analysis.AnalyticQuery`) into the SQL the service
runs, with its report for the NOTICE: the one-pass shape
(:mod:`anonproxy.suppress.one_pass`), or the simple and per-person shapes;
:mod:`anonproxy.suppress.rules` writes the rules as SQL conditions and
:mod:`anonproxy.suppress.complementary` complementary suppression's CTEs;
:mod:`anonproxy.suppress.nested`
does it for the nested shapes (an outer query over an aggregate query,
Superset's series limit); :mod:`anonproxy.suppress.explain` writes
EXPLAIN (ANONPROXY). See docs/suppression.md.
"""
