-- Migration 0013: the longest a statement of an anonymized role may run, per mode.
--
-- The proxy runs the statements of roles in mode suppress (rewritten, on its
-- service connection) and dp (contribution-bounded, for a noisy answer) on its
-- own connections. Each runs with statement_timeout set to the client's own
-- statement_timeout, capped by max_statement_time of the role's mode: a
-- statement past it is cancelled with SQLSTATE 57014 (docs/policy.md). The
-- cap is part of the policy: changing it bumps the policy version like any
-- other change, and proxies follow it without a restart.

create table anonproxy.statement_limits (
    mode text primary key constraint timed_mode check (mode in ('suppress', 'dp')),
    max_statement_time interval not null
        constraint positive_time check (max_statement_time > interval '0')
        -- statement_timeout takes whole milliseconds below about 24 days
        constraint time_in_range check (max_statement_time >= interval '1 millisecond'
                                        and max_statement_time <= interval '24 days')
);
insert into anonproxy.statement_limits (mode, max_statement_time)
values ('suppress', interval '30 seconds'), ('dp', interval '30 seconds');
comment on table anonproxy.statement_limits is
    'Per anonymized mode: the longest one statement may run (the client''s statement_timeout may be shorter).';
grant select on anonproxy.statement_limits to public;

create trigger policy_changed after insert or update or delete or truncate on anonproxy.statement_limits
    for each statement execute function anonproxy.policy_changed();

create function anonproxy.set_max_statement_time(mode text, max_statement_time interval) returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
begin
    if mode is null or mode not in ('suppress', 'dp') then
        raise exception using errcode = '22023',
            message = format('max_statement_time is set per mode suppress or dp, got %L', mode),
            hint = 'Direct roles follow their own statement_timeout; denied roles run nothing.';
    end if;
    if max_statement_time is null or max_statement_time < interval '1 millisecond'
       or max_statement_time > interval '24 days' then
        raise exception using errcode = '22023',
            message = format('max_statement_time must be between 1 millisecond and 24 days, got %s',
                             coalesce(max_statement_time::text, 'null'));
    end if;
    insert into anonproxy.statement_limits as l (mode, max_statement_time)
    values (set_max_statement_time.mode, set_max_statement_time.max_statement_time)
    on conflict on constraint statement_limits_pkey do update set max_statement_time = excluded.max_statement_time
     where l.max_statement_time is distinct from excluded.max_statement_time;
end
$$;

revoke execute on function anonproxy.set_max_statement_time(text, interval) from public;
