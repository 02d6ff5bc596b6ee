-- Migration 0034: contribution bounds a DBA declares, per role and protected table, next to the role's budget.
--
-- dp mode bounds what one person may add to an answer before it adds noise (docs/dp.md, "Contribution bounds"):
-- at most max_groups_per_person groups of a GROUP BY, and at most max_rows_per_person_and_group rows in each. The
-- noise grows with both; rows past them are left out of the answer. Both are 1 unless declared (each person counted
-- once, in one group), which suits a protected table read alone; over a linked table with several rows per person
-- (visits, orders) larger bounds count what the rows say instead of the people.
--
-- anonproxy.set_contribution_bounds(role, table, groups, rows) sets them on a budget that exists (set_budget keeps
-- them when it changes the budget's amounts); a change of them is a change of the policy (the trigger of 0003).

alter table anonproxy.budgets
    add column max_groups_per_person integer not null default 1
        constraint max_groups_per_person_range check (max_groups_per_person between 1 and 1000),
    add column max_rows_per_person_and_group integer not null default 1
        constraint max_rows_per_person_and_group_range check (max_rows_per_person_and_group between 1 and 1000);
comment on column anonproxy.budgets.max_groups_per_person is
    'dp mode: the most groups of one answer a person''s rows may reach (the others are left out), 1 to 1000.';
comment on column anonproxy.budgets.max_rows_per_person_and_group is
    'dp mode: the most rows of one person counted in one group of an answer (the others are left out), 1 to 1000.';

create function anonproxy.set_contribution_bounds(role_name name, domain regclass, max_groups_per_person integer,
                                                  max_rows_per_person_and_group integer default 1)
returns void
language plpgsql set search_path = pg_catalog, pg_temp as $$
declare
    target text := anonproxy.budget_domain(domain);
    item text := format('for role "%s" on %s', role_name, target);
begin
    if max_groups_per_person is null or not max_groups_per_person between 1 and 1000 then
        raise exception using errcode = '22023',
            message = format('max_groups_per_person %s must be an integer in [1, 1000], got %s',
                             item, coalesce(max_groups_per_person::text, 'NULL')),
            hint = 'the most groups of one answer a person may reach: 1 counts each person in one group';
    end if;
    if max_rows_per_person_and_group is null or not max_rows_per_person_and_group between 1 and 1000 then
        raise exception using errcode = '22023',
            message = format('max_rows_per_person_and_group %s must be an integer in [1, 1000], got %s',
                             item, coalesce(max_rows_per_person_and_group::text, 'NULL')),
            hint = 'the most rows of one person counted in one group: 1 counts people, not rows';
    end if;
    update anonproxy.budgets b
       set max_groups_per_person = set_contribution_bounds.max_groups_per_person,
           max_rows_per_person_and_group = set_contribution_bounds.max_rows_per_person_and_group
     where b.role_name = set_contribution_bounds.role_name and b.domain = target;
    if not found then
        raise exception using errcode = '42704',
            message = format('role "%s" has no privacy budget on %s', role_name, target),
            hint = format('give it one first: select anonproxy.set_budget(%L, %L, <epsilon>, <delta>)',
                          role_name, target);
    end if;
end
$$;

revoke execute on function anonproxy.set_contribution_bounds(name, regclass, integer, integer) from public;
