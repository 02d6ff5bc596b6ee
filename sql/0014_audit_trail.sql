-- Migration 0014: the audit trail -- who asked what through the proxy, and what left the database.
--
-- One row per statement of a role in an anonymized mode (suppress, dp), written
-- by the proxy in batches (anonproxy/proxy/audit_trail.py, docs/audit-trail.md):
-- when, which login from which address, the statement's text, the proxy's
-- decision (answered, refused with its SQLSTATE, passed to the client's own
-- connection, intercepted), the relations its answer read and the (epsilon,
-- delta) it was charged.
--
-- Who may do what:
--   * the owner (the role that installed the schema) reads the table; nobody
--     else holds any privilege on it, PUBLIC included;
--   * the proxy writes only through anonproxy.audit_write(), SECURITY DEFINER,
--     which checks its caller as the ledger does (anonproxy.check_ledger_caller:
--     the service role named in anonproxy.settings, or the owner). The service
--     role thus appends rows but cannot read, change or delete one: whoever
--     takes over the proxy's login cannot look back at what others asked nor
--     erase a trace;
--   * rows older than the retention (anonproxy.audit_settings, 90 days unless
--     the owner calls set_audit_retention) are deleted by audit_purge(), which
--     the proxy calls when it starts and then hourly, and the owner may call.
--
-- Every function pins search_path = pg_catalog, pg_temp and qualifies every name.

create table anonproxy.audit_settings (
    singleton boolean primary key default true constraint one_row check (singleton),
    retention interval not null default interval '90 days'
        constraint retention_positive check (retention > interval '0')
);
insert into anonproxy.audit_settings default values;
comment on table anonproxy.audit_settings is
    'retention: audit_purge() deletes the audit trail''s rows older than this.';

create table anonproxy.audit_trail (
    id bigint generated always as identity primary key,
    at timestamptz not null,  -- when the proxy decided (or, for dp, answered)
    login name,  -- the role the client logged in as (null only in a 'lost' row, as are database, session, mode)
    database name,
    client_addr inet,  -- null: the client's address was unknown (a Unix socket)
    client_port integer,
    session_id text,  -- the proxy process and its session number: the statements of one connection
    mode text,  -- the role's mode when the statement was decided: suppress, dp or deny
    statement text not null,
    decision text not null
        constraint decision_kind check (decision in ('answered', 'refused', 'passed', 'intercepted', 'lost')),
    sqlstate text,  -- of a refusal
    message text,  -- of a refusal
    relations text[] not null default '{}',  -- the tables the answer read (policy names)
    epsilon numeric,  -- dp: what this statement was charged (0: a cached or public-domain answer)
    delta numeric,
    rows_sent bigint,  -- dp: the rows of the answer
    written_by name not null default session_user,
    written_at timestamptz not null default pg_catalog.clock_timestamp(),
    constraint refusal_has_sqlstate check ((decision = 'refused') = (sqlstate is not null)),
    constraint who_is_known check (decision = 'lost'
                                   or (login, database, session_id, mode) is not null)
);
comment on table anonproxy.audit_trail is
    'One row per statement of a role in suppress or dp mode, written by the proxy through audit_write(). '
    'decision lost: a row standing for records the proxy had to drop (its buffer was full); statement says how '
    'many. Readable by its owner only; rows older than audit_settings.retention are deleted by audit_purge().';

create index audit_trail_at on anonproxy.audit_trail (at);
create index audit_trail_login_at on anonproxy.audit_trail (login, at);

revoke all on anonproxy.audit_trail, anonproxy.audit_settings from public;

-- A record is never edited: only appended, and deleted when it is older than the retention.
create function anonproxy.audit_trail_is_not_edited() returns trigger
language plpgsql set search_path = pg_catalog, pg_temp as $$
begin
    raise exception using errcode = '42501', message = 'rows of the audit trail are never updated',
        hint = 'records are only appended, and deleted by anonproxy.audit_purge() after the retention';
end
$$;

create trigger not_edited before update on anonproxy.audit_trail
    for each row execute function anonproxy.audit_trail_is_not_edited();


-- Append a batch of records: a JSON array of objects, one per statement (keys as the columns, at in seconds since
-- the epoch). Returns the number of rows written.
create function anonproxy.audit_write(records jsonb) returns bigint
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    written bigint;
begin
    perform anonproxy.check_ledger_caller('write the audit trail');
    insert into anonproxy.audit_trail (at, login, database, client_addr, client_port, session_id, mode, statement,
                                       decision, sqlstate, message, relations, epsilon, delta, rows_sent)
    select pg_catalog.to_timestamp(r.at), r.login, r.database, r.client_addr, r.client_port, r.session_id, r.mode,
           r.statement, r.decision, r.sqlstate, r.message, coalesce(r.relations, '{}'), r.epsilon, r.delta,
           r.rows_sent
      from pg_catalog.jsonb_to_recordset(records) as r(at double precision, login name, database name,
                                                        client_addr inet, client_port integer, session_id text,
                                                        mode text, statement text, decision text, sqlstate text,
                                                        message text, relations text[], epsilon numeric,
                                                        delta numeric, rows_sent bigint);
    get diagnostics written = row_count;
    return written;
end
$$;

-- Delete the rows older than the retention; returns how many.
create function anonproxy.audit_purge() returns bigint
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    deleted bigint;
begin
    perform anonproxy.check_ledger_caller('purge the audit trail');
    delete from anonproxy.audit_trail
     where at < pg_catalog.clock_timestamp() - (select s.retention from anonproxy.audit_settings s);
    get diagnostics deleted = row_count;
    return deleted;
end
$$;

-- The owner's setting: how long records are kept.
create function anonproxy.set_audit_retention(retention interval) returns void
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
begin
    if retention is null or retention <= interval '0' then
        raise exception using errcode = '22023',
            message = format('the audit retention must be a positive interval, got %s', coalesce(retention::text,
                                                                                                  'null')),
            hint = 'for example: select anonproxy.set_audit_retention(''90 days'')';
    end if;
    update anonproxy.audit_settings set retention = set_audit_retention.retention;
end
$$;

-- audit_write and audit_purge keep PUBLIC's EXECUTE and check their caller (so they follow set_service_role()
-- without a GRANT); the retention is the owner's to set, and the trigger function is nobody's to call.
revoke execute on function anonproxy.set_audit_retention(interval), anonproxy.audit_trail_is_not_edited()
    from public;
