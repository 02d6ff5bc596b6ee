-- Migration 0024: the audit trail records each execution with the values bound to it, and a digest of a statement
-- whose text it keeps only in part.
--
-- Since this migration the proxy writes a row before anything of a statement's answer leaves (one row per execution:
-- a Query, or a Bind of a prepared statement), so a prepared `... where id <> $1` run for three ids is three rows,
-- each with its value. `parameters` holds them as text (binary values in hex, `\x...`; NULL for SQL NULL).
-- `statement_sha256` is the hex SHA-256 of the client's whole text (UTF-8) when `statement` holds only its first
-- part (a text longer than 256 kB), else null. Text the database cannot store (a NUL byte) is written as U+2400.

alter table anonproxy.audit_trail
    add column parameters text[],  -- the values bound to a prepared statement's execution, as text
    add column statement_sha256 text;  -- the whole text's digest when statement holds only its first part

create or replace function anonproxy.audit_write(records jsonb) returns bigint
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    written bigint;
begin
    perform anonproxy.check_ledger_caller('write the audit trail');
    insert into anonproxy.audit_trail (at, login, database, client_addr, client_port, session_id, mode, statement,
                                       decision, sqlstate, message, relations, epsilon, delta, rho, delta_add,
                                       rows_sent, parameters, statement_sha256)
    select pg_catalog.to_timestamp(r.at), r.login, r.database, r.client_addr, r.client_port, r.session_id, r.mode,
           r.statement, r.decision, r.sqlstate, r.message, coalesce(r.relations, '{}'), r.epsilon, r.delta, r.rho,
           r.delta_add, r.rows_sent, r.parameters, r.statement_sha256
      from pg_catalog.jsonb_to_recordset(records) as r(at double precision, login name, database name,
                                                        client_addr inet, client_port integer, session_id text,
                                                        mode text, statement text, decision text, sqlstate text,
                                                        message text, relations text[], epsilon numeric,
                                                        delta numeric, rho numeric, delta_add numeric,
                                                        rows_sent bigint, parameters text[],
                                                        statement_sha256 text);
    get diagnostics written = row_count;
    return written;
end
$$;
