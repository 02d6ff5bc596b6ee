-- Migration 0035: a charge that does not grow with the ledger -- each role's totals kept beside its charges.
--
-- Until now every charge (and every remaining_budget) summed the role's rows of anonproxy.budget_ledger: an
-- index-only scan of all of them for a budget without a refresh period, so a charge cost more with every charge
-- before it (benchmarks/dp/breakdown.py: a charge's round trip 2.0 ms with an empty ledger, 8.2 ms once the role had
-- 10,000 charges). Now:
--
-- * anonproxy.budget_totals holds, per (role, domain), the sums of epsilon, delta, rho and delta_add of every charge
--   and their count. A trigger on the ledger adds each charge to them in the charge's own transaction: the totals
--   and the ledger commit together or not at all (a refused charge inserts nothing; a charge rolled back takes its
--   addition with it), and concurrent charges of one role add up exactly (INSERT ... ON CONFLICT DO UPDATE waits for
--   the row; charge() already holds the role's budget row FOR UPDATE, so they do not wait any more than before).
-- * role_spending reads the totals when the budget has no refresh period. With one, only the charges of the last
--   period count: it sums them as before (an index range scan over that period's charges only).
-- * domain_spending (the shared caps) still sums: totals per domain would make every role's charges on a domain wait
--   for each other, where without a cap they do not.
--
-- numeric addition is exact, and a sum's scale is the largest of its terms' either way, so every figure the ledger
-- answers is the one the sums gave, to the last digit.

create table anonproxy.budget_totals (
    role_name name not null,
    domain text not null,
    epsilon numeric not null,
    delta numeric not null,
    rho numeric not null,
    delta_add numeric not null,
    charges bigint not null,
    primary key (role_name, domain)
);
comment on table anonproxy.budget_totals is
    'Per role and domain, the sums of the amounts of every charge in anonproxy.budget_ledger and their count, kept by '
    'the ledger''s trigger in each charge''s transaction (sql/0035). Readable by its owner only.';
revoke all on anonproxy.budget_totals from public;

create function anonproxy.add_to_totals() returns trigger
language plpgsql security definer set search_path = pg_catalog, pg_temp as $$
begin
    insert into anonproxy.budget_totals as t (role_name, domain, epsilon, delta, rho, delta_add, charges)
        values (new.role_name, new.domain, new.epsilon, new.delta, new.rho, new.delta_add, 1)
        on conflict (role_name, domain) do update
           set epsilon = t.epsilon + excluded.epsilon, delta = t.delta + excluded.delta, rho = t.rho + excluded.rho,
               delta_add = t.delta_add + excluded.delta_add, charges = t.charges + 1;
    return null;
end
$$;
revoke execute on function anonproxy.add_to_totals() from public;

-- No charge may slip in between the sums below and the trigger (this migration is one transaction).
lock table anonproxy.budget_ledger in share row exclusive mode;
insert into anonproxy.budget_totals (role_name, domain, epsilon, delta, rho, delta_add, charges)
select l.role_name, l.domain, sum(l.epsilon), sum(l.delta), sum(l.rho), sum(l.delta_add), count(*)
  from anonproxy.budget_ledger l
 group by l.role_name, l.domain;
create trigger add_to_totals after insert on anonproxy.budget_ledger
    for each row execute function anonproxy.add_to_totals();

-- role_spending of 0019: the totals without a refresh period, the period's charges summed with one. Volatile, as
-- before: charge() calls it after locking the budget row, and each call reads what was committed by then.
create or replace function anonproxy.role_spending(budget anonproxy.budgets, as_of timestamptz)
returns anonproxy.budget_spending
language sql set search_path = pg_catalog, pg_temp as $$
    select case
        when budget.refresh_period is null then
            coalesce((select row(t.epsilon, t.delta, t.rho, t.delta_add)::anonproxy.budget_spending
                        from anonproxy.budget_totals t
                       where t.role_name = budget.role_name and t.domain = budget.domain),
                     row(0, 0, 0, 0)::anonproxy.budget_spending)
        else
            (select row(coalesce(sum(l.epsilon), 0), coalesce(sum(l.delta), 0), coalesce(sum(l.rho), 0),
                        coalesce(sum(l.delta_add), 0))::anonproxy.budget_spending
               from anonproxy.budget_ledger l
              where l.role_name = budget.role_name and l.domain = budget.domain
                and l.charged_at > as_of - budget.refresh_period)
    end
$$;
