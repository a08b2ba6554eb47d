// DATA_FILE on a full disk. Latch runs on a small tmpfs that a filler file fills up, so that its
// journal meets what a full disk really does: a write that stores fewer bytes than asked without
// an error, then writes that fail with ENOSPC. Checked: a change is answered as done only once all
// of its bytes are on disk; a write that fails or is cut short answers 500 server_error and leaves
// only whole lines; once space returns, writes work again without a restart; every restart opens
// the file and finds every token answered 200 active; and a compaction that runs out of space
// leaves the journal as it was and says so in the log.
// Mounting the tmpfs needs root: without it these tests are skipped, or fail when CI is set.

import { after, before, describe, it } from 'node:test'
import type { TestContext } from 'node:test'
import assert from 'node:assert/strict'
import { execFileSync, spawn } from 'node:child_process'
import { once } from 'node:events'
import { Agent, request } from 'node:http'
import { fileURLToPath } from 'node:url'
import { closeSync, fstatSync, ftruncateSync, openSync, readFileSync, writeSync } from 'node:fs'
import { mkdir, mkdtemp, readFile, readdir, rm, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import { FileStore, createSecret, hashSecret } from '../server.ts'
import type { Grant, Token } from '../server.ts'
import { START, startLatch, until } from './harness.ts'

const VERIFIER = 'dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk'
const CHALLENGE = 'E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM'
const CLIENT_ID = 'http://127.0.0.1:8080/'
const REDIRECT_URI = 'http://127.0.0.1:8080/callback'
/** tmpfs hands out space in pages of 4 KiB: a file grows into the rest of its last page for free. */
const PAGE = 4096

let disk: string
let mountFailure: string | undefined

before(async () => {
  disk = await mkdtemp(join(tmpdir(), 'latch-disk-'))
  try {
    execFileSync('mount', ['-t', 'tmpfs', '-o', 'size=1m', 'tmpfs', disk], { stdio: 'pipe' })
  } catch (err) {
    mountFailure = String((err as { stderr?: Buffer }).stderr ?? err)
      .trim()
      .split('\n')[0]
  }
})

after(async () => {
  if (mountFailure === undefined) {
    try {
      execFileSync('umount', [disk], { stdio: 'pipe' })
    } catch {
      execFileSync('umount', ['-l', disk], { stdio: 'pipe' }) // a failed test may have left the data file open
    }
  }
  await rm(disk, { recursive: true, force: true })
})

/** False, with the test skipped, when the tmpfs could not be mounted; a failure instead on CI. */
function haveDisk(t: TestContext): boolean {
  if (mountFailure === undefined) return true
  if (process.env.CI) assert.fail(`testing a full disk needs 'mount -t tmpfs' (run as root): ${mountFailure}`)
  t.skip(`cannot mount a tmpfs to fill (run as root to test a full disk): ${mountFailure}`)
  return false
}

/**
 * Fills the disk with zeros until ENOSPC, then frees exactly `pages` pages of the filler: what
 * is left is those pages, besides the unused rest of the last page of each other file.
 */
function fillDisk(path: string, pages: number): void {
  const fd = openSync(path, 'w')
  const zeros = Buffer.alloc(16 * PAGE)
  try {
    for (let i = 0; i < 1_000; i++) writeSync(fd, zeros) // more than the disk holds; the last write may be cut short
    assert.fail('the disk never filled up')
  } catch (err) {
    if ((err as NodeJS.ErrnoException).code !== 'ENOSPC') throw err
    const size = fstatSync(fd).size
    assert.equal(size % PAGE, 0)
    ftruncateSync(fd, size - pages * PAGE)
  } finally {
    closeSync(fd)
  }
}

// --- A client that walks the flow ---------------------------------------------------------

function post(url: string, fields: Record<string, string>, headers: Record<string, string> = {}): Promise<Response> {
  const body = new URLSearchParams(fields).toString()
  return fetch(url, {
    method: 'POST',
    redirect: 'manual',
    headers: { 'Content-Type': 'application/x-www-form-urlencoded', ...headers },
    body,
  })
}

async function obtainCode(base: string): Promise<string> {
  const query = new URLSearchParams({
    client_id: CLIENT_ID,
    redirect_uri: REDIRECT_URI,
    state: 's',
    code_challenge: CHALLENGE,
    scope: 'create',
  })
  const html = await (await fetch(`${base}/auth?${query}`, { redirect: 'manual' })).text()
  const request = /name="request" value="([^"]+)"/.exec(html)?.[1] ?? ''
  const csrf = /name="csrf" value="([^"]+)"/.exec(html)?.[1] ?? ''
  const approved = await post(
    `${base}/auth/consent`,
    { request, csrf, scope: 'create', decision: 'approve' },
    { Cookie: `latch_csrf=${csrf}` },
  )
  assert.equal(approved.status, 303)
  return new URL(approved.headers.get('location') ?? '').searchParams.get('code') ?? ''
}

function exchange(base: string, code: string): Promise<Response> {
  return post(`${base}/token`, {
    grant_type: 'authorization_code',
    code,
    client_id: CLIENT_ID,
    redirect_uri: REDIRECT_URI,
    code_verifier: VERIFIER,
  })
}

function refresh(base: string, refreshToken: string): Promise<Response> {
  return post(`${base}/token`, { grant_type: 'refresh_token', refresh_token: refreshToken, client_id: CLIENT_ID })
}

type Tokens = { access_token: string; refresh_token: string }

async function tokensOf(response: Response): Promise<Tokens> {
  assert.equal(response.status, 200)
  return (await response.json()) as Tokens
}

async function isActive(base: string, token: string): Promise<boolean> {
  return ((await (await post(`${base}/introspect`, { token })).json()) as { active: boolean }).active
}

/** Latch on a FileStore of the data file, with the store's log kept for assertions. */
async function startOn(file: string) {
  const logs: string[] = []
  const store = await FileStore.open(file, { now: () => START, log: (line) => logs.push(line) })
  const latch = await startLatch({ DATA_FILE: file }, { store })
  const stop = async () => {
    await latch.close()
    await store.close()
  }
  return { base: latch.base, store, logs, stop }
}

/** Every line of the journal is whole: it ends with a newline and reads as JSON. */
async function assertWholeLines(file: string, when: string): Promise<void> {
  const text = await readFile(file, 'utf8')
  assert.ok(text.endsWith('\n'), `${when}, the journal ends with a torn line: …${JSON.stringify(text.slice(-60))}`)
  text
    .slice(0, -1)
    .split('\n')
    .forEach((line, i) =>
      assert.doesNotThrow(
        () => JSON.parse(line),
        `${when}, line ${i + 1} of the journal is not JSON: ${line.slice(0, 80)}…`,
      ),
    )
}

// --- The tests -----------------------------------------------------------------------------

describe('DATA_FILE: a full disk', () => {
  it('answers 200 only for an exchange wholly on disk, 500 for one that does not fit, and writes again once space returns', async (t) => {
    if (!haveDisk(t)) return
    const file = join(disk, 'full', 'data.jsonl')
    const filler = join(disk, 'full-filler')
    t.after(() => rm(filler, { force: true })) // frees the disk for the next test, even after a failure
    const running = await startOn(file)
    const codes: string[] = []
    for (let i = 0; i < 30; i++) codes.push(await obtainCode(running.base)) // their lines are written while there is room
    fillDisk(filler, 1) // a few KB left: some exchanges fit, the one that meets the end is written in part

    const promised: string[] = []
    let failed: string | undefined
    for (const code of codes) {
      const response = await exchange(running.base, code)
      if (response.status !== 200) {
        assert.equal(response.status, 500)
        assert.equal(((await response.json()) as { error: string }).error, 'server_error')
        failed = code
        break
      }
      promised.push(((await response.json()) as { access_token: string }).access_token)
    }
    assert.ok(failed !== undefined, 'every exchange was answered 200: the disk never filled up')
    await assertWholeLines(file, 'after the disk filled up')
    // the log says what to do, and that no restart is needed: the first thing an owner would try
    const said = running.logs.find((line) => line.startsWith('journal: writing '))
    assert.match(
      said ?? '',
      /ENOSPC.* \(the disk is full: free some space; writes go on by themselves once it is, with no restart\)$/,
    )

    await rm(filler) // space returns: the same store writes again, the failed code's exchange included
    const retried = await exchange(running.base, failed)
    assert.equal(retried.status, 200)
    promised.push(((await retried.json()) as { access_token: string }).access_token)
    await assertWholeLines(file, 'after space returned')
    await running.stop()

    const restarted = await startOn(file)
    try {
      for (const token of promised)
        assert.equal(await isActive(restarted.base, token), true, 'a token answered 200 is lost after a restart')
      assert.equal(restarted.store.memory.tokens.size, 2 * promised.length) // nothing of the exchange answered 500
    } finally {
      await restarted.stop()
    }
  })

  it('starts on a full disk and serves the tokens it holds', async (t) => {
    if (!haveDisk(t)) return
    const file = join(disk, 'start-full', 'data.jsonl')
    const filler = join(disk, 'start-full-filler')
    t.after(() => rm(filler, { force: true }))
    const first = await startOn(file)
    const { access_token } = (await (await exchange(first.base, await obtainCode(first.base))).json()) as {
      access_token: string
    }
    await first.stop()
    fillDisk(filler, 0)
    const restarted = await startOn(file)
    try {
      assert.equal(await isActive(restarted.base, access_token), true)
      assert.deepEqual(await readdir(join(disk, 'start-full')), ['data.jsonl'])
    } finally {
      await restarted.stop()
    }
  })

  it('takes a refresh answered 500 back whole: the token rotated before it is still the one to retry', async (t) => {
    if (!haveDisk(t)) return
    const file = join(disk, 'rotate', 'data.jsonl')
    const filler = join(disk, 'rotate-filler')
    t.after(() => rm(filler, { force: true }))
    const running = await startOn(file)
    try {
      const first = await tokensOf(await exchange(running.base, await obtainCode(running.base)))
      const other = await tokensOf(await exchange(running.base, await obtainCode(running.base)))
      const second = await tokensOf(await refresh(running.base, first.refresh_token))
      fillDisk(filler, 0)
      // another grant's refreshes take what is left of the journal's last page, until one does not fit
      let spare = other.refresh_token
      for (let fitted = 0; ; fitted++) {
        assert.ok(fitted < 100, 'every refresh fitted: the disk never filled up')
        const answer = await refresh(running.base, spare)
        if (answer.status === 500) break
        spare = (await tokensOf(answer)).refresh_token
      }
      assert.equal((await refresh(running.base, second.refresh_token)).status, 500)
      // the grant names the first as rotated last again, not none (which would let any used token retry)
      const grantId = running.store.memory.tokens.get(hashSecret(first.refresh_token))?.grantId ?? ''
      assert.equal(running.store.memory.grants.get(grantId)?.lastRotated, hashSecret(first.refresh_token))
      await rm(filler)
      // the rotation from the second did not happen: the first, rotated last, sent again within
      // REFRESH_TOKEN_GRACE is a retry, not a reuse that revokes the grant
      await tokensOf(await refresh(running.base, first.refresh_token))
      assert.equal(await isActive(running.base, second.access_token), true)
    } finally {
      await running.stop()
    }
  })

  it('starts on a new data file when the disk is full, and writes once there is room', async (t) => {
    if (!haveDisk(t)) return
    const file = join(disk, 'new-on-full', 'data.jsonl')
    await mkdir(join(disk, 'new-on-full'))
    const filler = join(disk, 'new-on-full-filler')
    t.after(() => rm(filler, { force: true }))
    fillDisk(filler, 0) // not a byte left: not even for the line that names the journal's format
    const running = await startOn(file)
    try {
      assert.equal(await readFile(file, 'utf8'), '')
      await rm(filler)
      assert.equal((await exchange(running.base, await obtainCode(running.base))).status, 200)
    } finally {
      await running.stop()
    }
    const restarted = await startOn(file) // and what it wrote is read back
    try {
      assert.equal(restarted.store.memory.grants.size, 1)
    } finally {
      await restarted.stop()
    }
  })

  it('keeps the journal as it was, and logs the failure, when a compaction runs out of space', async (t) => {
    if (!haveDisk(t)) return
    const file = join(disk, 'compact', 'data.jsonl')
    const filler = join(disk, 'compact-filler')
    t.after(() => rm(filler, { force: true }))
    // 150 live grants with an access token each, then dead lines up to 10,000 in all: the next
    // line starts a compaction, whose snapshot (about 65 KB, 301 lines) is written in one go.
    const secrets = Array.from({ length: 150 }, () => createSecret())
    const lines = [JSON.stringify({ journal: 'latch', format: 1 })] // else the first start compacts it
    for (const secret of secrets) {
      const grantId = hashSecret(`grant ${secret}`)
      const grant: Grant = {
        client_id: CLIENT_ID,
        client_name: undefined,
        me: 'https://example.com/',
        scope: ['create'],
        resource: [],
        accessTokenTtlSeconds: 86400,
        approvedAt: START,
        lastUsedAt: START,
        expiresAt: START + 86400_000,
      }
      const token: Token = {
        kind: 'access',
        grantId,
        scope: ['create'],
        resource: [],
        issuedAt: START,
        expiresAt: START + 86400_000,
        usedAt: undefined,
      }
      lines.push(
        JSON.stringify({ set: 'grant', key: grantId, value: grant }),
        JSON.stringify({ set: 'token', key: hashSecret(secret), value: token }),
      )
    }
    while (lines.length < 10_000)
      lines.push(JSON.stringify({ delete: 'session', key: hashSecret(`gone ${lines.length}`) }))
    const original = lines.map((line) => `${line}\n`).join('')
    await mkdir(join(disk, 'compact'))
    await writeFile(file, original)

    const running = await startOn(file)
    fillDisk(filler, 1) // a few KB left: room for the next line, not for the snapshot
    const code = await obtainCode(running.base) // line 10,001: more than 10,000 and than 4 × 301 live entries
    assert.ok(running.store.compaction !== undefined, 'no compaction started')
    await running.store.compaction
    assert.ok(
      running.logs.some((line) =>
        /^journal: compacting .* failed, .*ENOSPC.* \(the disk is full: free some space;/.test(line),
      ),
      'no log line says the compaction failed',
    )
    assert.ok(
      (await readFile(file, 'utf8')).startsWith(original),
      'the journal was replaced by a snapshot that did not fit',
    )
    assert.deepEqual(await readdir(join(disk, 'compact')), ['data.jsonl']) // no snapshot left behind
    await running.stop()
    await rm(filler)

    const restarted = await startOn(file)
    try {
      for (const secret of secrets)
        assert.equal(await isActive(restarted.base, secret), true, 'a live token is lost after the failed compaction')
      assert.equal((await exchange(restarted.base, code)).status, 200) // the line that started the compaction is kept too
    } finally {
      await restarted.stop()
    }
  })
})

describe('The log on a full disk', () => {
  it('drops lines while the disk is full, then goes on and says how many it lost', async (t) => {
    if (!haveDisk(t)) return
    await mkdir(join(disk, 'log'))
    const logFile = join(disk, 'log', 'latch.log')
    const filler = join(disk, 'log', 'filler')
    const fd = openSync(logFile, 'a') // as `npx tsx server.ts >> latch.log`
    const child = spawn(process.execPath, ['--import', 'tsx', 'server.ts'], {
      cwd: fileURLToPath(new URL('..', import.meta.url)),
      env: { PATH: process.env.PATH ?? '', PORT: '0', DATA_FILE: 'memory' },
      stdio: ['ignore', fd, 'inherit'],
    })
    closeSync(fd)
    const log = () => readFileSync(logFile, 'utf8')
    try {
      assert.ok(await until(() => /listening on http/.test(log()), 20_000), 'Latch did not start')
      const base = /listening on (http:\/\/\S+)/.exec(log())?.[1] ?? ''
      fillDisk(filler, 0)
      // more than 64 KiB of log lines, written as soon as they are gathered: on the full disk
      const agent = new Agent({ keepAlive: true })
      for (let i = 0; i < 700; i++) await get(`${base}/.well-known/oauth-authorization-server`, agent)
      await rm(filler)
      await get(`${base}/apps`, agent)
      assert.ok(await until(() => /lines dropped while the disk was full/.test(log())), 'the log stopped for good')
      const lines = log().split('\n')
      assert.ok(lines.some((line) => /^\S+ 127\.0\.0\.1 GET \/apps 200 /.test(line))) // on a line of its own
      const dropped = Number(/log: (\d+) lines dropped/.exec(log())?.[1])
      assert.ok(dropped > 0 && dropped <= 700, `${dropped} lines dropped`)
      agent.destroy()
    } finally {
      child.kill('SIGKILL')
      await once(child, 'close')
    }
  })
})

/** A GET whose answer is read to its end, on the given agent's connections. */
function get(url: string, agent: Agent): Promise<number> {
  return new Promise((resolve, reject) => {
    request(url, { agent }, (res) => {
      res.resume()
      res.on('end', () => resolve(res.statusCode ?? 0))
    })
      .on('error', reject)
      .end()
  })
}
