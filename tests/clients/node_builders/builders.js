// Knex and Kysely, the query builders of Node applications, over node-postgres: what a dashboard or report of
// such an application asks of the demo tables, and the introspection they run. Connects with the PG* environment
// variables; prints one JSON line per step: {id, kind, tool, what, statements: [{sql, params}], rows | error}.
// Run by tests/test_bi_builders.py; with --capture the statements are written into the corpus by that file.
"use strict";

const knexFactory = require("knex");
const { Kysely, PostgresDialect, sql } = require("kysely");
const pg = require("pg");
const { prepareValue } = require("pg/lib/utils");  // the text node-postgres sends for a value

const connection = {
  host: process.env.PGHOST, port: Number(process.env.PGPORT), database: process.env.PGDATABASE,
  user: process.env.PGUSER, password: process.env.PGPASSWORD,
};

const sent = [];  // the statements of the current step, as the library hands them to node-postgres
const knex = knexFactory({ client: "pg", connection, pool: { min: 1, max: 1 } });
knex.on("query", (query) => sent.push({ sql: query.sql, params: query.bindings || [] }));
const kysely = new Kysely({
  dialect: new PostgresDialect({ pool: new pg.Pool({ ...connection, max: 1 }) }),
  log: (event) => sent.push({ sql: event.query.sql, params: event.query.parameters }),
});

const START = new Date(Date.UTC(2025, 2, 1));
const END = new Date(Date.UTC(2025, 3, 1));

const STEPS = [
  ["Knex", "kx-has-table", "catalog", "knex.schema.hasTable('adult')", () => knex.schema.hasTable("adult")],
  ["Knex", "kx-column-info", "catalog", "knex('adult').columnInfo()",
    async () => Object.keys(await knex("adult").columnInfo()).sort()],
  ["Knex", "kx-count-by-sex", "aggregate", "knex('adult').select('sex').count('* as n').groupBy('sex')",
    () => knex("adult").select("sex").count("* as n").groupBy("sex").orderBy("sex")],
  ["Knex", "kx-avg-filter", "aggregate",
    "knex('adult').select('education').avg('hours_per_week as hours').where('age', '>', 40).groupBy('education')",
    () => knex("adult").select("education").avg("hours_per_week as hours").where("age", ">", 40)
      .groupBy("education").orderBy("education")],
  ["Knex", "kx-monthly", "aggregate",
    "knex('visits').select(knex.raw(\"date_trunc('month', visited_at) as month\")).count().sum().groupByRaw('1')",
    () => knex("visits").select(knex.raw("date_trunc('month', visited_at) as month")).count("* as visits")
      .sum("amount as amount").groupByRaw("1").orderByRaw("1"), true],
  ["Knex", "kx-daily-bound-unit", "aggregate",
    "knex.raw('date_trunc(?, visited_at)', ['day']) ... where('visited_at', '>=', start).andWhere('visited_at', '<', end)",
    () => knex("visits").select(knex.raw("date_trunc(?, visited_at) as day", ["day"])).count("* as visits")
      .where("visited_at", ">=", START).andWhere("visited_at", "<", END).groupByRaw("1").orderByRaw("1"), true],
  ["Knex", "kx-count-distinct", "aggregate", "knex('visits').countDistinct('person_id as people')",
    () => knex("visits").countDistinct("person_id as people")],
  ["Knex", "kx-having", "aggregate",
    "knex('adult').select('occupation').count('* as n').groupBy('occupation').havingRaw('count(*) > ?', [1000])",
    () => knex("adult").select("occupation").count("* as n").groupBy("occupation")
      .havingRaw("count(*) > ?", [1000]).orderBy("occupation")],
  ["Knex", "kx-first", "row-level", "knex('adult').first()", () => knex("adult").first()],
  ["Kysely", "ky-get-tables", "catalog", "db.introspection.getTables()",
    async () => (await kysely.introspection.getTables()).map((table) => table.name).sort()],
  ["Kysely", "ky-count-by-race", "aggregate",
    "db.selectFrom('adult').select(['race', eb => eb.fn.countAll().as('n')]).groupBy('race')",
    () => kysely.selectFrom("adult").select(["race", (eb) => eb.fn.countAll().as("n")]).groupBy("race")
      .orderBy("race").execute()],
  ["Kysely", "ky-avg-where", "aggregate",
    "db.selectFrom('adult').select(['income', eb => eb.fn.avg('capital_gain').as('gain')]).where('age', '>=', 30)",
    () => kysely.selectFrom("adult").select(["income", (eb) => eb.fn.avg("capital_gain").as("gain")])
      .where("age", ">=", 30).groupBy("income").orderBy("income").execute()],
  ["Kysely", "ky-join", "aggregate",
    "db.selectFrom('visits').innerJoin('adult', 'adult.id', 'visits.person_id').select([...sum('visits.amount')])",
    () => kysely.selectFrom("visits").innerJoin("adult", "adult.id", "visits.person_id")
      .select(["adult.sex", "visits.channel", (eb) => eb.fn.sum("visits.amount").as("amount")])
      .groupBy(["adult.sex", "visits.channel"]).orderBy("adult.sex").orderBy("visits.channel").execute()],
  ["Kysely", "ky-monthly", "aggregate",
    "db.selectFrom('visits').select([sql`date_trunc('month', visited_at)`.as('month'), countAll])",
    () => kysely.selectFrom("visits")
      .select([sql`date_trunc('month', visited_at)`.as("month"), (eb) => eb.fn.countAll().as("visits")])
      .groupBy(sql`date_trunc('month', visited_at)`).orderBy("month").execute(), true],
  ["Kysely", "ky-rows", "row-level", "db.selectFrom('adult').selectAll().where('age', '>', 80)",
    () => kysely.selectFrom("adult").selectAll().where("age", ">", 80).execute()],
];

async function main() {
  for (const [tool, id, kind, what, run, timeSeries] of STEPS) {
    sent.length = 0;
    const line = { tool, id, kind, what, time_series: Boolean(timeSeries) };
    try {
      line.rows = await run();
    } catch (error) {
      line.error = { code: error.code || null, message: error.message, hint: error.hint || null };
    }
    line.statements = sent.map(({ sql: text, params }) => ({ sql: text, params: params.map(prepareValue) }));
    console.log(JSON.stringify(line));
  }
  await knex.destroy();
  await kysely.destroy();
}

main().catch((error) => { console.error(error); process.exit(1); });
