-- Migration 0040: a point that splits a table's integer unit column in two, for N computed on two cores.
--
-- The suppression SQL of a GROUP BY over rows that are not people counts N (the people of the FROM clause) and the
-- most rows one person has there in one aggregation per person (anonproxy/suppress/one_pass.py, docs/suppression.md
-- "N on two cores"). PostgreSQL 15 finishes such an aggregation in one process. Where the unit is an integer, that
-- SQL counts the people below a point and those at or above it in two branches of one UNION ALL, which PostgreSQL
-- runs side by side (a Parallel Append: one branch per process), and adds them up. Any point gives the same N and
-- the same most (each person is in exactly one branch); a point near the middle of the units gives each branch
-- about half the rows.
--
-- anonproxy.unit_midpoint(relation, unit): the middle of the column's smallest and largest values (two index
-- probes where the column is indexed), 0 for an empty table. A scalar subquery in its place would be an InitPlan,
-- which keeps PostgreSQL 15 from planning the branches in parallel; a function marked PARALLEL SAFE is evaluated
-- where each branch starts its scan. It runs with the caller's rights (the proxy's service role, which reads the
-- table anyway) and writes nothing: PUBLIC keeps EXECUTE.

create function anonproxy.unit_midpoint(relation regclass, unit name) returns bigint
language plpgsql stable parallel safe set search_path = pg_catalog, pg_temp as $$
declare
    middle bigint;
begin
    -- numeric: the sum of two bigints may not fit in one; half of each does.
    execute pg_catalog.format('select (min(%1$I)::numeric / 2 + max(%1$I)::numeric / 2)::bigint from %2$s',
                              unit, relation)
       into middle;
    return coalesce(middle, 0);
end
$$;

comment on function anonproxy.unit_midpoint(regclass, name) is
    'Called by the SQL the proxy runs in suppress mode to count N in two halves: the middle of the smallest and '
    'largest values of an integer unit column (0 for an empty table).';
