// What hostile traffic costs Latch: memory under floods of authorization requests, and how long
// hostile client pages hold up the event loop. Latch runs in a child process of its own
// (bench/attack-server.ts: the real handler and server, DATA_FILE=memory, started with
// --expose-gc), so that its RSS is its own; this process is the attacker, and plays the hostile
// client site too. All traffic goes to 127.0.0.1, in bounded counts and times.
//
//   node --import tsx bench/attack.ts
//
//   (1) GET /auth flood: ATTACK_REQUESTS requests over ATTACK_CONNECTIONS connections, twice, each
//       in a fresh Latch: (a) the largest request the limits accept (ATTACK_MAX_SCOPES
//       distinct scopes of ATTACK_MAX_SCOPE_LENGTH characters, a state of ATTACK_MAX_STATE, a `me`
//       filling the request target up to ATTACK_MAX_TARGET characters, at most ATTACK_MAX_ME),
//       and (b) a hostile one those limits refuse: ATTACK_HOSTILE_SCOPES distinct scopes of
//       ATTACK_HOSTILE_SCOPE_LENGTH characters (distinct, since Latch drops repeated scopes;
//       Node's own 16 KiB cap on a request's head is the bound today). The client is a loopback
//       one, which Latch never fetches. RSS and heapUsed before and after, each after forced GCs,
//       and the peak RSS sampled every 100 ms. A flood stops early once Latch's RSS passes
//       ATTACK_RSS_LIMIT_MB, or after ATTACK_FLOOD_SECONDS.
//   (2) Discovery flood: ATTACK_DISCOVERY_REQUESTS authorization requests over
//       ATTACK_DISCOVERY_CONNECTIONS connections, each for a client_id of its own
//       (http://c<i>.example/) with a redirect_uri on another host, so that Latch fetches every
//       client. Every name resolves (injected lookup) to a public-looking address and every
//       connection goes (injected agent) to the hostile site here, which answers each one 200
//       text/html with ATTACK_PAGE_BYTES trickled over ATTACK_TRICKLE_MS. RSS before, peak and
//       after; the fetches the site saw and how many were open at once; stops after
//       ATTACK_DISCOVERY_SECONDS.
//   (3) The longest event-loop stall while crafted pages are scanned: ATTACK_SCAN_PAGES
//       discoveries, ATTACK_SCAN_CONCURRENCY at a time, of a page of ATTACK_PAGE_BYTES that opens
//       ATTACK_SCAN_NEST nested <div> and then closes </x> as often as fits (each closing tag is
//       looked for among the open elements); and, as the baseline, as many of a plain page of the
//       same size (<p>hello</p> again and again). Max and p99 of Latch's event-loop delay
//       (monitorEventLoopDelay, resolution 1 ms; an idle loop reads about 1 ms), and Latch's CPU
//       time per discovery. Pages that arrive together are read back to back, so one stall can
//       span several; (2) reports the longest stall of its flood too.
//
// Settings (defaults): ATTACK_FIGURES (123: the figures to measure), ATTACK_REQUESTS (20,000),
// ATTACK_CONNECTIONS (50), ATTACK_FLOOD_SECONDS (20), ATTACK_RSS_LIMIT_MB (2,048),
// ATTACK_MAX_TARGET (8,192), ATTACK_MAX_STATE (1,024), ATTACK_MAX_ME (2,048),
// ATTACK_MAX_SCOPES (50), ATTACK_MAX_SCOPE_LENGTH (100), ATTACK_HOSTILE_SCOPES (3,900),
// ATTACK_HOSTILE_SCOPE_LENGTH (3), ATTACK_DISCOVERY_REQUESTS (3,000),
// ATTACK_DISCOVERY_CONNECTIONS (500), ATTACK_DISCOVERY_SECONDS (30), ATTACK_PAGE_BYTES (262,144),
// ATTACK_TRICKLE_MS (3,500), ATTACK_SCAN_PAGES (40), ATTACK_SCAN_CONCURRENCY (4),
// ATTACK_SCAN_NEST (256), ATTACK_DEADLINE_SECONDS (150: past it, the bench prints what it has and
// stops). The bench never fails: it prints what it measured.

import { spawn } from 'node:child_process'
import type { ChildProcess } from 'node:child_process'
import { Agent, createServer, request } from 'node:http'
import type { IncomingMessage, Server, ServerResponse } from 'node:http'
import type { AddressInfo } from 'node:net'
import { cpus, loadavg } from 'node:os'
import { fileURLToPath } from 'node:url'
import type { AttackDelay, AttackMessage, AttackUsage } from './attack-server.ts'

const setting = (name: string, fallback: number) => Number(process.env[name] ?? fallback)

/** The limits the server is to enforce: the largest accepted request is built to fit them exactly. */
const LIMITS = {
  target: setting('ATTACK_MAX_TARGET', 8_192),
  state: setting('ATTACK_MAX_STATE', 1_024),
  me: setting('ATTACK_MAX_ME', 2_048),
  scopes: setting('ATTACK_MAX_SCOPES', 50),
  scopeLength: setting('ATTACK_MAX_SCOPE_LENGTH', 100),
}
const FIGURES = process.env.ATTACK_FIGURES ?? '123'
const REQUESTS = setting('ATTACK_REQUESTS', 20_000)
const CONNECTIONS = setting('ATTACK_CONNECTIONS', 50)
const FLOOD_SECONDS = setting('ATTACK_FLOOD_SECONDS', 20)
const RSS_LIMIT = setting('ATTACK_RSS_LIMIT_MB', 2_048) * 2 ** 20
const HOSTILE_SCOPES = setting('ATTACK_HOSTILE_SCOPES', 3_900)
const HOSTILE_SCOPE_LENGTH = setting('ATTACK_HOSTILE_SCOPE_LENGTH', 3)
const DISCOVERY_REQUESTS = setting('ATTACK_DISCOVERY_REQUESTS', 3_000)
const DISCOVERY_CONNECTIONS = setting('ATTACK_DISCOVERY_CONNECTIONS', 500)
const DISCOVERY_SECONDS = setting('ATTACK_DISCOVERY_SECONDS', 30)
const PAGE_BYTES = setting('ATTACK_PAGE_BYTES', 256 * 1024)
const TRICKLE_MS = setting('ATTACK_TRICKLE_MS', 3_500)
const SCAN_PAGES = setting('ATTACK_SCAN_PAGES', 40)
const SCAN_CONCURRENCY = setting('ATTACK_SCAN_CONCURRENCY', 4)
const SCAN_NEST = setting('ATTACK_SCAN_NEST', 256)
const DEADLINE_SECONDS = setting('ATTACK_DEADLINE_SECONDS', 150)

/** Pieces a trickled page is sent in, evenly over ATTACK_TRICKLE_MS. */
const TRICKLE_STEPS = 16
/** How long requests still in flight when a flood stops may take to finish before they are cut. */
const GRACE_MS = 8_000
const SAMPLE_EVERY_MS = 100

const ROOT = fileURLToPath(new URL('..', import.meta.url))
const CHALLENGE = 'E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM'
const LOOPBACK_CLIENT = 'http://127.0.0.1:8080/'
const LOOPBACK_REDIRECT = 'http://127.0.0.1:8080/callback'
const OTHER_REDIRECT = 'https://other.example/cb'

// --- Request shapes ---------------------------------------------------------------------------

const ALPHABET = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789'

/** The i-th of a run of distinct tokens of `length` characters, from letters and digits only (nothing to escape). */
function token(i: number, length: number): string {
  let text = ''
  for (let rest = i; text.length < length; rest = Math.floor(rest / ALPHABET.length))
    text += ALPHABET[rest % ALPHABET.length]
  return text
}

function authPath(fields: {
  clientId: string
  redirectUri: string
  state: string
  scopes: string[]
  me?: string
}): string {
  const me = fields.me === undefined ? '' : `&me=${fields.me}`
  return `/auth?response_type=code&client_id=${encodeURIComponent(fields.clientId)}&redirect_uri=${encodeURIComponent(fields.redirectUri)}&code_challenge=${CHALLENGE}&code_challenge_method=S256&state=${fields.state}${me}&scope=${fields.scopes.join('+')}`
}

/** The largest request the limits accept: every scope and the state at their limit, and `me` filling the target up. */
function largestAccepted(): { path: string; description: string } {
  const scopes = Array.from({ length: LIMITS.scopes }, (_, i) => token(i, LIMITS.scopeLength))
  const state = 'S'.repeat(LIMITS.state)
  const mePrefix = 'https://me.example/'
  const without = authPath({
    clientId: LOOPBACK_CLIENT,
    redirectUri: LOOPBACK_REDIRECT,
    state,
    scopes,
    me: mePrefix,
  }).length
  const me = mePrefix + 'm'.repeat(Math.max(0, Math.min(LIMITS.me - mePrefix.length, LIMITS.target - without)))
  const path = authPath({ clientId: LOOPBACK_CLIENT, redirectUri: LOOPBACK_REDIRECT, state, scopes, me })
  return {
    path,
    description: `${format(LIMITS.scopes)} scopes × ${format(LIMITS.scopeLength)} characters, state ${format(LIMITS.state)}, me ${format(me.length)}`,
  }
}

/** Many short distinct scopes: the most entries per byte of URL. */
function hostile(): { path: string; description: string } {
  const scopes = Array.from({ length: HOSTILE_SCOPES }, (_, i) => token(i, HOSTILE_SCOPE_LENGTH))
  const path = authPath({ clientId: LOOPBACK_CLIENT, redirectUri: LOOPBACK_REDIRECT, state: 'hostile', scopes })
  return { path, description: `${format(HOSTILE_SCOPES)} distinct scopes × ${format(HOSTILE_SCOPE_LENGTH)} characters` }
}

const discoveryPath = (clientId: string) =>
  authPath({ clientId, redirectUri: OTHER_REDIRECT, state: 's', scopes: ['create'] })

// --- Latch in a child process -------------------------------------------------------------------

type Latch = {
  url: string
  child: ChildProcess
  /** One answer to one message, or undefined when none comes within `timeoutMs` (or Latch exited). */
  ask: <T>(message: AttackMessage, timeoutMs?: number) => Promise<T | undefined>
  /** Why Latch exited, once it has. */
  exited: () => string | undefined
}

const children = new Set<ChildProcess>()

async function startLatch(sitePort?: number): Promise<Latch> {
  const env: Record<string, string> = { ...(process.env as Record<string, string>) }
  if (sitePort !== undefined) env.ATTACK_SITE_PORT = String(sitePort)
  const child = spawn(
    process.execPath,
    ['--expose-gc', '--max-old-space-size=4096', '--import', 'tsx', 'bench/attack-server.ts'],
    {
      cwd: ROOT,
      env,
      stdio: ['ignore', 'ignore', 'inherit', 'ipc'],
    },
  )
  children.add(child)
  let exitedWith: string | undefined
  let nextId = 1
  const waiting = new Map<number, (answer: unknown) => void>()
  child.on('message', (message: { id?: number }) => {
    if (message.id === undefined) return
    waiting.get(message.id)?.(message)
    waiting.delete(message.id)
  })
  child.on('exit', (code, signal) => {
    exitedWith = signal === null ? `exit code ${code}` : `signal ${signal}`
    children.delete(child)
    for (const resolve of waiting.values()) resolve(undefined)
    waiting.clear()
  })
  const url = await new Promise<string>((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error('Latch did not start within 30 s')), 30_000)
    child.on('message', (message: { kind?: string; url?: string }) => {
      if (message.kind !== 'ready' || message.url === undefined) return
      clearTimeout(timer)
      resolve(message.url)
    })
    child.on('exit', () => {
      clearTimeout(timer)
      reject(new Error(`Latch exited while starting (${exitedWith})`))
    })
  })
  const ask = <T>(message: AttackMessage, timeoutMs = 10_000) =>
    new Promise<T | undefined>((resolve) => {
      if (exitedWith !== undefined || !child.connected) return resolve(undefined)
      const id = nextId++
      const timer = setTimeout(() => {
        waiting.delete(id)
        resolve(undefined)
      }, timeoutMs)
      waiting.set(id, (answer) => {
        clearTimeout(timer)
        resolve(answer as T | undefined)
      })
      child.send({ ...message, id })
    })
  return { url, child, ask, exited: () => exitedWith }
}

function stopLatch(latch: Latch): Promise<void> {
  const child = latch.child
  if (child.exitCode !== null || child.signalCode !== null) return Promise.resolve()
  return new Promise((resolve) => {
    const kill = setTimeout(() => child.kill('SIGKILL'), 3_000)
    child.once('exit', () => {
      clearTimeout(kill)
      resolve()
    })
    child.kill('SIGTERM')
  })
}

const usageOf = (latch: Latch, gc: boolean) => latch.ask<AttackUsage>({ kind: 'usage', gc }, 30_000)

// --- The flood -----------------------------------------------------------------------------------

type Flood = {
  sent: number
  answered: number
  /** Answers by status code, and failures by what went wrong. */
  outcomes: Map<string, number>
  seconds: number
  bytes: number
  peakRss: number
  /** Why the flood stopped before sending every request, if it did. */
  stoppedBy: string | undefined
  /** CPU time Latch used from the start of the flood to its last answer. */
  cpuMicros: number
}

/**
 * Sends `count` GET requests, `connections` at a time, to Latch, and samples its RSS every 100 ms.
 * Stops sending once the RSS passes the limit, Latch exits, or `seconds` pass; requests still in
 * flight then get GRACE_MS to finish before they are cut.
 */
async function flood(
  latch: Latch,
  options: { path: (i: number) => string; count: number; connections: number; seconds: number },
): Promise<Flood> {
  const agent = new Agent({ keepAlive: true, maxSockets: options.connections })
  const { port } = new URL(latch.url)
  const outcomes = new Map<string, number>()
  const note = (outcome: string) => outcomes.set(outcome, (outcomes.get(outcome) ?? 0) + 1)
  let stoppedBy: string | undefined
  let cutting = false
  let sent = 0
  let answered = 0
  let bytes = 0
  let peakRss = 0
  const started = performance.now()
  let lastAnswer = started
  const cpuBefore = (await latch.ask<AttackUsage>({ kind: 'usage' }))?.cpuMicros ?? 0

  const one = (path: string) =>
    new Promise<void>((resolve) => {
      let done = false
      const finish = (outcome: string) => {
        if (done) return
        done = true
        note(outcome)
        resolve()
      }
      const sending = request({ host: '127.0.0.1', port, path, agent }, (response) => {
        response.on('data', (chunk: Buffer) => (bytes += chunk.length))
        response.on('end', () => {
          answered++
          lastAnswer = performance.now()
          finish(String(response.statusCode))
        })
        response.on('error', () => finish(cutting ? 'cut at the time limit' : 'reset mid-answer'))
      })
      sending.on('error', (err: NodeJS.ErrnoException) =>
        finish(cutting ? 'cut at the time limit' : `error ${err.code ?? err.message}`),
      )
      sending.end()
    })

  const worker = async () => {
    while (stoppedBy === undefined && sent < options.count) {
      const i = sent++
      await one(options.path(i))
    }
  }
  let samplingDone = false
  const sampler = async () => {
    while (!samplingDone) {
      const usage = await latch.ask<AttackUsage>({ kind: 'usage' })
      if (usage !== undefined) peakRss = Math.max(peakRss, usage.rss)
      if (usage !== undefined && usage.rss > RSS_LIMIT && stoppedBy === undefined)
        stoppedBy = `Latch's RSS passed ${mib(RSS_LIMIT)}`
      if (latch.exited() !== undefined && stoppedBy === undefined) stoppedBy = `Latch exited (${latch.exited()})`
      await sleep(SAMPLE_EVERY_MS)
    }
  }
  const sampling = sampler()
  const timeLimit = setTimeout(() => (stoppedBy ??= `the time limit of ${options.seconds} s`), options.seconds * 1000)
  let cut: NodeJS.Timeout | undefined
  const stopWatch = setInterval(() => {
    if (stoppedBy !== undefined && cut === undefined) {
      cut = setTimeout(() => {
        cutting = true
        agent.destroy()
      }, GRACE_MS)
    }
  }, 50)
  await Promise.all(Array.from({ length: Math.min(options.connections, options.count) }, worker))
  clearTimeout(timeLimit)
  clearTimeout(cut)
  clearInterval(stopWatch)
  samplingDone = true
  await sampling
  agent.destroy()
  const cpuAfter = (await latch.ask<AttackUsage>({ kind: 'usage' }))?.cpuMicros ?? cpuBefore
  return {
    sent,
    answered,
    outcomes,
    seconds: (lastAnswer - started) / 1000,
    bytes,
    peakRss,
    stoppedBy,
    cpuMicros: cpuAfter - cpuBefore,
  }
}

/** One request, for what it answers before a flood. */
async function probe(latch: Latch, path: string): Promise<{ status: number; bytes: number }> {
  return new Promise((resolve) => {
    const sending = request(`${latch.url}${path}`, (response) => {
      let bytes = 0
      response.on('data', (chunk: Buffer) => (bytes += chunk.length))
      response.on('end', () => resolve({ status: response.statusCode ?? 0, bytes }))
      response.on('error', () => resolve({ status: 0, bytes }))
    })
    sending.on('error', () => resolve({ status: 0, bytes: 0 }))
    sending.end()
  })
}

// --- The hostile client site --------------------------------------------------------------------

type SiteMode = 'trickle' | 'plain' | 'crafted'

type Site = {
  port: number
  server: Server
  mode: SiteMode
  fetches: number
  open: number
  peakOpen: number
  reset: () => void
}

/** `<p>hello</p>` again and again: an ordinary page of `bytes`. */
function plainPage(bytes: number): Buffer {
  const html = '<p>hello</p>'.repeat(Math.floor(bytes / 12))
  return Buffer.from(html.padEnd(bytes, ' '))
}

/** ATTACK_SCAN_NEST nested <div>, then </x> as often as fits in `bytes`: no closing tag matches an open element. */
function craftedPage(bytes: number): Buffer {
  const open = '<div>'.repeat(SCAN_NEST)
  const html = open + '</x>'.repeat(Math.max(0, Math.floor((bytes - open.length) / 4)))
  return Buffer.from(html.padEnd(bytes, ' '))
}

async function startSite(): Promise<Site> {
  const pages: Record<SiteMode, Buffer> = {
    trickle: plainPage(PAGE_BYTES),
    plain: plainPage(PAGE_BYTES),
    crafted: craftedPage(PAGE_BYTES),
  }
  const site: Site = {
    port: 0,
    server: createServer(),
    mode: 'plain',
    fetches: 0,
    open: 0,
    peakOpen: 0,
    reset: () => {
      site.fetches = 0
      site.peakOpen = site.open
    },
  }
  site.server.on('request', (req: IncomingMessage, res: ServerResponse) => {
    site.fetches++
    site.open++
    site.peakOpen = Math.max(site.peakOpen, site.open)
    res.on('close', () => site.open--)
    req.resume()
    const page = pages[site.mode]
    res.writeHead(200, { 'Content-Type': 'text/html; charset=utf-8', 'Content-Length': page.length })
    if (site.mode !== 'trickle') return void res.end(page)
    const piece = Math.ceil(page.length / TRICKLE_STEPS)
    let step = 0
    const send = () => {
      if (res.destroyed) return
      const start = step * piece
      step++
      if (start + piece >= page.length) return void res.end(page.subarray(start))
      res.write(page.subarray(start, start + piece))
      setTimeout(send, TRICKLE_MS / TRICKLE_STEPS)
    }
    setTimeout(send, TRICKLE_MS / TRICKLE_STEPS)
  })
  await new Promise<void>((resolve) => site.server.listen(0, '127.0.0.1', resolve))
  site.port = (site.server.address() as AddressInfo).port
  return site
}

function stopSite(site: Site): Promise<void> {
  site.server.closeAllConnections()
  return new Promise((resolve) => site.server.close(() => resolve()))
}

// --- Printing -------------------------------------------------------------------------------------

const format = (value: number, digits = 0) =>
  value.toLocaleString('en-US', { maximumFractionDigits: digits, minimumFractionDigits: digits })
const mib = (bytes: number) => `${format(bytes / 2 ** 20, 1)} MiB`
const kib = (bytes: number) => `${format(bytes / 1024, 1)} KiB`
const ms = (value: number) => `${format(value, 1)} ms`
const sleep = (milliseconds: number) => new Promise((resolve) => setTimeout(resolve, milliseconds))

function describeOutcomes(outcomes: Map<string, number>): string {
  const entries = [...outcomes].sort(([a], [b]) => a.localeCompare(b))
  return entries.length === 0 ? 'none' : entries.map(([outcome, count]) => `${outcome} × ${format(count)}`).join(', ')
}

function describeFlood(result: Flood): string[] {
  const rate = result.seconds > 0 ? `${format(result.answered / result.seconds)} answers/s` : 'no answers'
  const cpu = result.answered > 0 ? `; Latch CPU ${format(result.cpuMicros / result.answered / 1000, 2)} ms/answer` : ''
  return [
    `  ${format(result.sent)} requests sent, ${format(result.answered)} answered in ${format(result.seconds, 1)} s (${rate}${cpu}; ${mib(result.bytes)} received)`,
    ...(result.stoppedBy === undefined ? [] : [`  STOPPED EARLY: ${result.stoppedBy}`]),
    `  answers: ${describeOutcomes(result.outcomes)}`,
  ]
}

const describeUsage = (usage: AttackUsage | undefined) =>
  usage === undefined
    ? 'no answer'
    : `RSS ${mib(usage.rss)}, heapUsed ${mib(usage.heapUsed)}, external ${mib(usage.external)}`

type Row = [figure: string, measured: string, answers: string]

const rows: Row[] = [['figure', 'measured', 'answers']]

function printTable(): void {
  const widths = [0, 1, 2].map((i) => Math.max(...rows.map((row) => row[i].length)))
  for (const [i, row] of rows.entries()) {
    console.log(`  ${row.map((cell, j) => cell.padEnd(widths[j])).join('   ')}`.trimEnd())
    if (i === 0) console.log(`  ${widths.map((width) => '-'.repeat(width)).join('   ')}`)
  }
}

/** A short form of the answers for the table: the commonest first. */
function shortOutcomes(outcomes: Map<string, number>): string {
  return [...outcomes]
    .sort((a, b) => b[1] - a[1])
    .map(([outcome, count]) => `${outcome} ×${format(count)}`)
    .join(', ')
}

// --- Figures ---------------------------------------------------------------------------------------

async function authFlood(label: string, title: string, shape: { path: string; description: string }): Promise<void> {
  const latch = await startLatch()
  try {
    const first = await probe(latch, shape.path)
    console.log(
      `\n${label} GET /auth flood, ${title}: ${shape.description}; request target ${format(shape.path.length)} characters`,
    )
    console.log(`  one request answers ${first.status} (${format(first.bytes)} bytes)`)
    const before = await usageOf(latch, true)
    const result = await flood(latch, {
      path: () => shape.path,
      count: REQUESTS,
      connections: CONNECTIONS,
      seconds: FLOOD_SECONDS,
    })
    const after = await usageOf(latch, true)
    for (const line of describeFlood(result)) console.log(line)
    console.log(`  before (after GC): ${describeUsage(before)}`)
    console.log(`  after  (after GC): ${describeUsage(after)}`)
    console.log(`  peak RSS during the flood: ${mib(result.peakRss)}`)
    const grown = before !== undefined && after !== undefined ? after.heapUsed - before.heapUsed : undefined
    if (after !== undefined && grown !== undefined && after.pending > 0) {
      console.log(`  Latch holds ${format(after.pending)} pending requests: ${kib(grown / after.pending)} of heap each`)
    }
    if (after !== undefined && after.errorLines > 0)
      console.log(`  Latch logged ${format(after.errorLines)} error lines, the first: ${after.firstError}`)
    if (latch.exited() !== undefined) console.log(`  Latch exited: ${latch.exited()}`)
    const memory =
      before === undefined || after === undefined
        ? `peak RSS ${mib(result.peakRss)}`
        : `RSS ${mib(before.rss)} → ${mib(after.rss)} (peak ${mib(result.peakRss)}), heap ${mib(before.heapUsed)} → ${mib(after.heapUsed)}`
    const each =
      after !== undefined && grown !== undefined && after.pending > 0
        ? `; ${kib(grown / after.pending)} a pending request`
        : ''
    const stopped = result.stoppedBy === undefined ? '' : `; stopped at ${format(result.sent)}`
    rows.push([
      `${label} ${title}, target ${format(shape.path.length)}`,
      `${memory}${each}${stopped}`,
      shortOutcomes(result.outcomes),
    ])
  } finally {
    await stopLatch(latch)
  }
}

async function discoveryFlood(site: Site): Promise<void> {
  const latch = await startLatch(site.port)
  try {
    console.log(
      `\n(2) Discovery flood: ${format(DISCOVERY_REQUESTS)} GET /auth, ${format(DISCOVERY_CONNECTIONS)} connections, each a client_id of its own; ` +
        `the site answers every fetch 200 text/html, ${kib(PAGE_BYTES)} trickled over ${format(TRICKLE_MS)} ms`,
    )
    site.mode = 'trickle'
    site.reset()
    const before = await usageOf(latch, true)
    await latch.ask({ kind: 'delay-reset' })
    const result = await flood(latch, {
      path: (i) => discoveryPath(`http://c${i}.example/`),
      count: DISCOVERY_REQUESTS,
      connections: DISCOVERY_CONNECTIONS,
      seconds: DISCOVERY_SECONDS,
    })
    const delay = await latch.ask<AttackDelay>({ kind: 'delay' })
    const after = await usageOf(latch, true)
    for (const line of describeFlood(result)) console.log(line)
    console.log(`  the site saw ${format(site.fetches)} fetches, at most ${format(site.peakOpen)} open at once`)
    console.log(`  before (after GC): ${describeUsage(before)}`)
    console.log(`  peak RSS during the flood: ${mib(result.peakRss)}`)
    console.log(`  after  (after GC): ${describeUsage(after)}`)
    if (delay !== undefined)
      console.log(`  event-loop delay during the flood: max ${ms(delay.maxMs)}, p99 ${ms(delay.p99Ms)}`)
    if (latch.exited() !== undefined) console.log(`  Latch exited: ${latch.exited()}`)
    const memory =
      before === undefined || after === undefined
        ? `peak RSS ${mib(result.peakRss)}`
        : `RSS ${mib(before.rss)} → peak ${mib(result.peakRss)} → ${mib(after.rss)}`
    const stall = delay === undefined ? '' : `; max stall ${ms(delay.maxMs)}`
    const stopped = result.stoppedBy === undefined ? '' : `; stopped at ${format(result.sent)}`
    rows.push([
      `(2) discovery flood, ${format(DISCOVERY_REQUESTS)} client_ids`,
      `${memory}; ${format(site.fetches)} fetches, ${format(site.peakOpen)} at once${stall}${stopped}`,
      shortOutcomes(result.outcomes),
    ])
  } finally {
    await stopLatch(latch)
  }
}

async function scanStalls(site: Site): Promise<void> {
  const latch = await startLatch(site.port)
  try {
    console.log(
      `\n(3) Event-loop stalls while client pages are scanned: ${format(SCAN_PAGES)} discoveries of each page, ${format(SCAN_CONCURRENCY)} at a time, ${kib(PAGE_BYTES)} each, sent at once`,
    )
    site.mode = 'plain'
    await flood(latch, {
      path: (i) => discoveryPath(`http://warm${i}.example/`),
      count: 2 * SCAN_CONCURRENCY,
      connections: SCAN_CONCURRENCY,
      seconds: 10,
    })
    const measured: Record<string, { delay: AttackDelay | undefined; result: Flood }> = {}
    for (const [mode, name] of [
      ['plain', 'plain page (<p>hello</p> repeated)'],
      [
        'crafted',
        `crafted page (${format(SCAN_NEST)} nested <div>, then ${format(Math.floor((PAGE_BYTES - 5 * SCAN_NEST) / 4))} × </x>)`,
      ],
    ] as const) {
      site.mode = mode
      site.reset()
      await usageOf(latch, true) // a GC now rather than during the run
      await latch.ask({ kind: 'delay-reset' })
      const result = await flood(latch, {
        path: (i) => discoveryPath(`http://${mode}${i}.example/`),
        count: SCAN_PAGES,
        connections: SCAN_CONCURRENCY,
        seconds: 20,
      })
      const delay = await latch.ask<AttackDelay>({ kind: 'delay' })
      measured[mode] = { delay, result }
      const cpu =
        result.answered > 0 ? `, Latch CPU ${format(result.cpuMicros / result.answered / 1000, 1)} ms a discovery` : ''
      console.log(
        `  ${name}: ${format(result.answered)} discoveries in ${format(result.seconds, 1)} s${cpu}; answers: ${describeOutcomes(result.outcomes)}`,
      )
      if (result.stoppedBy !== undefined) console.log(`    STOPPED EARLY: ${result.stoppedBy}`)
      console.log(
        `    event-loop delay: ${delay === undefined ? 'no answer' : `max ${ms(delay.maxMs)}, p99 ${ms(delay.p99Ms)}, mean ${ms(delay.meanMs)}`}`,
      )
    }
    const stall = (delay: AttackDelay | undefined) =>
      delay === undefined ? 'no answer' : `max ${ms(delay.maxMs)}, p99 ${ms(delay.p99Ms)}`
    rows.push([
      `(3) stall, crafted page (${format(SCAN_NEST)} <div>, </x>…)`,
      stall(measured.crafted?.delay),
      shortOutcomes(measured.crafted?.result.outcomes ?? new Map()),
    ])
    rows.push([
      '(3) stall, plain page (baseline)',
      stall(measured.plain?.delay),
      shortOutcomes(measured.plain?.result.outcomes ?? new Map()),
    ])
    if (latch.exited() !== undefined) console.log(`  Latch exited: ${latch.exited()}`)
  } finally {
    await stopLatch(latch)
  }
}

// --- Main -------------------------------------------------------------------------------------------

async function attempt(name: string, figure: () => Promise<void>): Promise<void> {
  try {
    await figure()
  } catch (err) {
    console.log(`\n${name} could not be measured: ${err instanceof Error ? err.message : String(err)}`)
    rows.push([name, 'not measured', '-'])
  }
}

function finish(began: number): void {
  console.log('\nSummary (RSS and heap before and after are taken after forced GCs)')
  printTable()
  console.log(`\nThe attack bench took ${format((performance.now() - began) / 1000)} s.`)
}

async function main(): Promise<void> {
  const began = performance.now()
  const load = loadavg()
    .map((value) => format(value, 2))
    .join(', ')
  console.log(
    `Latch attack bench: Node ${process.version}, ${cpus().length} cores (load average ${load}), 127.0.0.1 only`,
  )
  console.log(
    `Latch runs in a child process (bench/attack-server.ts, DATA_FILE=memory, --expose-gc); limits: target ${format(LIMITS.target)}, ` +
      `state ${format(LIMITS.state)}, me ${format(LIMITS.me)}, ${format(LIMITS.scopes)} scopes × ${format(LIMITS.scopeLength)} characters`,
  )
  const watchdog = setTimeout(() => {
    console.log(`\nThe bench ran past ${DEADLINE_SECONDS} s: stopping with what it has.`)
    for (const child of children) child.kill('SIGKILL')
    finish(began)
    process.exit(0)
  }, DEADLINE_SECONDS * 1000)
  watchdog.unref()

  if (FIGURES.includes('1')) {
    await attempt('(1a)', () => authFlood('(1a)', 'largest accepted', largestAccepted()))
    await attempt('(1b)', () => authFlood('(1b)', 'hostile', hostile()))
  }
  if (FIGURES.includes('2') || FIGURES.includes('3')) {
    const site = await startSite()
    try {
      if (FIGURES.includes('2')) await attempt('(2)', () => discoveryFlood(site))
      if (FIGURES.includes('3')) await attempt('(3)', () => scanStalls(site))
    } finally {
      await stopSite(site)
    }
  }
  clearTimeout(watchdog)
  finish(began)
}

try {
  await main()
} catch (err) {
  console.log(`The attack bench stopped: ${err instanceof Error ? err.message : String(err)}`)
} finally {
  for (const child of children) child.kill('SIGKILL')
}
