-- Migration 0012: one read for a question already answered (docs/ledger.md, "lookup_answer").
--
-- The proxy's path for a statement it has seen: the role's per-query cost on the
-- domain (to know which plan, hence which fingerprint, is asked), the data version
-- of the tables and the answer cached for that fingerprint on that version -- in
-- one statement, so one snapshot and one round trip. Stable: every read inside
-- sees the calling statement's snapshot, so the answer found is for the version
-- returned; inside a REPEATABLE READ transaction that is the transaction's.

create function anonproxy.lookup_answer(role_name name, domain text, tables text[], fingerprint text,
                                        out epsilon_per_query numeric, out delta_per_query numeric,
                                        out data_version text, out answer bytea)
language plpgsql stable security definer set search_path = pg_catalog, pg_temp as $$
begin
    -- the service role and the owner only: the data version is theirs to read (data_version() says so too)
    perform anonproxy.check_ledger_caller(format('look up the answers of role "%s"', role_name));
    select b.epsilon_per_query, b.delta_per_query into epsilon_per_query, delta_per_query
      from anonproxy.budgets b
     where b.role_name = lookup_answer.role_name and b.domain = lookup_answer.domain;
    if not found then
        perform anonproxy.no_budget(role_name, domain);
    end if;
    data_version := anonproxy.data_version(tables);
    if fingerprint is not null then
        answer := anonproxy.cached_answer(role_name, fingerprint, data_version);
    end if;
end
$$;

-- Like the ledger's other entry points, it keeps PUBLIC's EXECUTE and checks its caller.
