-- Migration 0022: suppress mode's report also says how many groups complementary suppression withheld.
--
-- Since this migration a GROUP BY answer in suppress mode withholds, besides the groups that fail the rules alone
-- (primary suppression), the smallest released groups needed for the withheld groups to pass the rules together
-- (complementary suppression), so that no total minus the released rows singles out fewer than k people. The
-- proxy's NOTICE says how many of each; the report function gains the argument `complementary` (null when the
-- number is not safe to tell, like `groups`). It still reads nothing and writes nothing: its output is its
-- arguments.

drop function anonproxy.suppression_report(integer, text, text[], bigint, text, boolean, boolean);

create function anonproxy.suppression_report(k integer, relation text, labels text[], groups bigint,
                                             complementary bigint, total text, rest boolean, null_group boolean)
returns boolean
language plpgsql volatile set search_path = pg_catalog, pg_temp as $$
begin
    raise info using message = 'anonproxy.suppression_report',
        detail = pg_catalog.jsonb_build_object('k', k, 'relation', relation, 'labels', labels, 'groups', groups,
                                               'complementary', complementary, 'total', total, 'rest', rest,
                                               'null_group', null_group)::text;
    return true;
end
$$;

comment on function anonproxy.suppression_report(integer, text, text[], bigint, bigint, text, boolean, boolean) is
    'Called by the SQL the proxy runs in suppress mode: raises INFO anonproxy.suppression_report with its '
    'arguments as JSON, which the proxy turns into a NOTICE. Reads and writes nothing.';
