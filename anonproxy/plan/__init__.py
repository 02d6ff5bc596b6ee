"""The mode-neutral front end for gated queries.

It takes the one parse of a client's statement (a sqlglot tree) to the shape
the back-ends accept, with pure passes over trees (no I/O, no policy
decisions beyond naming tables):

* :mod:`anonproxy.plan.names` normalises column references (``schema.table.column``
  to the name the FROM clause gives the table);
* :mod:`anonproxy.plan.flatten` inlines derived tables and non-recursive CTEs
  that only filter, project or rename their tables into one SELECT;
* :mod:`anonproxy.plan.outer` recognises the two shapes that stay nested: an
  outer query that post-processes the released rows of an aggregate query,
  and Superset's series limit (a top-N aggregate joined back to its table);
* :mod:`anonproxy.plan.spines` recognises constant relations (time spines:
  ``generate_series`` of constants, VALUES) that such an outer query may read
  beside the released rows;
* :mod:`anonproxy.plan.semi_joins` admits EXISTS and IN subqueries in WHERE
  that are semi-joins on the privacy unit (each person in or out);
* :mod:`anonproxy.plan.shape` runs the passes in order and hands each back-end
  (suppression: :mod:`anonproxy.route.decide`, differential privacy:
  :mod:`anonproxy.dp.plan`) the statement it analyses.

What the result may compute is still decided by the back-ends' analysis
(:func:`anonproxy.plan.analysis.analyze`) on the flattened statement.
"""
