// npm run bench: how close Latch comes to the node:http limit, and how it holds up.
//
// Three processes share the two cores: the server under test, the load generator (autocannon,
// bench/load.ts) and this one, which only steers and is idle while a figure is timed. Latch runs
// as a child process through its real command line (`server.ts`, DATA_FILE=memory), with
// its one log line per request going to a file, exactly as a user runs it: that gives honest
// numbers, where an in-process server would share an event loop with the bench. The bare
// node:http server (bench/bare.ts) answers the same requests with the same headers and as many
// bytes as Latch, and does nothing else: the limit.
//
//   (a) POST /introspect of a live token              target: ≥ 80% of bare
//   (b) POST /token, one fresh code per request          target: ≥ 50% of bare
//       (the codes are minted through GET /auth and POST /auth/consent before the timed part)
//   (c) GET /auth, the consent page
//   (d) heap bytes per live token, 1,000,000 in a MemoryStore    target: ≤ 300
//   (e) longest event-loop stall while they all expire            target: ≤ 20 ms
//   (f) soak: SOAK_SECONDS (60) of mixed traffic, memory at start and end
//
// (a) to (c) measure the two servers in turn, round after round, and keep each one's best run:
// on two shared cores a neighbour's load can halve a run.
//
// Settings: SOAK_SECONDS (60), BENCH_SECONDS per timed run (6), BENCH_ROUNDS (5),
// BENCH_EXCHANGE_BATCHES (4: batches of 9,000 fresh codes a round for (b)),
// BENCH_CONNECTIONS (10), BENCH_FIGURES (abcdef: the letters of the figures to measure).
// The bench never fails: it prints what it measured, and which targets were missed.

import { fork, spawn } from 'node:child_process'
import type { ChildProcess } from 'node:child_process'
import { closeSync, mkdtempSync, openSync, readFileSync, rmSync } from 'node:fs'
import { Agent, request } from 'node:http'
import type { IncomingHttpHeaders } from 'node:http'
import { cpus, tmpdir } from 'node:os'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import type { BareAnswers } from './bare.ts'
import type { LoadJob, LoadResult, SoakJob } from './load.ts'

const SOAK_SECONDS = Number(process.env.SOAK_SECONDS ?? 60)
const MEASURE_SECONDS = Number(process.env.BENCH_SECONDS ?? 6)
const WARMUP_SECONDS = 2
const CONNECTIONS = Number(process.env.BENCH_CONNECTIONS ?? 10)
/** Which figures to measure, by letter: all by default; `BENCH_FIGURES=ab` for introspection and exchange only. */
const FIGURES = process.env.BENCH_FIGURES ?? 'abcdef'
/** Codes for one batch of timed token exchanges: under the 10,000 unredeemed codes Latch keeps. */
const TIMED_CODES = 9000
/** Batches of token exchanges a round times at Latch, one after the other. */
const EXCHANGE_BATCHES = Number(process.env.BENCH_EXCHANGE_BATCHES ?? 4)
/** Rounds of each pair of runs; each server's best counts. */
const ROUNDS = Number(process.env.BENCH_ROUNDS ?? 5)
const WARMUP_CODES = 800

const ROOT = fileURLToPath(new URL('..', import.meta.url))
const VERIFIER = 'dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk'
const CHALLENGE = 'E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM'
const CLIENT_ID = 'http://127.0.0.1:8080/'
const REDIRECT_URI = 'http://127.0.0.1:8080/callback'
const AUTHORIZATION_PATH = `/auth?${new URLSearchParams({ response_type: 'code', client_id: CLIENT_ID, redirect_uri: REDIRECT_URI, state: 'bench', code_challenge: CHALLENGE, code_challenge_method: 'S256', scope: 'profile create' })}`
const TOKEN_BODY = `grant_type=authorization_code&code=CODE&${new URLSearchParams({ client_id: CLIENT_ID, redirect_uri: REDIRECT_URI, code_verifier: VERIFIER })}`

// --- Processes ------------------------------------------------------------------------

type Server = { url: string; child: ChildProcess; logFile: string }

/** Starts a node process whose output goes to a file, and waits for the line that names its URL. */
async function startServer(
  name: string,
  args: string[],
  env: Record<string, string>,
  ready: RegExp,
  dir: string,
): Promise<Server> {
  const logFile = join(dir, `${name}.log`)
  const fd = openSync(logFile, 'w')
  const child = spawn(process.execPath, args, {
    cwd: ROOT,
    env: { ...cleanEnv(), ...env },
    stdio: ['ignore', fd, fd, 'ipc'],
  })
  closeSync(fd)
  for (let waited = 0; waited < 20_000; waited += 50) {
    const match = ready.exec(readFileSync(logFile, 'utf8'))
    if (match !== null)
      return { url: match[1].startsWith('http') ? match[1] : `http://127.0.0.1:${match[1]}`, child, logFile }
    if (child.exitCode !== null) break
    await sleep(50)
  }
  throw new Error(`${name} did not start:\n${readFileSync(logFile, 'utf8')}`)
}

/** The environment without any Latch setting, so that the bench measures the defaults. */
function cleanEnv(): Record<string, string> {
  const env: Record<string, string> = {}
  for (const [name, value] of Object.entries(process.env)) {
    if (
      value !== undefined &&
      !/^(PORT|HOST|ISSUER|ME|PASSWORD_HASH|DATA_FILE|CODE_TTL|ACCESS_TOKEN_TTL|REFRESH_TOKEN_TTL|INTROSPECTION_SECRET|PROFILE_\w+)$/.test(
        name,
      )
    )
      env[name] = value
  }
  return env
}

function stop(child: ChildProcess): Promise<void> {
  if (child.exitCode !== null || child.signalCode !== null) return Promise.resolve()
  return new Promise((resolve) => {
    child.once('exit', () => resolve())
    child.kill('SIGTERM')
  })
}

/** Asks a child for the one answer to one message. */
function ask<T>(child: ChildProcess, message: unknown): Promise<T> {
  return new Promise((resolve) => {
    child.once('message', (answer) => resolve(answer as T))
    child.send(message as object)
  })
}

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms))

// --- A small client for the untimed parts: signing in and minting codes ----------------

const agent = new Agent({ keepAlive: true, maxSockets: 16 })

type Answer = { status: number; location: string; cookie: string; headers: IncomingHttpHeaders; text: string }

function send(
  url: string,
  method: string,
  path: string,
  options: { body?: string; cookie?: string } = {},
): Promise<Answer> {
  const headers: Record<string, string> = {}
  if (options.body !== undefined) headers['Content-Type'] = 'application/x-www-form-urlencoded'
  if (options.cookie !== undefined) headers.Cookie = options.cookie
  return new Promise((resolve, reject) => {
    const req = request(`${url}${path}`, { method, headers, agent }, (res) => {
      let text = ''
      res.setEncoding('utf8')
      res.on('data', (chunk: string) => (text += chunk))
      res.on('end', () =>
        resolve({
          status: res.statusCode ?? 0,
          location: res.headers.location ?? '',
          cookie: (res.headers['set-cookie']?.[0] ?? '').split(';')[0],
          headers: res.headers,
          text,
        }),
      )
    })
    req.on('error', reject)
    req.end(options.body)
  })
}

/** One code, the way a person gets it: open the consent page, approve. */
async function mintCode(url: string): Promise<string> {
  const page = await send(url, 'GET', AUTHORIZATION_PATH)
  const id = /name="request" value="([^"]+)"/.exec(page.text)?.[1]
  const csrf = /name="csrf" value="([^"]+)"/.exec(page.text)?.[1]
  const body = `request=${id}&csrf=${csrf}&scope=profile&scope=create&decision=approve`
  const approved = await send(url, 'POST', '/auth/consent', { body, cookie: page.cookie })
  const code = /[?&]code=([^&]+)/.exec(approved.location)?.[1]
  if (code === undefined) throw new Error(`consent answered ${approved.status} ${approved.text.slice(0, 200)}`)
  return code
}

async function mintCodes(url: string, count: number): Promise<string[]> {
  const codes: string[] = []
  let started = 0
  const worker = async () => {
    while (started++ < count) codes.push(await mintCode(url))
  }
  await Promise.all(Array.from({ length: 8 }, worker))
  return codes
}

/** What the bare server needs to answer like Latch did: the headers node:http does not add itself, and the body's length. */
function shapeOf(answer: Answer): BareAnswers[string] {
  const headers = Object.fromEntries(
    Object.entries(answer.headers).filter(
      ([name]) => !['date', 'connection', 'keep-alive', 'content-length'].includes(name),
    ),
  )
  return { headers, bytes: Buffer.byteLength(answer.text) }
}

// --- Figures ----------------------------------------------------------------------------

/** A timed run, with the CPU time the server spent per request: a figure the load generator's own limits do not blur. */
type Measured = LoadResult & { cpuMicrosPerRequest: number }

/** Each server's best run of the rounds, and every round's ratio. */
type Pair = { bare: Measured; latch: Measured; roundRatios: number[] }

const loadJob = (url: string, fields: Partial<LoadJob>): LoadJob => ({
  kind: 'load',
  url,
  path: '/',
  method: 'GET',
  connections: CONNECTIONS,
  ...fields,
})

async function measure(load: ChildProcess, server: Server, job: LoadJob): Promise<Measured> {
  const before = await ask<Usage>(server.child, 'usage')
  const result = await ask<LoadResult>(load, job)
  const after = await ask<Usage>(server.child, 'usage')
  return { ...result, cpuMicrosPerRequest: (after.cpuMicros - before.cpuMicros) / result.requests }
}

/**
 * Warms both servers up, then measures them in turn, bare first, for ROUNDS rounds with the same
 * request, and keeps each server's best run: a neighbour's load on two shared cores can halve a
 * run, and alternating keeps a slow spell from falling on one server only.
 */
async function measurePair(load: ChildProcess, bare: Server, latch: Server, fields: Partial<LoadJob>): Promise<Pair> {
  await ask(load, loadJob(bare.url, { ...fields, seconds: WARMUP_SECONDS }))
  await ask(load, loadJob(latch.url, { ...fields, seconds: WARMUP_SECONDS }))
  const rounds: { bare: Measured; latch: Measured }[] = []
  for (let round = 0; round < ROUNDS; round++) {
    const bareResult = await measure(load, bare, loadJob(bare.url, { ...fields, seconds: MEASURE_SECONDS }))
    rounds.push({
      bare: bareResult,
      latch: await measure(load, latch, loadJob(latch.url, { ...fields, seconds: MEASURE_SECONDS })),
    })
  }
  return bestOf(rounds)
}

function bestOf(rounds: { bare: Measured; latch: Measured }[]): Pair {
  const best = (runs: Measured[]) => runs.reduce((a, b) => (b.rps > a.rps ? b : a))
  return {
    bare: best(rounds.map((round) => round.bare)),
    latch: best(rounds.map((round) => round.latch)),
    roundRatios: rounds.map((round) => round.latch.rps / round.bare.rps),
  }
}

/**
 * Token exchange: every Latch request redeems its own code, minted before the clock starts.
 * Latch keeps at most 10,000 unredeemed codes, so a round mints and redeems EXCHANGE_BATCHES
 * batches of 9,000 in turn, and only the redeeming is timed; the round's run is the batches
 * added up. One batch alone lasts half a second: too short a window to measure a server by, and
 * the best of a few such windows flatters the faster server most. The bare server does not
 * read the codes, so it gets such bodies for MEASURE_SECONDS, as in the other figures. Each
 * server's best round counts, as above.
 */
async function measureTokenExchange(load: ChildProcess, bare: Server, latch: Server): Promise<Pair> {
  const bodies = (codes: string[]) => codes.map((code) => TOKEN_BODY.replace('CODE', code))
  const exchange = (url: string, codes: string[]): LoadJob =>
    loadJob(url, { method: 'POST', path: '/token', bodies: bodies(codes), amount: codes.length - CONNECTIONS - 1 })
  const warmup = await mintCodes(latch.url, WARMUP_CODES)
  await ask(load, exchange(latch.url, warmup))
  const bareJob = (seconds: number) =>
    loadJob(bare.url, { method: 'POST', path: '/token', bodies: bodies(warmup), seconds })
  await ask(load, bareJob(WARMUP_SECONDS))
  const rounds: { bare: Measured; latch: Measured }[] = []
  for (let round = 0; round < ROUNDS; round++) {
    const bareResult = await measure(load, bare, bareJob(MEASURE_SECONDS))
    const batches: Measured[] = []
    for (let batch = 0; batch < EXCHANGE_BATCHES; batch++)
      batches.push(await measure(load, latch, exchange(latch.url, await mintCodes(latch.url, TIMED_CODES))))
    rounds.push({ bare: bareResult, latch: addUp(batches) })
  }
  return bestOf(rounds)
}

/** Timed runs taken as one: totals, and the worst batch's p50 and p99 (a latency histogram cannot be added up from percentiles). */
function addUp(runs: Measured[]): Measured {
  const total = (field: 'requests' | 'seconds' | 'status4xx' | 'status5xx' | 'errors' | 'resets') =>
    runs.reduce((sum, run) => sum + run[field], 0)
  const requests = total('requests')
  const seconds = total('seconds')
  return {
    requests,
    seconds,
    rps: requests / seconds,
    p50Ms: Math.max(...runs.map((run) => run.p50Ms)),
    p99Ms: Math.max(...runs.map((run) => run.p99Ms)),
    status4xx: total('status4xx'),
    status5xx: total('status5xx'),
    errors: total('errors'),
    resets: total('resets'),
    cpuMicrosPerRequest: runs.reduce((sum, run) => sum + run.cpuMicrosPerRequest * run.requests, 0) / requests,
  }
}

/** What bench/probe.ts answers: memory, and CPU time used so far (all threads: GC helpers count). */
type Usage = { rss: number; heapUsed: number; cpuMicros: number }

type TokenMemory = {
  tokens: number
  bytesPerToken: number
  fillSeconds: number
  drainSeconds: number
  drained: boolean
  left: number
  maxStallMs: number
  longestSweepMs: number
  sweepIntervalMs: number
}

/** (d) and (e) run alone, in a process of their own with `--expose-gc`. */
function measureTokenMemory(): Promise<TokenMemory> {
  return new Promise((resolve, reject) => {
    const child = spawn(
      process.execPath,
      ['--expose-gc', '--max-old-space-size=4096', '--import', 'tsx', 'bench/memory.ts'],
      { cwd: ROOT, stdio: ['ignore', 'pipe', 'inherit'] },
    )
    let output = ''
    child.stdout.on('data', (chunk) => (output += chunk))
    child.on('exit', (code) =>
      code === 0
        ? resolve(JSON.parse(output.trim().split('\n').at(-1) ?? '') as TokenMemory)
        : reject(new Error(`bench/memory.ts exited ${code}`)),
    )
  })
}

// --- Printing ---------------------------------------------------------------------------

const format = (value: number, digits = 0) =>
  value.toLocaleString('en-US', { maximumFractionDigits: digits, minimumFractionDigits: digits })
const mib = (bytes: number) => `${format(bytes / 2 ** 20, 1)} MiB`
const percent = (ratio: number) => `${format(ratio * 100)}%`

function describeRun(name: string, result: LoadResult & { cpuMicrosPerRequest?: number }): string {
  const problems = [
    result.status4xx > 0 ? `${result.status4xx} 4xx` : '',
    result.status5xx > 0 ? `${result.status5xx} 5xx` : '',
    result.errors > 0 ? `${result.errors} errors` : '',
  ]
  const note = problems.filter(Boolean).join(', ')
  const cpu =
    result.cpuMicrosPerRequest === undefined
      ? ''
      : `   CPU ${format(result.cpuMicrosPerRequest).padStart(3)} µs/request`
  return `  ${name.padEnd(6)} ${format(result.rps).padStart(8)} req/s   p50 ${format(result.p50Ms).padStart(3)} ms   p99 ${format(result.p99Ms).padStart(3)} ms${cpu}   (${format(result.requests)} requests in ${format(result.seconds, 1)} s${note === '' ? '' : `; ${note}`})`
}

function printPair(title: string, pair: Pair): void {
  console.log(`\n${title}`)
  console.log(describeRun('bare', pair.bare))
  console.log(describeRun('Latch', pair.latch))
  console.log(
    `  Latch/bare: ${percent(pair.latch.rps / pair.bare.rps)} of the requests per second; ${format(pair.latch.cpuMicrosPerRequest / pair.bare.cpuMicrosPerRequest, 1)}× the server CPU time per request`,
  )
  console.log(`  round by round: ${pair.roundRatios.map(percent).join(', ')}`)
}

type Row = [figure: string, measured: string, target: string, verdict: string]

function printTable(rows: Row[]): void {
  const widths = [0, 1, 2, 3].map((i) => Math.max(...rows.map((row) => row[i].length)))
  for (const [i, row] of rows.entries()) {
    console.log(`  ${row.map((cell, j) => cell.padEnd(widths[j])).join('   ')}`.trimEnd())
    if (i === 0) console.log(`  ${widths.map((width) => '-'.repeat(width)).join('   ')}`)
  }
}

const verdict = (ok: boolean) => (ok ? 'ok' : 'MISSED')

// --- Main -------------------------------------------------------------------------------

async function main(): Promise<void> {
  const began = performance.now()
  console.log(
    `Latch bench: Node ${process.version}, ${cpus().length} cores, 127.0.0.1 only, ${CONNECTIONS} connections, ${MEASURE_SECONDS} s per timed run after ${WARMUP_SECONDS} s of warm-up`,
  )
  console.log(
    'Latch runs as `node --import tsx server.ts` with DATA_FILE=memory in a child process; autocannon runs in another.',
  )
  console.log('Latencies are whole milliseconds, as autocannon records them; p99 figures below read Latch / bare.')
  const dir = mkdtempSync(join(tmpdir(), 'latch-bench-'))
  const probe = new URL('probe.ts', import.meta.url).href
  const latch = await startServer(
    'latch',
    ['--import', 'tsx', '--import', probe, 'server.ts'],
    { PORT: '0', DATA_FILE: 'memory' },
    /listening on (http:\/\/\S+)/,
    dir,
  )
  // One answer of each kind from Latch, for the bare server to send the same headers and as many bytes.
  const consentPage = await send(latch.url, 'GET', AUTHORIZATION_PATH)
  const exchanged = await send(latch.url, 'POST', '/token', {
    body: TOKEN_BODY.replace('CODE', await mintCode(latch.url)),
  })
  const token = /"access_token":"([^"]+)"/.exec(exchanged.text)?.[1]
  if (token === undefined) throw new Error(`/token answered ${exchanged.status} ${exchanged.text}`)
  const introspected = await send(latch.url, 'POST', '/introspect', { body: `token=${token}` })
  const answers: BareAnswers = {
    '/auth': shapeOf(consentPage),
    '/token': shapeOf(exchanged),
    '/introspect': shapeOf(introspected),
  }
  const bare = await startServer(
    'bare',
    ['--import', 'tsx', '--import', probe, 'bench/bare.ts'],
    { BARE_ANSWERS: JSON.stringify(answers) },
    /listening (\d+)/,
    dir,
  )
  const load = fork(join(ROOT, 'bench/load.ts'), { cwd: ROOT, execArgv: ['--import', 'tsx'], stdio: 'inherit' })
  try {
    const rows: Row[] = [['figure', 'measured', 'target', 'verdict']]
    const ratio = (pair: Pair) => pair.latch.rps / pair.bare.rps
    const describePair = (pair: Pair) =>
      `${percent(ratio(pair))} (${format(pair.latch.rps)} / ${format(pair.bare.rps)}), p99 ${format(pair.latch.p99Ms)} / ${format(pair.bare.p99Ms)} ms`

    if (FIGURES.includes('a')) {
      const introspection = await measurePair(load, bare, latch, {
        method: 'POST',
        path: '/introspect',
        body: `token=${token}`,
      })
      printPair('(a) POST /introspect, a live token', introspection)
      rows.push([
        '(a) introspection, Latch/bare req/s',
        describePair(introspection),
        '≥ 80%',
        verdict(ratio(introspection) >= 0.8),
      ])
    }

    if (FIGURES.includes('b')) {
      const exchange = await measureTokenExchange(load, bare, latch)
      printPair(
        `(b) POST /token, each request with its own fresh code (at Latch, ${EXCHANGE_BATCHES} batches of ${format(TIMED_CODES)} a round, each minted through GET /auth and POST /auth/consent first)`,
        exchange,
      )
      rows.push([
        '(b) token exchange, Latch/bare req/s',
        describePair(exchange),
        '≥ 50%',
        verdict(ratio(exchange) >= 0.5),
      ])
    }

    if (FIGURES.includes('c')) {
      const consent = await measurePair(load, bare, latch, { method: 'GET', path: AUTHORIZATION_PATH })
      printPair(`(c) GET /auth, the consent page (${format(Buffer.byteLength(consentPage.text))} bytes)`, consent)
      rows.push(['(c) consent page, Latch/bare req/s', describePair(consent), '-', '-'])
    }

    if (FIGURES.includes('f')) {
      console.log(
        `\n(f) Soak: ${SOAK_SECONDS} s of mixed traffic (sign in, exchange, introspect ×5, metadata, revoke, home page, again)`,
      )
      const soakStart = await ask<Usage>(latch.child, 'usage')
      const soak = await ask<LoadResult>(load, {
        kind: 'soak',
        url: latch.url,
        authorizationPath: AUTHORIZATION_PATH,
        tokenBody: TOKEN_BODY,
        seconds: SOAK_SECONDS,
        connections: CONNECTIONS,
      } satisfies SoakJob)
      const soakEnd = await ask<Usage>(latch.child, 'usage')
      console.log(describeRun('Latch', soak))
      console.log(`  start: RSS ${mib(soakStart.rss)}, heapUsed ${mib(soakStart.heapUsed)}`)
      console.log(`  end:   RSS ${mib(soakEnd.rss)}, heapUsed ${mib(soakEnd.heapUsed)}`)
      const errorLines = readFileSync(latch.logFile, 'utf8')
        .split('\n')
        .filter((line) => /^error:|server_error/.test(line))
      console.log(
        `  Latch logged ${errorLines.length} error lines during the whole bench${errorLines.length === 0 ? '' : `, the first: ${errorLines[0]}`}`,
      )
      const outcome =
        soak.status5xx + soak.errors === 0 && errorLines.length === 0
          ? 'no 5xx, no errors'
          : `${soak.status5xx} 5xx, ${soak.errors + errorLines.length} errors`
      rows.push([
        `(f) soak ${SOAK_SECONDS} s, RSS / heapUsed`,
        `${mib(soakStart.rss)} → ${mib(soakEnd.rss)} / ${mib(soakStart.heapUsed)} → ${mib(soakEnd.heapUsed)}`,
        '-',
        outcome,
      ])
    }
    await Promise.all([stop(latch.child), stop(bare.child), stop(load)])

    if (FIGURES.includes('d') || FIGURES.includes('e')) {
      console.log('\n(d) and (e): 1,000,000 live tokens in a MemoryStore, in a process of their own (node --expose-gc)')
      const memory = await measureTokenMemory()
      console.log(
        `  ${format(memory.tokens)} tokens, each with its own grant, saved in ${format(memory.fillSeconds, 1)} s: ${format(memory.bytesPerToken)} heap bytes per token`,
      )
      console.log(
        `  then all expired, swept by store.sweep(now) every ${memory.sweepIntervalMs} ms (the server does every 100 ms): ${memory.drained ? 'empty' : `${format(memory.left)} entries left`} after ${format(memory.drainSeconds, 2)} s`,
      )
      console.log(
        `  longest event-loop stall ${format(memory.maxStallMs, 1)} ms; longest single sweep ${format(memory.longestSweepMs, 1)} ms`,
      )
      rows.push([
        '(d) heap bytes per live token',
        format(memory.bytesPerToken),
        '≤ 300',
        verdict(memory.bytesPerToken <= 300),
      ])
      rows.push([
        '(e) max event-loop stall, 1M expiring',
        `${format(memory.maxStallMs, 1)} ms (empty after ${format(memory.drainSeconds, 1)} s)`,
        '≤ 20 ms',
        verdict(memory.maxStallMs <= 20 && memory.drained),
      ])
    }

    console.log('\nSummary')
    printTable(rows)
    console.log(`\nThe bench took ${format((performance.now() - began) / 1000)} s.`)
  } finally {
    agent.destroy()
    await Promise.all([stop(latch.child), stop(bare.child), stop(load)])
    rmSync(dir, { recursive: true, force: true })
  }
}

await main()
