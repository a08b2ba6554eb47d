// Latch behind a real nginx (Debian's /usr/sbin/nginx) that speaks TLS with a self-signed
// certificate for localhost, as docs/deploy.md sets it up: nginx uses the `location /` block of
// docs/nginx.conf, and Latch runs as its own command line with TRUST_PROXY=127.0.0.1. Clients
// connect from 127.0.0.2, 127.0.0.3, … (every 127/8 address is loopback on Linux), so nginx sees
// each as a different address and passes it on in X-Forwarded-For. Checked through the proxy:
// https URLs built from the issuer, Secure cookies, the issuer in the redirect, a Latch without a
// password refusing all that comes through (403, and 421 for a foreign Host), per-address password
// limits, and the client's address in the log, never the proxy's nor one the client made up.
//
// Without nginx or openssl the tests are skipped with the reason printed; with CI set they fail.

import { after, before, describe, it } from 'node:test'
import assert from 'node:assert/strict'
import { spawn, spawnSync } from 'node:child_process'
import type { ChildProcess, ChildProcessWithoutNullStreams } from 'node:child_process'
import { existsSync } from 'node:fs'
import { readFile, rm, writeFile } from 'node:fs/promises'
import type { IncomingHttpHeaders } from 'node:http'
import { request } from 'node:https'
import { connect, createServer } from 'node:net'
import type { AddressInfo } from 'node:net'
import { join } from 'node:path'
import { escapeHtml, hashPassword } from '../server.ts'
import { makeCertificate } from './tls.ts'

const NGINX = '/usr/sbin/nginx'
const PASSWORD = 'correct horse battery staple'
const CLIENT_ID = 'http://127.0.0.1:9/' // a loopback client: Latch never fetches it
const REDIRECT_URI = 'http://127.0.0.1:9/callback'
const CHALLENGE = 'E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM'
const SPOOFED = '203.0.113.9'
/** The longest wait for anything: a process to start, an answer, a log line. */
const TIMEOUT = 15_000

/** Why the test cannot run here, or undefined when it can. */
function missingTool(): string | undefined {
  if (!existsSync(NGINX)) return `nginx not found at ${NGINX}: apt-get install -y nginx to run the proxy test`
  const openssl = spawnSync('openssl', ['version'], { encoding: 'utf8' })
  if (openssl.error !== undefined || openssl.status !== 0)
    return 'openssl not found: apt-get install -y openssl to run the proxy test'
  return undefined
}

const MISSING = missingTool()
/** The `skip` option of each test: the reason, outside CI, when a tool is missing. */
const SKIP = MISSING !== undefined && (process.env.CI ?? '') === '' ? MISSING : false

// --- Processes -------------------------------------------------------------------

async function freePort(): Promise<number> {
  const server = createServer()
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
  const { port } = server.address() as AddressInfo
  await new Promise((resolve) => server.close(resolve))
  return port
}

/** Resolves once `child` has exited, or after SIGKILL when SIGTERM was not enough within the timeout. */
async function stop(child: ChildProcess | undefined): Promise<void> {
  if (child === undefined || child.exitCode !== null || child.signalCode !== null) return
  const exited = new Promise((resolve) => child.once('exit', resolve))
  child.kill('SIGTERM')
  const timer = setTimeout(() => child.kill('SIGKILL'), 5_000)
  await exited
  clearTimeout(timer)
}

type Latch = {
  child: ChildProcessWithoutNullStreams
  /** The port Latch listens on, behind nginx. */
  port: number
  /** Every whole line Latch wrote to standard output so far. */
  lines: string[]
  /** The first line that matches, as soon as Latch writes it (it writes its log every 100 ms). */
  waitForLine: (pattern: RegExp) => Promise<string>
}

/** Starts `node --import tsx server.ts` on 127.0.0.1 and a free port, and reads its log. */
async function startLatch(settings: Record<string, string>): Promise<Latch> {
  const env: Record<string, string | undefined> = { ...process.env }
  for (const name of ['ME', 'PASSWORD_HASH', 'LOG_FORMAT', 'TRUST_PROXY', 'ISSUER']) delete env[name]
  const child = spawn(process.execPath, ['--import', 'tsx', 'server.ts'], {
    cwd: new URL('..', import.meta.url),
    env: { ...env, PORT: '0', HOST: '127.0.0.1', DATA_FILE: 'memory', TRUST_PROXY: '127.0.0.1', ...settings },
  })
  const lines: string[] = []
  let partial = ''
  let stderr = ''
  child.stdout.setEncoding('utf8')
  child.stdout.on('data', (chunk: string) => {
    const parts = (partial + chunk).split('\n')
    partial = parts.pop() ?? ''
    lines.push(...parts)
  })
  child.stderr.setEncoding('utf8')
  child.stderr.on('data', (chunk: string) => (stderr += chunk))
  const waitForLine = (pattern: RegExp) =>
    new Promise<string>((resolve, reject) => {
      let timer: NodeJS.Timeout | undefined
      const done = () => {
        clearTimeout(timer)
        child.stdout.off('data', check)
        child.off('exit', check)
      }
      function check() {
        const line = lines.find((candidate) => pattern.test(candidate))
        if (line !== undefined) {
          done()
          resolve(line)
        } else if (child.exitCode !== null) {
          done()
          reject(new Error(`Latch exited before writing a line that matches ${pattern}:\n${lines.join('\n')}${stderr}`))
        }
      }
      timer = setTimeout(() => {
        done()
        reject(
          new Error(`no line of Latch's log matched ${pattern} within ${TIMEOUT} ms; its log:\n${lines.join('\n')}`),
        )
      }, TIMEOUT)
      child.stdout.on('data', check) // after the listener above, so `lines` holds the new chunk
      child.on('exit', check)
      check()
    })
  // the last line of the start-up banner, or its one JSON line with LOG_FORMAT=json
  await waitForLine(/^ {2}metadata |"event":"start"/).catch((err: unknown) => {
    child.kill() // the caller never sees this child, so it could not stop it
    throw err
  })
  const listening = lines
    .map((line) =>
      /^Latch is listening on http:\/\/127\.0\.0\.1:(\d+)|"listening":"http:\/\/127\.0\.0\.1:(\d+)"/.exec(line),
    )
    .find(Boolean)
  assert.ok(listening, `Latch did not say where it listens:\n${lines.join('\n')}`)
  return { child, port: Number(listening[1] ?? listening[2]), lines, waitForLine }
}

/** The `location / { … }` block that docs/nginx.conf recommends, proxying to `port` instead of 3000. */
async function recommendedLocation(port: number): Promise<string> {
  const text = await readFile(new URL('../docs/nginx.conf', import.meta.url), 'utf8')
  const block = /^[ \t]*location \/ \{\n[\s\S]*?^[ \t]*\}$/m.exec(text)?.[0]
  assert.ok(block !== undefined, 'docs/nginx.conf has no `location / { … }` block')
  assert.match(block, /proxy_pass http:\/\/127\.0\.0\.1:3000;/)
  return block.replace('http://127.0.0.1:3000', `http://127.0.0.1:${port}`)
}

/** An nginx configuration that keeps every file it writes in `dir`: one TLS server per Latch. */
async function nginxConfig(dir: string, servers: { listen: number; latch: number }[]): Promise<string> {
  const blocks = await Promise.all(
    servers.map(
      async ({ listen, latch }) => `
  server {
    listen 127.0.0.1:${listen} ssl;
    server_name localhost;
    ssl_certificate ${dir}/cert.pem;
    ssl_certificate_key ${dir}/key.pem;
    client_max_body_size 64k;
${await recommendedLocation(latch)}
  }`,
    ),
  )
  return `daemon off;
master_process off;
worker_processes 1;
pid ${dir}/nginx.pid;
error_log ${dir}/error.log notice;
events {
  worker_connections 64;
}
http {
  access_log ${dir}/access.log;
  client_body_temp_path ${dir}/client_body_temp;
  proxy_temp_path ${dir}/proxy_temp;
  fastcgi_temp_path ${dir}/fastcgi_temp;
  uwsgi_temp_path ${dir}/uwsgi_temp;
  scgi_temp_path ${dir}/scgi_temp;
${blocks.join('\n')}
}
`
}

/** Resolves once something accepts connections on 127.0.0.1:`port`; fails when `child` exits first. */
async function waitUntilAccepting(port: number, child: ChildProcess, why: () => Promise<string>): Promise<void> {
  const deadline = Date.now() + TIMEOUT
  for (;;) {
    if (child.exitCode !== null || child.signalCode !== null) throw new Error(`nginx exited: ${await why()}`)
    const accepted = await new Promise<boolean>((resolve) => {
      const socket = connect(port, '127.0.0.1')
      socket.once('connect', () => (socket.destroy(), resolve(true)))
      socket.once('error', () => resolve(false))
    })
    if (accepted) return
    if (Date.now() > deadline) throw new Error(`nginx did not listen on ${port} within ${TIMEOUT} ms: ${await why()}`)
    await new Promise((resolve) => setTimeout(resolve, 20)) // the poll's interval
  }
}

// --- Requests through nginx ----------------------------------------------------------

type Answer = { status: number; headers: IncomingHttpHeaders; body: string }

type Send = {
  /** The loopback address the client connects from: nginx's $remote_addr. */
  from: string
  method?: string
  headers?: Record<string, string>
  body?: string
}

let ca: string

/** Sends one request to nginx on `port` over https, checking its certificate against ours. */
function send(port: number, path: string, { from, method = 'GET', headers = {}, body }: Send): Promise<Answer> {
  return new Promise((resolve, reject) => {
    const req = request(
      {
        host: '127.0.0.1',
        port,
        servername: 'localhost', // for SNI and the certificate check, whatever the Host header says
        ca,
        localAddress: from,
        agent: false,
        method,
        path,
        headers: { Host: `localhost:${port}`, ...headers },
        timeout: TIMEOUT,
      },
      (res) => {
        let text = ''
        res.setEncoding('utf8')
        res.on('data', (chunk: string) => (text += chunk))
        res.on('end', () => resolve({ status: res.statusCode ?? 0, headers: res.headers, body: text }))
        res.on('error', reject)
      },
    )
    req.on('timeout', () => req.destroy(new Error(`no answer to ${method} ${path} within ${TIMEOUT} ms`)))
    req.on('error', reject)
    req.end(body)
  })
}

function cookies(answer: Answer): string[] {
  return answer.headers['set-cookie'] ?? []
}

/** The attributes of a Set-Cookie value, lower-cased, without the name and value. */
function attributes(setCookie: string): string[] {
  return setCookie
    .split(';')
    .slice(1)
    .map((part) => part.trim().toLowerCase())
}

type Consent = { request: string; csrf: string; cookie: string }

/** Opens an authorization request from `from`, and returns what its consent form posts back. */
async function openConsent(port: number, from: string): Promise<Consent & { answer: Answer }> {
  const query = new URLSearchParams({
    response_type: 'code',
    client_id: CLIENT_ID,
    redirect_uri: REDIRECT_URI,
    state: 'proxy-state',
    code_challenge: CHALLENGE,
    code_challenge_method: 'S256',
    scope: 'create',
  })
  const answer = await send(port, `/auth?${query}`, { from })
  assert.equal(answer.status, 200, answer.body)
  const request = /name="request" value="([^"]+)"/.exec(answer.body)?.[1]
  const csrf = /name="csrf" value="([^"]+)"/.exec(answer.body)?.[1]
  const cookie = cookies(answer)
    .map((value) => /^(__Host-latch_csrf=[^;]+)/.exec(value)?.[1])
    .find(Boolean)
  assert.ok(request !== undefined && csrf !== undefined, 'the consent page has no request or csrf field')
  assert.ok(cookie !== undefined, `no __Host-latch_csrf cookie: ${JSON.stringify(cookies(answer))}`)
  return { request, csrf, cookie, answer }
}

function postConsent(port: number, from: string, consent: Consent, password: string): Promise<Answer> {
  return send(port, '/auth/consent', {
    from,
    method: 'POST',
    headers: { 'Content-Type': 'application/x-www-form-urlencoded', Cookie: consent.cookie },
    body: new URLSearchParams({
      request: consent.request,
      csrf: consent.csrf,
      scope: 'create',
      decision: 'approve',
      password,
    }).toString(),
  })
}

const escape = (text: string) => text.replace(/[.*+?^${}()|[\]\\/]/g, '\\$&')

/** A text log line: `<ISO time> <address> <METHOD> <path> <status> <N>ms`, then maybe more. */
function logLine(address: string, method: string, path: string, status: number): RegExp {
  return new RegExp(`^(\\S+) ${escape(address)} ${method} ${escape(path)} ${status} \\d+ms(?: |$)`)
}

// --- The test ------------------------------------------------------------------------

describe('Latch behind nginx with TLS (docs/deploy.md)', () => {
  let dir: string
  let nginx: ChildProcess | undefined
  let withPassword: Latch | undefined // PASSWORD_HASH set, text log
  let withoutPassword: Latch | undefined // no PASSWORD_HASH, LOG_FORMAT=json
  let port: number // nginx's port in front of withPassword
  let openPort: number // nginx's port in front of withoutPassword
  let issuer: string
  const secrets: string[] = [PASSWORD]

  before(async () => {
    if (MISSING !== undefined) {
      if (SKIP !== false) return
      throw new Error(`${MISSING} (CI is set, so the proxy test must run)`)
    }
    const certificate = await makeCertificate('localhost')
    dir = certificate.dir
    ca = certificate.cert.toString('utf8')

    port = await freePort()
    openPort = await freePort()
    issuer = `https://localhost:${port}`
    const passwordHash = await hashPassword(PASSWORD, { ln: 10, r: 8, p: 1 })
    secrets.push(passwordHash)
    withPassword = await startLatch({ ISSUER: issuer, ME: 'https://example.com/', PASSWORD_HASH: passwordHash })
    // TRUST_PROXY names a proxy, which without a password refuses to start
    withoutPassword = await startLatch({ ISSUER: `https://localhost:${openPort}`, LOG_FORMAT: 'json', TRUST_PROXY: '' })

    const conf = join(dir, 'nginx.conf')
    await writeFile(
      conf,
      await nginxConfig(dir, [
        { listen: port, latch: withPassword.port },
        { listen: openPort, latch: withoutPassword.port },
      ]),
    )
    let nginxOutput = ''
    nginx = spawn(NGINX, ['-p', `${dir}/`, '-c', conf, '-e', join(dir, 'error.log')], { stdio: 'pipe' })
    nginx.stdout?.on('data', (chunk) => (nginxOutput += chunk))
    nginx.stderr?.on('data', (chunk) => (nginxOutput += chunk))
    const why = async () => nginxOutput + (await readFile(join(dir, 'error.log'), 'utf8').catch(() => ''))
    await waitUntilAccepting(port, nginx, why)
    await waitUntilAccepting(openPort, nginx, why)
  })

  after(async () => {
    await stop(nginx)
    await stop(withPassword?.child)
    await stop(withoutPassword?.child)
    if (dir !== undefined) await rm(dir, { recursive: true, force: true })
  })

  it('gives https URLs built from the issuer, on the home page and in the metadata', { skip: SKIP }, async () => {
    const metadata = await send(port, '/.well-known/oauth-authorization-server', { from: '127.0.0.4' })
    assert.equal(metadata.status, 200, metadata.body)
    const document = JSON.parse(metadata.body) as Record<string, unknown>
    assert.equal(document.issuer, issuer)
    assert.equal(document.authorization_endpoint, `${issuer}/auth`)
    assert.equal(document.token_endpoint, `${issuer}/token`)
    for (const [name, value] of Object.entries(document))
      if (name.endsWith('_endpoint')) assert.ok(String(value).startsWith(`${issuer}/`), `${name} is ${value}`)

    const home = await send(port, '/', { from: '127.0.0.4' })
    assert.equal(home.status, 200)
    assert.ok(
      home.body.includes(escapeHtml(`<link rel="authorization_endpoint" href="${issuer}/auth">`)),
      'the home page does not show the https /auth',
    )
    assert.ok(String(home.headers.link).includes(`<${issuer}/auth>; rel="authorization_endpoint"`))
    assert.ok(String(home.headers.link).includes(`<${issuer}/token>; rel="token_endpoint"`))
  })

  it('sets Secure cookies, and redirects an approval with the https issuer as iss', { skip: SKIP }, async () => {
    const from = '127.0.0.4'
    const consent = await openConsent(port, from)
    secrets.push(consent.csrf, consent.request, consent.cookie.split('=')[1])
    const csrfCookie = cookies(consent.answer).find((value) => value.startsWith('__Host-latch_csrf='))
    assert.ok(csrfCookie !== undefined)
    assert.ok(attributes(csrfCookie).includes('secure'), csrfCookie)
    assert.ok(attributes(csrfCookie).includes('httponly'), csrfCookie)

    const approved = await postConsent(port, from, consent, PASSWORD)
    assert.equal(approved.status, 303, approved.body)
    const location = new URL(String(approved.headers.location))
    assert.equal(`${location.origin}${location.pathname}`, REDIRECT_URI)
    assert.equal(location.searchParams.get('iss'), issuer)
    assert.equal(location.searchParams.get('state'), 'proxy-state')
    assert.ok(location.searchParams.get('code'))
    secrets.push(location.searchParams.get('code') ?? '')
    const session = cookies(approved).find((value) => value.startsWith('__Host-latch_session='))
    assert.ok(session !== undefined, `no session cookie: ${JSON.stringify(cookies(approved))}`)
    secrets.push(/^[^=]+=([^;]*)/.exec(session)?.[1] ?? '')
    assert.ok(attributes(session).includes('secure'), session)
    assert.ok(attributes(session).includes('httponly'), session)

    const line = await withPassword!.waitForLine(logLine(from, 'POST', '/auth/consent', 303))
    assert.ok(!Number.isNaN(Date.parse(line.split(' ')[0])), `the line does not start with a time: ${line}`)
    const opened = await withPassword!.waitForLine(logLine(from, 'GET', '/auth', 200))
    assert.ok(opened.includes(` client_id=${CLIENT_ID}`), `no client_id on the /auth line: ${opened}`)
  })

  it(
    'refuses all that nginx forwards when Latch has no password: 403, or 421 to a Host not the issuer’s',
    { skip: SKIP },
    async () => {
      // whoever nginx serves connects from loopback: a request it forwards may be anyone's
      const from = '127.0.0.6'
      const own = await send(openPort, '/', { from })
      assert.equal(own.status, 403, own.body)
      assert.match(own.body, /came through a proxy/)
      const foreign = await send(openPort, '/', { from, headers: { Host: `rebound.example:${openPort}` } })
      assert.equal(foreign.status, 421, foreign.body)

      for (const [status, error] of [
        [403, 'access_denied'],
        [421, 'invalid_request'],
      ] as const) {
        const line = await withoutPassword!.waitForLine(new RegExp(`"status":${status}`))
        const entry = JSON.parse(line) as Record<string, unknown>
        assert.equal(entry.address, '127.0.0.1') // nginx's: without TRUST_PROXY, its header is not believed
        assert.equal(entry.method, 'GET')
        assert.equal(entry.path, '/')
        assert.equal(typeof entry.ms, 'number')
        assert.ok(!Number.isNaN(Date.parse(String(entry.time))), `no time in ${line}`)
        assert.equal(entry.error, error)
      }
    },
  )

  it('limits wrong passwords per client address, as nginx forwards it', { skip: SKIP }, async () => {
    const guesser = '127.0.0.2'
    const owner = '127.0.0.3'
    const consent = await openConsent(port, guesser)
    secrets.push(consent.csrf, consent.request)
    for (let attempt = 1; attempt <= 5; attempt++) {
      const answer = await postConsent(port, guesser, consent, `wrong guess ${attempt}`)
      assert.equal(answer.status, 401, `attempt ${attempt} from ${guesser}: ${answer.status}`)
      assert.match(answer.body, /Wrong password/)
    }
    // Past the five free attempts, each one must wait longer than the last: a fast guesser is
    // refused within a few more (the delay may start one attempt late, and grows if we were slow).
    let refused: Answer | undefined
    const statuses: number[] = []
    for (let attempt = 6; attempt <= 8 && refused === undefined; attempt++) {
      const answer = await postConsent(port, guesser, consent, `wrong guess ${attempt}`)
      statuses.push(answer.status)
      if (answer.status === 429) refused = answer
      else assert.equal(answer.status, 401, answer.body)
    }
    assert.ok(refused !== undefined, `${guesser} was never refused after 5 wrong passwords: ${statuses.join(', ')}`)
    assert.match(String(refused.headers['retry-after']), /^\d+$/)

    const other = await openConsent(port, owner)
    const answer = await postConsent(port, owner, other, 'an honest typo')
    assert.equal(answer.status, 401, `${owner} has free attempts of its own: ${answer.status}`)
    assert.match(answer.body, /Wrong password/)

    const locked = await withPassword!.waitForLine(logLine(guesser, 'POST', '/auth/consent', 429))
    assert.ok(locked.includes(' error=too_many_requests'), locked)
    await withPassword!.waitForLine(logLine(owner, 'POST', '/auth/consent', 401))
    // a security event, on a line of its own, that names the guesser's address
    await withPassword!.waitForLine(new RegExp(`^\\S+ ${escape(guesser)} security: .*(?:lockout|wrong password)`, 'i'))
    const proxied = withPassword!.lines.filter((line) => / 127\.0\.0\.1 (?:GET|POST) /.test(line))
    assert.deepEqual(proxied, [], 'requests through nginx were logged with the proxy’s address')
  })

  it('logs the address nginx saw, not one the client sent in its own headers', { skip: SKIP }, async () => {
    const path = '/.well-known/oauth-authorization-server'
    // 127.0.0.1 is the proxy's own, trusted address: a client there came through a tunnel on this machine
    for (const from of ['127.0.0.5', '127.0.0.1']) {
      const answer = await send(port, path, {
        from,
        headers: { 'X-Forwarded-For': SPOOFED, Forwarded: `for=${SPOOFED}` },
      })
      assert.equal(answer.status, 200)
      await withPassword!.waitForLine(logLine(from, 'GET', path, 200))
    }
    assert.deepEqual(
      withPassword!.lines.filter((line) => line.includes(SPOOFED)),
      [],
    )
  })

  it('never writes a password, hash, code, cookie or form token to the log', { skip: SKIP }, () => {
    const log = [...withPassword!.lines, ...withoutPassword!.lines].join('\n')
    for (const secret of secrets.filter((value) => value.length >= 8))
      assert.ok(!log.includes(secret), `the log holds a secret: ${secret.slice(0, 8)}…`)
  })
})
