-- Migration 0026: the auditor role, a trail only the owner and the auditors read, and the policy's history.
--
-- `anonproxy console` (anonproxy/console/, docs/console.md) shows a data-protection officer the trail, the
-- budgets, the releases and the policy's history. It logs in as a member of the group role anonproxy_auditor,
-- which may read those and nothing else:
--   * SELECT on the audit trail, its retention setting, the budget ledger, the release registry and the policy's
--     history (the policy tables and the budgets are readable by PUBLIC since 0002 and 0003);
--   * EXECUTE on the read-only functions below (budgets as the ledger counts them, their history, a release's
--     measurements now), each SECURITY DEFINER and granted to the auditors only;
--   * no row of a protected table, no policy change, no charge: nothing else is granted.
--
-- Before this migration the trail was readable by any member of pg_read_all_data (the demo's `dba`), which holds
-- SELECT on every table whatever its grants say. Row security is the one thing pg_read_all_data does not pass,
-- so the trail gets a policy whose check refuses (42501) anyone but the auditors; its owner (and a superuser, or
-- a BYPASSRLS role) is not subject to row security and reads it as before.
--
-- The group role is created here when the installing role may create roles, and kept if it exists (roles belong
-- to the whole cluster: another database's install may have made it). An owner that may not create roles (no
-- CREATEROLE, as on some managed services) still installs the rest, with a warning: once someone with CREATEROLE
-- has run `create role anonproxy_auditor nologin`, the owner runs `select anonproxy.grant_auditor_privileges()`.
-- Until then nobody but the owner reads the trail.
--
-- Every function pins search_path = pg_catalog, pg_temp and qualifies every name.

do $$
begin
    if pg_catalog.to_regrole('anonproxy_auditor') is null
       and exists (select from pg_catalog.pg_roles where rolname = current_user and (rolcreaterole or rolsuper)) then
        create role anonproxy_auditor nologin;
        comment on role anonproxy_auditor is
            'anonproxy: reads the audit trail, budgets, ledger, release registry and policy history; nothing else.';
    end if;
end
$$;


-- The trail: the owner and the auditors ---------------------------------------------------------

-- Whether the current role may read the trail; raises 42501 otherwise. Declared immutable so that the planner
-- evaluates it once, while planning: a reader outside the auditors is refused even when the trail is empty, and
-- no row is looked at first. A plan made under row security is re-planned for another role, so a cached plan of
-- an auditor never serves anyone else.
create function anonproxy.audit_trail_reader() returns boolean
language plpgsql immutable set search_path = pg_catalog, pg_temp as $$
begin
    if pg_catalog.to_regrole('anonproxy_auditor') is null
       or not pg_catalog.pg_has_role(current_user, 'anonproxy_auditor', 'usage') then
        raise exception using errcode = '42501', message = 'permission denied for table audit_trail',
            detail = 'the audit trail is readable by its owner and the members of anonproxy_auditor only',
            hint = 'the owner of the anonproxy schema runs: grant anonproxy_auditor to <login>';
    end if;
    return true;
end
$$;

alter table anonproxy.audit_trail enable row level security;
create policy auditors_read on anonproxy.audit_trail for select using (anonproxy.audit_trail_reader());

comment on table anonproxy.audit_trail is
    'One row per statement of a role in suppress or dp mode, written by the proxy through audit_write(). '
    'decision lost: a row standing for records the proxy had to drop (its buffer was full); statement says how '
    'many. Readable by its owner and the members of anonproxy_auditor only (row security refuses everyone else, '
    'pg_read_all_data included); rows older than audit_settings.retention are deleted by audit_purge().';


-- The policy's history ------------------------------------------------------------------------------

-- One row per policy version: the whole policy as it stood when the transaction that made the version committed.
create table anonproxy.policy_history (
    version bigint primary key,
    changed_at timestamptz not null default pg_catalog.clock_timestamp(),
    changed_by name not null default session_user,  -- the login that changed the policy
    policy jsonb not null
);
comment on table anonproxy.policy_history is
    'The policy at each version (tables, columns, links, roles, budgets, caps, service role), recorded when the '
    'change commits. Readable by the owner and anonproxy_auditor.';
revoke all on anonproxy.policy_history from public;

-- The policy as it stands, as one JSON object.
create function anonproxy.policy_snapshot() returns jsonb
language sql stable set search_path = pg_catalog, pg_temp as $$
    select pg_catalog.jsonb_build_object(
        'protected_tables', (select coalesce(pg_catalog.jsonb_agg(t order by t.table_name), '[]')
                               from anonproxy.protected_tables t),
        'linked_tables', (select coalesce(pg_catalog.jsonb_agg(t order by t.table_name), '[]')
                            from anonproxy.linked_tables t),
        'column_policies', (select coalesce(pg_catalog.jsonb_agg(c order by c.table_name, c.column_name), '[]')
                              from anonproxy.column_policies c),
        'role_policies', (select coalesce(pg_catalog.jsonb_agg(r order by r.role_name), '[]')
                            from anonproxy.role_policies r),
        'budgets', (select coalesce(pg_catalog.jsonb_agg(b order by b.role_name, b.domain), '[]')
                      from anonproxy.budgets b),
        'shared_budgets', (select coalesce(pg_catalog.jsonb_agg(s order by s.domain), '[]')
                             from anonproxy.shared_budgets s),
        'service_role', (select s.service_role from anonproxy.settings s))
$$;

-- Deferred to the commit of the transaction that bumped the version (policy_changed() bumps it once per
-- transaction, at its first change), so the snapshot holds every change of that transaction.
create function anonproxy.record_policy_version() returns trigger
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
begin
    insert into anonproxy.policy_history (version, policy)
    values (new.version, anonproxy.policy_snapshot())
    on conflict (version) do update set policy = excluded.policy, changed_at = excluded.changed_at;
    return null;
end
$$;

create constraint trigger record_version after update on anonproxy.policy_version
    deferrable initially deferred for each row execute function anonproxy.record_policy_version();

-- The policy in force now is the history's first row.
insert into anonproxy.policy_history (version, policy, changed_by)
select v.version, anonproxy.policy_snapshot(), current_user from anonproxy.policy_version v;


-- Budgets as the ledger counts them --------------------------------------------------------------------

-- Every role's budget on every domain, now (what remaining_budgets gives a role about itself).
create function anonproxy.audit_budgets() returns setof anonproxy.budget_remaining
language sql stable security definer set search_path = pg_catalog, pg_temp as $$
    select r.*
      from anonproxy.budgets b left join anonproxy.shared_budgets s on s.domain = b.domain
     cross join lateral anonproxy.budget_state(b, s, pg_catalog.clock_timestamp()) r
     order by b.role_name, b.domain
$$;

-- A role's budget on a domain over time: after each charge of the ledger, epsilon spent as the budget's
-- accounting counts it (basic: the sum of epsilon; zcdp: the sum of rho converted at what is left of delta),
-- with the charges that counted at that moment (a refresh period counts only the latest ones).
create function anonproxy.audit_budget_history(role_name name, domain text)
returns table (charged_at timestamptz, epsilon numeric, rho numeric, epsilon_spent numeric)
language sql stable security definer set search_path = pg_catalog, pg_temp as $$
    select l.charged_at, l.epsilon, l.rho,
           (anonproxy.budget_balance(b.accounting, b.epsilon, b.delta, w.spent)).epsilon_spent
      from anonproxy.budgets b
      join anonproxy.budget_ledger l on l.role_name = b.role_name and l.domain = b.domain
     cross join lateral (
         select row(coalesce(sum(c.epsilon), 0), coalesce(sum(c.delta), 0), coalesce(sum(c.rho), 0),
                    coalesce(sum(c.delta_add), 0))::anonproxy.budget_spending as spent
           from anonproxy.budget_ledger c
          where c.role_name = b.role_name and c.domain = b.domain
            and (c.charged_at, c.id) <= (l.charged_at, l.id)
            and (b.refresh_period is null or c.charged_at > l.charged_at - b.refresh_period)) w
     where b.role_name = audit_budget_history.role_name and b.domain = audit_budget_history.domain
     order by l.charged_at, l.id
$$;


-- Releases measured now -------------------------------------------------------------------------------

-- A release's smallest class now (k_anonymity of sql/0009, null for a release made with a privacy unit, whose
-- table has no unit column to count by) and its composition with every other release of the same source and
-- sensitive column (composition_risk of sql/0010, as check_composition runs it). Aggregates only: no row.
create function anonproxy.audit_release(release_id bigint) returns jsonb
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    release anonproxy.releases;
    target regclass;
    others regclass[];
    k_now bigint;
    risk jsonb;
    problem text;
begin
    select * into release from anonproxy.releases r where r.id = release_id;
    if not found then
        raise exception using errcode = '42704', message = format('release %s is not registered', release_id);
    end if;
    target := pg_catalog.to_regclass(release.target);
    if target is null then
        return pg_catalog.jsonb_build_object('problem', format('table %s no longer exists', release.target));
    end if;
    if release.unit is null then
        k_now := anonproxy.k_anonymity(target, release.quasi_identifiers);
    end if;
    select pg_catalog.array_agg(pg_catalog.to_regclass(g.target) order by g.id) into others
      from anonproxy.releases g
     where g.source = release.source and g.id <> release.id and g.sensitive is not distinct from release.sensitive
       and pg_catalog.to_regclass(g.target) is not null;
    if others is not null and release.sensitive is not null then
        begin
            risk := anonproxy.composition_risk(target || others, pg_catalog.to_regclass(release.source));
        exception when sqlstate '55000' then
            get stacked diagnostics problem = message_text;
        end;
    end if;
    return pg_catalog.jsonb_build_object('k_now', k_now, 'others', pg_catalog.to_jsonb(others::text[]),
                                         'risk', risk, 'problem', problem);
end
$$;


-- Who may do what ------------------------------------------------------------------------------------

revoke execute on function anonproxy.record_policy_version(), anonproxy.audit_budgets(),
    anonproxy.audit_budget_history(name, text), anonproxy.audit_release(bigint) from public;

-- The auditors' privileges; false (and nothing granted) while the group role does not exist. Idempotent.
create function anonproxy.grant_auditor_privileges() returns boolean
language plpgsql set search_path = pg_catalog, pg_temp as $$
begin
    if pg_catalog.to_regrole('anonproxy_auditor') is null then
        return false;
    end if;
    grant execute on function anonproxy.audit_budgets(), anonproxy.audit_budget_history(name, text),
        anonproxy.audit_release(bigint) to anonproxy_auditor;
    grant select on anonproxy.audit_trail, anonproxy.audit_settings, anonproxy.budget_ledger, anonproxy.releases,
        anonproxy.policy_history to anonproxy_auditor;
    return true;
end
$$;
revoke execute on function anonproxy.grant_auditor_privileges() from public;

do $$
begin
    if not anonproxy.grant_auditor_privileges() then
        raise warning using
            message = format('the group role anonproxy_auditor does not exist and role %I may not create it: '
                             'only the owner reads the audit trail', current_user),
            hint = 'a role with CREATEROLE runs: create role anonproxy_auditor nologin; then the owner of the '
                   'anonproxy schema runs: select anonproxy.grant_auditor_privileges()';
    end if;
end
$$;
