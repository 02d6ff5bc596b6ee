-- Migration 0016: how suppress mode tells the proxy what it withheld.
--
-- The SQL the proxy runs for a role in suppress mode (anonproxy/rewrite/suppress.py, reported()) calls
-- anonproxy.suppression_report() once per answer, before its first row, with figures computed next to the answer:
-- k, the protected relation, the labels of the grouping columns, how many groups were withheld (only when that
-- count is safe to release, else null), whether a total without GROUP BY was withheld and by which rule, whether
-- the suppressed-rest row was released, and whether a released group has NULL in every grouping column too.
--
-- The function raises them as one INFO message whose DETAIL is a JSON object. INFO, because it reaches the client
-- whatever client_min_messages says; the client here is the proxy, which reads the message, never forwards it,
-- and sends a NOTICE in its own words instead (docs/suppression.md, "What suppression says").
--
-- It reads nothing and writes nothing: its output is its arguments. So PUBLIC keeps EXECUTE (the proxy's service
-- role calls it; anyone else only learns what they passed in).

create function anonproxy.suppression_report(k integer, relation text, labels text[], groups bigint, total text,
                                             rest boolean, null_group boolean) returns boolean
language plpgsql volatile set search_path = pg_catalog, pg_temp as $$
begin
    raise info using message = 'anonproxy.suppression_report',
        detail = pg_catalog.jsonb_build_object('k', k, 'relation', relation, 'labels', labels, 'groups', groups,
                                               'total', total, 'rest', rest, 'null_group', null_group)::text;
    return true;
end
$$;

comment on function anonproxy.suppression_report(integer, text, text[], bigint, text, boolean, boolean) is
    'Called by the SQL the proxy runs in suppress mode: raises INFO anonproxy.suppression_report with its '
    'arguments as JSON, which the proxy turns into a NOTICE. Reads and writes nothing.';
