-- Migration 0019: zero-concentrated DP accounting beside basic composition (docs/ledger.md, "Two accountings").
--
-- Every charge now carries four numbers, each a valid guarantee of that one answer:
--   epsilon, delta     its (epsilon, delta)-DP guarantee, for basic composition (as before);
--   rho, delta_add     it is delta_add-approximately rho-zCDP (Bun and Steinke 2016): rho from its noisy
--                      statistics, delta_add from partition selection only.
-- So either accountant can read any row, and switching a budget's accountant never under-counts.
--
-- Every budget (a role's, and a domain's shared cap) has an accounting:
--   basic  a charge fits iff sum(epsilon) <= E and sum(delta) <= D (the rule of 0003, unchanged);
--   zcdp   a charge fits iff sum(delta_add) < D and sum(rho) <= rho_max(E, D - sum(delta_add)), where
--          rho_max(E, d) = (sqrt(E + ln(1/d)) - sqrt(ln(1/d)))^2 inverts Bun and Steinke's conversion
--          rho-zCDP => (rho + 2 sqrt(rho ln(1/d)), d)-DP. What the composed answers guarantee is then
--          (E, D)-DP: sum(delta_add) of approximation, plus the rest of D for the conversion.
-- Sums stay exact numeric; the conversion (ln, sqrt) is computed to 45 decimals and rounded outwards at 30
-- (rho_max down, epsilon up), so it can only err on the side of spending less.
--
-- Existing charges: rho = epsilon^2/2 and delta_add = delta, exact for every mechanism charged before this
-- migration (discrete Laplace and the exponential mechanism are pure epsilon-DP, hence epsilon^2/2-zCDP;
-- delta came from threshold partition selection only). Existing budgets and caps: the default rule, except
-- that one keeps basic where the zCDP view of its charges would leave more to spend than basic composition
-- does: the migration never gives back budget.

-- The conversion ------------------------------------------------------------------------------

-- x >= 0 rounded up to places decimals (trunc() rounds towards zero).
create function anonproxy.round_up(x numeric, places integer) returns numeric
language sql immutable strict set search_path = pg_catalog, pg_temp as $$
    select pg_catalog.trunc(x, places)
         + case when pg_catalog.trunc(x, places) < x then ('1e-' || places)::numeric else 0 end
$$;

-- The largest total rho whose Bun-Steinke conversion at delta stays within epsilon:
-- (sqrt(epsilon + L) - sqrt(L))^2 with L = ln(1/delta), computed as (epsilon / (sqrt(epsilon + L) + sqrt(L)))^2,
-- which loses no digits to cancellation. Rounded down; 0 at delta = 0 (no rho converts to a finite epsilon).
create function anonproxy.zcdp_rho_max(epsilon numeric, delta numeric) returns numeric
language plpgsql immutable strict set search_path = pg_catalog, pg_temp as $$
declare
    wide constant numeric := 1.000000000000000000000000000000000000000000000;  -- 45 decimals, kept by ln and sqrt
    l numeric;
    root numeric;
begin
    if not (epsilon >= 0 and epsilon < 'Infinity') then
        raise exception using errcode = '22023', message = format('epsilon must be a finite number >= 0, got %s', epsilon);
    end if;
    if not (delta >= 0 and delta < 1) then
        raise exception using errcode = '22023', message = format('delta must be in [0, 1), got %s', delta);
    end if;
    if delta = 0 or epsilon = 0 then
        return 0;
    end if;
    l := -pg_catalog.ln(delta * wide);
    root := epsilon * wide / (pg_catalog.sqrt(epsilon * wide + l) + pg_catalog.sqrt(l));
    return greatest(pg_catalog.trunc(root * root, 30) - 1e-30, 0);
end
$$;
comment on function anonproxy.zcdp_rho_max(numeric, numeric) is
    'The largest rho whose zCDP-to-DP conversion (Bun and Steinke 2016, Prop. 1.3) at delta is at most epsilon.';

-- Bun and Steinke 2016, Prop. 1.3: rho-zCDP implies (rho + 2 sqrt(rho ln(1/delta)), delta)-DP. Rounded up;
-- infinite at delta = 0 unless rho = 0.
create function anonproxy.zcdp_epsilon(rho numeric, delta numeric) returns numeric
language plpgsql immutable strict set search_path = pg_catalog, pg_temp as $$
declare
    wide constant numeric := 1.000000000000000000000000000000000000000000000;
begin
    if not (rho >= 0 and rho < 'Infinity') then
        raise exception using errcode = '22023', message = format('rho must be a finite number >= 0, got %s', rho);
    end if;
    if not (delta >= 0 and delta < 1) then
        raise exception using errcode = '22023', message = format('delta must be in [0, 1), got %s', delta);
    end if;
    if rho = 0 then
        return 0;
    end if;
    if delta = 0 then
        return 'Infinity';
    end if;
    -- rounded up, and one unit more: the 45-decimal value may itself be below the true one by far less than that
    return anonproxy.round_up(rho * wide + 2 * pg_catalog.sqrt(rho * wide * -pg_catalog.ln(delta * wide)), 30) + 1e-30;
end
$$;
comment on function anonproxy.zcdp_epsilon(numeric, numeric) is
    'The epsilon of the (epsilon, delta)-DP guarantee that rho-zCDP implies (Bun and Steinke 2016, Prop. 1.3).';

-- The accounting a budget gets when none is given: zcdp when it affords more one-statistic answers at the per-query
-- epsilon q (default 0.5, as the proxy's) -- a Gaussian answer at the noise of a Laplace one at q costs rho q^2/4,
-- a Laplace answer costs q under basic composition -- and basic otherwise (always at delta 0: pure zCDP gives no
-- finite epsilon there).
create function anonproxy.default_accounting(epsilon numeric, delta numeric, epsilon_per_query numeric default null)
returns text
language plpgsql immutable set search_path = pg_catalog, pg_temp as $$
declare
    q numeric := coalesce(epsilon_per_query, 0.5);
begin
    if epsilon is null or delta is null or not (epsilon > 0 and epsilon < 'Infinity') or not (delta > 0 and delta < 1)
       or not (q > 0 and q < 'Infinity') then
        return 'basic';
    end if;
    return case when anonproxy.zcdp_rho_max(epsilon, delta) / (q * q / 4) > epsilon / q then 'zcdp' else 'basic' end;
end
$$;

grant execute on function anonproxy.round_up(numeric, integer),
    anonproxy.zcdp_rho_max(numeric, numeric), anonproxy.zcdp_epsilon(numeric, numeric),
    anonproxy.default_accounting(numeric, numeric, numeric) to public;


-- The ledger: four numbers per charge -----------------------------------------------------------

-- The append-only triggers refuse UPDATE even to the owner: set aside for the backfill, in this transaction only
-- (ADD COLUMN holds an ACCESS EXCLUSIVE lock until it commits: no charge can slip in meanwhile).
alter table anonproxy.budget_ledger disable trigger append_only;
alter table anonproxy.budget_ledger add column rho numeric, add column delta_add numeric;
update anonproxy.budget_ledger set rho = epsilon * epsilon * 0.5, delta_add = delta;  -- a product: exact
alter table anonproxy.budget_ledger enable trigger append_only;
alter table anonproxy.budget_ledger
    alter column rho set not null,
    alter column delta_add set not null,
    add constraint rho_not_negative check (rho >= 0 and rho < 'Infinity'),
    add constraint delta_add_probability check (delta_add >= 0 and delta_add <= delta);

drop index anonproxy.budget_ledger_role_domain;
drop index anonproxy.budget_ledger_domain;
create index budget_ledger_role_domain on anonproxy.budget_ledger (role_name, domain, charged_at)
    include (epsilon, delta, rho, delta_add);
create index budget_ledger_domain on anonproxy.budget_ledger (domain, charged_at) include (epsilon, delta, rho, delta_add);


-- What has been spent, and what is left ---------------------------------------------------------

create type anonproxy.budget_spending as (
    epsilon numeric,
    delta numeric,
    rho numeric,
    delta_add numeric
);

alter type anonproxy.budget_remaining
    add attribute accounting text,          -- the role's budget: basic or zcdp
    add attribute epsilon_spent numeric,    -- of the role's budget, under its accounting
    add attribute rho_spent numeric,        -- sum of rho of the role's charges that count
    add attribute rho_left numeric,         -- what the role's budget still allows in rho; null under basic
    add attribute shared_accounting text,   -- the shared cap's; null without a cap
    add attribute shared_rho_left numeric;  -- what the cap still allows in rho; null without a zcdp cap

-- One budget under its accounting, given what counts against it (the pending charge included, if any).
create type anonproxy.budget_balance as (
    epsilon_left numeric,   -- what may still be spent, in epsilon at the budget's delta
    delta_left numeric,     -- basic: D - sum(delta); zcdp: D - sum(delta_add)
    epsilon_spent numeric,  -- basic: sum(epsilon); zcdp: the conversion of sum(rho) at what is left of delta
    rho_left numeric,       -- zcdp only
    fits boolean            -- whether spent stays within the budget
);

-- zcdp figures are shown to 12 decimals, rounded on the safe side (spent up, left down); the check itself uses
-- the unrounded sums.
create function anonproxy.budget_balance(accounting text, epsilon numeric, delta numeric,
                                         spent anonproxy.budget_spending)
returns anonproxy.budget_balance
language plpgsql immutable set search_path = pg_catalog, pg_temp as $$
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
    rho_max := anonproxy.zcdp_rho_max(epsilon, result.delta_left);
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

-- What counts for a role's budget, and for a domain's shared cap, at time as_of. Volatile on purpose: when
-- charge() calls them after locking the budget rows, each statement takes a new snapshot, which sees every
-- charge committed by whoever held the locks before.
create function anonproxy.role_spending(budget anonproxy.budgets, as_of timestamptz) returns anonproxy.budget_spending
language sql set search_path = pg_catalog, pg_temp as $$
    select row(coalesce(sum(l.epsilon), 0), coalesce(sum(l.delta), 0), coalesce(sum(l.rho), 0),
               coalesce(sum(l.delta_add), 0))::anonproxy.budget_spending
      from anonproxy.budget_ledger l
     where l.role_name = budget.role_name and l.domain = budget.domain
       and (budget.refresh_period is null or l.charged_at > as_of - budget.refresh_period)
$$;

create function anonproxy.domain_spending(cap anonproxy.shared_budgets, as_of timestamptz)
returns anonproxy.budget_spending
language sql set search_path = pg_catalog, pg_temp as $$
    select row(coalesce(sum(l.epsilon), 0), coalesce(sum(l.delta), 0), coalesce(sum(l.rho), 0),
               coalesce(sum(l.delta_add), 0))::anonproxy.budget_spending
      from anonproxy.budget_ledger l
     where l.domain = cap.domain and (cap.refresh_period is null or l.charged_at > as_of - cap.refresh_period)
$$;

create function anonproxy.plus(spent anonproxy.budget_spending, epsilon numeric, delta numeric, rho numeric,
                               delta_add numeric)
returns anonproxy.budget_spending
language sql immutable set search_path = pg_catalog, pg_temp as $$
    select row(spent.epsilon + epsilon, spent.delta + delta, spent.rho + rho,
               spent.delta_add + delta_add)::anonproxy.budget_spending
$$;

-- The remaining budget of a role (and of its domain's cap, if any), given what counts against each.
create function anonproxy.budget_state(budget anonproxy.budgets, cap anonproxy.shared_budgets,
                                       role_spent anonproxy.budget_spending, cap_spent anonproxy.budget_spending)
returns anonproxy.budget_remaining
language plpgsql immutable set search_path = pg_catalog, pg_temp as $$
declare
    result anonproxy.budget_remaining;
    own anonproxy.budget_balance := anonproxy.budget_balance(budget.accounting, budget.epsilon, budget.delta,
                                                             role_spent);
    shared anonproxy.budget_balance;
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
        shared := anonproxy.budget_balance(cap.accounting, cap.epsilon, cap.delta, cap_spent);
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

-- Budget state at time as_of (remaining_budget and remaining_budgets call it; same signature as in 0003).
create or replace function anonproxy.budget_state(budget anonproxy.budgets, cap anonproxy.shared_budgets,
                                                  as_of timestamptz)
returns anonproxy.budget_remaining
language plpgsql set search_path = pg_catalog, pg_temp as $$
begin
    return anonproxy.budget_state(budget, cap, anonproxy.role_spending(budget, as_of),
                                  case when cap.domain is not null then anonproxy.domain_spending(cap, as_of) end);
end
$$;


-- Budgets and caps: an accounting each ----------------------------------------------------------

alter table anonproxy.budgets add column accounting text;
alter table anonproxy.shared_budgets add column accounting text;

-- The default rule, unless the zCDP view of what already counts would leave more to spend than basic composition.
-- Only where there are rows: an UPDATE bumps the policy version (a statement trigger), a fresh install need not.
do $$
begin
    if exists (select from anonproxy.shared_budgets) then
        update anonproxy.shared_budgets s
           set accounting = case
               when anonproxy.default_accounting(s.epsilon, s.delta) = 'zcdp'
                and (anonproxy.budget_balance('zcdp', s.epsilon, s.delta, spent)).epsilon_left
                    <= (anonproxy.budget_balance('basic', s.epsilon, s.delta, spent)).epsilon_left
               then 'zcdp' else 'basic' end
          from (select c.domain, anonproxy.domain_spending(c, pg_catalog.clock_timestamp()) as spent
                  from anonproxy.shared_budgets c) x
         where x.domain = s.domain;
    end if;
    if exists (select from anonproxy.budgets) then
        update anonproxy.budgets b
           set accounting = case
               when anonproxy.default_accounting(b.epsilon, b.delta, b.epsilon_per_query) = 'zcdp'
                and (anonproxy.budget_balance('zcdp', b.epsilon, b.delta, spent)).epsilon_left
                    <= (anonproxy.budget_balance('basic', b.epsilon, b.delta, spent)).epsilon_left
               then 'zcdp' else 'basic' end
          from (select r.role_name, r.domain, anonproxy.role_spending(r, pg_catalog.clock_timestamp()) as spent
                  from anonproxy.budgets r) x
         where x.role_name = b.role_name and x.domain = b.domain;
    end if;
end
$$;

alter table anonproxy.budgets
    alter column accounting set not null,
    add constraint accounting_known check (accounting in ('basic', 'zcdp')),
    add constraint zcdp_needs_delta check (accounting = 'basic' or delta > 0);
alter table anonproxy.shared_budgets
    alter column accounting set not null,
    add constraint accounting_known check (accounting in ('basic', 'zcdp')),
    add constraint zcdp_needs_delta check (accounting = 'basic' or delta > 0);

comment on column anonproxy.budgets.accounting is
    'basic: epsilon and delta of the charges add up; zcdp: their rho and delta_add add up, converted to (epsilon, '
    'delta) by Bun and Steinke''s bound. See docs/ledger.md.';
comment on column anonproxy.shared_budgets.accounting is 'As anonproxy.budgets.accounting, for all roles together.';

-- The accounting given, or the default rule; refused when it cannot hold.
create function anonproxy.budget_accounting(item text, accounting text, epsilon numeric, delta numeric,
                                            epsilon_per_query numeric)
returns text
language plpgsql immutable set search_path = pg_catalog, pg_temp as $$
begin
    if accounting is null then
        return anonproxy.default_accounting(epsilon, delta, epsilon_per_query);
    end if;
    if accounting not in ('basic', 'zcdp') then
        raise exception using errcode = '22023',
            message = format('accounting %s must be basic or zcdp, got %s', item, accounting),
            hint = 'give none for the default: zcdp when it affords more answers, else basic';
    end if;
    if accounting = 'zcdp' and delta = 0 then
        raise exception using errcode = '22023',
            message = format('accounting %s cannot be zcdp with delta 0', item),
            hint = 'zCDP converts to (epsilon, delta)-DP only at a delta above 0: give a delta such as 0.00001, '
                   'or accounting basic';
    end if;
    return accounting;
end
$$;

drop function anonproxy.set_budget(name, regclass, numeric, numeric, interval, numeric, numeric);
create function anonproxy.set_budget(
    role_name name,
    domain regclass,
    epsilon numeric,
    delta numeric default 0,
    refresh_period interval default null,
    epsilon_per_query numeric default null,
    delta_per_query numeric default null,
    accounting text default null
) returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    target text;
    item text;
    chosen text;
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
    chosen := anonproxy.budget_accounting(item, accounting, epsilon, delta, epsilon_per_query);
    insert into anonproxy.budgets as b
        (role_name, domain, epsilon, delta, refresh_period, epsilon_per_query, delta_per_query, accounting)
        values (role_name, target, epsilon, delta, refresh_period, epsilon_per_query, delta_per_query, chosen)
        on conflict on constraint budgets_pkey do update
            set epsilon = excluded.epsilon, delta = excluded.delta, refresh_period = excluded.refresh_period,
                epsilon_per_query = excluded.epsilon_per_query, delta_per_query = excluded.delta_per_query,
                accounting = excluded.accounting;
end
$$;

drop function anonproxy.set_shared_budget(regclass, numeric, numeric, interval);
create function anonproxy.set_shared_budget(
    domain regclass,
    epsilon numeric,
    delta numeric default 0,
    refresh_period interval default null,
    accounting text default null
) returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    target text := anonproxy.budget_domain(domain);
    item text := format('of the shared budget on %s', target);
    chosen text;
begin
    perform anonproxy.check_budget_limits(item, epsilon, delta, refresh_period);
    chosen := anonproxy.budget_accounting(item, accounting, epsilon, delta, null);
    insert into anonproxy.shared_budgets as s (domain, epsilon, delta, refresh_period, accounting)
        values (target, epsilon, delta, refresh_period, chosen)
        on conflict on constraint shared_budgets_pkey do update
            set epsilon = excluded.epsilon, delta = excluded.delta, refresh_period = excluded.refresh_period,
                accounting = excluded.accounting;
end
$$;


-- Charging ----------------------------------------------------------------------------------------

-- Charge an answer's four amounts to role_name's budget on domain, or refuse (53400), each budget -- the role's, then
-- the domain's shared cap -- by its own accounting. Locks, snapshot and durability as in 0003: lock the role's budget
-- row, then the cap's row (always in this order: charges never deadlock), sum what counts with a snapshot taken after
-- the locks, insert the charge, make sure its COMMIT is flushed. Returns what remains after it.
create function anonproxy.charge(role_name name, domain text, epsilon numeric, delta numeric, rho numeric,
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
    by_role := not (anonproxy.budget_balance(budget.accounting, budget.epsilon, budget.delta,
                                             anonproxy.plus(role_spent, epsilon, delta, rho, delta_add))).fits;
    if by_role or (cap.domain is not null
                   and not (anonproxy.budget_balance(cap.accounting, cap.epsilon, cap.delta,
                                                     anonproxy.plus(cap_spent, epsilon, delta, rho, delta_add))).fits)
    then
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
                'the total converts to (epsilon, delta) by rho + 2 sqrt(rho ln(1/delta)), at what is left of delta '
                'after partition selection (%s)',
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

    insert into anonproxy.budget_ledger (role_name, domain, epsilon, delta, rho, delta_add, fingerprint, charged_at)
        values (role_name, domain, epsilon, delta, rho, delta_add, fingerprint, as_of);
    -- A charge must survive a crash of the server once its COMMIT has returned:
    -- with synchronous_commit off (or local, with synchronous standbys) it might not.
    if pg_catalog.current_setting('synchronous_commit') in ('off', 'local') then
        perform pg_catalog.set_config('synchronous_commit', 'on', true);
    end if;
    return anonproxy.budget_state(budget, cap, anonproxy.plus(role_spent, epsilon, delta, rho, delta_add),
                                  case when cap.domain is not null
                                       then anonproxy.plus(cap_spent, epsilon, delta, rho, delta_add) end);
end
$$;

-- The charge of 0003, for an answer whose epsilon is pure DP and whose delta is partition selection's (every answer
-- before this migration): rho = epsilon^2/2 (pure epsilon-DP implies epsilon^2/2-zCDP), delta_add = delta.
create or replace function anonproxy.charge(role_name name, domain text, epsilon numeric, delta numeric,
                                            fingerprint text)
returns anonproxy.budget_remaining
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
begin
    if role_name is null or domain is null or epsilon is null or delta is null or fingerprint is null then
        raise exception using errcode = '22004', message = 'role_name, domain, epsilon, delta and fingerprint '
            'of a charge must not be null';
    end if;
    return anonproxy.charge(role_name, domain, epsilon, delta, epsilon * epsilon * 0.5, delta, fingerprint);  -- exact
end
$$;


-- Reading ---------------------------------------------------------------------------------------------

-- lookup_answer (0012) also says the accounting, which decides the plan (and so the fingerprint).
drop function anonproxy.lookup_answer(name, text, text[], text);
create function anonproxy.lookup_answer(role_name name, domain text, tables text[], fingerprint text,
                                        out epsilon_per_query numeric, out delta_per_query numeric,
                                        out accounting text, out data_version text, out answer bytea)
language plpgsql stable security definer set search_path = pg_catalog, pg_temp as $$
begin
    -- the service role and the owner only: the data version is theirs to read (data_version() says so too)
    perform anonproxy.check_ledger_caller(format('look up the answers of role "%s"', role_name));
    select b.epsilon_per_query, b.delta_per_query, b.accounting into epsilon_per_query, delta_per_query, accounting
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

-- The budget left of whoever asks, by domain: plain SQL a BI tool can run, directly or through the proxy (where it
-- runs on the client's own connection, so session_user is the login). No budget: no rows.
create view anonproxy.my_budget as
select r.domain,
       r.accounting,
       r.epsilon_budget,
       r.epsilon_spent,
       r.epsilon as epsilon_left,           -- the lesser of the role's and the shared cap's
       r.delta_budget,
       r.delta as delta_left,
       r.rho_spent,
       least(r.rho_left, r.shared_rho_left) as rho_left,  -- null when neither budget is zcdp
       r.refresh_period
  from anonproxy.remaining_budgets(session_user) r;
comment on view anonproxy.my_budget is
    'The privacy budget left to the login role (session_user) on each protected table it has a budget on.';
grant select on anonproxy.my_budget to public;


-- Who may call what --------------------------------------------------------------------------------------------

revoke execute on function
    anonproxy.budget_balance(text, numeric, numeric, anonproxy.budget_spending),
    anonproxy.role_spending(anonproxy.budgets, timestamptz),
    anonproxy.domain_spending(anonproxy.shared_budgets, timestamptz),
    anonproxy.plus(anonproxy.budget_spending, numeric, numeric, numeric, numeric),
    anonproxy.budget_state(anonproxy.budgets, anonproxy.shared_budgets, anonproxy.budget_spending,
                           anonproxy.budget_spending),
    anonproxy.budget_accounting(text, text, numeric, numeric, numeric),
    anonproxy.set_budget(name, regclass, numeric, numeric, interval, numeric, numeric, text),
    anonproxy.set_shared_budget(regclass, numeric, numeric, interval, text)
from public;
-- anonproxy.charge (both forms) and lookup_answer keep PUBLIC's EXECUTE and check their caller, as in 0003.
