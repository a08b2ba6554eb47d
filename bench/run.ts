// npm run bench: what Latch costs in the three states a person's server is in, beside the
// node:http limit and a real peer.
//
// Four processes share the two cores: the servers under test, the load generator (autocannon,
// bench/load.ts) and this one, which steers, and sends the paced requests itself. Latch runs as a
// child process through its real command line (`server.ts`, DATA_FILE=memory), with its one log
// line per request going to a file, exactly as a user runs it. The bare node:http server
// (bench/bare.ts) answers the same requests with the same headers and as many bytes as Latch, and
// does nothing else: the limit. The peer is node-oidc-provider in memory (bench/peer.ts).
//
// Warm (as a load generator sees it: 10 connections as fast as they go, after a warm-up)
//   (a) POST /introspect of a live token         targets: ≥ 80% of bare; the peer ≥ 8× Latch's CPU
//   (b) POST /token, one fresh code per request  targets: ≥ 50% of bare, ≤ 1.3× its CPU; the peer ≥ 5×
//   (g) POST /revoke of a token the server does not hold
//   (c) GET /auth, the consent page
// Paced (as a person's clients send them; servers warm)
//   (i) each kind one request at a time, then at a fixed 200 a second
// Cold (a process just started, with its data file on disk)
//   (h) start to first answer with `tsx server.ts`, with an empty data file (target ≤ 1 s) and
//       with 100,000 live tokens in it (≤ 1.5 s); CPU of the first 100 and 1,000 requests of each
//       kind, one at a time      target: first 100 exchanges ≤ 2× the same process's, once warm;
//       and the same for the bare server, fresh too: what node:http alone pays for being cold
// Counted (each server afresh under valgrind's callgrind, bench/instructions.ts)
//   (j) instructions per introspection and per exchange: beside CPU time, a figure that does not
//       move with the machine's other load, for changes too small for the timed figures to show
// Memory
//   (d) heap bytes per live token, 1,000,000 in a MemoryStore    target: ≤ 300
//   (e) longest event-loop stall while they all expire            target: ≤ 20 ms
//   (f) soak: SOAK_SECONDS (60) of mixed traffic, memory at start and end
//
// The warm figures measure the servers in turn, round after round, and print each one's best and
// median round; the summary uses the medians: on two shared cores a neighbour's load can halve a
// run, and the best alone flatters the faster server most. Beside each peer target the summary
// prints the peer's ratio to bare: no server on node:http can beat the peer by more than that.
//
// Settings: SOAK_SECONDS (60), BENCH_SECONDS per timed run (6), BENCH_ROUNDS (5),
// BENCH_EXCHANGE_BATCHES (4: batches of 9,000 fresh codes a round for (b)),
// BENCH_CONNECTIONS (10), BENCH_FIGURES (abgcijhfde: the letters of the figures to measure).
// The bench never fails: it prints what it measured, and which targets were missed.

import { fork, spawn } from 'node:child_process'
import type { ChildProcess } from 'node:child_process'
import { closeSync, copyFileSync, mkdtempSync, openSync, readFileSync, rmSync } from 'node:fs'
import { Agent, request } from 'node:http'
import type { IncomingHttpHeaders } from 'node:http'
import { cpus, tmpdir } from 'node:os'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { createSecret } from '../server.ts'
import type { BareAnswers } from './bare.ts'
import type { PeerAnswer } from './peer.ts'
import type { LoadJob, LoadResult, SoakJob } from './load.ts'
import { callgrindMissing, Counter, underCallgrind } from './instructions.ts'
import { atRate, oneAtATime, startToFirstAnswer } from './paced.ts'
import { fillDataFile } from './tokens.ts'

const SOAK_SECONDS = Number(process.env.SOAK_SECONDS ?? 60)
const MEASURE_SECONDS = Number(process.env.BENCH_SECONDS ?? 6)
const WARMUP_SECONDS = 2
const CONNECTIONS = Number(process.env.BENCH_CONNECTIONS ?? 10)
/** Which figures to measure, by letter: all by default; `BENCH_FIGURES=ab` for introspection and exchange only. */
const FIGURES = process.env.BENCH_FIGURES ?? 'abgcijhfde'
/** Requests of each paced run, and the fixed rate of the second. */
const PACED_REQUESTS = 1000
const PACED_RATE = 200
/** Fresh processes the cold figures start, for each kind and each data file. */
const COLD_STARTS = 3
const LIVE_TOKENS_AT_START = 100_000
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

/**
 * Starts a node process whose output goes to a file, and waits for the line that names its URL.
 * `wrapper` is a command that runs node (callgrind, for (j)).
 */
async function startServer(
  name: string,
  args: string[],
  env: Record<string, string>,
  ready: RegExp,
  dir: string,
  wrapper: string[] = [],
): Promise<Server> {
  const logFile = join(dir, `${name}.log`)
  const fd = openSync(logFile, 'w')
  const [command, ...commandArgs] = [...wrapper, process.execPath, ...args]
  const child = spawn(command, commandArgs, {
    cwd: ROOT,
    env: { ...cleanEnv(), ...env },
    stdio: ['ignore', fd, fd, 'ipc'],
  })
  closeSync(fd)
  for (let waited = 0; waited < (wrapper.length === 0 ? 20_000 : 120_000); waited += 50) {
    const match = ready.exec(readFileSync(logFile, 'utf8'))
    if (match !== null)
      return { url: match[1].startsWith('http') ? match[1] : `http://127.0.0.1:${match[1]}`, child, logFile }
    if (child.exitCode !== null) break
    await sleep(50)
  }
  throw new Error(`${name} did not start:\n${readFileSync(logFile, 'utf8')}`)
}

/** Latch by its own command line, with `probe` preloaded, on `dataFile`: memory unless told. */
function startLatch(name: string, probe: string, dir: string, dataFile = 'memory', wrapper: string[] = []) {
  const args = ['--import', 'tsx', '--import', probe, 'server.ts']
  return startServer(name, args, { PORT: '0', DATA_FILE: dataFile }, /listening on (http:\/\/\S+)/, dir, wrapper)
}

/** The bare server (bench/bare.ts), with `probe` preloaded, answering as `answers` says. */
function startBare(name: string, probe: string, dir: string, answers: BareAnswers, wrapper: string[] = []) {
  const args = ['--import', 'tsx', '--import', probe, 'bench/bare.ts']
  return startServer(name, args, { BARE_ANSWERS: JSON.stringify(answers) }, /listening (\d+)/, dir, wrapper)
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

/** One server's rounds: the best (most requests per second) and the median, by the same measure. */
type Rounds = { best: Measured; median: Measured; all: Measured[] }

/**
 * A server the bench compares, and how to ask it for each kind of request: the same forms, at
 * its own paths. `codes` makes fresh authorization codes for the verifier the bench sends,
 * outside the timed part; `tokenBody`, `introspectionBody` and `revocationBody` make the bodies.
 */
type Contender = {
  name: string
  server: Server
  paths: { token: string; introspection: string; revocation: string }
  codes: (count: number) => Promise<string[]>
  tokenBody: (code: string) => string
  introspectionBody: string
  revocationBody: (token: string) => string
}

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

function roundsOf(runs: Measured[]): Rounds {
  const byRate = [...runs].sort((a, b) => a.rps - b.rps)
  return { best: byRate[byRate.length - 1], median: byRate[Math.floor((byRate.length - 1) / 2)], all: runs }
}

/**
 * Warms every server up, then measures them in turn, round after round, with the same request
 * shape: a neighbour's load on two shared cores can halve a run, and alternating keeps a slow
 * spell from falling on one server only. `job` makes one timed run's job for a server.
 */
async function measureRounds(
  load: ChildProcess,
  contenders: Contender[],
  job: (contender: Contender, seconds: number) => Batches,
): Promise<Map<string, Rounds>> {
  for (const contender of contenders)
    for (const warmup of job(contender, WARMUP_SECONDS)) await ask(load, await warmup())
  const runs = new Map<string, Measured[]>(contenders.map((contender) => [contender.name, []]))
  for (let round = 0; round < ROUNDS; round++) {
    for (const contender of contenders) {
      const batches: Measured[] = []
      for (const batch of job(contender, MEASURE_SECONDS))
        batches.push(await measure(load, contender.server, await batch()))
      runs.get(contender.name)?.push(addUp(batches))
    }
  }
  return new Map([...runs].map(([name, measured]) => [name, roundsOf(measured)]))
}

/**
 * Token exchange: every request redeems its own code, made before the clock starts. Latch keeps
 * at most 10,000 unredeemed codes, so a round makes and redeems EXCHANGE_BATCHES batches of
 * 9,000 in turn, and only the redeeming is timed; the round's run is the batches added up. The
 * peer, several times slower, gets batches of 2,000. The bare server does not read the codes, so
 * it gets such bodies for MEASURE_SECONDS, as in the other figures.
 */
function exchangeJobs(contender: Contender, seconds: number): Batches {
  const { server, paths } = contender
  if (contender.name === 'bare') {
    const bodies = Array.from({ length: 1000 }, (_, i) => contender.tokenBody(`code-${i}`))
    return [async () => loadJob(server.url, { method: 'POST', path: paths.token, bodies, seconds })]
  }
  const warmup = seconds === WARMUP_SECONDS
  const size = warmup ? WARMUP_CODES : contender.name === 'peer' ? 2000 : TIMED_CODES
  const batches = warmup ? 1 : contender.name === 'peer' ? 2 : EXCHANGE_BATCHES
  // each batch's codes are made just before it is timed: at most 10,000 wait at once
  return Array.from({ length: batches }, () => async () => {
    const codes = await contender.codes(size)
    return loadJob(server.url, {
      method: 'POST',
      path: paths.token,
      bodies: codes.map(contender.tokenBody),
      amount: codes.length - CONNECTIONS - 1,
    })
  })
}

const LATCH_PATHS = { token: '/token', introspection: '/introspect', revocation: '/revoke' }

/** Latch as a contender: its codes made as a person makes them, `token` one of its live access tokens. */
function latchContender(server: Server, token: string): Contender {
  return {
    name: 'Latch',
    server,
    paths: LATCH_PATHS,
    codes: (count) => mintCodes(server.url, count),
    tokenBody: (code) => TOKEN_BODY.replace('CODE', code),
    introspectionBody: `token=${token}`,
    revocationBody,
  }
}

/** The bare server as a contender: it reads no code or token, so any will do. */
function bareContender(server: Server, token: string): Contender {
  return {
    name: 'bare',
    server,
    paths: LATCH_PATHS,
    codes: async (count) => Array.from({ length: count }, (_, i) => `code-${i}`),
    tokenBody: (code) => TOKEN_BODY.replace('CODE', code),
    introspectionBody: `token=${token}`,
    revocationBody,
  }
}

/** A live access token from the Latch at `url`, made as a client makes one. */
async function issueToken(url: string): Promise<string> {
  const exchanged = await send(url, 'POST', '/token', { body: TOKEN_BODY.replace('CODE', await mintCode(url)) })
  const token = /"access_token":"([^"]+)"/.exec(exchanged.text)?.[1]
  if (token === undefined) throw new Error(`/token answered ${exchanged.status} ${exchanged.text}`)
  return token
}

/** The timed runs of one round at one server, each made when its turn comes. */
type Batches = (() => Promise<LoadJob>)[]

/** Runs of one fixed request shape for as long as asked: introspection, revocation. */
function steadyJobs(path: (contender: Contender) => string, bodies: (contender: Contender) => string[]) {
  return (contender: Contender, seconds: number): Batches => [
    async () =>
      loadJob(contender.server.url, { method: 'POST', path: path(contender), bodies: bodies(contender), seconds }),
  ]
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

/** Latch's revocation body for a token: a public client names itself. */
const revocationBody = (token: string) => `token=${token}&${new URLSearchParams({ client_id: CLIENT_ID })}`

const medianOf = (values: number[]) => [...values].sort((a, b) => a - b)[Math.floor((values.length - 1) / 2)]

/** The counts at which the cold figures read the server's CPU: the first 100, up to 1,000, and the last 1,000 of 5,000. */
const COLD_CHECKPOINTS = [100, 1000, 4000, 5000]

/** CPU per request in µs, and requests per second, one at a time. */
type ColdRun = { first100: number; first1000: number; warm: number; first100Rps: number; warmRps: number }

type Cold = { requests: Map<string, ColdRun[]>; bare: ColdRun[]; startEmpty: number[]; startFull: number[] }

/** Sends 5,000 requests one at a time to a server just started, and reads its CPU at `COLD_CHECKPOINTS`. */
async function coldRun(server: Server, path: string, bodies: string[]): Promise<ColdRun> {
  const cpu = async () => (await ask<Usage>(server.child, 'usage')).cpuMicros
  const { stretches } = await oneAtATime(server.url, path, bodies, cpu, COLD_CHECKPOINTS)
  const [first, rest, , last] = stretches.map((stretch) => stretch.cpuMicrosPerRequest)
  const [first100Rps, , , warmRps] = stretches.map((stretch) => stretch.rps)
  return { first100: first, first1000: (first * 100 + rest * 900) / 1000, warm: last, first100Rps, warmRps }
}

/**
 * (h) A data file is written as a server that had issued them would leave it: 5,000 codes and
 * 10,000 tokens; and another with 100,000 live tokens. For each kind, COLD_STARTS fresh
 * processes, each with its own copy of the file, answer 5,000 requests one at a time; their CPU
 * is read after the first 100, the first 1,000, and for the last 1,000, by when the process is
 * warm: the same server, store and client, so the ratio shows what being cold costs and nothing
 * else. Then the start itself: `tsx server.ts`, the command the README gives less npx's own
 * start, timed to the first answer.
 */
async function measureCold(probe: string, dir: string, answers: BareAnswers): Promise<Cold> {
  const small = join(dir, 'cold-small.journal')
  const { codes, tokens } = await fillDataFile(small, { codes: 5000, tokens: 10_000 }, Date.now())
  const requests: Cold['requests'] = new Map()
  const kinds = [
    ['exchange', '/token', codes.map((code) => TOKEN_BODY.replace('CODE', code))],
    ['introspection', '/introspect', tokens.slice(0, 5000).map((token) => `token=${token}`)],
    ['revocation', '/revoke', tokens.slice(5000).map(revocationBody)],
  ] as const
  for (const [kind, path, bodies] of kinds) {
    const runs: ColdRun[] = []
    for (let start = 0; start < COLD_STARTS; start++) {
      const copy = join(dir, `cold-${kind}-${start}.journal`)
      copyFileSync(small, copy)
      const server = await startLatch(`cold-${kind}-${start}`, probe, dir, copy)
      runs.push(await coldRun(server, path, [...bodies]))
      await stop(server.child)
      rmSync(copy, { force: true })
    }
    requests.set(kind, runs)
  }
  // What node:http itself pays for being cold: the bare server, started afresh, answering the same exchanges.
  const bare: ColdRun[] = []
  for (let start = 0; start < COLD_STARTS; start++) {
    const server = await startBare(`cold-bare-${start}`, probe, dir, answers)
    bare.push(
      await coldRun(
        server,
        '/token',
        codes.map((code) => TOKEN_BODY.replace('CODE', code)),
      ),
    )
    await stop(server.child)
  }
  const full = join(dir, 'cold-full.journal')
  await fillDataFile(full, { codes: 0, tokens: LIVE_TOKENS_AT_START }, Date.now())
  const tsx = join(ROOT, 'node_modules/.bin/tsx')
  const startTimes = async (file: string) => {
    const times: number[] = []
    for (let start = 0; start < COLD_STARTS; start++) {
      const copy = join(dir, `start-${start}.journal`)
      rmSync(copy, { force: true })
      if (file !== '') copyFileSync(file, copy)
      const env = { ...cleanEnv(), DATA_FILE: copy }
      times.push(await startToFirstAnswer(tsx, ['server.ts'], env, '/.well-known/oauth-authorization-server', ROOT))
    }
    return times
  }
  return { requests, bare, startEmpty: await startTimes(''), startFull: await startTimes(full) }
}

/**
 * Requests of each kind (j) counts at each server, three times over (the median counts), after
 * WARM_BATCHES times as many not counted: V8 goes on optimizing for thousands of requests.
 */
const COUNTED_REQUESTS = 1000
const WARM_BATCHES = 10

/** Instructions per request, by kind. */
type Instructions = { introspection: number; exchange: number }

/** Sends each body as a POST to `path`, CONNECTIONS at a time; throws unless every answer is 200. */
async function sendAll(url: string, path: string, bodies: string[]): Promise<void> {
  let next = 0
  const sender = async () => {
    while (next < bodies.length) {
      const answer = await send(url, 'POST', path, { body: bodies[next++] })
      if (answer.status !== 200) throw new Error(`${path} answered ${answer.status} ${answer.text.slice(0, 200)}`)
    }
  }
  await Promise.all(Array.from({ length: CONNECTIONS }, sender))
}

/**
 * (j) A server started afresh under callgrind (bench/instructions.ts): its instructions per
 * introspection, then per exchange (the peer's token to introspect is the one made at its start,
 * before its store fills), each counted as COUNTED_REQUESTS says.
 */
async function countInstructions(
  start: (wrapper: string[]) => Promise<Contender>,
  file: string,
): Promise<Instructions> {
  const contender = await start(underCallgrind(file))
  const { server, paths } = contender
  const counter = new Counter(server.child.pid ?? 0, file)
  const introspections = () =>
    sendAll(server.url, paths.introspection, Array(COUNTED_REQUESTS).fill(contender.introspectionBody))
  const exchanges = async () => (await contender.codes(COUNTED_REQUESTS)).map(contender.tokenBody)
  const counts = async (count: () => Promise<number>) => {
    const three = [await count(), await count(), await count()]
    return medianOf(three) / COUNTED_REQUESTS
  }
  try {
    for (let warmup = 0; warmup < WARM_BATCHES; warmup++) await introspections()
    const introspection = await counts(() => counter.count(introspections))
    for (let warmup = 0; warmup < WARM_BATCHES; warmup++) await sendAll(server.url, paths.token, await exchanges())
    const exchange = await counts(async () => {
      const bodies = await exchanges() // made before the count begins
      return counter.count(() => sendAll(server.url, paths.token, bodies))
    })
    return { introspection, exchange }
  } finally {
    await stop(server.child)
  }
}

/**
 * The peer, node-oidc-provider (bench/peer.ts), with its own paths. It wants every caller of its
 * introspection endpoint to name a client: the bench's public client names itself, as Latch's
 * revocation requests do. Its codes and tokens are made in its process, outside the timed part.
 */
async function startPeer(probe: string, dir: string, name = 'peer', wrapper: string[] = []): Promise<Contender> {
  const server = await startServer(
    name,
    ['--import', 'tsx', '--import', probe, 'bench/peer.ts'],
    {},
    /listening (\d+)/,
    dir,
    wrapper,
  )
  const ready = /token=(\S+) introspection=(\S+) revocation=(\S+)/.exec(readFileSync(server.logFile, 'utf8'))
  if (ready === null) throw new Error('the peer did not name its endpoints')
  const client = new URLSearchParams({ client_id: CLIENT_ID })
  const [token] = (await ask<PeerAnswer & { tokens: string[] }>(server.child, { kind: 'tokens', count: 1 })).tokens
  return {
    name: 'peer',
    server,
    paths: { token: ready[1], introspection: ready[2], revocation: ready[3] },
    codes: async (count) => (await ask<PeerAnswer & { codes: string[] }>(server.child, { kind: 'codes', count })).codes,
    tokenBody: (code) => TOKEN_BODY.replace('CODE', code),
    introspectionBody: `token=${token}&${client}`,
    revocationBody: (value) => `token=${value}&${client}`,
  }
}

// --- Printing ---------------------------------------------------------------------------

const format = (value: number, digits = 0) =>
  value.toLocaleString('en-US', { maximumFractionDigits: digits, minimumFractionDigits: digits })
const mib = (bytes: number) => `${format(bytes / 2 ** 20, 1)} MiB`
const percent = (ratio: number) => `${format(ratio * 100)}%`

/** A run of either client: autocannon's (whole milliseconds, status counts) or the paced one's (failures). */
type Run = Pick<LoadResult, 'rps' | 'p50Ms' | 'p99Ms' | 'requests' | 'seconds'> & {
  cpuMicrosPerRequest?: number
  status4xx?: number
  status5xx?: number
  errors?: number
  failures?: number
}

function describeRun(name: string, result: Run): string {
  const problems = [
    (result.status4xx ?? 0) > 0 ? `${result.status4xx} 4xx` : '',
    (result.status5xx ?? 0) > 0 ? `${result.status5xx} 5xx` : '',
    (result.errors ?? 0) > 0 ? `${result.errors} errors` : '',
    (result.failures ?? 0) > 0 ? `${result.failures} not 200` : '',
  ]
  const note = problems.filter(Boolean).join(', ')
  const cpu =
    result.cpuMicrosPerRequest === undefined
      ? ''
      : `   CPU ${format(result.cpuMicrosPerRequest).padStart(4)} µs/request`
  const ms = (value: number) => format(value, Number.isInteger(value) ? 0 : 1).padStart(5)
  return `  ${name.padEnd(24)} ${format(result.rps).padStart(8)} req/s   p50 ${ms(result.p50Ms)} ms   p99 ${ms(result.p99Ms)} ms${cpu}   (${format(result.requests)} requests in ${format(result.seconds, 1)} s${note === '' ? '' : `; ${note}`})`
}

/** Prints each server's best and median round, and how Latch compares by the median. */
function printRounds(title: string, rounds: Map<string, Rounds>): void {
  console.log(`\n${title}`)
  for (const [name, { best, median }] of rounds) {
    console.log(describeRun(`${name} best`, best))
    console.log(describeRun(`${name} median`, median))
  }
  const latch = rounds.get('Latch')?.median
  const bare = rounds.get('bare')?.median
  const peer = rounds.get('peer')?.median
  if (latch === undefined) return
  if (bare !== undefined)
    console.log(
      `  Latch/bare, medians: ${percent(latch.rps / bare.rps)} of the requests per second; ${format(latch.cpuMicrosPerRequest / bare.cpuMicrosPerRequest, 2)}× the server CPU time per request`,
    )
  if (peer !== undefined)
    console.log(
      `  peer/Latch, medians: the peer spends ${format(peer.cpuMicrosPerRequest / latch.cpuMicrosPerRequest, 1)}× Latch's CPU time per request; Latch answers ${format(latch.rps / peer.rps, 1)}× as many per second`,
    )
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
    `Latch bench: Node ${process.version}, ${cpus().length} cores, 127.0.0.1 only, ${CONNECTIONS} connections, ${MEASURE_SECONDS} s per timed run after ${WARMUP_SECONDS} s of warm-up, ${ROUNDS} rounds`,
  )
  console.log(
    'Latch runs as `node --import tsx server.ts` with DATA_FILE=memory in a child process; autocannon runs in another.',
  )
  console.log(
    "Each server is shown by its best round and its median round; the summary uses the medians. CPU is the server's, all threads.",
  )
  const dir = mkdtempSync(join(tmpdir(), 'latch-bench-'))
  const probe = new URL('probe.ts', import.meta.url).href
  const latch = await startLatch('latch', probe, dir)
  // One answer of each kind from Latch, for the bare server to send the same headers and as many bytes.
  const consentPage = await send(latch.url, 'GET', AUTHORIZATION_PATH)
  const exchanged = await send(latch.url, 'POST', '/token', {
    body: TOKEN_BODY.replace('CODE', await mintCode(latch.url)),
  })
  const token = /"access_token":"([^"]+)"/.exec(exchanged.text)?.[1]
  if (token === undefined) throw new Error(`/token answered ${exchanged.status} ${exchanged.text}`)
  const introspected = await send(latch.url, 'POST', '/introspect', { body: `token=${token}` })
  const revoked = await send(latch.url, 'POST', '/revoke', { body: revocationBody(createSecret()) })
  const answers: BareAnswers = {
    '/auth': shapeOf(consentPage),
    '/token': shapeOf(exchanged),
    '/introspect': shapeOf(introspected),
    '/revoke': shapeOf(revoked),
  }
  const bare = await startBare('bare', probe, dir, answers)
  const peer = await startPeer(probe, dir)
  const load = fork(join(ROOT, 'bench/load.ts'), { cwd: ROOT, execArgv: ['--import', 'tsx'], stdio: 'inherit' })
  const contenders: Contender[] = [bareContender(bare, token), latchContender(latch, token), peer]
  try {
    const rows: Row[] = [['figure (medians)', 'measured', 'target', 'verdict']]
    const median = (rounds: Map<string, Rounds>, name: string) => rounds.get(name)?.median
    /** Latch's CPU per request as a multiple of bare's, and the peer's as a multiple of Latch's. */
    const compare = (
      title: string,
      rounds: Map<string, Rounds>,
      targets: { rps: number; latchToBare: number; peerToLatch: number },
    ) => {
      const { latchToBare, peerToLatch } = targets
      const [bareRun, latchRun, peerRun] = ['bare', 'Latch', 'peer'].map((name) => median(rounds, name))
      if (bareRun === undefined || latchRun === undefined || peerRun === undefined) return
      const overBare = latchRun.cpuMicrosPerRequest / bareRun.cpuMicrosPerRequest
      const underPeer = peerRun.cpuMicrosPerRequest / latchRun.cpuMicrosPerRequest
      rows.push([
        `${title}, req/s Latch/bare`,
        `${percent(latchRun.rps / bareRun.rps)} (${format(latchRun.rps)} / ${format(bareRun.rps)})`,
        targets.rps > 0 ? `≥ ${percent(targets.rps)}` : '-',
        targets.rps > 0 ? verdict(latchRun.rps / bareRun.rps >= targets.rps) : '-',
      ])
      rows.push([
        `${title}, CPU/request Latch/bare`,
        `${format(overBare, 2)}× (${format(latchRun.cpuMicrosPerRequest)} / ${format(bareRun.cpuMicrosPerRequest)} µs)`,
        latchToBare > 0 ? `≤ ${format(latchToBare, 1)}×` : '-',
        latchToBare > 0 ? verdict(overBare <= latchToBare) : '-',
      ])
      rows.push([
        `${title}, CPU/request peer/Latch`,
        `${format(underPeer, 1)}× (${format(peerRun.cpuMicrosPerRequest)} / ${format(latchRun.cpuMicrosPerRequest)} µs)`,
        peerToLatch > 0 ? `≥ ${format(peerToLatch)}×` : '-',
        peerToLatch > 0 ? verdict(underPeer >= peerToLatch) : '-',
      ])
      // The most any server on node:http could show against the peer in this run: bare's ratio.
      const ceiling = peerRun.cpuMicrosPerRequest / bareRun.cpuMicrosPerRequest
      rows.push([
        `${title}, CPU/request peer/bare (ceiling)`,
        `${format(ceiling, 1)}× (${format(peerRun.cpuMicrosPerRequest)} / ${format(bareRun.cpuMicrosPerRequest)} µs)`,
        peerToLatch > 0
          ? `≥ ${format(peerToLatch)}× needs Latch ≤ ${format(peerRun.cpuMicrosPerRequest / peerToLatch, 1)} µs`
          : '-',
        peerToLatch > 0 ? (ceiling >= peerToLatch ? 'yes' : 'NO') : '-',
      ])
    }

    if (FIGURES.includes('a')) {
      const introspection = await measureRounds(
        load,
        contenders,
        steadyJobs(
          (contender) => contender.paths.introspection,
          (contender) => [contender.introspectionBody],
        ),
      )
      printRounds('(a) warm: introspection of a live token, 10 connections', introspection)
      compare('(a) warm introspection', introspection, { rps: 0.8, latchToBare: 0, peerToLatch: 8 })
    }

    if (FIGURES.includes('b')) {
      const exchange = await measureRounds(load, contenders, exchangeJobs)
      printRounds(
        `(b) warm: token exchange, each request with its own fresh code (at Latch, ${EXCHANGE_BATCHES} batches of ${format(TIMED_CODES)} a round, each made through GET /auth and POST /auth/consent first; at the peer, 2 batches of 2,000 made in its process)`,
        exchange,
      )
      compare('(b) warm token exchange', exchange, { rps: 0.5, latchToBare: 1.3, peerToLatch: 5 })
    }

    if (FIGURES.includes('g')) {
      const unknown = Array.from({ length: 1000 }, () => createSecret())
      const revocation = await measureRounds(
        load,
        contenders,
        steadyJobs(
          (contender) => contender.paths.revocation,
          (contender) => unknown.map(contender.revocationBody),
        ),
      )
      printRounds('(g) warm: revocation of a token the server does not hold (RFC 7009 §2.2: 200)', revocation)
      compare('(g) warm revocation', revocation, { rps: 0, latchToBare: 0, peerToLatch: 0 })
    }

    if (FIGURES.includes('c')) {
      const consent = await measureRounds(load, contenders.slice(0, 2), (contender, seconds) => [
        async () => loadJob(contender.server.url, { method: 'GET', path: AUTHORIZATION_PATH, seconds }),
      ])
      printRounds(
        `(c) warm: GET /auth, the consent page (${format(Buffer.byteLength(consentPage.text))} bytes)`,
        consent,
      )
    }

    if (FIGURES.includes('i')) {
      console.log(
        `\n(i) paced: ${format(PACED_REQUESTS)} requests one at a time over one connection, then ${format(PACED_REQUESTS)} at ${PACED_RATE} a second (servers warm)`,
      )
      for (const kind of ['exchange', 'introspection', 'revocation'] as const) {
        for (const contender of contenders) {
          const cpu = async () => (await ask<Usage>(contender.server.child, 'usage')).cpuMicros
          const bodies = async (): Promise<string[]> =>
            kind === 'exchange'
              ? (await contender.codes(PACED_REQUESTS)).map(contender.tokenBody)
              : kind === 'introspection'
                ? Array.from({ length: PACED_REQUESTS }, () => contender.introspectionBody)
                : Array.from({ length: PACED_REQUESTS }, () => contender.revocationBody(createSecret()))
          const path = contender.paths[kind === 'exchange' ? 'token' : kind]
          const single = await oneAtATime(contender.server.url, path, await bodies(), cpu)
          const rated = await atRate(contender.server.url, path, await bodies(), PACED_RATE, cpu)
          console.log(describeRun(`${kind} ${contender.name} 1×`, single.whole))
          console.log(describeRun(`${kind} ${contender.name} ${PACED_RATE}/s`, rated))
        }
      }
    }

    if (FIGURES.includes('j')) {
      const missing = callgrindMissing()
      console.log(
        `\n(j) instructions per request, counted by callgrind: each server started afresh under valgrind, ${format(COUNTED_REQUESTS * WARM_BATCHES)} requests of each kind to warm it up, then the median of three counts of ${format(COUNTED_REQUESTS)}, ${CONNECTIONS} at a time; what timers run left out (bench/instructions.ts)`,
      )
      if (missing !== undefined) console.log(`  left out: ${missing}`)
      else {
        const counted = new Map<string, Instructions>()
        const starts: [string, (wrapper: string[]) => Promise<Contender>][] = [
          [
            'bare',
            async (wrapper) => bareContender(await startBare('bare-counted', probe, dir, answers, wrapper), token),
          ],
          [
            'Latch',
            async (wrapper) => {
              const started = await startLatch('latch-counted', probe, dir, 'memory', wrapper)
              return latchContender(started, await issueToken(started.url))
            },
          ],
          ['peer', (wrapper) => startPeer(probe, dir, 'peer-counted', wrapper)],
        ]
        for (const [name, start] of starts)
          counted.set(name, await countInstructions(start, join(dir, `${name}.callgrind`)))
        for (const kind of ['introspection', 'exchange'] as const) {
          const [bareCount, latchCount, peerCount] = ['bare', 'Latch', 'peer'].map(
            (name) => counted.get(name)?.[kind] ?? 0,
          )
          console.log(
            `  ${kind.padEnd(14)} bare ${format(bareCount)}   Latch ${format(latchCount)}   peer ${format(peerCount)}`,
          )
          rows.push([
            `(j) ${kind}, instructions/request Latch/bare`,
            `${format(latchCount / bareCount, 2)}× (${format(latchCount)} / ${format(bareCount)})`,
            '-',
            '-',
          ])
          rows.push([
            `(j) ${kind}, instructions/request peer/Latch`,
            `${format(peerCount / latchCount, 1)}× (${format(peerCount)} / ${format(latchCount)})`,
            '-',
            '-',
          ])
        }
      }
    }

    if (FIGURES.includes('h')) {
      console.log(
        '\n(h) cold: a fresh Latch process, each request one at a time, as a client that just found it sends them',
      )
      const cold = await measureCold(probe, dir, answers)
      const bareKind = 'bare node:http'
      for (const [kind, runs] of [...cold.requests, [bareKind, cold.bare] as const]) {
        const [first100, first1000, warm, first100Rps, warmRps] = (
          ['first100', 'first1000', 'warm', 'first100Rps', 'warmRps'] as const
        ).map((field) => medianOf(runs.map((run) => run[field])))
        const where = kind === bareKind ? 'the same exchanges, no data file' : 'data file on disk'
        console.log(
          `  ${kind.padEnd(14)} CPU per request: first 100 ${format(first100)} µs (${format(first100Rps)} req/s), first 1,000 ${format(first1000)} µs, requests 4,001 to 5,000 (warm) ${format(warm)} µs (${format(warmRps)} req/s) (medians of ${runs.length} starts, ${where})`,
        )
        // bare's is what node:http itself pays for being cold: with no journal, whose fixed cost lowers Latch's ratio
        rows.push([
          kind === bareKind
            ? '(h) cold first-100 exchange / warm, bare node:http'
            : `(h) cold first-100 ${kind} / warm`,
          `${format(first100 / warm, 2)}× (${format(first100)} / ${format(warm)} µs)`,
          kind === 'exchange' ? '≤ 2×' : '-',
          kind === 'exchange' ? verdict(first100 / warm <= 2) : '-',
        ])
      }
      for (const [label, times, target] of [
        ['empty data file', cold.startEmpty, 1000],
        [`${format(LIVE_TOKENS_AT_START)} live tokens`, cold.startFull, 1500],
      ] as const) {
        console.log(
          `  start to first answer, ${label}: median ${format(medianOf(times))} ms, best ${format(Math.min(...times))} ms (\`tsx server.ts\`, ${times.length} starts)`,
        )
        rows.push([
          `(h) start to first answer, ${label}`,
          `${format(medianOf(times))} ms`,
          `≤ ${format(target)} ms`,
          verdict(medianOf(times) <= target),
        ])
      }
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
    await Promise.all([stop(latch.child), stop(bare.child), stop(peer.server.child), stop(load)])

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
    await Promise.all([stop(latch.child), stop(bare.child), stop(peer.server.child), stop(load)])
    rmSync(dir, { recursive: true, force: true })
  }
}

await main()
