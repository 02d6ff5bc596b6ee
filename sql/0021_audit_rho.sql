-- Migration 0021: the audit trail records a dp answer's zCDP cost (rho, delta_add) beside its (epsilon, delta).
--
-- Since migration 0019 every charge carries four numbers, each a valid guarantee of that one answer: (epsilon,
-- delta) for basic composition, and rho-zCDP up to delta_add for zCDP accounting. A budget under zcdp adds up rho
-- and delta_add, so a data-protection officer reconciling the trail with such a budget needs those. Rows written
-- before this migration have them null; so do rows of statements the proxy did not charge.

alter table anonproxy.audit_trail
    add column rho numeric,  -- dp: the rho this statement was charged (0: a cached or public-domain answer)
    add column delta_add numeric;  -- dp: the delta zCDP accounting adds for it (partition selection)

create or replace function anonproxy.audit_write(records jsonb) returns bigint
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    written bigint;
begin
    perform anonproxy.check_ledger_caller('write the audit trail');
    insert into anonproxy.audit_trail (at, login, database, client_addr, client_port, session_id, mode, statement,
                                       decision, sqlstate, message, relations, epsilon, delta, rho, delta_add,
                                       rows_sent)
    select pg_catalog.to_timestamp(r.at), r.login, r.database, r.client_addr, r.client_port, r.session_id, r.mode,
           r.statement, r.decision, r.sqlstate, r.message, coalesce(r.relations, '{}'), r.epsilon, r.delta, r.rho,
           r.delta_add, r.rows_sent
      from pg_catalog.jsonb_to_recordset(records) as r(at double precision, login name, database name,
                                                        client_addr inet, client_port integer, session_id text,
                                                        mode text, statement text, decision text, sqlstate text,
                                                        message text, relations text[], epsilon numeric,
                                                        delta numeric, rho numeric, delta_add numeric,
                                                        rows_sent bigint);
    get diagnostics written = row_count;
    return written;
end
$$;
