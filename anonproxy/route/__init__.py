"""The router: what the gate does with a statement of an anonymized role.

:func:`anonproxy.route.decide.decide` returns, for the text of a Query or
Parse message, one of the decisions of :mod:`anonproxy.route.decision`:
pass it, relay a rewrite of it, run the suppression SQL of
:mod:`anonproxy.suppress`, answer it with differential privacy
(:mod:`anonproxy.dp`), intercept it, or refuse it. ``commands`` allows the
session and transaction commands, ``probes`` answers privilege probes,
``discovery`` answers a statement that returns no row whatever the data
(LIMIT 0, WHERE false) with its columns, and
``reports`` is the gate's one hook into what a mode says about its answers. The
front end it drives (splitting, parsing, naming tables, checking what a
statement reads and computes, the final SQL check) is :mod:`anonproxy.plan`;
the router sits above it and above the back-ends, and nothing below imports it.
"""
