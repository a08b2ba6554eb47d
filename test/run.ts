// `npm test`: every test file, with node:test, and a watchdog instead of --test-force-exit.
// Under --test-force-exit, Node drops the last results of some files from its report
// (nodejs/node#64833): the tests ran, but the count printed was lower than the count run, and it
// changed from run to run. Without it, a test that fails and leaves a server open keeps its file's
// process, and the run, alive: so a run that prints nothing for two minutes is stopped, and says
// so, with every process it started. Arguments go to node --test (`npm test -- --test-name-pattern=x`).

import { spawn } from 'node:child_process'
import { readdirSync } from 'node:fs'

const QUIET_MS = 120_000
const files = [
  'server.test.ts',
  ...readdirSync('test').flatMap((name) => (name.endsWith('.test.ts') ? [`test/${name}`] : [])),
]
const reporter = process.stdout.isTTY ? ['--test-reporter=spec'] : [] // as node --test picks on its own
const child = spawn(
  process.execPath,
  ['--import', 'tsx', '--test', ...reporter, ...process.argv.slice(2), ...files],
  { stdio: ['ignore', 'pipe', 'pipe'], detached: true }, // its own process group: stopped whole
)

let quiet: NodeJS.Timeout | undefined
const heard = () => {
  clearTimeout(quiet)
  quiet = setTimeout(() => {
    process.stderr.write(
      `\nnpm test: nothing was printed for ${QUIET_MS / 1000} s, so a test left something running: stopped\n`,
    )
    stop('SIGKILL')
    process.exit(1)
  }, QUIET_MS)
}
child.stdout.on('data', (chunk: Buffer) => (process.stdout.write(chunk), heard()))
child.stderr.on('data', (chunk: Buffer) => (process.stderr.write(chunk), heard()))
heard()
child.on('close', (code, signal) => {
  clearTimeout(quiet)
  process.exitCode = code ?? (signal === null ? 1 : 128)
})
for (const signal of ['SIGINT', 'SIGTERM'] as const) {
  process.on(signal, () => {
    stop(signal) // Ctrl-C stops the tests too
    process.exit(130)
  })
}

/** Stops the tests' process group, if it was started: its node --test and every file's process. */
function stop(signal: NodeJS.Signals): void {
  if (child.pid !== undefined) process.kill(-child.pid, signal)
}
