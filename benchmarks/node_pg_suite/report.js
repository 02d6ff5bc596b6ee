// Loaded with `node --require` before each test file of node-postgres's suite (run.py): records each test of its
// Suite class as one JSON line in the file NODE_PG_SUITE_REPORT names, "start" before its body runs and "done"
// when it has passed. The Suite ends the process at a test's failure, so a test that started and is not done failed.
'use strict'
const fs = require('fs')
const path = require('path')

const Suite = require(path.resolve('test/suite.js')) // the working directory is the checkout's packages/pg
const record = (event) => fs.appendFileSync(process.env.NODE_PG_SUITE_REPORT, JSON.stringify(event) + '\n')
const run = Suite.prototype.run

Suite.prototype.run = function (test, callback) {
  record({ test: test.name, event: 'start', body: Boolean(test.action) })
  return run.call(this, test, (err) => {
    record({ test: test.name, event: 'done' })
    callback(err)
  })
}
