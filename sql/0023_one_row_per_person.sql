-- Migration 0023: the catalog fact that suppress mode's one-pass SQL rests on, checked when the SQL runs.
--
-- Where the unit column of a protected table is unique and not null (a primary key, or NOT NULL with a unique
-- index of that column alone), each row is one person, and the SQL the proxy runs for a role in suppress mode
-- counts people with count(*) (anonproxy/suppress/rows.py, docs/suppression.md "The SQL it runs"). The proxy reads
-- that fact with the policy; an index dropped since, or the NOT NULL, or a child table added (FROM t reads its
-- children too, which the index does not cover), would let one person's several rows count as several people
-- until the proxy reads the policy again. So that SQL calls anonproxy.one_row_per_person() first, once per
-- statement: it returns true while the fact holds and raises an error otherwise, before any row is returned.
--
-- It reads only the catalog and writes nothing: PUBLIC keeps EXECUTE (the proxy's service role calls it).

create function anonproxy.one_row_per_person(relation text, unit text) returns boolean
language plpgsql stable set search_path = pg_catalog, pg_temp as $$
begin
    if exists (select
                 from pg_catalog.pg_index i
                 join pg_catalog.pg_attribute a on a.attrelid = i.indrelid and a.attnum = i.indkey[0]
                 join pg_catalog.pg_class c on c.oid = i.indrelid and not c.relhassubclass
                where i.indrelid = relation::regclass and a.attname = unit and a.attnotnull
                  and i.indisunique and i.indisvalid and i.indislive and i.indnkeyatts = 1
                  and i.indpred is null and i.indexprs is null) then
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
