-- Migration 0031: a zCDP charge as cheap as a basic one -- each zcdp budget's rho_max is computed when it is set.
--
-- Since 0025, zcdp_rho_max searches over the orders alpha (a doubling, then up to 40 Newton steps on 45-decimal
-- logarithms), and budget_balance ran it for every zcdp balance: three times per charge to a zcdp budget (whether it
-- fits, epsilon spent before it, what is left after it), once per budget in remaining_budget(s) and my_budget, and
-- once per ledger row in audit_budget_history. It depends only on the budget's epsilon and on the delta left, which
-- is the budget's delta as long as no partition selection has spent any. So:
--
-- * anonproxy.budget_rho_max holds zcdp_rho_max(epsilon, delta) of every zcdp budget and shared cap, computed when
--   the budget is set or changed (a statement trigger on budgets and shared_budgets), and dropped when no budget
--   has those numbers any more. It is keyed by the numbers exactly as the budget holds them, scale included
--   (10 and 10.0 are equal but not the same input: the conversion's 45-decimal digits follow the input's scale).
-- * budget_balance reads rho_max from it (budget_rho_max_of), and computes it as before for a pair it does not hold.
--   Once partition selection has spent some delta, the delta left is not the budget's: a charge stores rho_max at
--   the delta left after it (keep_rho_max), where the next charge starts. So a charge searches once if it spends
--   delta, and not at all otherwise.
-- * charge computes the balances with the charge once, not twice (whether it fits, then what is left): each zcdp
--   balance still converts its sum of rho to epsilon spent (zcdp_epsilon), which depends on every charge.
--
-- Every figure is the one the functions of 0025 give for the same numbers: nothing the ledger answers changes. A
-- later migration that redefines zcdp_rho_max must empty anonproxy.budget_rho_max and call refresh_budget_rho_max().

-- No unique key: two charges that store the same pair at once both insert it (each row of a pair holds the same
-- value), rather than one waiting for the other's commit.
create table anonproxy.budget_rho_max (
    epsilon text not null,  -- a budget's epsilon, as numeric's text: its value and its scale
    delta text not null,    -- its delta or a delta left, likewise
    rho_max numeric not null,
    constraint exact_numbers check (epsilon = epsilon::numeric::text and delta = delta::numeric::text)
);
create index budget_rho_max_numbers on anonproxy.budget_rho_max (epsilon, delta);
comment on table anonproxy.budget_rho_max is
    'zcdp_rho_max(epsilon, delta) of every zcdp budget and shared cap, computed when it was set, and at the delta '
    'left after each charge that spent partition selection''s delta (sql/0031), so that a charge reads it instead '
    'of searching for it. Keyed by the numbers'' text: value and scale.';
revoke all on anonproxy.budget_rho_max from public;

-- zcdp_rho_max(epsilon, delta): the stored value when those very numbers are stored, else computed.
create function anonproxy.budget_rho_max_of(epsilon numeric, delta numeric) returns numeric
language plpgsql stable strict set search_path = pg_catalog, pg_temp as $$
declare
    known numeric;
begin
    select m.rho_max into known
      from anonproxy.budget_rho_max m
     where m.epsilon = budget_rho_max_of.epsilon::text and m.delta = budget_rho_max_of.delta::text
     limit 1;
    if found then
        return known;
    end if;
    return anonproxy.zcdp_rho_max(epsilon, delta);
end
$$;

-- For a charge: make sure the pair is stored, so that budget_balance reads it, and so will the next charge, which
-- starts from this one's delta left (one search per charge that spends partition selection's delta, none after).
create function anonproxy.keep_rho_max(epsilon numeric, delta numeric) returns void
language plpgsql strict set search_path = pg_catalog, pg_temp as $$
begin
    if delta > 0 and not exists (select from anonproxy.budget_rho_max m
                                  where m.epsilon = keep_rho_max.epsilon::text and m.delta = keep_rho_max.delta::text)
    then
        insert into anonproxy.budget_rho_max (epsilon, delta, rho_max)
            values (epsilon::text, delta::text, anonproxy.zcdp_rho_max(epsilon, delta));
    end if;
end
$$;

-- The (epsilon, delta) of every zcdp budget and cap, as budget_rho_max keys them.
create view anonproxy.zcdp_budget_numbers as
select b.epsilon::text as epsilon, b.delta::text as delta from anonproxy.budgets b where b.accounting = 'zcdp'
 union
select s.epsilon::text, s.delta::text from anonproxy.shared_budgets s where s.accounting = 'zcdp';
revoke all on anonproxy.zcdp_budget_numbers from public;

-- Make anonproxy.budget_rho_max hold the numbers of the zcdp budgets and caps, and only those: the pairs charges
-- stored go too, so besides the budgets' it holds at most one pair per charge since the last change of a budget.
-- Computes only the pairs it lacks: setting a budget to numbers already held costs a look-up.
create function anonproxy.refresh_budget_rho_max() returns void
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
begin
    delete from anonproxy.budget_rho_max m
     where not exists (select from anonproxy.zcdp_budget_numbers n where n.epsilon = m.epsilon and n.delta = m.delta);
    insert into anonproxy.budget_rho_max (epsilon, delta, rho_max)
    select n.epsilon, n.delta, anonproxy.zcdp_rho_max(n.epsilon::numeric, n.delta::numeric)
      from anonproxy.zcdp_budget_numbers n
     where not exists (select from anonproxy.budget_rho_max m where m.epsilon = n.epsilon and m.delta = n.delta);
end
$$;

create function anonproxy.budget_rho_max_follows() returns trigger
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
begin
    perform anonproxy.refresh_budget_rho_max();
    return null;
end
$$;

create trigger budget_rho_max_follows after insert or update or delete or truncate on anonproxy.budgets
    for each statement execute function anonproxy.budget_rho_max_follows();
create trigger budget_rho_max_follows after insert or update or delete or truncate on anonproxy.shared_budgets
    for each statement execute function anonproxy.budget_rho_max_follows();

select anonproxy.refresh_budget_rho_max();  -- the budgets set before this migration

-- budget_balance of 0019, reading rho_max through budget_rho_max_of (its one change, and so stable now, as what it
-- calls is).
create or replace function anonproxy.budget_balance(accounting text, epsilon numeric, delta numeric,
                                                    spent anonproxy.budget_spending)
returns anonproxy.budget_balance
language plpgsql stable set search_path = pg_catalog, pg_temp as $$
declare
    result anonproxy.budget_balance;
    rho_max numeric;
begin
    if accounting = 'basic' then
        result.epsilon_spent := spent.epsilon;
        result.epsilon_left := greatest(epsilon - spent.epsilon, 0);
        result.delta_left := greatest(delta - spent.delta, 0);
        result.fits := spent.epsilon <= epsilon and spent.delta <= delta;
        return result;
    end if;
    result.delta_left := greatest(delta - spent.delta_add, 0);
    if result.delta_left = 0 then  -- nothing left of delta to convert at: nothing may be spent
        result.epsilon_spent := epsilon;
        result.epsilon_left := 0;
        result.rho_left := 0;
        result.fits := false;
        return result;
    end if;
    rho_max := anonproxy.budget_rho_max_of(epsilon, result.delta_left);
    result.fits := spent.rho <= rho_max;
    result.rho_left := pg_catalog.trim_scale(greatest(pg_catalog.trunc(rho_max - spent.rho, 12), 0));
    result.epsilon_spent := pg_catalog.trim_scale(
        anonproxy.round_up(anonproxy.zcdp_epsilon(spent.rho, result.delta_left), 12));
    if result.fits then  -- within the budget: rounding up must not show more than all of it spent
        result.epsilon_spent := least(result.epsilon_spent, epsilon);
    end if;
    result.epsilon_left := greatest(epsilon - result.epsilon_spent, 0);
    return result;
end
$$;

-- The remaining budget of a role (and of its domain's cap, if any) from their balances with what counts against each
-- (budget_state of 0019, its balances given): so that a charge, which has just computed them to decide whether it
-- fits, does not compute them again.
create function anonproxy.budget_state(budget anonproxy.budgets, cap anonproxy.shared_budgets,
                                       role_spent anonproxy.budget_spending, own anonproxy.budget_balance,
                                       shared anonproxy.budget_balance)
returns anonproxy.budget_remaining
language plpgsql immutable set search_path = pg_catalog, pg_temp as $$
declare
    result anonproxy.budget_remaining;
begin
    result.role_name := budget.role_name;
    result.domain := budget.domain;
    result.role_epsilon := own.epsilon_left;
    result.role_delta := own.delta_left;
    result.accounting := budget.accounting;
    result.epsilon_spent := own.epsilon_spent;
    result.rho_spent := role_spent.rho;
    result.rho_left := own.rho_left;
    if cap.domain is not null then
        result.shared_epsilon := shared.epsilon_left;
        result.shared_delta := shared.delta_left;
        result.shared_accounting := cap.accounting;
        result.shared_rho_left := shared.rho_left;
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

-- budget_state of 0019 (remaining_budget, remaining_budgets, audit_budgets and a refused charge call it): the same.
create or replace function anonproxy.budget_state(budget anonproxy.budgets, cap anonproxy.shared_budgets,
                                                  role_spent anonproxy.budget_spending,
                                                  cap_spent anonproxy.budget_spending)
returns anonproxy.budget_remaining
language plpgsql stable set search_path = pg_catalog, pg_temp as $$
begin
    return anonproxy.budget_state(
        budget, cap, role_spent, anonproxy.budget_balance(budget.accounting, budget.epsilon, budget.delta, role_spent),
        case when cap.domain is not null
             then anonproxy.budget_balance(cap.accounting, cap.epsilon, cap.delta, cap_spent) end);
end
$$;

-- The charge of 0025, which computed the balances with the charge twice (whether it fits, then what is left): now
-- once. Its outcome, refusal or result, is the same.
create or replace function anonproxy.charge(role_name name, domain text, epsilon numeric, delta numeric, rho numeric,
                                 delta_add numeric, fingerprint text)
returns anonproxy.budget_remaining
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
declare
    budget anonproxy.budgets;
    cap anonproxy.shared_budgets;
    as_of timestamptz;
    role_spent anonproxy.budget_spending;
    cap_spent anonproxy.budget_spending;
    before anonproxy.budget_remaining;
    refusing_accounting text;
    by_role boolean;
    limit_detail text;
    remaining_text text;
    needed_text text;
    spent_before numeric;  -- the role's budget's epsilon spent before this charge
    role_after anonproxy.budget_spending;  -- what counts against the role's budget with this charge
    cap_after anonproxy.budget_spending;   -- and against the cap
    own anonproxy.budget_balance;          -- the role's budget with this charge
    shared anonproxy.budget_balance;       -- the cap with this charge
    result anonproxy.budget_remaining;
begin
    perform anonproxy.check_ledger_caller('charge a privacy budget');
    if role_name is null or domain is null or epsilon is null or delta is null or rho is null or delta_add is null
       or fingerprint is null then
        raise exception using errcode = '22004', message = 'role_name, domain, epsilon, delta, rho, delta_add and '
            'fingerprint of a charge must not be null';
    end if;
    if not (epsilon >= 0 and epsilon < 'Infinity') then
        raise exception using errcode = '22023',
            message = format('epsilon of a charge must be a finite number >= 0, got %s', epsilon);
    end if;
    if not (delta >= 0 and delta < 1) then
        raise exception using errcode = '22023', message = format('delta of a charge must be in [0, 1), got %s', delta);
    end if;
    if not (rho >= 0 and rho < 'Infinity') then
        raise exception using errcode = '22023',
            message = format('rho of a charge must be a finite number >= 0, got %s', rho);
    end if;
    if not (delta_add >= 0 and delta_add <= delta) then
        raise exception using errcode = '22023',
            message = format('delta_add of a charge must be in [0, delta], got %s with delta %s', delta_add, delta),
            hint = 'delta_add is the part of delta that partition selection adds: it is never more than delta';
    end if;
    -- Every noisy statistic costs in both currencies: one without the other would be free for one accountant.
    if (epsilon = 0) <> (rho = 0) then
        raise exception using errcode = '22023',
            message = format('a charge must cost rho exactly when it costs epsilon, got epsilon %s and rho %s',
                             epsilon, rho);
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
    role_spent := anonproxy.role_spending(budget, as_of);
    if cap.domain is not null then
        cap_spent := anonproxy.domain_spending(cap, as_of);
    end if;
    role_after := anonproxy.plus(role_spent, epsilon, delta, rho, delta_add);
    if budget.accounting = 'zcdp' then  -- the delta left as budget_balance computes it
        perform anonproxy.keep_rho_max(budget.epsilon, greatest(budget.delta - role_after.delta_add, 0));
    end if;
    own := anonproxy.budget_balance(budget.accounting, budget.epsilon, budget.delta, role_after);
    by_role := not own.fits;
    if cap.domain is not null and not by_role then
        cap_after := anonproxy.plus(cap_spent, epsilon, delta, rho, delta_add);
        if cap.accounting = 'zcdp' then
            perform anonproxy.keep_rho_max(cap.epsilon, greatest(cap.delta - cap_after.delta_add, 0));
        end if;
        shared := anonproxy.budget_balance(cap.accounting, cap.epsilon, cap.delta, cap_after);
    end if;
    if by_role or (cap.domain is not null and not shared.fits) then
        before := anonproxy.budget_state(budget, cap, role_spent, cap_spent);
        refusing_accounting := case when by_role then budget.accounting else cap.accounting end;
        if refusing_accounting = 'basic' then
            remaining_text := format('remaining epsilon %s, delta %s',
                pg_catalog.trim_scale(case when by_role then before.role_epsilon else before.shared_epsilon end),
                pg_catalog.trim_scale(case when by_role then before.role_delta else before.shared_delta end));
            needed_text := format('this query needs epsilon %s, delta %s (basic accounting)',
                                  pg_catalog.trim_scale(epsilon), pg_catalog.trim_scale(delta));
        else
            remaining_text := format('remaining rho %s (epsilon %s), delta %s',
                pg_catalog.trim_scale(case when by_role then before.rho_left else before.shared_rho_left end),
                pg_catalog.trim_scale(case when by_role then before.role_epsilon else before.shared_epsilon end),
                pg_catalog.trim_scale(case when by_role then before.role_delta else before.shared_delta end));
            needed_text := format('this query needs rho %s, delta %s (zCDP accounting)',
                                  pg_catalog.trim_scale(rho), pg_catalog.trim_scale(delta_add));
        end if;
        if by_role then
            limit_detail := format('the budget of role "%s" on %s is epsilon %s, delta %s %s',
                role_name, domain, pg_catalog.trim_scale(budget.epsilon), pg_catalog.trim_scale(budget.delta),
                coalesce('per ' || budget.refresh_period::text, 'in total'));
        else
            limit_detail := format('the shared budget of all roles on %s is epsilon %s, delta %s %s, '
                                   'and epsilon %s, delta %s of it is left',
                domain, pg_catalog.trim_scale(cap.epsilon), pg_catalog.trim_scale(cap.delta),
                coalesce('per ' || cap.refresh_period::text, 'in total'),
                pg_catalog.trim_scale(before.shared_epsilon), pg_catalog.trim_scale(before.shared_delta));
        end if;
        if refusing_accounting = 'zcdp' then
            limit_detail := limit_detail || format('; under zCDP accounting the rho of its answers adds up, and '
                'the total converts to (epsilon, delta) by Canonne, Kamath and Steinke''s bound (the least over alpha > 1 '
                'of alpha rho + (ln(1/delta) + (alpha - 1) ln(1 - 1/alpha) - ln alpha) / (alpha - 1)), at what is '
                'left of delta after partition selection (%s)',
                pg_catalog.trim_scale(case when by_role then before.role_delta else before.shared_delta end));
        end if;
        raise exception using errcode = '53400', schema = 'anonproxy',
            table = case when by_role then 'budgets' else 'shared_budgets' end,
            message = format('privacy budget exhausted for role "%s" on %s: %s; %s',
                             role_name, domain, remaining_text, needed_text),
            detail = limit_detail,
            hint = 'repeat an earlier query (its answer is cached and free), ask with a smaller epsilon, or '
                || case when (case when by_role then budget.refresh_period else cap.refresh_period end) is null
                        then 'ask the policy owner for a larger budget'
                        else 'wait: charges older than the refresh period no longer count' end;
    end if;

    -- What the charge moves the role's "epsilon spent" by, in its accounting: under zcdp not the answer's own epsilon.
    spent_before := (anonproxy.budget_balance(budget.accounting, budget.epsilon, budget.delta, role_spent)).epsilon_spent;
    result := anonproxy.budget_state(budget, cap, role_after, own, shared);
    result.epsilon_spent_delta := result.epsilon_spent - spent_before;
    insert into anonproxy.budget_ledger (role_name, domain, epsilon, delta, rho, delta_add, fingerprint, charged_at,
                                         epsilon_spent_after, epsilon_spent_delta)
        values (role_name, domain, epsilon, delta, rho, delta_add, fingerprint, as_of, result.epsilon_spent,
                result.epsilon_spent_delta);
    -- A charge must survive a crash of the server once its COMMIT has returned:
    -- with synchronous_commit off (or local, with synchronous standbys) it might not.
    if pg_catalog.current_setting('synchronous_commit') in ('off', 'local') then
        perform pg_catalog.set_config('synchronous_commit', 'on', true);
    end if;
    return result;
end
$$;

-- As budget_balance (0019): internal, for the ledger's own SECURITY DEFINER functions.
revoke execute on function anonproxy.budget_rho_max_of(numeric, numeric), anonproxy.keep_rho_max(numeric, numeric),
    anonproxy.refresh_budget_rho_max(),
    anonproxy.budget_rho_max_follows(),
    anonproxy.budget_state(anonproxy.budgets, anonproxy.shared_budgets, anonproxy.budget_spending,
                           anonproxy.budget_balance, anonproxy.budget_balance)
from public;
-- anonproxy.charge keeps PUBLIC's EXECUTE and checks its caller, as in 0003.
