"""What the gate does with a statement of an anonymized role.

:func:`anonproxy.route.decide.decide` returns, for the text of a Query or
Parse message, one of the decisions of :mod:`anonproxy.route.decision`:
pass it, relay a rewrite of it, run the suppression SQL of
:mod:`anonproxy.suppress`, answer it with differential privacy
(:mod:`anonproxy.dp`), intercept it, or refuse it. The modules here
split and parse statements (statements, classify), name tables (names),
check what a gated statement reads and computes (relations, expressions),
allow commands (commands), answer privilege probes (probes) and check the
final SQL (final_sql). :mod:`anonproxy.route.reports` is the gate's one
hook into what a mode says about its answers. Nothing is imported here, so that the front end and
the back-ends can import these modules without a cycle.
"""
