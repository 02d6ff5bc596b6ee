-- Migration 0040: a point that splits a table's integer unit column in two, for N computed on two cores.
--
-- The suppression SQL of a GROUP BY over rows that are not people counts N (the people of the FROM clause) and the
-- most rows one person has there in one aggregation per person (anonproxy/suppress/universe.py, docs/suppression.md
-- "N on two cores"). PostgreSQL 15 finishes such an aggregation in one process. Where the unit is an integer, that
-- SQL counts the people below a point and those at or above it in two branches of one UNION ALL, which PostgreSQL
-- runs side by side (a Parallel Append: one branch per process), and adds them up. Any point gives the same N and
-- the same most (each person is in exactly one branch); a point near the middle of the units gives each branch
-- about half the rows.
--
-- anonproxy.unit_midpoint(relation, unit): where a valid btree index (not partial) leads with the column, the middle
-- of its smallest and largest values (two index probes; 0 for an empty table); without such an index, the smallest
-- bigint, so that one branch reads every row and the other none, rather than two scans of the table to find them.
--
-- It is marked IMMUTABLE although it reads the table, so that PostgreSQL evaluates it once, while it plans the
-- statement, and the branches compare with a constant: STABLE, it would be called again for every row a branch
-- filters (a table scan per row where the column has no index), and as a scalar subquery (an InitPlan) it keeps
-- PostgreSQL 15 from planning the branches in parallel. A value kept too long (a plan reused after the table
-- changed) only moves the point: the answer does not depend on it. It runs with the caller's rights (the proxy's
-- service role, which reads the table anyway) and writes nothing: PUBLIC keeps EXECUTE.

create function anonproxy.unit_midpoint(relation regclass, unit name) returns bigint
language plpgsql immutable parallel safe set search_path = pg_catalog, pg_temp as $$
declare
    middle bigint;
begin
    if not exists (select
                     from pg_catalog.pg_index i
                     join pg_catalog.pg_class c on c.oid = i.indexrelid
                     join pg_catalog.pg_am m on m.oid = c.relam and m.amname = 'btree'
                     join pg_catalog.pg_attribute a on a.attrelid = i.indrelid and a.attnum = i.indkey[0]
                    where i.indrelid = relation and a.attname = unit and i.indisvalid and i.indpred is null) then
        return -9223372036854775808;
    end if;
    -- numeric: the sum of two bigints may not fit in one; half of each does.
    execute pg_catalog.format('select (min(%1$I)::numeric / 2 + max(%1$I)::numeric / 2)::bigint from %2$s',
                              unit, relation)
       into middle;
    return coalesce(middle, 0);
end
$$;

comment on function anonproxy.unit_midpoint(regclass, name) is
    'Called by the SQL the proxy runs in suppress mode to count N in two halves: the middle of the smallest and '
    'largest values of an indexed integer unit column (0 for an empty table; the smallest bigint without an index).';
