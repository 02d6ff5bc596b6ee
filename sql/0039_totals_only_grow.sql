-- Migration 0039: the running totals are as append-only as the ledger they add up.
--
-- Since 0035 what a role has spent on a budget without a refresh period is read from anonproxy.budget_totals, not
-- summed over the ledger. The ledger refuses UPDATE, DELETE and TRUNCATE even to its owner (0003), so that an
-- answer once paid for stays paid for; the totals did not: a DELETE or TRUNCATE of budget_totals, or an UPDATE that
-- lowered a row, gave a role its budget back while the ledger kept every charge. Now a trigger refuses them, to the
-- owner too. The one change a row may take is the ledger's trigger adding one charge (0035's add_to_totals): the
-- count goes up by one and no sum goes down; a new row is one charge, of amounts >= 0 (a row of negative amounts
-- for a role without one would have been a budget made larger).

create function anonproxy.totals_only_grow() returns trigger
language plpgsql set search_path = pg_catalog, pg_temp as $$
begin
    if tg_op = 'INSERT' and new.charges = 1 and new.epsilon >= 0 and new.delta >= 0 and new.rho >= 0
       and new.delta_add >= 0 then
        return new;
    end if;
    if tg_op = 'UPDATE' and new.role_name = old.role_name and new.domain = old.domain
       and new.charges = old.charges + 1 and new.epsilon >= old.epsilon and new.delta >= old.delta
       and new.rho >= old.rho and new.delta_add >= old.delta_add then
        return new;
    end if;
    raise exception using errcode = '42501',
        message = format('the privacy-budget totals only grow with the ledger: %s is not allowed',
                         case when tg_op in ('INSERT', 'UPDATE') then 'this ' || lower(tg_op) else lower(tg_op) end),
        hint = 'each charge in anonproxy.budget_ledger adds itself to them; a charge is never taken back';
end
$$;

create trigger only_grow before insert or update or delete on anonproxy.budget_totals
    for each row execute function anonproxy.totals_only_grow();
create trigger only_grow_truncate before truncate on anonproxy.budget_totals
    for each statement execute function anonproxy.totals_only_grow();
