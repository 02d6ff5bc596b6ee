-- Migration 0003: privacy budgets, the ledger that charges them, and the cache of answers already paid for.
--
-- Differential-privacy mode (docs/ledger.md). A role in mode dp spends a budget
-- (epsilon, delta) per privacy-unit domain; a domain is a protected table, named
-- as in anonproxy.protected_tables ('public.adult'). A query over a linked table
-- spends the budget of the protected table it links to.
--
--   budgets         per (role, domain): total epsilon and delta, an optional
--                   refresh period (a sliding window), default cost of a query
--   shared_budgets  per domain, optional: a cap on what all roles together spend
--                   (analysts who collude pool their answers)
--   budget_ledger   append-only: one row per charge
--   answer_cache    the answer to each query a role paid for, by fingerprint and
--                   data version: asking again is free and gets the same answer
--   data_changes    per-table change counters behind anonproxy.data_version()
--
-- The proxy calls anonproxy.charge() on its service connection, in a transaction
-- of its own, and sends the first row of an answer only after that transaction
-- has committed. A crash between the commit and the answer loses an answer that
-- was paid for (over-count); no answer leaves before its charge is durable, so
-- nothing is ever under-counted.
--
-- Budgets are policy: PUBLIC may read them, their changes bump
-- anonproxy.policy_version, and only the owner (or whom it delegates to) may
-- edit them with the functions below. The ledger, the cache and the counters are
-- private: the functions that use them are SECURITY DEFINER and check who calls
-- (anonproxy.check_ledger_caller): the service role named in anonproxy.settings,
-- the owner, and for reading its own budget or answers the role itself. The check
-- is made at each call against the settings, so it follows set_service_role()
-- and needs no GRANT to a role that may not exist yet at install time.
--
-- Arithmetic is numeric (exact): 0.1 + 0.2 = 0.3, so a budget that allows
-- exactly n charges allows n, not n - 1.
--
-- Every function runs with search_path = pg_catalog, pg_temp and qualifies every
-- name it uses.


-- Budgets ----------------------------------------------------------------------

-- Comparisons with 'Infinity' also reject NaN, which PostgreSQL sorts above every number.
create table anonproxy.budgets (
    role_name name not null,
    domain text not null,
    epsilon numeric not null
        constraint epsilon_positive check (epsilon > 0 and epsilon < 'Infinity'),
    delta numeric not null default 0
        constraint delta_probability check (delta >= 0 and delta < 1),
    refresh_period interval
        constraint refresh_period_positive check (refresh_period > interval '0'),
    epsilon_per_query numeric
        constraint epsilon_per_query_range check (epsilon_per_query > 0 and epsilon_per_query <= epsilon),
    delta_per_query numeric
        constraint delta_per_query_range check (delta_per_query >= 0 and delta_per_query <= delta),
    primary key (role_name, domain)
);
comment on table anonproxy.budgets is
    'Privacy budget of a role on a domain (a protected table). With refresh_period, only charges made less than '
    'refresh_period ago count (a sliding window); without, every charge counts forever. A role without a budget '
    'on a domain may not query it in dp mode.';

create table anonproxy.shared_budgets (
    domain text primary key,
    epsilon numeric not null
        constraint epsilon_positive check (epsilon > 0 and epsilon < 'Infinity'),
    delta numeric not null default 0
        constraint delta_probability check (delta >= 0 and delta < 1),
    refresh_period interval
        constraint refresh_period_positive check (refresh_period > interval '0')
);
comment on table anonproxy.shared_budgets is
    'Optional cap on what all roles together may spend on a domain, against analysts who pool their answers.';

grant select on anonproxy.budgets, anonproxy.shared_budgets to public;

create trigger policy_changed after insert or update or delete or truncate on anonproxy.budgets
    for each statement execute function anonproxy.policy_changed();
create trigger policy_changed after insert or update or delete or truncate on anonproxy.shared_budgets
    for each statement execute function anonproxy.policy_changed();


-- The ledger -------------------------------------------------------------------

create table anonproxy.budget_ledger (
    id bigint generated always as identity primary key,
    role_name name not null,
    domain text not null,
    epsilon numeric not null constraint epsilon_not_negative check (epsilon >= 0 and epsilon < 'Infinity'),
    delta numeric not null constraint delta_probability check (delta >= 0 and delta < 1),
    fingerprint text not null,
    charged_at timestamptz not null default pg_catalog.clock_timestamp(),
    charged_by name not null default session_user  -- the login that charged: the proxy's service role
);
comment on table anonproxy.budget_ledger is
    'Append-only: one row per charge, written by anonproxy.charge(). Readable by its owner only.';

-- What counts for a role's budget, and for a domain's shared cap, read from the index alone.
create index budget_ledger_role_domain on anonproxy.budget_ledger (role_name, domain, charged_at)
    include (epsilon, delta);
create index budget_ledger_domain on anonproxy.budget_ledger (domain, charged_at) include (epsilon, delta);

create function anonproxy.ledger_is_append_only() returns trigger
language plpgsql set search_path = pg_catalog, pg_temp as $$
begin
    raise exception using errcode = '42501',
        message = format('the privacy-budget ledger is append-only: %s is not allowed', lower(tg_op)),
        hint = 'a charge is never taken back; answers already sent stay spent';
end
$$;

create trigger append_only before update or delete on anonproxy.budget_ledger
    for each row execute function anonproxy.ledger_is_append_only();
create trigger append_only_truncate before truncate on anonproxy.budget_ledger
    for each statement execute function anonproxy.ledger_is_append_only();

revoke all on anonproxy.budget_ledger from public;


-- Answers already paid for --------------------------------------------------------

create table anonproxy.answer_cache (
    role_name name not null,
    fingerprint text not null,
    data_version text not null,
    answer bytea not null,
    created_at timestamptz not null default pg_catalog.clock_timestamp(),
    primary key (role_name, fingerprint, data_version)
);
comment on table anonproxy.answer_cache is
    'The released answer to each query a role paid for; the same query on the same data is answered from here, '
    'free, with the same noise. Readable by its owner only.';

revoke all on anonproxy.answer_cache from public;

-- One row per (relation, backend) that changed it: a transaction that writes a
-- tracked relation adds 1 to the row of its own backend, once. Keyed by backend so
-- that concurrent writers never wait for each other's row lock; sum(changes) over
-- a relation counts the committed transactions that changed it.
create table anonproxy.data_changes (
    relid oid not null,
    backend integer not null,
    changes bigint not null,
    changed_in xid8 not null,  -- the transaction that last added 1
    primary key (relid, backend)
);
comment on table anonproxy.data_changes is
    'Change counters of the tables whose data version anonproxy.data_version() reports.';

revoke all on anonproxy.data_changes from public;


-- The remaining budget -------------------------------------------------------------

create type anonproxy.budget_remaining as (
    role_name name,
    domain text,
    epsilon numeric,            -- what the role may still spend: the lesser of the two remainders below
    delta numeric,
    role_epsilon numeric,       -- remainder of the role's own budget
    role_delta numeric,
    shared_epsilon numeric,     -- remainder of the domain's shared cap, for all roles together; null: no cap
    shared_delta numeric,
    epsilon_budget numeric,     -- the role's budget, as configured
    delta_budget numeric,
    refresh_period interval,
    epsilon_per_query numeric,  -- the default cost of one query; null: the proxy's default
    delta_per_query numeric
);

-- Who may use the ledger. Called by the SECURITY DEFINER functions below, where
-- current_user is their owner and session_user the login that called them (a
-- non-superuser cannot change session_user). Allowed: members of the service
-- role, members of the owner, and -- where for_role is given -- that role itself.
create function anonproxy.check_ledger_caller(action text, for_role name default null) returns void
language plpgsql stable set search_path = pg_catalog, pg_temp as $$
declare
    service name := (select s.service_role from anonproxy.settings s);
begin
    if pg_catalog.pg_has_role(session_user, current_user, 'MEMBER')
       or (exists (select from pg_catalog.pg_roles r where r.rolname = service)
           and pg_catalog.pg_has_role(session_user, service, 'MEMBER'))
       or session_user = for_role then
        return;
    end if;
    raise exception using errcode = '42501',
        message = format('role "%s" may not %s', session_user, action),
        hint = format('the proxy does this on its service connection, as role "%s"', service);
end
$$;

-- Budget state at time as_of. Volatile on purpose: when charge() calls it after
-- locking the budget rows, each statement here takes a new snapshot, which sees
-- every charge committed by whoever held the locks before.
create function anonproxy.budget_state(budget anonproxy.budgets, cap anonproxy.shared_budgets, as_of timestamptz)
returns anonproxy.budget_remaining
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    result anonproxy.budget_remaining;
    spent_epsilon numeric;
    spent_delta numeric;
begin
    select coalesce(sum(l.epsilon), 0), coalesce(sum(l.delta), 0) into spent_epsilon, spent_delta
      from anonproxy.budget_ledger l
     where l.role_name = budget.role_name and l.domain = budget.domain
       and (budget.refresh_period is null or l.charged_at > as_of - budget.refresh_period);
    result.role_name := budget.role_name;
    result.domain := budget.domain;
    result.role_epsilon := greatest(budget.epsilon - spent_epsilon, 0);
    result.role_delta := greatest(budget.delta - spent_delta, 0);
    if cap.domain is not null then
        select coalesce(sum(l.epsilon), 0), coalesce(sum(l.delta), 0) into spent_epsilon, spent_delta
          from anonproxy.budget_ledger l
         where l.domain = cap.domain
           and (cap.refresh_period is null or l.charged_at > as_of - cap.refresh_period);
        result.shared_epsilon := greatest(cap.epsilon - spent_epsilon, 0);
        result.shared_delta := greatest(cap.delta - spent_delta, 0);
    end if;
    result.epsilon := least(result.role_epsilon, result.shared_epsilon);  -- least() ignores nulls
    result.delta := least(result.role_delta, result.shared_delta);
    result.epsilon_budget := budget.epsilon;
    result.delta_budget := budget.delta;
    result.refresh_period := budget.refresh_period;
    result.epsilon_per_query := budget.epsilon_per_query;
    result.delta_per_query := budget.delta_per_query;
    return result;
end
$$;

-- Fail closed: a role may spend only what it was given.
create function anonproxy.no_budget(role_name name, domain text) returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
begin
    raise exception using errcode = '42501', schema = 'anonproxy', table = 'budgets',
        message = format('role "%s" has no privacy budget on %s', role_name, domain),
        hint = format('the policy owner gives one with: select anonproxy.set_budget(%L, %L, <epsilon>, <delta>)',
                      role_name, domain);
end
$$;

create function anonproxy.remaining_budget(role_name name, domain text) returns anonproxy.budget_remaining
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    budget anonproxy.budgets;
    cap anonproxy.shared_budgets;
begin
    perform anonproxy.check_ledger_caller(format('read the privacy budget of role "%s"', role_name), role_name);
    select b.* into budget from anonproxy.budgets b
     where b.role_name = remaining_budget.role_name and b.domain = remaining_budget.domain;
    if not found then
        perform anonproxy.no_budget(role_name, domain);
    end if;
    select s.* into cap from anonproxy.shared_budgets s where s.domain = remaining_budget.domain;
    return anonproxy.budget_state(budget, cap, pg_catalog.clock_timestamp());
end
$$;

-- Every budget of a role, by domain (SHOW anonproxy.budget).
create function anonproxy.remaining_budgets(role_name name) returns setof anonproxy.budget_remaining
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    as_of timestamptz := pg_catalog.clock_timestamp();
begin
    perform anonproxy.check_ledger_caller(format('read the privacy budget of role "%s"', role_name), role_name);
    return query
        select r.*
          from anonproxy.budgets b left join anonproxy.shared_budgets s on s.domain = b.domain
         cross join lateral anonproxy.budget_state(b, s, as_of) r
         where b.role_name = remaining_budgets.role_name
         order by b.domain;
end
$$;


-- Charging -----------------------------------------------------------------------

-- Charge (epsilon, delta) to role_name's budget on domain, or refuse.
--
-- In the caller's transaction, which must be READ COMMITTED and should hold
-- nothing else: lock the role's budget row, then the domain's shared cap row
-- (always in this order, so two charges never deadlock), sum what counts with a
-- snapshot taken after the locks, then insert the charge or raise 53400. The
-- locks are held until the transaction ends, so concurrent charges of a role (or,
-- with a shared cap, of any role) on a domain happen one after the other and
-- each sees every charge committed before it. Returns what remains after it.
create function anonproxy.charge(role_name name, domain text, epsilon numeric, delta numeric, fingerprint text)
returns anonproxy.budget_remaining
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    budget anonproxy.budgets;
    cap anonproxy.shared_budgets;
    as_of timestamptz;
    result anonproxy.budget_remaining;
    by_role boolean;
    limit_detail text;
begin
    perform anonproxy.check_ledger_caller('charge a privacy budget');
    if role_name is null or domain is null or epsilon is null or delta is null or fingerprint is null then
        raise exception using errcode = '22004', message = 'role_name, domain, epsilon, delta and fingerprint '
            'of a charge must not be null';
    end if;
    if not (epsilon >= 0 and epsilon < 'Infinity') then
        raise exception using errcode = '22023',
            message = format('epsilon of a charge must be a finite number >= 0, got %s', epsilon);
    end if;
    if not (delta >= 0 and delta < 1) then
        raise exception using errcode = '22023', message = format('delta of a charge must be in [0, 1), got %s', delta);
    end if;
    if epsilon = 0 and delta = 0 then
        raise exception using errcode = '22023', message = 'a charge of epsilon 0 and delta 0 charges nothing',
            hint = 'answers that cost nothing need no charge';
    end if;
    if fingerprint = '' or pg_catalog.octet_length(fingerprint) > 512 then
        raise exception using errcode = '22023',
            message = format('fingerprint of a charge must have 1 to 512 bytes, got %s',
                             pg_catalog.octet_length(fingerprint)),
            hint = 'pass a hash of the canonical query';
    end if;
    -- Under REPEATABLE READ or SERIALIZABLE every statement would read the
    -- snapshot taken before the locks were granted, and miss concurrent charges.
    if pg_catalog.current_setting('transaction_isolation') <> 'read committed' then
        raise exception using errcode = '25000',
            message = format('anonproxy.charge() must run in a READ COMMITTED transaction, not %s',
                             upper(pg_catalog.current_setting('transaction_isolation'))),
            hint = 'charge in a transaction of its own: begin isolation level read committed';
    end if;

    select b.* into budget from anonproxy.budgets b
     where b.role_name = charge.role_name and b.domain = charge.domain
       for update;
    if not found then
        perform anonproxy.no_budget(role_name, domain);
    end if;
    select s.* into cap from anonproxy.shared_budgets s where s.domain = charge.domain for update;

    -- The clock after the locks: a charge that waited is dated when it counts.
    as_of := pg_catalog.clock_timestamp();
    result := anonproxy.budget_state(budget, cap, as_of);
    if epsilon > result.epsilon or delta > result.delta then
        by_role := epsilon > result.role_epsilon or delta > result.role_delta;  -- else the shared cap
        if by_role then
            limit_detail := format('the budget of role "%s" on %s is epsilon %s, delta %s %s',
                role_name, domain, pg_catalog.trim_scale(budget.epsilon), pg_catalog.trim_scale(budget.delta),
                coalesce('per ' || budget.refresh_period::text, 'in total'));
        else
            limit_detail := format('the shared budget of all roles on %s is epsilon %s, delta %s %s, '
                                   'and epsilon %s, delta %s of it is left',
                domain, pg_catalog.trim_scale(cap.epsilon), pg_catalog.trim_scale(cap.delta),
                coalesce('per ' || cap.refresh_period::text, 'in total'),
                pg_catalog.trim_scale(result.shared_epsilon), pg_catalog.trim_scale(result.shared_delta));
        end if;
        raise exception using errcode = '53400', schema = 'anonproxy',
            table = case when by_role then 'budgets' else 'shared_budgets' end,
            message = format('privacy budget exhausted for role "%s" on %s: remaining epsilon %s, delta %s; '
                             'this query needs epsilon %s, delta %s',
                             role_name, domain, pg_catalog.trim_scale(result.epsilon),
                             pg_catalog.trim_scale(result.delta), pg_catalog.trim_scale(epsilon),
                             pg_catalog.trim_scale(delta)),
            detail = limit_detail,
            hint = 'repeat an earlier query (its answer is cached and free), ask with a smaller epsilon, or '
                || case when (case when by_role then budget.refresh_period else cap.refresh_period end) is null
                        then 'ask the policy owner for a larger budget'
                        else 'wait: charges older than the refresh period no longer count' end;
    end if;

    insert into anonproxy.budget_ledger (role_name, domain, epsilon, delta, fingerprint, charged_at)
        values (role_name, domain, epsilon, delta, fingerprint, as_of);
    -- A charge must survive a crash of the server once its COMMIT has returned:
    -- with synchronous_commit off (or local, with synchronous standbys) it might not.
    if pg_catalog.current_setting('synchronous_commit') in ('off', 'local') then
        perform pg_catalog.set_config('synchronous_commit', 'on', true);
    end if;

    result.epsilon := result.epsilon - epsilon;
    result.delta := result.delta - delta;
    result.role_epsilon := result.role_epsilon - epsilon;
    result.role_delta := result.role_delta - delta;
    result.shared_epsilon := result.shared_epsilon - epsilon;
    result.shared_delta := result.shared_delta - delta;
    return result;
end
$$;


-- Configuring budgets ----------------------------------------------------------------

-- The stored name of a protected table, or an error that says what to do.
create function anonproxy.budget_domain(tbl regclass) returns text
language plpgsql stable set search_path = pg_catalog, pg_temp as $$
declare
    target text := anonproxy.policy_table_name(tbl);
    referenced text;
begin
    if exists (select from anonproxy.protected_tables t where t.table_name = target) then
        return target;
    end if;
    select l.references_table into referenced from anonproxy.linked_tables l where l.table_name = target;
    if found then
        raise exception using errcode = '22023',
            message = format('table %s is a linked table; budgets belong to the protected table it links to, %s',
                             target, referenced),
            hint = format('set the budget on %s', referenced);
    end if;
    raise exception using errcode = '22023', message = format('table %s is not protected', target),
        hint = format('protect it first: select anonproxy.protect_table(%L, <unit column>)', target);
end
$$;

create function anonproxy.check_budget_limits(item text, epsilon numeric, delta numeric, refresh_period interval)
returns void
language plpgsql immutable set search_path = pg_catalog, pg_temp as $$
begin
    if epsilon is null or not (epsilon > 0 and epsilon < 'Infinity') then
        raise exception using errcode = '22023',
            message = format('epsilon %s must be a finite number greater than 0, got %s',
                             item, coalesce(epsilon::text, 'NULL'));
    end if;
    if delta is null or not (delta >= 0 and delta < 1) then
        raise exception using errcode = '22023',
            message = format('delta %s must be in [0, 1), got %s', item, coalesce(delta::text, 'NULL')),
            hint = 'delta is a probability of failure: choose it well below 1/n for n privacy units, or 0';
    end if;
    if refresh_period <= interval '0' then
        raise exception using errcode = '22023',
            message = format('refresh_period %s must be positive, got %s', item, refresh_period),
            hint = 'give no refresh period (null) for a budget that never comes back';
    end if;
end
$$;

-- Create or replace the budget of role_name on domain (a protected table).
create function anonproxy.set_budget(
    role_name name,
    domain regclass,
    epsilon numeric,
    delta numeric default 0,
    refresh_period interval default null,
    epsilon_per_query numeric default null,
    delta_per_query numeric default null
) returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    target text;
    item text;
begin
    if role_name is null or not exists (select from pg_catalog.pg_roles r where r.rolname = role_name) then
        raise exception using errcode = '42704', message = format('role "%s" does not exist', role_name);
    end if;
    target := anonproxy.budget_domain(domain);
    item := format('for role "%s" on %s', role_name, target);
    perform anonproxy.check_budget_limits(item, epsilon, delta, refresh_period);
    if not (epsilon_per_query > 0 and epsilon_per_query <= epsilon) then
        raise exception using errcode = '22023',
            message = format('epsilon_per_query %s must be in (0, %s], the budget''s epsilon; got %s',
                             item, pg_catalog.trim_scale(epsilon), epsilon_per_query);
    end if;
    if not (delta_per_query >= 0 and delta_per_query <= delta) then
        raise exception using errcode = '22023',
            message = format('delta_per_query %s must be in [0, %s], the budget''s delta; got %s',
                             item, pg_catalog.trim_scale(delta), delta_per_query);
    end if;
    insert into anonproxy.budgets as b
        (role_name, domain, epsilon, delta, refresh_period, epsilon_per_query, delta_per_query)
        values (role_name, target, epsilon, delta, refresh_period, epsilon_per_query, delta_per_query)
        on conflict on constraint budgets_pkey do update
            set epsilon = excluded.epsilon, delta = excluded.delta, refresh_period = excluded.refresh_period,
                epsilon_per_query = excluded.epsilon_per_query, delta_per_query = excluded.delta_per_query;
end
$$;

-- Takes text, like unprotect_table, so that the budget of a table since dropped can still be removed.
-- The ledger keeps the role's charges: a new budget starts from what was spent.
create function anonproxy.drop_budget(role_name name, domain text) returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    target text := anonproxy.stored_table_name(domain);
begin
    delete from anonproxy.budgets b where b.role_name = drop_budget.role_name and b.domain = target;
    if not found then
        raise exception using errcode = '42704',
            message = format('role "%s" has no privacy budget on %s', role_name, target),
            hint = 'give the schema-qualified name listed in anonproxy.budgets';
    end if;
end
$$;

-- Create or replace the cap on what all roles together may spend on domain.
create function anonproxy.set_shared_budget(
    domain regclass,
    epsilon numeric,
    delta numeric default 0,
    refresh_period interval default null
) returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    target text := anonproxy.budget_domain(domain);
begin
    perform anonproxy.check_budget_limits(format('of the shared budget on %s', target), epsilon, delta, refresh_period);
    insert into anonproxy.shared_budgets as s (domain, epsilon, delta, refresh_period)
        values (target, epsilon, delta, refresh_period)
        on conflict on constraint shared_budgets_pkey do update
            set epsilon = excluded.epsilon, delta = excluded.delta, refresh_period = excluded.refresh_period;
end
$$;

create function anonproxy.drop_shared_budget(domain text) returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    target text := anonproxy.stored_table_name(domain);
begin
    delete from anonproxy.shared_budgets s where s.domain = target;
    if not found then
        raise exception using errcode = '42704', message = format('table %s has no shared privacy budget', target),
            hint = 'give the schema-qualified name listed in anonproxy.shared_budgets';
    end if;
end
$$;

-- Remove every budget and shared cap (not the ledger: what was spent stays spent).
-- For `anonproxy policy apply`, which rebuilds the policy in the same transaction.
create function anonproxy.clear_budgets() returns void
language sql set search_path = pg_catalog, pg_temp as $$
    delete from anonproxy.budgets;
    delete from anonproxy.shared_budgets;
$$;


-- Data versions ------------------------------------------------------------------------

-- Statement trigger on tracked relations: add 1 to this backend's counter, once
-- per transaction. SECURITY DEFINER so that whoever writes a protected table need
-- not write anonproxy.data_changes. It runs only as a trigger, and only counts
-- changes of the relation it fires on, so PUBLIC keeps EXECUTE (needed by whoever
-- creates the trigger).
create function anonproxy.note_data_change() returns trigger
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
begin
    insert into anonproxy.data_changes as d (relid, backend, changes, changed_in)
        values (tg_relid, pg_catalog.pg_backend_pid(), 1, pg_catalog.pg_current_xact_id())
        on conflict (relid, backend) do update set changes = d.changes + 1, changed_in = excluded.changed_in
        where d.changed_in is distinct from excluded.changed_in;
    return null;
end
$$;

-- The table, its partitions and inheritance children, recursively.
create function anonproxy.relation_tree(tbl regclass) returns table (relid oid, relkind "char")
language sql stable set search_path = pg_catalog, pg_temp as $$
    with recursive tree (relid) as (
        select tbl::oid
        union
        select i.inhrelid from tree t join pg_catalog.pg_inherits i on i.inhparent = t.relid
    )
    select t.relid, c.relkind from tree t join pg_catalog.pg_class c on c.oid = t.relid
$$;

-- Install the change trigger on a table and on each of its partitions and
-- inheritance children (statement triggers on a parent do not fire for
-- statements that name a partition). ENABLE ALWAYS: it fires under
-- session_replication_role = replica too (logical replication). Idempotent: a
-- relation whose trigger is in place is left alone. Partitions attached later
-- need another call; until then data_version() of the table is null.
-- Protecting or linking a table calls this (trigger track_data_version below).
create function anonproxy.track_data_version(tbl regclass) returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    target text := anonproxy.policy_table_name(tbl);
    rel record;
begin
    for rel in select t.relid::regclass as relid, t.relkind from anonproxy.relation_tree(tbl) t loop
        if rel.relkind not in ('r', 'p') then
            raise exception using errcode = '22023',
                message = case when rel.relid = tbl
                    then format('%s is not a table: its data version cannot be tracked', target)
                    else format('%s, part of %s, is not a table: its data version cannot be tracked',
                                rel.relid, target) end,
                hint = 'answers over views, materialized views and foreign tables are not cached';
        end if;
        if not exists (select from pg_catalog.pg_trigger g
                        where g.tgrelid = rel.relid and g.tgname = 'anonproxy_data_version'
                          and g.tgfoid = 'anonproxy.note_data_change()'::regprocedure and g.tgenabled = 'A') then
            if exists (select from pg_catalog.pg_trigger g
                        where g.tgrelid = rel.relid and g.tgname = 'anonproxy_data_version') then
                execute format('drop trigger anonproxy_data_version on %s', rel.relid);  -- disabled or altered
            end if;
            execute format('create trigger anonproxy_data_version after insert or update or delete or truncate '
                           'on %s for each statement execute function anonproxy.note_data_change()', rel.relid);
            execute format('alter table %s enable always trigger anonproxy_data_version', rel.relid);
        end if;
    end loop;
end
$$;

-- Row trigger on the policy's tables: protecting or linking a table tracks it.
-- Views and the like are skipped (their answers are not cached). If tracking
-- fails, the table is just not cached (data_version() is null): a caller who may
-- not create triggers on it is stopped by apply_grants() with a clearer error.
create function anonproxy.track_policy_table() returns trigger
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    tbl regclass := pg_catalog.to_regclass(new.table_name);
begin
    if tbl is not null and (select c.relkind from pg_catalog.pg_class c where c.oid = tbl) in ('r', 'p') then
        begin
            perform anonproxy.track_data_version(tbl);
        exception when invalid_parameter_value or insufficient_privilege then  -- e.g. a foreign partition
            raise notice using message = format('answers over %s will not be cached: %s', new.table_name, sqlerrm),
                hint = format('its owner can track it: select anonproxy.track_data_version(%L)', new.table_name);
        end;
    end if;
    return null;
end
$$;

create trigger track_data_version after insert or update of table_name on anonproxy.protected_tables
    for each row execute function anonproxy.track_policy_table();
create trigger track_data_version after insert or update of table_name on anonproxy.linked_tables
    for each row execute function anonproxy.track_policy_table();

-- The version of the data of some tables, as the caller's snapshot sees it; null
-- if it cannot be known (a table that does not exist, is not tracked, or has an
-- untracked partition): then nothing is cached. It changes when any transaction
-- that wrote one of the tables (or their partitions) commits, when one is
-- truncated or rewritten (relfilenode), when its columns change (names, types),
-- and when its change trigger is re-created or re-enabled (so changes made while
-- it was missing or disabled cannot hide). An md5 of, per relation: oid,
-- relfilenode, trigger oid and xmin, committed changes, column signature.
create function anonproxy.data_version(tables text[]) returns text
language plpgsql stable security definer set search_path = pg_catalog, pg_temp as $$
declare
    untracked boolean;
    entries text;
begin
    perform anonproxy.check_ledger_caller('read data versions');
    if tables is null or pg_catalog.cardinality(tables) = 0 or pg_catalog.array_position(tables, null) is not null then
        raise exception using errcode = '22023', message = 'data_version() needs at least one table, and no NULL';
    end if;
    with recursive tree (relid) as (
        select pg_catalog.to_regclass(t)::oid from pg_catalog.unnest(tables) t
        union
        select i.inhrelid from tree t join pg_catalog.pg_inherits i on i.inhparent = t.relid
    )
    select pg_catalog.bool_or(c.oid is null or c.relkind not in ('r', 'p') or g.oid is null),
           pg_catalog.string_agg(format('%s/%s/%s/%s/%s/%s', c.oid, c.relfilenode, g.oid, g.xmin, d.changes,
                                        a.signature), ',' order by c.oid)
      into untracked, entries
      from tree t
      left join pg_catalog.pg_class c on c.oid = t.relid
      left join pg_catalog.pg_trigger g
             on g.tgrelid = t.relid and g.tgname = 'anonproxy_data_version'
            and g.tgfoid = 'anonproxy.note_data_change()'::regprocedure and g.tgenabled = 'A'
      left join lateral (select coalesce(sum(x.changes), 0) as changes
                           from anonproxy.data_changes x where x.relid = t.relid) d on true
      left join lateral (select pg_catalog.md5(pg_catalog.string_agg(
                                    format('%s:%s:%s:%s', a.attnum, a.attname, a.atttypid, a.atttypmod),
                                    ',' order by a.attnum)) as signature
                           from pg_catalog.pg_attribute a
                          where a.attrelid = t.relid and a.attnum > 0 and not a.attisdropped) a on true;
    if untracked then
        return null;
    end if;
    return pg_catalog.md5(entries);
end
$$;


-- The answer cache ------------------------------------------------------------------------

-- The answer role_name paid for, or null. A null data_version (unknown) finds nothing.
create function anonproxy.cached_answer(role_name name, fingerprint text, data_version text) returns bytea
language plpgsql stable security definer set search_path = pg_catalog, pg_temp as $$
begin
    perform anonproxy.check_ledger_caller(format('read the cached answers of role "%s"', role_name), role_name);
    return (select c.answer from anonproxy.answer_cache c
             where c.role_name = cached_answer.role_name and c.fingerprint = cached_answer.fingerprint
               and c.data_version = cached_answer.data_version);
end
$$;

-- Keep answer as the answer to fingerprint for role_name on data_version, unless
-- one is kept already; return the one kept, which is the one to send: when two
-- sessions of a role ask the same question at once, both pay, one answer is
-- released. With a null data_version nothing is kept and answer comes back.
create function anonproxy.store_answer(role_name name, fingerprint text, data_version text, answer bytea)
returns bytea
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    kept bytea;
begin
    perform anonproxy.check_ledger_caller('store answers');
    if role_name is null or fingerprint is null or answer is null then
        raise exception using errcode = '22004', message = 'role_name, fingerprint and answer must not be null';
    end if;
    if fingerprint = '' or pg_catalog.octet_length(fingerprint) > 512 then
        raise exception using errcode = '22023',
            message = format('fingerprint must have 1 to 512 bytes, got %s', pg_catalog.octet_length(fingerprint)),
            hint = 'pass a hash of the canonical query';
    end if;
    if data_version is null then
        return answer;
    end if;
    insert into anonproxy.answer_cache as c (role_name, fingerprint, data_version, answer)
        values (role_name, fingerprint, data_version, answer)
        on conflict on constraint answer_cache_pkey do nothing
        returning c.answer into kept;
    if not found then  -- kept by a transaction that committed first; this statement's snapshot sees it
        select c.answer into kept from anonproxy.answer_cache c
         where c.role_name = store_answer.role_name and c.fingerprint = store_answer.fingerprint
           and c.data_version = store_answer.data_version;
    end if;
    return kept;
end
$$;


-- Tables protected before this migration ------------------------------------------------

do $$
declare
    tbl text;
begin
    for tbl in select table_name from anonproxy.protected_tables union select table_name from anonproxy.linked_tables loop
        begin
            if (select c.relkind from pg_catalog.pg_class c where c.oid = pg_catalog.to_regclass(tbl)) in ('r', 'p') then
                perform anonproxy.track_data_version(pg_catalog.to_regclass(tbl));
            end if;
        exception when insufficient_privilege or invalid_parameter_value then
            raise notice using message = format('answers over %s will not be cached until its owner runs '
                                                'select anonproxy.track_data_version(%L): %s', tbl, tbl, sqlerrm);
        end;
    end loop;
end
$$;


-- Who may call what --------------------------------------------------------------------------

-- Configuration and internals: the owner, and whom it grants EXECUTE to.
revoke execute on function
    anonproxy.ledger_is_append_only(),
    anonproxy.check_ledger_caller(text, name),
    anonproxy.budget_state(anonproxy.budgets, anonproxy.shared_budgets, timestamptz),
    anonproxy.no_budget(name, text),
    anonproxy.budget_domain(regclass),
    anonproxy.check_budget_limits(text, numeric, numeric, interval),
    anonproxy.set_budget(name, regclass, numeric, numeric, interval, numeric, numeric),
    anonproxy.drop_budget(name, text),
    anonproxy.set_shared_budget(regclass, numeric, numeric, interval),
    anonproxy.drop_shared_budget(text),
    anonproxy.clear_budgets(),
    anonproxy.relation_tree(regclass),
    anonproxy.track_data_version(regclass),
    anonproxy.track_policy_table()
from public;

-- The proxy's entry points keep PUBLIC's EXECUTE: each one checks its caller
-- (check_ledger_caller) against the service role in anonproxy.settings, so the
-- service role needs no GRANT, and a change of service role takes effect at once.
--   anonproxy.charge, remaining_budget, remaining_budgets, data_version,
--   cached_answer, store_answer, note_data_change (trigger only).
