// Knex's query builder, the Sequelize, Drizzle and TypeORM ORMs over node-postgres: what an application's dashboard
// asks of the demo tables, and the introspection and connection start-up each sends. Connects with the PG*
// environment variables (PGOPTIONS as the connection's options, so a direct connection can run as a role:
// -c role=...); prints one JSON line per step: {tool, id, kind, what, keys, count, per_person, refusal,
// statements: [{sql, params}], rows | error}. Kinds: catalog, counts (counts by `keys`), exact, refused (the message
// names `refusal`); `count` names the field that counts people (`value` for a scalar), per_person is false over the
// visits. Run by tests/test_orm_node.py.
"use strict";

const knexFactory = require("knex");
const pg = require("pg");
const { Sequelize, DataTypes, Op, fn, col } = require("sequelize");
const { prepareValue } = require("pg/lib/utils");  // the text node-postgres sends for a value
const { drizzle } = require("drizzle-orm/node-postgres");
const { bigint, integer, numeric, pgTable, text, timestamp } = require("drizzle-orm/pg-core");
const dz = require("drizzle-orm");
const typeorm = require("typeorm");

const connection = {
  host: process.env.PGHOST, port: Number(process.env.PGPORT), database: process.env.PGDATABASE,
  user: process.env.PGUSER, password: process.env.PGPASSWORD, options: process.env.PGOPTIONS,
};

// The statements of the current step as node-postgres receives them, the libraries' connection start-up included.
const sent = [];
const clientQuery = pg.Client.prototype.query;
pg.Client.prototype.query = function query(config, values, callback) {
  const text = typeof config === "string" ? config : config && config.text;
  if (text) sent.push({ sql: text, params: (config && config.values) || (Array.isArray(values) ? values : []) });
  return clientQuery.call(this, config, values, callback);
};

const knex = knexFactory({ client: "pg", connection, pool: { min: 1, max: 1 } });
const sequelize = new Sequelize(connection.database, connection.user, connection.password, {
  host: connection.host, port: connection.port, dialect: "postgres", dialectOptions: { options: connection.options },
  pool: { max: 1 }, logging: false,
});

const Adult = sequelize.define("Adult", {
  id: { type: DataTypes.INTEGER, primaryKey: true }, age: DataTypes.INTEGER, workclass: DataTypes.TEXT,
  education: DataTypes.TEXT, occupation: DataTypes.TEXT, race: DataTypes.TEXT, sex: DataTypes.TEXT,
  capital_gain: DataTypes.INTEGER, hours_per_week: DataTypes.INTEGER, native_country: DataTypes.TEXT,
  income: DataTypes.TEXT,
}, { tableName: "adult", timestamps: false });
const Visit = sequelize.define("Visit", {
  visit_id: { type: DataTypes.BIGINT, primaryKey: true }, person_id: DataTypes.INTEGER,
  visited_at: DataTypes.DATE, channel: DataTypes.TEXT, amount: DataTypes.DECIMAL(10, 2),
}, { tableName: "visits", timestamps: false });
Adult.hasMany(Visit, { foreignKey: "person_id" });
Visit.belongsTo(Adult, { foreignKey: "person_id" });

// Drizzle over a node-postgres pool of one connection, its tables declared as an application declares them.
const pool = new pg.Pool({ ...connection, max: 1 });
const db = drizzle(pool);
const adult = pgTable("adult", {
  id: integer("id").primaryKey(), age: integer("age"), workclass: text("workclass"), education: text("education"),
  occupation: text("occupation"), race: text("race"), sex: text("sex"), capitalGain: integer("capital_gain"),
  hoursPerWeek: integer("hours_per_week"), nativeCountry: text("native_country"), income: text("income"),
});
const visits = pgTable("visits", {
  visitId: bigint("visit_id", { mode: "number" }).primaryKey(), personId: integer("person_id"),
  visitedAt: timestamp("visited_at", { withTimezone: true }), channel: text("channel"),
  amount: numeric("amount", { precision: 10, scale: 2 }),
});
const month = dz.sql`date_trunc('month', ${visits.visitedAt})`;

// TypeORM's entities declared without decorators (EntitySchema), a data source of one pooled connection.
const text_ = { type: "text", nullable: true };
const AdultEntity = new typeorm.EntitySchema({
  name: "Adult", tableName: "adult",
  columns: { id: { type: "int", primary: true }, age: { type: "int" }, workclass: text_, education: text_,
    occupation: text_, race: text_, sex: text_, capital_gain: { type: "int" }, hours_per_week: { type: "int" },
    native_country: text_, income: text_ },
  relations: { visits: { type: "one-to-many", target: "Visit", inverseSide: "person" } },
});
const VisitEntity = new typeorm.EntitySchema({
  name: "Visit", tableName: "visits",
  columns: { visit_id: { type: "bigint", primary: true }, person_id: { type: "int" },
    visited_at: { type: "timestamptz" }, channel: text_, amount: { type: "numeric", precision: 10, scale: 2 } },
  relations: { person: { type: "many-to-one", target: "Adult", joinColumn: { name: "person_id" } } },
});
const dataSource = new typeorm.DataSource({
  type: "postgres", host: connection.host, port: connection.port, database: connection.database,
  username: connection.user, password: connection.password, extra: { options: connection.options, max: 1 },
  entities: [AdultEntity, VisitEntity], synchronize: false, logging: false,
});
let source = null;  // initialized by the first TypeORM step: its connection start-up is that step's
async function orm() {
  source = source || await dataSource.initialize();
  return source;
}
const people = async () => (await orm()).getRepository("Adult");
const adults = async () => (await people()).createQueryBuilder("a");
const visitsOf = async () => (await orm()).getRepository("Visit").createQueryBuilder("v");
async function tableColumns(name) {
  const runner = (await orm()).createQueryRunner();
  try {
    const table = await runner.getTable(name);
    return table.columns.map((column) => [column.name, column.type, column.isNullable]);
  } finally {
    await runner.release();
  }
}
async function hasTable(name) {
  const runner = (await orm()).createQueryRunner();
  try {
    return await runner.hasTable(name);
  } finally {
    await runner.release();
  }
}

const START = new Date(Date.UTC(2025, 2, 1));
const END = new Date(Date.UTC(2025, 5, 1));

// [tool, id, kind, what, run, {keys, count, per_person, refusal}]
const STEPS = [
  ["Knex", "kx-has-table", "catalog", "knex.schema.hasTable('visits')", () => knex.schema.hasTable("visits")],
  ["Knex", "kx-column-info", "catalog", "knex('visits').columnInfo()", () => knex("visits").columnInfo()],
  ["Knex", "kx-count-group", "counts", "knex('adult').select('education').count('id as n').groupBy('education')",
    () => knex("adult").select("education").count("id as n").groupBy("education").orderBy("education"),
    { keys: ["education"], count: "n" }],
  ["Knex", "kx-where-in", "counts",
    "knex('adult').select('sex', 'race').count('* as n').whereIn('race', ['White', 'Black', 'Other'])"
      + ".groupBy('sex', 'race')",
    () => knex("adult").select("sex", "race").count("* as n").whereIn("race", ["White", "Black", "Other"])
      .groupBy("sex", "race").orderBy(["sex", "race"]), { keys: ["sex", "race"], count: "n" }],
  ["Knex", "kx-where-between-first", "exact", "knex('adult').count('* as n').whereBetween('age', [30, 39]).first()",
    () => knex("adult").count("* as n").whereBetween("age", [30, 39]).first(), { count: "n" }],
  ["Knex", "kx-sum", "exact", "knex('adult').sum('capital_gain as total').where('sex', 'Female')",
    () => knex("adult").sum("capital_gain as total").where("sex", "Female")],
  ["Knex", "kx-avg", "exact", "knex('adult').select('sex').avg('hours_per_week as hours').groupBy('sex')",
    () => knex("adult").select("sex").avg("hours_per_week as hours").groupBy("sex").orderBy("sex")],
  ["Knex", "kx-count-distinct", "exact", "knex('adult').countDistinct('native_country as countries')",
    () => knex("adult").countDistinct("native_country as countries")],
  ["Knex", "kx-having-bindings", "exact",
    "knex('adult').select('education').count('* as n').groupBy('education').havingRaw('count(*) > ?', [500])",
    () => knex("adult").select("education").count("* as n").groupBy("education").havingRaw("count(*) > ?", [500])
      .orderBy("education")],
  ["Knex", "kx-top-n", "exact", "knex('adult').select('occupation').count('* as n').groupBy('occupation')"
      + ".orderBy('n', 'desc').limit(3)",
    () => knex("adult").select("occupation").count("* as n").groupBy("occupation").orderBy("n", "desc").limit(3)],
  ["Knex", "kx-join-sum", "exact",
    "knex('visits').join('adult', 'adult.id', 'visits.person_id').select('adult.sex').sum('visits.amount as amount')"
      + ".groupBy('adult.sex')",
    () => knex("visits").join("adult", "adult.id", "visits.person_id").select("adult.sex")
      .sum("visits.amount as amount").groupBy("adult.sex").orderBy("adult.sex"), { per_person: false }],
  ["Knex", "kx-monthly-between", "exact",
    "knex('visits').select(knex.raw(\"date_trunc('month', visited_at) as month\")).count('* as n')"
      + ".whereBetween('visited_at', [start, end]).groupByRaw('1')",
    () => knex("visits").select(knex.raw("date_trunc('month', visited_at) as month")).count("* as n")
      .whereBetween("visited_at", [START, END]).groupByRaw("1").orderByRaw("1"), { per_person: false }],
  ["Knex", "kx-max", "refused", "knex('adult').max('age as oldest')", () => knex("adult").max("age as oldest"),
    { refusal: "max()" }],
  ["Knex", "kx-first-row", "refused", "knex('adult').where('age', '>', 85).first()",
    () => knex("adult").where("age", ">", 85).first(), { refusal: "row-level" }],
  ["Sequelize", "sq-show-tables", "catalog", "sequelize.getQueryInterface().showAllTables()",
    async () => (await sequelize.getQueryInterface().showAllTables()).sort()],
  ["Sequelize", "sq-describe-table", "catalog", "sequelize.getQueryInterface().describeTable('adult')",
    () => sequelize.getQueryInterface().describeTable("adult")],
  ["Sequelize", "sq-count-group", "counts", "Adult.count({ group: ['education'] })",
    () => Adult.count({ group: ["education"] }), { keys: ["education"], count: "count" }],
  ["Sequelize", "sq-findall-fn", "counts",
    "Adult.findAll({ attributes: ['sex', 'workclass', [fn('COUNT', col('id')), 'n']], group: ['sex', 'workclass'], "
      + "raw: true })",
    () => Adult.findAll({ attributes: ["sex", "workclass", [fn("COUNT", col("id")), "n"]],
      group: ["sex", "workclass"], order: [["sex", "ASC"], ["workclass", "ASC"]], raw: true }),
    { keys: ["sex", "workclass"], count: "n" }],
  ["Sequelize", "sq-count-where", "exact",
    "Adult.count({ where: { age: { [Op.between]: [30, 39] }, sex: { [Op.in]: ['Female'] } } })",
    () => Adult.count({ where: { age: { [Op.between]: [30, 39] }, sex: { [Op.in]: ["Female"] } } }),
    { count: "value" }],
  ["Sequelize", "sq-count-ilike", "exact", "Adult.count({ where: { occupation: { [Op.iLike]: '%sales%' } } })",
    () => Adult.count({ where: { occupation: { [Op.iLike]: "%sales%" } } }), { count: "value" }],
  ["Sequelize", "sq-count-distinct", "exact", "Adult.count({ distinct: true, col: 'native_country' })",
    () => Adult.count({ distinct: true, col: "native_country" })],
  ["Sequelize", "sq-sum", "exact", "Adult.sum('capital_gain', { where: { sex: 'Female' } })",
    () => Adult.sum("capital_gain", { where: { sex: "Female" } })],
  ["Sequelize", "sq-avg-group", "exact",
    "Adult.findAll({ attributes: ['income', [fn('AVG', col('hours_per_week')), 'hours']], group: ['income'] })",
    () => Adult.findAll({ attributes: ["income", [fn("AVG", col("hours_per_week")), "hours"]], group: ["income"],
      order: [["income", "ASC"]], raw: true })],
  ["Sequelize", "sq-include-count", "exact",
    "Adult.count({ include: [{ model: Visit, where: { channel: 'web' }, required: true }], distinct: true })",
    () => Adult.count({ include: [{ model: Visit, where: { channel: "web" }, required: true }], distinct: true }),
    { per_person: false }],
  ["Sequelize", "sq-monthly", "exact",
    "Visit.findAll({ attributes: [[fn('date_trunc', 'month', col('visited_at')), 'month'], [fn('COUNT', "
      + "col('visit_id')), 'n']], group: [fn('date_trunc', 'month', col('visited_at'))] })",
    () => Visit.findAll({ attributes: [[fn("date_trunc", "month", col("visited_at")), "month"],
      [fn("COUNT", col("visit_id")), "n"]], group: [fn("date_trunc", "month", col("visited_at"))],
      order: [[fn("date_trunc", "month", col("visited_at")), "ASC"]], raw: true }), { per_person: false }],
  ["Sequelize", "sq-max", "refused", "Adult.max('age')", () => Adult.max("age"), { refusal: "max()" }],
  ["Sequelize", "sq-find-all", "refused", "Adult.findAll({ where: { age: { [Op.gt]: 85 } }, limit: 5 })",
    () => Adult.findAll({ where: { age: { [Op.gt]: 85 } }, limit: 5, raw: true }), { refusal: "row-level" }],
  ["Drizzle", "dz-count-by-sex", "counts", "db.select({ sex: adult.sex, n: count() }).from(adult).groupBy(adult.sex)",
    () => db.select({ sex: adult.sex, n: dz.count() }).from(adult).groupBy(adult.sex).orderBy(adult.sex),
    { keys: ["sex"], count: "n" }],
  ["Drizzle", "dz-in-two", "counts",
    "db.select({ sex, race, n: count() }).from(adult).where(inArray(adult.race, [...])).groupBy(adult.sex, adult.race)",
    () => db.select({ sex: adult.sex, race: adult.race, n: dz.count() }).from(adult)
      .where(dz.inArray(adult.race, ["White", "Black", "Amer-Indian-Eskimo"])).groupBy(adult.sex, adult.race)
      .orderBy(adult.sex, adult.race), { keys: ["sex", "race"], count: "n" }],
  ["Drizzle", "dz-eq-range", "counts",
    "... .where(and(eq(adult.sex, 'Female'), gte(adult.age, 30), lt(adult.age, 40))).groupBy(adult.education)",
    () => db.select({ education: adult.education, n: dz.count(adult.id) }).from(adult)
      .where(dz.and(dz.eq(adult.sex, "Female"), dz.gte(adult.age, 30), dz.lt(adult.age, 40)))
      .groupBy(adult.education).orderBy(adult.education), { keys: ["education"], count: "n" }],
  ["Drizzle", "dz-ilike", "exact", "db.select({ n: count() }).from(adult).where(ilike(adult.occupation, '%sales%'))",
    () => db.select({ n: dz.count() }).from(adult).where(dz.ilike(adult.occupation, "%sales%")), { count: "n" }],
  ["Drizzle", "dz-dollar-count", "exact", "db.$count(adult, isNotNull(adult.workclass))",
    () => db.$count(adult, dz.isNotNull(adult.workclass)), { count: "value" }],
  ["Drizzle", "dz-aggregates", "exact",
    "db.select({ total: sum(adult.capitalGain), mean: avg(adult.age), sd: sql`stddev(...)` }).where(gte(...))",
    () => db.select({ total: dz.sum(adult.capitalGain), mean: dz.avg(adult.age),
      sd: dz.sql`stddev(${adult.hoursPerWeek})` }).from(adult).where(dz.gte(adult.age, 18))],
  ["Drizzle", "dz-count-distinct", "exact", "db.select({ countries: countDistinct(adult.nativeCountry) }).from(adult)",
    () => db.select({ countries: dz.countDistinct(adult.nativeCountry) }).from(adult)],
  ["Drizzle", "dz-conditional", "exact",
    "db.select({ race, women: sql`count(*) filter (where ${adult.sex} = ${'Female'})`, high: sql`sum(case ...)` })",
    () => db.select({ race: adult.race,
      women: dz.sql`count(*) filter (where ${adult.sex} = ${"Female"})`.mapWith(Number),
      high: dz.sql`sum(case when ${adult.income} = ${">50K"} then 1 else 0 end)`.mapWith(Number) })
      .from(adult).groupBy(adult.race).orderBy(adult.race)],
  ["Drizzle", "dz-top-n", "exact", "... .groupBy(adult.occupation).orderBy(desc(count())).limit(3): LIMIT $1",
    () => db.select({ occupation: adult.occupation, n: dz.count() }).from(adult).groupBy(adult.occupation)
      .orderBy(dz.desc(dz.count())).limit(3)],
  ["Drizzle", "dz-having", "exact", "... .groupBy(adult.education).having(({ n }) => gt(n, 500))",
    () => db.select({ education: adult.education, n: dz.count() }).from(adult).groupBy(adult.education)
      .having(({ n }) => dz.gt(n, 500)).orderBy(adult.education)],
  ["Drizzle", "dz-monthly", "exact",
    "db.select({ month: sql`date_trunc('month', ${visits.visitedAt})`, n: count() }).where(between(...))"
      + ".groupBy(month)",
    () => db.select({ month, n: dz.count() }).from(visits).where(dz.between(visits.visitedAt, START, END))
      .groupBy(month).orderBy(month), { per_person: false }],
  ["Drizzle", "dz-join-sum", "exact",
    "db.select({ sex: adult.sex, amount: sum(visits.amount) }).from(visits).innerJoin(adult, eq(...))",
    () => db.select({ sex: adult.sex, amount: dz.sum(visits.amount) }).from(visits)
      .innerJoin(adult, dz.eq(visits.personId, adult.id)).groupBy(adult.sex).orderBy(adult.sex),
    { per_person: false }],
  ["Drizzle", "dz-max", "refused", "db.select({ oldest: max(adult.age) }).from(adult)",
    () => db.select({ oldest: dz.max(adult.age) }).from(adult), { refusal: "max()" }],
  ["Drizzle", "dz-rows", "refused", "db.select().from(adult).where(gt(adult.age, 85)).limit(5)",
    () => db.select().from(adult).where(dz.gt(adult.age, 85)).limit(5), { refusal: "row-level" }],
  ["TypeORM", "to-has-table", "catalog", "dataSource.initialize(); queryRunner.hasTable('visits')",
    () => hasTable("visits")],
  ["TypeORM", "to-get-table", "catalog", "queryRunner.getTable('adult'): its columns", () => tableColumns("adult")],
  ["TypeORM", "to-count-group", "counts", "qb.select('a.sex', 'sex').addSelect('COUNT(a.id)', 'n').groupBy('a.sex')"
      + ".getRawMany()",
    async () => (await adults()).select("a.sex", "sex").addSelect("COUNT(a.id)", "n").groupBy("a.sex")
      .orderBy("a.sex").getRawMany(), { keys: ["sex"], count: "n" }],
  ["TypeORM", "to-where-in", "counts", "... .where('a.race IN (:...races)', { races }).groupBy('a.sex')"
      + ".addGroupBy('a.race')",
    async () => (await adults()).select("a.sex", "sex").addSelect("a.race", "race").addSelect("COUNT(*)", "n")
      .where("a.race IN (:...races)", { races: ["White", "Black", "Other"] }).groupBy("a.sex").addGroupBy("a.race")
      .orderBy("a.sex").addOrderBy("a.race").getRawMany(), { keys: ["sex", "race"], count: "n" }],
  ["TypeORM", "to-eq-between", "counts", "... .where('a.sex = :sex').andWhere('a.age BETWEEN :lo AND :hi')"
      + ".groupBy('a.education')",
    async () => (await adults()).select("a.education", "education").addSelect("COUNT(a.id)", "n")
      .where("a.sex = :sex", { sex: "Female" }).andWhere("a.age BETWEEN :lo AND :hi", { lo: 30, hi: 39 })
      .groupBy("a.education").orderBy("a.education").getRawMany(), { keys: ["education"], count: "n" }],
  ["TypeORM", "to-count-by", "exact", "repository.countBy({ sex: 'Female' }): COUNT(1)",
    async () => (await people()).countBy({ sex: "Female" }), { count: "value" }],
  ["TypeORM", "to-count-ilike", "exact", "repository.countBy({ occupation: ILike('%sales%') })",
    async () => (await people()).countBy({ occupation: typeorm.ILike("%sales%") }), { count: "value" }],
  ["TypeORM", "to-count-not-null", "exact", "repository.countBy({ workclass: Not(IsNull()) })",
    async () => (await people()).countBy({ workclass: typeorm.Not(typeorm.IsNull()) }), { count: "value" }],
  ["TypeORM", "to-sum", "exact", "repository.sum('capital_gain', { sex: 'Female' })",
    async () => (await people()).sum("capital_gain", { sex: "Female" })],
  ["TypeORM", "to-average", "exact", "repository.average('hours_per_week', { income: '>50K' })",
    async () => (await people()).average("hours_per_week", { income: ">50K" })],
  ["TypeORM", "to-count-distinct", "exact", "qb.select('COUNT(DISTINCT a.native_country)', 'countries').getRawOne()",
    async () => (await adults()).select("COUNT(DISTINCT a.native_country)", "countries").getRawOne()],
  ["TypeORM", "to-case-sum", "exact", "qb.addSelect('SUM(CASE WHEN a.income = :rich THEN 1 ELSE 0 END)', 'high')"
      + ".groupBy('a.race')",
    async () => (await adults()).select("a.race", "race").addSelect("COUNT(*)", "n")
      .addSelect("SUM(CASE WHEN a.income = :rich THEN 1 ELSE 0 END)", "high").setParameter("rich", ">50K")
      .groupBy("a.race").orderBy("a.race").getRawMany()],
  ["TypeORM", "to-top-n", "exact", "... .groupBy('a.occupation').orderBy('n', 'DESC').limit(3)",
    async () => (await adults()).select("a.occupation", "occupation").addSelect("COUNT(*)", "n")
      .groupBy("a.occupation").orderBy("n", "DESC").limit(3).getRawMany()],
  ["TypeORM", "to-having", "exact", "... .groupBy('a.education').having('COUNT(*) > :min', { min: 500 })",
    async () => (await adults()).select("a.education", "education").addSelect("AVG(a.hours_per_week)", "hours")
      .groupBy("a.education").having("COUNT(*) > :min", { min: 500 }).orderBy("a.education").getRawMany()],
  ["TypeORM", "to-monthly", "exact", "visits qb.select(\"date_trunc('month', v.visited_at)\", 'month')"
      + ".where('v.visited_at BETWEEN :start AND :end').groupBy('month')",
    async () => (await visitsOf()).select("date_trunc('month', v.visited_at)", "month").addSelect("COUNT(*)", "n")
      .where("v.visited_at BETWEEN :start AND :end", { start: START, end: END }).groupBy("month")
      .orderBy("month").getRawMany(), { per_person: false }],
  ["TypeORM", "to-join-sum", "exact", "visits qb.innerJoin('v.person', 'a').select('a.sex').addSelect('SUM(v.amount)')"
      + ".groupBy('a.sex')",
    async () => (await visitsOf()).innerJoin("v.person", "a").select("a.sex", "sex")
      .addSelect("SUM(v.amount)", "amount").groupBy("a.sex").orderBy("a.sex").getRawMany(), { per_person: false }],
  ["TypeORM", "to-maximum", "refused", "repository.maximum('age')", async () => (await people()).maximum("age"),
    { refusal: "max()" }],
  ["TypeORM", "to-find", "refused", "repository.find({ where: { age: MoreThan(85) }, take: 5 })",
    async () => (await people()).find({ where: { age: typeorm.MoreThan(85) }, take: 5 }), { refusal: "row-level" }],
  ["TypeORM", "to-find-one-by", "refused", "repository.findOneBy({ id: 1 })",
    async () => (await people()).findOneBy({ id: 1 }), { refusal: "row-level" }],
];

// A value as JSON carries it: dates as ISO text, numbers as node-postgres gave them (bigint and numeric as text).
function plain(value) {
  return JSON.parse(JSON.stringify(value === undefined ? null : value));
}

async function main() {
  for (const [tool, id, kind, what, run, extra] of STEPS) {
    sent.length = 0;
    const line = { tool, id, kind, what, keys: [], count: null, per_person: true, refusal: "", ...extra };
    try {
      line.rows = plain(await run());
    } catch (error) {
      // Sequelize wraps node-postgres's error in .parent, Drizzle in .cause, TypeORM in .driverError
      const cause = error.parent || error.driverError || (error.cause && error.cause.code ? error.cause : error);
      line.error = { code: cause.code || null, message: cause.message, hint: cause.hint || null };
    }
    line.statements = sent.map(({ sql: text, params }) => ({ sql: text, params: params.map(prepareValue) }));
    console.log(JSON.stringify(line));
  }
  await knex.destroy();
  await sequelize.close();
  await pool.end();
  if (source) await source.destroy();
}

main().catch((error) => { console.error(error); process.exit(1); });
