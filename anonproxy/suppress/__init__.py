"""The suppression back-end: exact aggregates without any group of fewer than k people.

:mod:`anonproxy.suppress.rewrite` turns the analysis of a statement
(:class:`anonproxy.plan.analysis.AnalyticQuery`) into the SQL the service
runs, with its report for the NOTICE; :mod:`anonproxy.suppress.nested`
does it for the nested shapes (an outer query over an aggregate query,
Superset's series limit); :mod:`anonproxy.suppress.explain` writes
EXPLAIN (ANONPROXY). See docs/suppression.md.
"""
