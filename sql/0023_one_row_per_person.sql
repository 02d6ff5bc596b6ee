-- Migration 0023: whether each row of a table is one person, read from the catalog, where the SQL runs.
--
-- Where a unit column is unique and not null (a primary key, or NOT NULL with a unique index of that column alone,
-- not partial, not on an expression) and the table has no child tables (FROM t reads its children too, which the
-- index does not cover), each row is one person: a count of distinct units is a count of rows, which PostgreSQL
-- computes without sorting.
--
-- * anonproxy.one_row_per_person(relation, unit): the SQL the proxy runs for a role in suppress mode rests on
--   that fact where the proxy read it with the policy (anonproxy/suppress/one_pass.py, docs/suppression.md "The
--   one-pass shape"); an index dropped since, or the NOT NULL, or a child table added, would let one person's
--   several rows count as several people until the proxy reads the policy again. So that SQL calls this function
--   once per statement, before its scan: it returns true while the fact holds and raises an error otherwise,
--   before any row is returned. It reads only the catalog and writes nothing: PUBLIC keeps EXECUTE (the proxy's
--   service role calls it).
-- * anonproxy.k_anonymity(rel, qi, unit) counts rows instead of distinct units when the fact holds for rel.
--
-- Both functions that the suppression SQL calls are marked for parallel query: a function left PARALLEL UNSAFE
-- (the default) anywhere in a statement keeps PostgreSQL from planning any part of it in parallel, so the one
-- aggregation pass over a large table ran on one core while the client's own statement, relayed, ran on several.
-- one_row_per_person reads only the catalog: PARALLEL SAFE. suppression_report (migration 0022) raises an INFO
-- message for the proxy: PARALLEL RESTRICTED, evaluated by the leader, which sends its messages in order.

create function anonproxy._unit_is_unique(relation regclass, unit text) returns boolean
language sql stable parallel safe set search_path = pg_catalog, pg_temp as $$
    select exists (select
                     from pg_catalog.pg_index i
                     join pg_catalog.pg_attribute a on a.attrelid = i.indrelid and a.attnum = i.indkey[0]
                     join pg_catalog.pg_class c on c.oid = i.indrelid and not c.relhassubclass
                    where i.indrelid = relation and a.attname = unit and a.attnotnull
                      and i.indisunique and i.indisvalid and i.indislive and i.indnkeyatts = 1
                      and i.indpred is null and i.indexprs is null)
$$;

create function anonproxy.one_row_per_person(relation text, unit text) returns boolean
language plpgsql stable parallel safe set search_path = pg_catalog, pg_temp as $$
begin
    if anonproxy._unit_is_unique(relation::regclass, unit) then
        return true;
    end if;
    raise exception using errcode = 'object_not_in_prerequisite_state',
        message = pg_catalog.format('anonproxy: %s.%s is no longer unique and not null in the catalog, as it was '
                                    'when the policy was read', relation, unit),
        hint = 'Ask the DBA to apply the policy again (any change to it makes every proxy read the catalog again).';
end
$$;

comment on function anonproxy.one_row_per_person(text, text) is
    'Called by the SQL the proxy runs in suppress mode where each row is one person: true while the unit column is '
    'unique, not null and without child tables; raises object_not_in_prerequisite_state otherwise.';

create or replace function anonproxy.k_anonymity(rel regclass, qi text[], unit text default null) returns bigint
language plpgsql stable set search_path = pg_catalog, pg_temp set jit = off as $$
declare
    qi_list text := anonproxy._verify_column_list(rel, qi, 'the quasi-identifiers');
    counted text := 'count(*)';
    k bigint;
begin
    if unit is not null then
        counted := anonproxy._verify_column_list(rel, array[unit], 'the unit');
        -- A unique, not-null unit: each row is one unit, and counting rows needs no sort per class.
        counted := case when anonproxy._unit_is_unique(rel, unit) then 'count(*)'
                        else format('count(distinct %s)', counted) end;
    end if;
    execute format('select min(n) from (select %s as n from %s group by %s) ec', counted, rel, qi_list) into k;
    return k;
end $$;

alter function anonproxy.suppression_report(integer, text, text[], bigint, bigint, text, boolean, boolean)
    parallel restricted;
