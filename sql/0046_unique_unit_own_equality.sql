-- Migration 0046: a unit column is unique only under its own equality.
--
-- anonproxy._unit_is_unique (sql/0023) took any unique index of the unit column alone for "each row is one person".
-- An index under another collation, or another operator class, than the column's own compares units otherwise than
-- the column does: a text unit of a nondeterministic collation (where 'r1' = 'R1') with a unique index under "C"
-- holds 'r1' and 'R1', one person for GROUP BY and count(DISTINCT), two rows that the suppression SQL counted as
-- two people (a kind of k - 1 people written two ways each was released: tests/test_attacks_round17.py). Now the
-- index must use the column's collation and its type's default operator class, as a primary key does; the policy
-- reads the same fact (anonproxy/policy/store.py, unique_units).

create or replace function anonproxy._unit_is_unique(relation regclass, unit text) returns boolean
language sql stable parallel safe set search_path = pg_catalog, pg_temp as $$
    select exists (select
                     from pg_catalog.pg_index i
                     join pg_catalog.pg_attribute a on a.attrelid = i.indrelid and a.attnum = i.indkey[0]
                     join pg_catalog.pg_class c on c.oid = i.indrelid and not c.relhassubclass
                     join pg_catalog.pg_opclass o on o.oid = i.indclass[0] and o.opcdefault
                    where i.indrelid = relation and a.attname = unit and a.attnotnull
                      and i.indisunique and i.indisvalid and i.indislive and i.indnkeyatts = 1
                      and i.indpred is null and i.indexprs is null and i.indcollation[0] = a.attcollation)
$$;
