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
-- * budget_balance reads rho_max from it (budget_rho_max_of); for a pair it does not hold (delta left below the
--   budget's once partition selection has spent some, or numbers no budget has) it computes it as before.
--
-- Every figure is the one zcdp_rho_max gives for the same numbers: nothing the ledger answers changes. A later
-- migration that redefines zcdp_rho_max must empty anonproxy.budget_rho_max and call refresh_budget_rho_max().

create table anonproxy.budget_rho_max (
    epsilon text not null,  -- a budget's epsilon, as numeric's text: its value and its scale
    delta text not null,    -- its delta, likewise
    rho_max numeric not null,
    primary key (epsilon, delta),
    constraint exact_numbers check (epsilon = epsilon::numeric::text and delta = delta::numeric::text)
);
comment on table anonproxy.budget_rho_max is
    'zcdp_rho_max(epsilon, delta) of every zcdp budget and shared cap, computed when it was set (sql/0031), so that '
    'a charge reads it instead of searching for it. Keyed by the numbers'' text: value and scale.';
revoke all on anonproxy.budget_rho_max from public;

-- zcdp_rho_max(epsilon, delta): the stored value when a budget has those very numbers, else computed.
create function anonproxy.budget_rho_max_of(epsilon numeric, delta numeric) returns numeric
language plpgsql stable strict set search_path = pg_catalog, pg_temp as $$
declare
    known numeric;
begin
    select m.rho_max into known
      from anonproxy.budget_rho_max m
     where m.epsilon = budget_rho_max_of.epsilon::text and m.delta = budget_rho_max_of.delta::text;
    if found then
        return known;
    end if;
    return anonproxy.zcdp_rho_max(epsilon, delta);
end
$$;

-- The (epsilon, delta) of every zcdp budget and cap, as budget_rho_max keys them.
create view anonproxy.zcdp_budget_numbers as
select b.epsilon::text as epsilon, b.delta::text as delta from anonproxy.budgets b where b.accounting = 'zcdp'
 union
select s.epsilon::text, s.delta::text from anonproxy.shared_budgets s where s.accounting = 'zcdp';
revoke all on anonproxy.zcdp_budget_numbers from public;

-- Make anonproxy.budget_rho_max hold the numbers of the zcdp budgets and caps, and only those. Computes only the
-- pairs it lacks: setting a budget to numbers already held costs a look-up.
create function anonproxy.refresh_budget_rho_max() returns void
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
begin
    delete from anonproxy.budget_rho_max m
     where not exists (select from anonproxy.zcdp_budget_numbers n where n.epsilon = m.epsilon and n.delta = m.delta);
    insert into anonproxy.budget_rho_max (epsilon, delta, rho_max)
    select n.epsilon, n.delta, anonproxy.zcdp_rho_max(n.epsilon::numeric, n.delta::numeric)
      from anonproxy.zcdp_budget_numbers n
     where not exists (select from anonproxy.budget_rho_max m where m.epsilon = n.epsilon and m.delta = n.delta)
        on conflict do nothing;  -- a concurrent change of another budget to the same numbers stored them first
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
-- calls is); budget_state, which calls it, likewise.
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
alter function anonproxy.budget_state(anonproxy.budgets, anonproxy.shared_budgets, anonproxy.budget_spending,
                                      anonproxy.budget_spending) stable;

-- As budget_balance (0019): internal, for the ledger's own SECURITY DEFINER functions.
revoke execute on function anonproxy.budget_rho_max_of(numeric, numeric), anonproxy.refresh_budget_rho_max(),
    anonproxy.budget_rho_max_follows() from public;
