// What the journal costs: tokens issued per second with DATA_FILE=memory and with a data file,
// in one run, under concurrent load; and how long start-up takes with 100,000 live tokens in the
// file. Latch runs as its real command line in a child process; this process is the client.
//
//   node --import tsx bench/durability.ts        (part of npm run bench)
//
// Settings: BENCH_EXCHANGES per run (4,000), BENCH_CONCURRENCY (16), BENCH_STARTUP_TOKENS (100,000).

import { spawn } from 'node:child_process'
import type { ChildProcess } from 'node:child_process'
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs'
import { Agent, request } from 'node:http'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { fileURLToPath } from 'node:url'
import { FileStore, hashSecret } from '../server.ts'

const EXCHANGES = Number(process.env.BENCH_EXCHANGES ?? 4_000)
const CONCURRENCY = Number(process.env.BENCH_CONCURRENCY ?? 16)
const STARTUP_TOKENS = Number(process.env.BENCH_STARTUP_TOKENS ?? 100_000)
const ROOT = fileURLToPath(new URL('..', import.meta.url))
const VERIFIER = 'dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk'
const CHALLENGE = 'E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM'
const CLIENT_ID = 'http://127.0.0.1:8080/'
const REDIRECT_URI = 'http://127.0.0.1:8080/callback'
const agent = new Agent({ keepAlive: true, maxSockets: CONCURRENCY })

type Reply = { status: number; headers: Record<string, string | string[] | undefined>; body: string }

function call(
  base: string,
  method: string,
  path: string,
  body?: string,
  headers: Record<string, string> = {},
): Promise<Reply> {
  return new Promise((resolve, reject) => {
    const sent = request(
      `${base}${path}`,
      {
        method,
        agent,
        headers: body === undefined ? headers : { 'Content-Type': 'application/x-www-form-urlencoded', ...headers },
      },
      (response) => {
        let text = ''
        response.setEncoding('utf8')
        response.on('data', (chunk: string) => (text += chunk))
        response.on('end', () => resolve({ status: response.statusCode ?? 0, headers: response.headers, body: text }))
      },
    )
    sent.on('error', reject)
    sent.end(body)
  })
}

/** Starts `server.ts` and resolves with its URL and how long it took to say it listens. */
function startLatch(env: Record<string, string>): Promise<{ base: string; child: ChildProcess; startupMs: number }> {
  const started = performance.now()
  const child = spawn(process.execPath, ['--import', 'tsx', 'server.ts'], {
    cwd: ROOT,
    env: { ...process.env, PORT: '0', ...env },
    stdio: ['ignore', 'pipe', 'pipe'],
  })
  let output = ''
  return new Promise((resolve, reject) => {
    child.stdout?.on('data', (chunk) => {
      output += chunk
      const match = /Latch is listening on (\S+)/.exec(output)
      if (match !== null && output.includes('metadata'))
        resolve({ base: match[1], child, startupMs: performance.now() - started })
    })
    child.stderr?.on('data', (chunk) => (output += chunk))
    child.on('exit', () => reject(new Error(`Latch exited: ${output}`)))
  })
}

async function stop(child: ChildProcess): Promise<void> {
  const closed = new Promise((resolve) => child.once('close', resolve))
  child.kill('SIGTERM')
  await closed
}

/** Mints one code through GET /auth and an approving POST /auth/consent. */
async function mintCode(base: string): Promise<string> {
  const query = new URLSearchParams({
    client_id: CLIENT_ID,
    redirect_uri: REDIRECT_URI,
    state: 's',
    code_challenge: CHALLENGE,
    scope: 'create',
  })
  const page = await call(base, 'GET', `/auth?${query}`)
  const requestId = /name="request" value="([^"]+)"/.exec(page.body)?.[1] ?? ''
  const csrf = /name="csrf" value="([^"]+)"/.exec(page.body)?.[1] ?? ''
  const consent = await call(
    base,
    'POST',
    '/auth/consent',
    new URLSearchParams({ request: requestId, csrf, scope: 'create', decision: 'approve' }).toString(),
    { Cookie: `latch_csrf=${csrf}` },
  )
  return new URL(String(consent.headers.location)).searchParams.get('code') ?? ''
}

/** Runs `task` for every item, `CONCURRENCY` at a time. */
async function inParallel<T>(items: T[], task: (item: T) => Promise<void>): Promise<void> {
  let next = 0
  await Promise.all(
    Array.from({ length: CONCURRENCY }, async () => {
      while (next < items.length) await task(items[next++])
    }),
  )
}

/** Tokens issued per second by one server: codes minted first, then exchanged concurrently. */
async function issuanceRate(dataFile: string): Promise<number> {
  const { base, child } = await startLatch({ DATA_FILE: dataFile })
  try {
    const codes: string[] = []
    await inParallel(
      Array.from({ length: EXCHANGES }, (_, i) => i),
      async () => void codes.push(await mintCode(base)),
    )
    const body = (code: string) =>
      new URLSearchParams({
        grant_type: 'authorization_code',
        code,
        client_id: CLIENT_ID,
        redirect_uri: REDIRECT_URI,
        code_verifier: VERIFIER,
      }).toString()
    const started = performance.now()
    let failed = 0
    await inParallel(codes, async (code) => {
      if ((await call(base, 'POST', '/token', body(code))).status !== 200) failed++
    })
    const seconds = (performance.now() - started) / 1000
    if (failed > 0) throw new Error(`${failed} exchanges failed`)
    return codes.length / seconds
  } finally {
    await stop(child)
  }
}

/** Writes a journal with `count` live tokens, each with its grant, as the server would. */
function writeJournal(path: string, count: number): void {
  const now = Date.now()
  const lines: string[] = []
  for (let i = 0; i < count; i++) {
    const grantId = hashSecret(`startup-code-${i}`)
    const expiresAt = now + 7 * 86400_000
    const grant = {
      client_id: CLIENT_ID,
      me: 'http://127.0.0.1:3000/',
      scope: ['create'],
      accessTokenTtlSeconds: 604800,
      approvedAt: now,
      lastUsedAt: now,
      expiresAt,
    }
    lines.push(JSON.stringify({ set: 'grant', key: grantId, value: grant }))
    lines.push(
      JSON.stringify({
        set: 'token',
        key: hashSecret(`startup-token-${i}`),
        value: { kind: 'access', grantId, scope: ['create'], issuedAt: now, expiresAt },
      }),
    )
  }
  writeFileSync(path, `${lines.join('\n')}\n`, { mode: 0o600 })
}

async function main(): Promise<void> {
  const dir = mkdtempSync(join(tmpdir(), 'latch-bench-'))
  try {
    console.log(`Latch durability bench: ${EXCHANGES} token exchanges per run, ${CONCURRENCY} at a time, on 127.0.0.1`)
    const memory = await issuanceRate('memory')
    const journal = await issuanceRate(join(dir, 'issuance.jsonl'))
    console.log(`  tokens issued per second, DATA_FILE=memory   ${Math.round(memory).toLocaleString('en')}`)
    console.log(`  tokens issued per second, journal on disk    ${Math.round(journal).toLocaleString('en')}`)
    console.log(
      `  journal / memory                             ${Math.round((100 * journal) / memory)}%   (target: at least 50%)`,
    )

    const file = join(dir, 'startup.jsonl')
    writeJournal(file, STARTUP_TOKENS)
    const opened = performance.now()
    const store = await FileStore.open(file, { log: () => {} })
    const replayMs = performance.now() - opened
    const live = store.memory.tokens.size
    await store.close()
    const { child, startupMs } = await startLatch({ DATA_FILE: file })
    await stop(child)
    console.log(
      `  start-up with ${live.toLocaleString('en')} live tokens in the file: replay ${Math.round(replayMs)} ms, whole process until it listens ${Math.round(startupMs)} ms`,
    )
  } finally {
    agent.destroy()
    rmSync(dir, { recursive: true, force: true })
  }
}

await main()
