// Tests for Latch, one `describe` per part of the wire contract (the README's endpoints), in the
// order a client meets them, then a full flow. Every HTTP test runs a real server on port 0 and
// calls it with fetch; time comes from a clock the test advances, never from sleeping.

import { after, before, describe, it } from 'node:test'
import assert from 'node:assert/strict'
import { fork, spawn } from 'node:child_process'
import { createHash } from 'node:crypto'
import { Agent, createServer, request } from 'node:http'
import type { IncomingMessage, ServerResponse } from 'node:http'
import { getEventListeners, once } from 'node:events'
import { connect } from 'node:net'
import type { AddressInfo, Socket } from 'node:net'
import { PassThrough, Writable } from 'node:stream'
import { setFlagsFromString } from 'node:v8'
import { runInNewContext } from 'node:vm'
import { fileURLToPath } from 'node:url'
import { mkdir, mkdtemp, rm, writeFile } from 'node:fs/promises'
import { tmpdir } from 'node:os'
import { join } from 'node:path'
import {
  CONNECTION_LIMITS,
  ConfigError,
  FileStore,
  MemoryStore,
  NotStored,
  OAuthError,
  buildHelp,
  SETTINGS,
  canonicalizeUrl,
  clientIdProblem,
  computeCodeChallenge,
  verifyCodeChallenge,
  configWarnings,
  countAttempt,
  closeLatchServer,
  createLatchServer,
  createHandler,
  createLineWriter,
  createSecret,
  getParam,
  readForm,
  hashSecret,
  hashPassword,
  isClientId,
  isCodeVerifier,
  loadConfig,
  openStore,
  parseDuration,
  parseForm,
  parseScope,
  profileUrlProblem,
  redirectUriProblem,
  safeEqual,
  verifyPassword,
  withPasswordSlot,
} from './server.ts'
import type {
  AuthorizationCode,
  Grant,
  Passkey,
  PasswordAttempts,
  PasswordSlots,
  PendingRequest,
  Store,
  Token,
  TokenIssue,
} from './server.ts'
import { START, startLatch, until } from './test/harness.ts'
import type { TestServer } from './test/harness.ts'

// --- Harness ----------------------------------------------------------------------

/** The PKCE example of RFC 7636 Appendix B. */
const VERIFIER = 'dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk'
const CHALLENGE = 'E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM'
const CLIENT_ID = 'http://127.0.0.1:8080/'
const REDIRECT_URI = 'http://127.0.0.1:8080/callback'
const FAST_COST = { ln: 10, r: 8, p: 1 }
/** A hash of 'correct horse', made with the fast cost, for settings that need one to be valid. */
const PASSWORD_HASH = await hashPassword('correct horse', FAST_COST)

function authorizationUrl(latch: TestServer, overrides: Record<string, string | undefined> = {}): string {
  const params: Record<string, string | undefined> = {
    response_type: 'code',
    client_id: CLIENT_ID,
    redirect_uri: REDIRECT_URI,
    state: 'state-1234',
    code_challenge: CHALLENGE,
    code_challenge_method: 'S256',
    scope: 'profile create',
    me: 'https://example.com/',
    ...overrides,
  }
  const query = new URLSearchParams()
  for (const [name, value] of Object.entries(params)) if (value !== undefined) query.append(name, value)
  return `${latch.base}/auth?${query}`
}

function form(fields: Record<string, string | string[] | undefined>): URLSearchParams {
  const body = new URLSearchParams()
  for (const [name, value] of Object.entries(fields)) {
    for (const one of typeof value === 'string' ? [value] : (value ?? [])) body.append(name, one)
  }
  return body
}

function post(url: string, body: URLSearchParams | string, headers: Record<string, string> = {}): Promise<Response> {
  return fetch(url, {
    method: 'POST',
    redirect: 'manual',
    headers: { 'Content-Type': 'application/x-www-form-urlencoded', ...headers },
    body: body.toString(),
  })
}

type Consent = { request: string; csrf: string; cookie: string; html: string }

/** Opens the consent page and reads its form's hidden fields and the CSRF cookie. */
async function openConsent(
  latch: TestServer,
  overrides: Record<string, string | undefined> = {},
  cookie?: string,
): Promise<Consent> {
  const response = await fetch(authorizationUrl(latch, overrides), {
    redirect: 'manual',
    headers: cookie ? { Cookie: cookie } : {},
  })
  const html = await response.text()
  assert.equal(response.status, 200, html)
  const setCookie = response.headers.get('set-cookie') ?? ''
  return {
    request: /name="request" value="([^"]+)"/.exec(html)?.[1] ?? '',
    csrf: /name="csrf" value="([^"]+)"/.exec(html)?.[1] ?? '',
    cookie: setCookie.split(';')[0],
    html,
  }
}

function submitConsent(
  latch: TestServer,
  consent: Consent,
  fields: Record<string, string | string[] | undefined> = {},
): Promise<Response> {
  const body = form({
    request: consent.request,
    csrf: consent.csrf,
    scope: ['profile', 'create'],
    decision: 'approve',
    ...fields,
  })
  return post(`${latch.base}/auth/consent`, body, { Cookie: consent.cookie })
}

/** Walks GET /auth and an approving consent; returns the code from the redirect. */
async function obtainCode(
  latch: TestServer,
  overrides: Record<string, string | undefined> = {},
  fields: Record<string, string | string[] | undefined> = {},
): Promise<string> {
  const consent = await openConsent(latch, overrides)
  const response = await submitConsent(latch, consent, fields)
  assert.equal(response.status, 303)
  const code = new URL(response.headers.get('location') ?? '').searchParams.get('code')
  assert.ok(code)
  return code
}

function exchange(
  latch: TestServer,
  code: string,
  overrides: Record<string, string | undefined> = {},
): Promise<Response> {
  const fields = {
    grant_type: 'authorization_code',
    code,
    client_id: CLIENT_ID,
    redirect_uri: REDIRECT_URI,
    code_verifier: VERIFIER,
    ...overrides,
  }
  return post(`${latch.base}/token`, form(fields))
}

async function obtainToken(
  latch: TestServer,
  fields: Record<string, string | string[] | undefined> = {},
): Promise<string> {
  const response = await exchange(latch, await obtainCode(latch, {}, fields))
  assert.equal(response.status, 200)
  return ((await response.json()) as { access_token: string }).access_token
}

async function introspect(
  latch: TestServer,
  token: string,
  headers: Record<string, string> = {},
): Promise<Record<string, unknown>> {
  const response = await post(`${latch.base}/introspect`, form({ token }), headers)
  assert.equal(response.status, 200)
  return (await response.json()) as Record<string, unknown>
}

/** Asserts a JSON OAuth error by status and `error` code, never by its prose. */
/** Asserts an error answer; `error` undefined: a 401 without an error code, as to a request without credentials. */
async function assertError(response: Response, status: number, error: string | undefined): Promise<void> {
  const body = await response.text()
  assert.equal(response.status, status, body)
  assert.equal(response.headers.get('content-type'), 'application/json')
  const json = JSON.parse(body) as Record<string, unknown>
  assert.equal(json.error, error, body)
  assert.equal(typeof json.error_description, 'string')
  assert.doesNotMatch(json.error_description as string, /["\\]/)
}

/** Asserts an error redirect from GET /auth: 302 to redirect_uri with error, state and iss. */
function assertErrorRedirect(
  latch: TestServer,
  response: Response,
  error: string,
  state: string | null = 'state-1234',
): URL {
  assert.equal(response.status, 302)
  const location = new URL(response.headers.get('location') ?? '')
  assert.equal(`${location.origin}${location.pathname}`, REDIRECT_URI)
  assert.equal(location.searchParams.get('error'), error)
  assert.ok(location.searchParams.get('error_description'))
  assert.equal(location.searchParams.get('state'), state)
  assert.equal(location.searchParams.get('iss'), latch.issuer)
  return location
}

// --- Configuration ------------------------------------------------------------------

describe('Configuration', () => {
  it('serves on 127.0.0.1:3000 with no settings at all', () => {
    const config = loadConfig({})
    assert.equal(config.port, 3000)
    assert.equal(config.host, '127.0.0.1')
    assert.equal(config.issuer, 'http://127.0.0.1:3000')
    assert.equal(config.me, 'http://127.0.0.1:3000/')
    assert.equal(config.passwordHash, undefined)
    assert.equal(config.dataFile, 'latch-data.jsonl')
    assert.equal(config.codeTtlSeconds, 300)
    assert.equal(config.accessTokenTtlSeconds, 604800)
    assert.equal(config.introspectionSecret, undefined)
    assert.equal(config.refreshTokenTtlSeconds, 2592000)
    assert.deepEqual(config.profile, {
      name: undefined,
      url: 'http://127.0.0.1:3000/',
      photo: undefined,
      email: undefined,
    })
  })

  it('lets a flag win over the variable, in both flag spellings', () => {
    assert.equal(loadConfig({ PORT: '4000' }, ['--port', '5000']).port, 5000)
    assert.equal(loadConfig({ PORT: '4000' }, ['--port=5001']).port, 5001)
    assert.equal(loadConfig({}, ['--code-ttl', '2m']).codeTtlSeconds, 120)
  })

  it('treats an empty variable as unset', () => {
    assert.equal(loadConfig({ PORT: '', INTROSPECTION_SECRET: '' }).port, 3000)
    assert.equal(loadConfig({ INTROSPECTION_SECRET: '' }).introspectionSecret, undefined)
  })

  it('builds the default issuer from the bound port when PORT is 0', () => {
    const config = loadConfig({ PORT: '0' }, [], { boundPort: 41234 })
    assert.equal(config.issuer, 'http://127.0.0.1:41234')
    assert.equal(config.me, 'http://127.0.0.1:41234/')
    assert.equal(loadConfig({ HOST: '::1' }).issuer, 'http://[::1]:3000')
    // as it is written in a URL: the brackets are not part of the address
    assert.equal(loadConfig({ HOST: '[::1]' }).host, '::1')
    assert.equal(loadConfig({ HOST: '[::1]' }).issuer, 'http://[::1]:3000')
    assert.throws(() => loadConfig({ HOST: '[]', PASSWORD_HASH }), /HOST \[\] is not an IPv6 address/) // not every interface
  })

  it('takes HOST as the address it is, however written, and binds localhost as 127.0.0.1', () => {
    for (const written of ['0:0:0:0:0:0:0:1', '[0::1]']) {
      const config = loadConfig({ HOST: written }) // loopback: no password needed
      assert.deepEqual([config.host, config.issuer], ['::1', 'http://[::1]:3000'])
    }
    assert.equal(loadConfig({ HOST: 'fd00:0::2', PASSWORD_HASH, ISSUER: 'https://a.example' }).host, 'fd00::2')
    // Node would bind only the first address the name resolves to, ::1 on many systems, and the
    // README's links to 127.0.0.1 would reach nothing; the issuer keeps the name, for passkeys
    const local = loadConfig({ HOST: 'localhost' })
    assert.deepEqual([local.host, local.issuer], ['127.0.0.1', 'http://localhost:3000'])
    assert.throws(() => loadConfig({ HOST: '0' }), { message: /^HOST 0 is not 127\.0\.0\.1/ }) // as written
  })

  it('drops a trailing slash from ISSUER and canonicalizes ME', () => {
    const config = loadConfig({
      ISSUER: 'https://Auth.Example.com/latch/',
      ME: 'HTTPS://Example.COM',
      PASSWORD_HASH: PASSWORD_HASH,
    })
    assert.equal(config.issuer, 'https://auth.example.com/latch')
    assert.equal(config.me, 'https://example.com/')
  })

  const durations: [string, number][] = [
    ['300', 300],
    ['90s', 90],
    ['10m', 600],
    ['12h', 43200],
    ['7d', 604800],
    ['0000000000000060', 60],
  ]
  for (const [value, seconds] of durations) {
    it(`reads the duration ${value} as ${seconds} seconds`, () => assert.equal(parseDuration('X', value), seconds))
  }

  it('reads a refresh grace of 0, in any unit, as off', () => {
    for (const value of ['0', '00', '0s', '0m'])
      assert.equal(loadConfig({ REFRESH_TOKEN_GRACE: value }).refreshTokenGraceSeconds, 0)
    assert.equal(parseDuration('REFRESH_TOKEN_GRACE', '0', { allowZero: true }), 0)
    assert.throws(() => parseDuration('CODE_TTL', '0'), /CODE_TTL 0 is not a positive duration/)
  })

  it('says a duration of many digits is too long, not that it is not one', () => {
    assert.throws(() => parseDuration('ACCESS_TOKEN_TTL', '9999999999999'), /is longer than ten years: use 3650d/)
    assert.throws(() => parseDuration('ACCESS_TOKEN_TTL', '9'.repeat(400)), /is longer than ten years/)
  })

  it('refuses a value with a carriage return, white space or quotes around it, and says which to remove', () => {
    const cases: [Record<string, string>, string[], string][] = [
      [
        { PORT: '4223\r' },
        [],
        'PORT "4223\\r" ends in a carriage return (its file has Windows line endings): remove it',
      ],
      [{ LOG_FORMAT: 'json\r' }, [], 'LOG_FORMAT "json\\r" ends in a carriage return'],
      [{}, ['--data-file', '/srv/latch.jsonl\r'], '--data-file "/srv/latch.jsonl\\r" ends in a carriage return'],
      [{ DATA_FILE: '/srv/latch.jsonl ' }, [], 'DATA_FILE "/srv/latch.jsonl " has white space around it: remove it'],
      [{ PROFILE_NAME: '\ufeffAda' }, [], 'PROFILE_NAME "\\ufeffAda" has white space around it: remove it'],
      // durations were trimmed: now every setting is read as written
      [{ CODE_TTL: ' 300' }, [], 'CODE_TTL " 300" has white space around it'],
      [{ REFRESH_TOKEN_GRACE: ' 0 ' }, [], 'REFRESH_TOKEN_GRACE " 0 " has white space around it'],
      [{ DATA_FILE: '"/srv/latch.jsonl"' }, [], 'DATA_FILE "\\"/srv/latch.jsonl\\"" has quotes around it'],
      [{ ME: "'https://example.com/'" }, [], `ME "'https://example.com/'" has quotes around it (an env file read`],
      [{ TRUST_PROXY: '127.0.0.1\r', PASSWORD_HASH }, [], 'TRUST_PROXY "127.0.0.1\\r" ends in a carriage return'],
      // a secret is named, never shown
      [{ PASSWORD_HASH: `${PASSWORD_HASH}\r` }, [], 'PASSWORD_HASH ends in a carriage return'],
      [{ INTROSPECTION_SECRET: '"a-long-introspection-secret"' }, [], 'INTROSPECTION_SECRET has quotes around it'],
    ]
    for (const [env, argv, message] of cases)
      assert.throws(
        () => loadConfig(env, argv),
        (err: unknown) => err instanceof ConfigError && err.message.startsWith(message),
        message,
      )
    // inside a value, spaces and quotes are the value's own
    const config = loadConfig({ PROFILE_NAME: 'Ada "Countess" Lovelace', TRUST_PROXY: '127.0.0.1, ::1', PASSWORD_HASH })
    assert.equal(config.profile.name, 'Ada "Countess" Lovelace')
    assert.deepEqual(config.trustProxy, ['127.0.0.1', '::1'])
  })

  it('says how a PASSWORD_HASH or a value was damaged on its way into an env file, never showing the hash', async () => {
    const cases: [Record<string, string>, RegExp][] = [
      // systemd's EnvironmentFile keeps a comment after a value, as part of it
      [{ PASSWORD_HASH: `${PASSWORD_HASH} # from hash-password` }, /^PASSWORD_HASH holds a comment/],
      [{ ISSUER: 'https://auth.example.com # the public URL' }, /^ISSUER "https:.*" holds a comment/],
      [{ PASSWORD_HASH: `PASSWORD_HASH=${PASSWORD_HASH}` }, /^PASSWORD_HASH begins with PASSWORD_HASH= again/],
      [{ PASSWORD_HASH: PASSWORD_HASH.slice(0, -5) }, /^PASSWORD_HASH's last part has 38 characters where a hash/],
      [{ PASSWORD_HASH: `${PASSWORD_HASH}x` }, /^PASSWORD_HASH's last part has 44 characters where a hash/],
      // a salt one character short decodes to 15 bytes, and the hash would start but never verify
      [{ PASSWORD_HASH: PASSWORD_HASH.replace(/(p=1:)./, '$1') }, /^PASSWORD_HASH's salt has 21 characters where/],
      [{ PASSWORD_HASH: PASSWORD_HASH.replace(':', ':\t') }, /^PASSWORD_HASH holds white space/],
      [{ PASSWORD_HASH: PASSWORD_HASH.replace('ln=10', 'ln=9') }, /^PASSWORD_HASH has a cost outside/],
      [{ PASSWORD_HASH: 'hunter2hunter2hunter2' }, /^PASSWORD_HASH is not a hash made by Latch: create one/],
    ]
    const salt = PASSWORD_HASH.split(':')[2] // in every damaged value but the last
    for (const [env, message] of cases)
      assert.throws(
        () => loadConfig(env),
        (err: unknown) => err instanceof ConfigError && message.test(err.message) && !err.message.includes(salt),
        String(message),
      )
    // a name is free text, and so is the path of a data file that is there: a # in them is their own
    assert.equal(loadConfig({ PROFILE_NAME: 'Ada #1', PASSWORD_HASH }).profile.name, 'Ada #1')
    const directory = await mkdtemp(join(tmpdir(), 'latch-hash-'))
    try {
      const file = join(directory, 'my #2', 'latch.jsonl')
      // not there: a comment added to an old line would else start an empty journal beside the old one
      assert.throws(() => loadConfig({ DATA_FILE: file }), /DATA_FILE ".*" holds a comment/)
      await mkdir(join(directory, 'my #2'))
      await writeFile(file, '')
      assert.equal(loadConfig({ DATA_FILE: file }).dataFile, file)
    } finally {
      await rm(directory, { recursive: true })
    }
  })

  const refusals: [string, Record<string, string>, string[], RegExp][] = [
    ['a zero duration', { ACCESS_TOKEN_TTL: '0' }, [], /ACCESS_TOKEN_TTL/],
    ['a negative duration', { ACCESS_TOKEN_TTL: '-5' }, [], /ACCESS_TOKEN_TTL/],
    ['a duration with an unknown unit', { CODE_TTL: '5w' }, [], /CODE_TTL/],
    ['a code lifetime over 10 minutes', { CODE_TTL: '601' }, [], /CODE_TTL/],
    ['a setting written in camelCase', { passwordHash: 'x' }, [], /passwordHash is not a setting: .* PASSWORD_HASH/],
    ['a setting without its underscore', { DATAFILE: 'memory' }, [], /DATAFILE is not a setting: .* DATA_FILE/],
    ['a flag in camelCase', {}, ['--dataFile', 'memory'], /Unknown option --dataFile: it is written --data-file/],
    ['an unknown flag', {}, ['--colour', 'red'], /Unknown option --colour: run `npx tsx server.ts --help`/],
    ['a secret as a misspelt flag', {}, ['--passwordHash', 'x'], /--passwordHash would show PASSWORD_HASH/],
    ['a token lifetime over ten years', { ACCESS_TOKEN_TTL: '3651d' }, [], /ACCESS_TOKEN_TTL/],
    ['a port out of range', { PORT: '70000' }, [], /PORT/],
    ['an issuer with a query', { ISSUER: 'https://a.example/?x=1' }, [], /ISSUER/],
    ['an issuer with a fragment', { ISSUER: 'https://a.example/#x' }, [], /ISSUER/],
    ['an issuer ending in a bare ?', { ISSUER: 'https://a.example/?' }, [], /ISSUER .* has a query or fragment/],
    ['an issuer ending in a bare #', { ISSUER: 'https://a.example/#' }, [], /ISSUER .* has a query or fragment/],
    ['an issuer with a user name', { ISSUER: 'https://me:pw@a.example/' }, [], /ISSUER .* user name or password/],
    ['an issuer that is not http(s)', { ISSUER: 'ftp://a.example' }, [], /ISSUER/],
    ['a profile URL with a fragment', { ME: 'https://example.com/#me' }, [], /ME/],
    ['a profile URL with a user name', { ME: 'https://user@example.com/' }, [], /ME/],
    ['a profile URL with a dot segment', { ME: 'https://example.com/a/../b' }, [], /ME/],
    ['a profile URL that URL() cannot parse', { ME: 'http://xn--a.com/' }, [], /ME/],
    [
      'a profile URL whose host is not written in ASCII, naming it in punycode',
      { ME: 'https://例え.jp/' },
      [],
      /^ME https:\/\/例え\.jp\/ has a host with characters outside ASCII: write the host in punycode, as xn--r8jz45g.jp$/,
    ],
    [
      'a profile URL whose user name is not written in ASCII, for its user name',
      { ME: 'https://ü@example.com/' },
      [],
      /^ME https:\/\/…@example\.com\/ is not a valid profile URL/, // its user name, not said back
    ],
    [
      'a profile URL whose path is not written in ASCII, as it was',
      { ME: 'https://example.com/päth' },
      [],
      /^ME .* is not a valid profile URL \(it contains spaces or characters that must be percent-encoded\)/,
    ],
    ['a password hash Latch did not make', { PASSWORD_HASH: 'hunter2' }, [], /PASSWORD_HASH.*hash-password/],
    ['a password hash in quotes', { PASSWORD_HASH: `"${PASSWORD_HASH}"` }, [], /^PASSWORD_HASH has quotes around it/],
    ['a password hash and a space', { PASSWORD_HASH: `${PASSWORD_HASH} ` }, [], /^PASSWORD_HASH has white space/],
    [
      'a password hash whose check would take 2 GiB, twice at once',
      { PASSWORD_HASH: 'scrypt:ln=20,r=16,p=4:AAAAAAAAAAAAAAAAAAAAAA:BBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB' },
      [],
      /PASSWORD_HASH .*at most 256 MiB of work/,
    ],
    [
      'a password hash too cheap to slow a guesser (r=1)',
      { PASSWORD_HASH: 'scrypt:ln=10,r=1,p=1:AAAAAAAAAAAAAAAAAAAAAA:BBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB' },
      [],
      /PASSWORD_HASH .*r of 8 to 16/,
    ],
    ...(
      [
        ['ln=9', 'ln=9,r=8,p=1'],
        ['r=7', 'ln=10,r=7,p=1'],
        ['r=17', 'ln=10,r=17,p=1'],
        ['p=0', 'ln=10,r=8,p=0'],
        ['p=5', 'ln=10,r=8,p=5'],
      ] as const
    ).map(([what, cost]): [string, Record<string, string>, string[], RegExp] => [
      `a password hash of a cost outside the bounds (${what})`,
      { PASSWORD_HASH: `scrypt:${cost}:AAAAAAAAAAAAAAAAAAAAAA:BBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB` },
      [],
      /PASSWORD_HASH .*ln of 10 or more, r of 8 to 16, p of 1 to 4/,
    ]),
    ['a non-loopback host without a password', { HOST: '0.0.0.0' }, [], /PASSWORD_HASH.*hash-password/],
    [
      'a proxy to trust without a password (it lets anyone through)',
      { TRUST_PROXY: '127.0.0.1' },
      [],
      /^TRUST_PROXY names a proxy, .*set PASSWORD_HASH, or unset TRUST_PROXY$/,
    ],
    [
      'a non-loopback host without a password, whatever the issuer',
      { HOST: '0.0.0.0', ISSUER: 'http://127.0.0.1:3000' },
      [],
      /PASSWORD_HASH.*hash-password/,
    ],
    ['a host that is not an address', { HOST: '999.1.1.1' }, [], /^HOST 999\.1\.1\.1 is not an IP address/],
    ['a host with a space', { HOST: 'bad host' }, [], /^HOST bad host is not an IP address or a host name/],
    [
      'a public issuer without a password (a proxy connects from loopback)',
      { ISSUER: 'https://auth.example.com' },
      [],
      /ISSUER.*PASSWORD_HASH.*hash-password/,
    ],
    [
      'a refresh grace period that is not a duration, saying that 0 is one',
      { REFRESH_TOKEN_GRACE: '-1' },
      [],
      /^REFRESH_TOKEN_GRACE -1 is not a duration: use 0, seconds or a unit, as in 0, 30/,
    ],
    ['a refresh grace period over 10 minutes', { REFRESH_TOKEN_GRACE: '11m' }, [], /REFRESH_TOKEN_GRACE/],
    ['a refresh grace period a second over 10 minutes', { REFRESH_TOKEN_GRACE: '601' }, [], /REFRESH_TOKEN_GRACE/],
    ['a short introspection secret', { INTROSPECTION_SECRET: 'short' }, [], /INTROSPECTION_SECRET/],
    [
      'an introspection secret no Bearer header can carry',
      { INTROSPECTION_SECRET: 'my introspection passphrase' },
      [],
      /INTROSPECTION_SECRET holds a character/,
    ],
    ['an unknown flag', {}, ['--colour', 'blue'], /--colour/],
    ['a profile photo that is not a URL', { PROFILE_PHOTO: 'me.jpg' }, [], /PROFILE_PHOTO/],
    [
      'a profile photo with a user name and password, which every app would be given',
      { PROFILE_PHOTO: 'https://me:secret@example.com/photo.jpg' },
      [],
      /^PROFILE_PHOTO https:\/\/…@example\.com\/photo\.jpg contains a user name or password: remove it$/,
    ],
    [
      'a home page with a user name',
      { PROFILE_URL: 'https://me@example.com/' },
      [],
      /^PROFILE_URL .* contains a user name or password: remove it$/,
    ],
    [
      'an issuer with a password, not said back',
      { ISSUER: 'https://admin:hunter2hunter2@auth.example' },
      [],
      /^ISSUER https:\/\/…@auth\.example contains a user name or password: remove it$/,
    ],
    [
      'a profile URL with a password, not said back',
      { ME: 'https://me:hunter2hunter2@example.com/' },
      [],
      /^ME https:\/\/…@example\.com\/ is not a valid profile URL/,
    ],
    ['a profile email that is not an address', { PROFILE_EMAIL: 'me' }, [], /PROFILE_EMAIL/],
    ['a zero refresh token lifetime', { REFRESH_TOKEN_TTL: '0' }, [], /REFRESH_TOKEN_TTL/],
    ['a flag without a value', {}, ['--port'], /--port/],
  ]
  for (const [what, env, argv, message] of refusals) {
    it(`refuses to start with ${what}, naming the setting`, () => {
      assert.throws(
        () => loadConfig(env, argv),
        (err: unknown) => err instanceof ConfigError && message.test(err.message),
      )
    })
  }

  it('reads a number as its decimal string, and refuses other values that are not strings, naming the setting', () => {
    // as settings read from JSON, or given by a JavaScript caller, may come
    const config = loadConfig({ PORT: 4000, CODE_TTL: 300, REFRESH_TOKEN_GRACE: 0 })
    assert.equal(config.port, 4000)
    assert.equal(config.codeTtlSeconds, 300)
    assert.equal(config.refreshTokenGraceSeconds, 0)
    const cases: [Record<string, unknown>, string][] = [
      [{ CODE_TTL: true }, "CODE_TTL must be a string or a number, as in '300', not a boolean"],
      [{ TRUST_PROXY: ['127.0.0.1', '::1'], PASSWORD_HASH }, 'TRUST_PROXY must be a string or a number, not an array'],
      [{ ISSUER: new URL('http://127.0.0.1:3000') }, 'ISSUER must be a string or a number, not an object'],
      [{ PORT: NaN }, "PORT must be a string or a number, as in '3000', not NaN"],
      [{ PROFILE_NAME: null }, 'PROFILE_NAME must be a string or a number, not null'],
    ]
    for (const [env, message] of cases)
      assert.throws(
        () => loadConfig(env as Record<string, string>),
        (err: unknown) => err instanceof ConfigError && err.message === message,
        message,
      )
  })

  it('refuses a proxy range wider than a network of proxies, in which every client would choose its address', () => {
    // ::ffff:0:0/96 and ::/8 hold every IPv4 client, as ::ffff:a.b.c.d
    const wide = ['0.0.0.0/0', '::/0', '10.0.0.0/7', '2000::/3', '::/8', '::ffff:0:0/96', '::ffff:10.0.0.0/103']
    for (const range of [...wide, '2a00::/7', '2600::/12'])
      assert.throws(
        () => loadConfig({ TRUST_PROXY: `127.0.0.1,${range}`, PASSWORD_HASH }),
        (err: unknown) =>
          err instanceof ConfigError &&
          err.message.startsWith(`TRUST_PROXY ${range} is wider than a network of proxies could be`) &&
          err.message.includes("list only your proxy's addresses"),
        range,
      )
    for (const range of ['10.0.0.0/8', 'fc00::/7', '::ffff:10.0.0.0/104', '2001:db8::/32', '2a06:98c0::/29', '::/81'])
      assert.deepEqual(loadConfig({ TRUST_PROXY: range, PASSWORD_HASH }).trustProxy, [range])
  })

  it('starts on a non-loopback host once a password hash is set', async () => {
    const passwordHash = await hashPassword('correct horse', FAST_COST)
    const config = loadConfig({ HOST: '0.0.0.0', ISSUER: 'http://192.168.1.10:3000', PASSWORD_HASH: passwordHash })
    assert.equal(config.host, '0.0.0.0')
    // listening on every address, it cannot tell its URL: http://0.0.0.0:3000 is no browser's
    for (const HOST of ['0.0.0.0', '::', '[::]', '0', '::0', '0:0:0:0:0:0:0:0', '::ffff:0.0.0.0'])
      assert.throws(
        () => loadConfig({ HOST, PASSWORD_HASH: passwordHash }),
        (err: unknown) => err instanceof ConfigError && /listens on every address.*set ISSUER/.test(err.message),
        HOST,
      )
  })

  it('warns of an ISSUER that is its own address behind the proxy TRUST_PROXY names', () => {
    const behind = { TRUST_PROXY: '127.0.0.1', ME: 'https://example.com/', PASSWORD_HASH, PORT: '4400' }
    for (const settings of [behind, { ...behind, ISSUER: 'http://127.0.0.1:4400' }])
      assert.match(configWarnings(loadConfig(settings)).join('\n'), /ISSUER is http:\/\/127\.0\.0\.1:4400, Latch's own/)
    // under another loopback name, or at the port http leaves unwritten
    for (const settings of [
      { ...behind, ISSUER: 'http://localhost:4400' },
      { ...behind, PORT: '80', ISSUER: 'http://127.0.0.1' },
      { ...behind, HOST: '192.0.2.7' }, // bound to an address of its own, and named by it
    ])
      assert.match(configWarnings(loadConfig(settings)).join('\n'), /, Latch's own address/)
    // a proxy on this machine at a port of its own: the URL it serves
    assert.deepEqual(configWarnings(loadConfig({ ...behind, ISSUER: 'http://localhost:8088/latch' })), [])
    assert.deepEqual(configWarnings(loadConfig({ ...behind, ISSUER: 'https://auth.example.com' })), [])
  })

  it('warns of an ISSUER on a loopback address that HOST does not listen on, where nothing answers', () => {
    const me = { ME: 'https://example.com/' }
    for (const [HOST, ISSUER] of [
      ['::1', 'http://127.0.0.1:3000'],
      ['127.0.0.1', 'http://[::1]:3000'],
      ['localhost', 'http://[::1]:3000'], // bound as 127.0.0.1
      ['127.0.0.1', 'http://127.0.0.2:3000'], // another loopback address of the same family
      ['0.0.0.0', 'http://[::1]:3000'], // every IPv4 address, and no IPv6 one
      ['192.0.2.7', 'http://127.0.0.1:3000'],
    ])
      assert.match(
        configWarnings(loadConfig({ ...me, HOST, ISSUER, PASSWORD_HASH })).join('\n'),
        /Latch listens on .* only: /,
      )
    for (const [HOST, ISSUER] of [
      ['::1', 'http://[::1]:3000'],
      ['::1', 'http://localhost:3000'], // a name browsers try on both
      ['::1', 'http://127.0.0.1:8080'], // another port: a proxy's
      ['::1', 'https://127.0.0.1'], // at 443
      ['::', 'http://127.0.0.1:80'], // every address of both families
      ['0.0.0.0', 'http://127.0.0.2:80'], // loopback too: no https wanted there
      ['::ffff:127.0.0.1', 'http://127.0.0.1:80'], // an IPv4 address written as IPv6: it listens there
    ])
      assert.deepEqual(configWarnings(loadConfig({ ...me, HOST, ISSUER, PORT: '80', PASSWORD_HASH })), [])
    // a name that begins as a loopback address does is no address
    assert.match(
      configWarnings(loadConfig({ ...me, ISSUER: 'http://127.example.com', PASSWORD_HASH })).join('\n'),
      /IndieAuth wants https/,
    )
  })

  it('warns about a profile URL with a port or an IP address, and about http off loopback', () => {
    assert.equal(configWarnings(loadConfig({ ME: 'https://example.com/' })).length, 0)
    assert.match(configWarnings(loadConfig({ ME: 'http://127.0.0.1:8080/' })).join('\n'), /ME/)
    // the zero-configuration start: the default ME is said in the start-up block, not warned about
    assert.deepEqual(configWarnings(loadConfig({})), [])
    assert.match(
      configWarnings(loadConfig({ ISSUER: 'http://auth.example.com', ME: 'https://example.com/', PASSWORD_HASH })).join(
        '\n',
      ),
      /ISSUER/,
    )
    // a name under localhost is loopback too (RFC 6761 §6.3), and browsers take it as such
    for (const issuer of ['http://latch.dev.localhost:3000', 'http://localhost.:3000', 'http://auth.localhost.:3000'])
      assert.deepEqual(configWarnings(loadConfig({ ISSUER: issuer, ME: 'https://example.com/', PASSWORD_HASH })), [])
  })

  it('warns of a refresh token lifetime no longer than the access token one, but at ten years', () => {
    const warnings = configWarnings(loadConfig({ ACCESS_TOKEN_TTL: '60d' }))
    assert.match(
      warnings.join('\n'),
      /REFRESH_TOKEN_TTL \(2592000 s\) is not longer than ACCESS_TOKEN_TTL \(5184000 s\)/,
    )
    assert.deepEqual(configWarnings(loadConfig({ ACCESS_TOKEN_TTL: '3650d', REFRESH_TOKEN_TTL: '3650d' })), [])
  })

  it('warns of an access token lifetime too short for the refreshes a grant may make in a day', () => {
    assert.match(
      configWarnings(loadConfig({ ACCESS_TOKEN_TTL: '60' })).join('\n'),
      /ACCESS_TOKEN_TTL \(60 s\) is so short .* more than the 1000 times a day .* make it 87 seconds or more/,
    )
    assert.deepEqual(configWarnings(loadConfig({ ACCESS_TOKEN_TTL: '87' })), [])
  })

  it('takes an introspection secret of any visible characters', () => {
    assert.equal(loadConfig({ INTROSPECTION_SECRET: 'p@ss!word#1234567%' }).introspectionSecret, 'p@ss!word#1234567%')
  })

  it('warns of a variable one letter away from a setting, which is not read, and of no other', () => {
    const config = loadConfig({})
    for (const [typo, meant] of [
      ['ISUER', 'ISSUER'],
      ['PASSWORD_HSAH', 'PASSWORD_HASH'],
      ['DATA_FILES', 'DATA_FILE'],
      ['TRUST_PROXI', 'TRUST_PROXY'],
    ]) {
      const warnings = configWarnings(config, { [typo]: 'x' })
      assert.deepEqual(warnings, [`${typo} is not a setting, and is not read: if it was meant as ${meant}, rename it`])
    }
    const unrelated = { PATH: '/usr/bin', HOSTNAME: 'box', NODE_ENV: 'production', ISSUER: 'http://localhost:3000' }
    assert.deepEqual(configWarnings(config, unrelated), [])
    assert.deepEqual(configWarnings(config, { ISUER: '' }), []) // empty: as if unset
  })

  it('takes no secret as a flag, which every user of the machine could read', () => {
    for (const [flag, name] of [
      ['--password-hash', 'PASSWORD_HASH'],
      ['--introspection-secret', 'INTROSPECTION_SECRET'],
    ]) {
      assert.throws(
        () => loadConfig({}, [flag, 'a-long-introspection-secret']),
        new RegExp(`${flag} would show ${name} to every user of this machine .*set the ${name} variable instead`),
      )
    }
  })

  it('prints every setting with its flag and default in --help, in 80 columns', () => {
    const help = buildHelp()
    for (const { name } of SETTINGS) {
      const flag = /SECRET|HASH/.test(name) ? 'variable only' : `--${name.toLowerCase().replaceAll('_', '-')}`
      assert.match(help, new RegExp(`^  ${name}, ${flag}  \\(default: `, 'm'))
    }
    for (const line of help.split('\n')) assert.ok(line.length <= 80, `${line.length}: ${line}`)
  })
})

// --- Small helpers ------------------------------------------------------------------

describe('Form parser', () => {
  it('decodes + as a space and %XX as UTF-8 bytes', () => {
    const params = parseForm('a=hello+world&b=%C3%A9t%C3%A9&c=%2B')
    assert.deepEqual(params.get('a'), ['hello world'])
    assert.deepEqual(params.get('b'), ['été'])
    assert.deepEqual(params.get('c'), ['+'])
  })

  it('keeps every value of a repeated name, and names without values', () => {
    const params = parseForm('scope=a&scope=b&flag&&x=')
    assert.deepEqual(params.get('scope'), ['a', 'b'])
    assert.deepEqual(params.get('flag'), [''])
    assert.deepEqual(params.get('x'), [''])
  })

  const malformed = ['a=%', 'a=%4', 'a=%zz', 'a=%C3', 'a=%FF', 'a=%C3%28', 'a=%ED%A0%80', '%=1']
  for (const text of malformed) {
    it(`rejects ${JSON.stringify(text)} with invalid_request`, () => {
      assert.throws(
        () => parseForm(text),
        (err: unknown) => err instanceof OAuthError && err.error === 'invalid_request' && err.status === 400,
      )
    })
  }

  it('treats an empty value as absent and a repeated one as invalid_request', () => {
    assert.equal(getParam(parseForm('a=&b=1'), 'a'), undefined)
    assert.equal(getParam(parseForm('a=&a=1'), 'a'), '1')
    assert.throws(
      () => getParam(parseForm('a=1&a=2'), 'a'),
      (err: unknown) => err instanceof OAuthError && err.error === 'invalid_request',
    )
  })

  it('splits a scope on spaces, drops repeats and rejects characters outside NQCHAR', () => {
    assert.deepEqual(parseScope('profile  create profile'), ['profile', 'create'])
    assert.deepEqual(parseScope(undefined), [])
    assert.throws(
      () => parseScope('create "quoted"'),
      (err: unknown) => err instanceof OAuthError && err.error === 'invalid_scope',
    )
  })
})

describe('Request bodies', () => {
  it('answers a body that a middleware read before Latch with a logged 500 naming the fix', async () => {
    const logs: string[] = []
    const handler = createHandler({ config: loadConfig({ DATA_FILE: 'memory' }), log: (line) => logs.push(line) })
    // as express.urlencoded() does: the body is read to its end before Latch is called
    const server = createServer((req, res) => req.resume().on('end', () => handler(req, res)))
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
    try {
      const { port } = server.address() as AddressInfo
      const response = await fetch(`http://127.0.0.1:${port}/revoke`, {
        method: 'POST',
        headers: { 'Content-Type': 'application/x-www-form-urlencoded' },
        body: 'token=abc',
      })
      assert.equal(response.status, 500)
      assert.deepEqual(await response.json(), { error: 'server_error' })
      assert.ok(
        logs.some((line) => /mount Latch before any body parser/.test(line)),
        logs.join('\n'),
      )
    } finally {
      server.close()
    }
  })

  it(
    'closes the connection after an answer given without reading the body, instead of reading it to its end',
    { timeout: 20_000 },
    async () => {
      const server = createLatchServer()
      server.on('request', createHandler({ config: loadConfig({ DATA_FILE: 'memory' }), log: () => {} }))
      await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
      const { port } = server.address() as AddressInfo
      /** Sends a request that says its body is 100 GB, and what is answered before the server closes. */
      const refused = async (head: string) => {
        const socket = connect(port, '127.0.0.1')
        let received = ''
        socket.on('data', (chunk: Buffer) => (received += chunk.toString('latin1')))
        socket.on('error', () => {}) // the server closes while bytes are still on their way: EPIPE
        const closed = new Promise((resolve) => socket.on('close', resolve))
        socket.write(`${head}\r\nHost: 127.0.0.1:${port}\r\nContent-Length: 100000000000\r\n\r\n`)
        const chunk = Buffer.alloc(64 * 1024, 'a')
        const pour = () => {
          while (!socket.destroyed && socket.write(chunk));
          if (!socket.destroyed) socket.once('drain', pour)
        }
        pour()
        await closed
        return received
      }
      try {
        for (const head of [
          'POST /nowhere HTTP/1.1', // 404
          'PUT /auth HTTP/1.1', // 405
          'GET /.well-known/oauth-authorization-server HTTP/1.1', // 200, a route that reads no body
          'POST /token HTTP/1.1\r\nContent-Type: text/plain', // 400, refused before the body
          'POST /token HTTP/1.1\r\nExpect: the-unexpected', // 417, before Latch is asked
          `POST /token HTTP/1.1${'\r\nX-Line: 1'.repeat(1_001)}`, // 431: its Content-Length is past what node:http keeps
        ]) {
          const answer = (await refused(head)).split('\r\n\r\n')[0] // its head: a 408 would follow 30 s later
          assert.match(answer, /^HTTP\/1\.1 [2-4]\d\d /, head)
          assert.match(answer, /\r\nConnection: close$/im, head)
          if (/^HTTP\/1\.1 417 /.test(answer)) assert.match(answer, /\r\nCache-Control: no-store\r\n/i, head)
        }
      } finally {
        server.closeAllConnections()
        await new Promise((resolve) => server.close(resolve))
      }
    },
  )

  it('closes whichever store openStore gives, a MemoryStore too', async () => {
    const store = await openStore(loadConfig({ DATA_FILE: 'memory' }))
    await store.close()
  })

  it('holds a body that comes in many small pieces as its bytes, not as the pieces', async () => {
    // each piece a byte of a buffer of its own, as the worst a socket could hand over
    setFlagsFromString('--expose-gc')
    const gc = runInNewContext('gc') as () => void
    const collected = async () => {
      for (let round = 0; round < 2; round++) {
        gc()
        await new Promise((resolve) => setImmediate(resolve)) // buffers are freed after a collection, not in it
      }
      return process.memoryUsage().arrayBuffers
    }
    const req = Object.assign(new PassThrough(), {
      headers: { 'content-type': 'application/x-www-form-urlencoded' },
    })
    const text = `a=${'b'.repeat(254)}` // 256 pieces, the most a body may come in
    const before = await collected()
    const form = readForm(req as unknown as IncomingMessage)
    for (const byte of Buffer.from(text)) req.write(Buffer.alloc(65_536, byte).subarray(0, 1))
    const held = (await collected()) - before // what the pieces keep until the body ends
    req.end()
    assert.equal(getParam(await form, 'a')?.length, 254)
    // kept as they came, the pieces would hold 16 MiB; a stray buffer of 64 KiB may outlive the collection
    assert.ok(held < 8 * 65_536, `a body of ${text.length} bytes held ${held} bytes while it came`)
  })
})

describe('Secrets and PKCE', () => {
  it('computes the S256 challenge of RFC 7636 Appendix B', () => {
    assert.equal(computeCodeChallenge(VERIFIER), CHALLENGE)
    assert.equal(verifyCodeChallenge(VERIFIER, CHALLENGE), true)
    assert.equal(verifyCodeChallenge(`${VERIFIER}x`, CHALLENGE), false)
    assert.equal(verifyCodeChallenge(VERIFIER, CHALLENGE.slice(0, 42)), false)
  })

  const verifiers: [string, boolean][] = [
    [VERIFIER, true],
    ['a'.repeat(43), true],
    ['a'.repeat(128), true],
    ['A-._~'.repeat(10), true],
    ['a'.repeat(42), false],
    ['a'.repeat(129), false],
    [`${'a'.repeat(42)}+`, false],
    [`${'a'.repeat(42)}=`, false],
  ]
  for (const [verifier, valid] of verifiers) {
    it(`${valid ? 'accepts' : 'rejects'} the code_verifier ${verifier.slice(0, 12)}… of length ${verifier.length}`, () => {
      assert.equal(isCodeVerifier(verifier), valid)
    })
  }

  it('makes 43-character base64url secrets, all different, and stores them by 128 bits of SHA-256', () => {
    const secrets = Array.from({ length: 1000 }, () => createSecret()) // several refills of the random pool
    for (const secret of secrets) assert.match(secret, /^[A-Za-z0-9_-]{43}$/)
    assert.equal(new Set(secrets).size, secrets.length)
    assert.equal(hashSecret('abc'), 'ungWv48Bz-pBQUDeXa4iIw') // SHA-256 ungWv48Bz-pBQUDeXa4iI7ADYaOWF3qctBD_YfIAFa0, cut to 16 bytes
    for (const secret of secrets)
      assert.equal(hashSecret(secret), createHash('sha256').update(secret).digest().toString('base64url', 0, 16))
  })

  it('compares secrets of any length', () => {
    assert.equal(safeEqual('abc', 'abc'), true)
    assert.equal(safeEqual('abc', 'abd'), false)
    assert.equal(safeEqual('abc', 'abcd'), false)
  })

  it('hashes a password with its own salt and cost, and verifies it', async () => {
    const hash = await hashPassword('correct horse', FAST_COST)
    assert.match(hash, /^scrypt:ln=10,r=8,p=1:[A-Za-z0-9_-]+:[A-Za-z0-9_-]{43}$/)
    assert.notEqual(await hashPassword('correct horse', FAST_COST), hash)
    assert.equal(await verifyPassword('correct horse', hash), true)
    assert.equal(await verifyPassword('wrong horse', hash), false)
  })
})

describe('Identifiers (IndieAuth §3.2, §3.3)', () => {
  const clientIds: [string, boolean][] = [
    ['https://app.example.com/', true],
    ['https://app.example.com', true],
    ['http://app.example.com/path/?q=1', true],
    ['https://app.example.com:8443/', true],
    ['http://localhost:8080/', true],
    ['http://127.0.0.1:8080/', true],
    ['http://[::1]:8080/', true],
    ['ftp://app.example.com/', false],
    ['app.example.com', false],
    ['https://app.example.com/#frag', false],
    ['https://app.example.com/#', false],
    ['https://user:pass@app.example.com/', false],
    ['https://user@app.example.com/', false],
    ['https://app.example.com/a/./b', false],
    ['https://app.example.com/a/../b', false],
    ['https://app.example.com/a/%2e%2e/b', false],
    ['https://app.example.com/..', false],
    ['https://10.0.0.1/', false],
    ['https://[2001:db8::1]/', false],
    ['https://app.example.com\\@evil.example/', false],
    ['https://app example.com/', false],
    ['https://app.example.com:99999/', false],
    ['https:///path', false],
    ['http://127.1/', false],
    ['http://0xc0a80001/', false],
    ['http://1.2.3.0x4/', false],
    ['http://app.0x/', false],
    ['http://xn--a.com/', false], // not a valid IDNA name: URL() refuses it
    ['http://[zz]/', false],
    ['http://app.example.com:0/', false], // nothing is served at port 0
    ['http://app.example.com/%zz', false], // not a URI at all (RFC 3986 §2.1)
    ['http://app.example.com/a%2Fb?q=%C3%A9', true],
  ]
  for (const [clientId, valid] of clientIds) {
    it(`${valid ? 'accepts' : 'rejects'} the client_id ${clientId}`, () =>
      assert.equal(isClientId(clientId), valid, clientIdProblem(clientId)))
  }

  const profiles: [string, boolean][] = [
    ['https://example.com/', true],
    ['https://example.com/username?x=1', true],
    ['http://127.0.0.1:3000/', true], // allowed with a warning, to try Latch locally
    ['mailto:me@example.com', false],
    ['https://example.com/#me', false],
    ['https://me:pw@example.com/', false],
    ['https://example.com/./', false],
  ]
  for (const [url, valid] of profiles) {
    it(`${valid ? 'accepts' : 'rejects'} the profile URL ${url}`, () =>
      assert.equal(profileUrlProblem(url) === undefined, valid))
  }

  it('says a URL of another scheme must use https or http, and one without // is not absolute', () => {
    assert.equal(profileUrlProblem('mailto:me@example.com'), 'it must use https or http')
    assert.equal(profileUrlProblem('ftp://example.com/'), 'it must use https or http')
    assert.equal(profileUrlProblem('https:example.com'), 'it is not an absolute URL')
    assert.equal(profileUrlProblem('example.com'), 'it is not an absolute URL')
  })

  it('canonicalizes scheme and host to lowercase and an empty path to /', () => {
    assert.equal(canonicalizeUrl('HTTPS://App.Example.COM'), 'https://app.example.com/')
    assert.equal(canonicalizeUrl('https://app.example.com/Path'), 'https://app.example.com/Path')
  })

  it('refuses a redirect_uri whose scheme runs in the browser or reads its files, even one the app publishes', () => {
    const browsers = [
      'ws://evil.example/cb',
      'view-source:https://evil.example/cb',
      'chrome-extension://id/cb',
      'devtools://devtools/cb',
    ] // no app's
    for (const uri of [
      'javascript:alert(1)//',
      'JavaScript:alert(1)//',
      'data:text/html,hi',
      'file:///etc/passwd',
      ...browsers,
    ]) {
      const client = { info: { redirectUris: [uri], metadataDocument: true } }
      assert.match(
        redirectUriProblem(uri, 'https://app.example/client.json', client) ?? '',
        /must not use the [\w-]+ scheme/,
        uri,
      )
    }
    const app = { info: { redirectUris: ['com.example.app:/callback'], metadataDocument: true } }
    assert.equal(redirectUriProblem('com.example.app:/callback', 'https://app.example/client.json', app), undefined)
  })

  it('takes no redirect_uri, not even on the same host, for a client not looked up for the load', () => {
    const clientId = 'https://app.example/client.json'
    assert.equal(redirectUriProblem('https://app.example/callback', clientId, {}), undefined) // could not be fetched
    assert.match(
      redirectUriProblem('https://app.example/callback', clientId, { busy: true }) ?? '',
      /could not be fetched just now, try again in a moment/,
    )
  })

  it('takes a redirect_uri of 2,048 characters, not 2,049, and none with a backslash', () => {
    const clientId = 'https://app.example/'
    const uri = (length: number) => `${clientId}callback?x=`.padEnd(length, 'x')
    assert.equal(redirectUriProblem(uri(2_048), clientId), undefined)
    assert.match(redirectUriProblem(uri(2_049), clientId) ?? '', /longer than 2048 characters/)
    // parsers disagree on it: a browser reads it as /, another as the end of a user name before @evil.example
    assert.match(redirectUriProblem('https://app.example\\@evil.example/', clientId) ?? '', /not an absolute URL/)
  })
})

// --- Storage --------------------------------------------------------------------------

describe('MemoryStore', () => {
  const code = (expiresAt: number): AuthorizationCode => ({
    client_id: CLIENT_ID,
    client_name: undefined,
    redirect_uri: REDIRECT_URI,
    code_challenge: CHALLENGE,
    scope: ['create'],
    resource: [],
    me: 'https://example.com/',
    accessTokenTtlSeconds: 3600,
    issuedAt: 0,
    expiresAt,
    usedAt: undefined,
  })
  const token = (expiresAt: number): Token => ({
    kind: 'access',
    grantId: 'g',
    scope: ['create'],
    resource: [],
    issuedAt: 0,
    expiresAt,
    usedAt: undefined,
  })
  const grant = (expiresAt: number): Grant => ({
    client_id: CLIENT_ID,
    client_name: undefined,
    me: 'https://example.com/',
    scope: ['create'],
    resource: [],
    accessTokenTtlSeconds: 3600,
    approvedAt: 0,
    lastUsedAt: 0,
    endsAt: undefined,
    expiresAt,
    lastRotated: undefined,
  })

  it('refuses a code whose replay revoked its grant while its first redemption failed to be written', async () => {
    const store = new MemoryStore()
    await store.saveCode('c', code(9000), 0)
    assert.equal(store.redeem({ kind: 'code', hash: 'c' }, 10), 'first') // its line is being written…
    await store.revokeGrant('c', 20) // …when a replay comes
    store.unredeem({ kind: 'code', hash: 'c' }, undefined) // and the write fails: a full disk
    const redeemed = { kind: 'code', hash: 'c' } as const
    assert.equal(await store.redeemForTokens({ redeemed, grantId: 'c', grant: grant(9000), tokens: [] }, 30), false)
  })

  it('puts back which refresh token a grant rotated last when a rotation is taken back, and snapshots it so', async () => {
    const store = new MemoryStore()
    await store.saveGrant('g', { ...grant(9000), lastRotated: 'r1' }, 0)
    await store.saveToken('r2', { ...token(9000), kind: 'refresh' }, 0)
    const redeemed = { kind: 'refresh', hash: 'r2' } as const
    const before = store.rotatedLastBefore(redeemed)
    assert.equal(before, 'r1')
    assert.equal(store.redeem(redeemed, 10), 'first')
    assert.equal((await store.findGrant('g', 10))?.lastRotated, 'r2')
    // a snapshot taken while the rotation is being written holds the grant as it was before
    const records = [...store.records(10, new Map([['r2', before]]))]
    const saved = records.find((record) => 'set' in record && record.set === 'grant')
    assert.equal(saved !== undefined && 'value' in saved && (saved.value as Grant).lastRotated, 'r1')
    store.unredeem(redeemed, before) // the write failed
    assert.equal((await store.findGrant('g', 20))?.lastRotated, 'r1')
    assert.equal((await store.findToken('r2', 20))?.usedAt, undefined)
    // one rotated after it (a parallel chain, within the grace period) is left as the last
    await store.saveToken('r3', { ...token(9000), kind: 'refresh' }, 0)
    const third = { kind: 'refresh', hash: 'r3' } as const
    const beforeSecond = store.rotatedLastBefore(redeemed)
    assert.equal(store.redeem(redeemed, 30), 'first')
    assert.equal(store.redeem(third, 31), 'first')
    store.unredeem(redeemed, beforeSecond)
    assert.equal((await store.findGrant('g', 40))?.lastRotated, 'r3')
  })

  it('marks a code used once, atomically, and hides it once expired', async () => {
    const store = new MemoryStore()
    await store.saveCode('h', code(1000), 0)
    assert.equal(await store.markCodeUsed('h', 10), true)
    assert.equal(await store.markCodeUsed('h', 20), false)
    assert.equal((await store.findCodeUsedOrNot('h', 30))?.usedAt, 10)
    assert.equal(await store.findCodeUsedOrNot('h', 1000), undefined)
    assert.equal(await store.markCodeUsed('h', 1000), false)
  })

  it('leaves expired entries to the sweep: a write walks nothing, sweep(now) takes the expired only', async () => {
    const store = new MemoryStore()
    await store.saveGrant('g', grant(9000), 0)
    await store.saveToken('late', token(5000), 0)
    await store.saveToken('early', token(1000), 0)
    await store.saveToken('middle', token(3000), 0)
    for (let i = 0; i < 50; i++) await store.saveToken(`fresh${i}`, token(9000), 3500)
    assert.equal(store.tokens.size, 53, 'no write swept')
    assert.equal(await store.findToken('early', 3500), undefined, 'an expired entry is never read')
    store.sweep(3500)
    assert.deepEqual(
      [store.tokens.has('early'), store.tokens.has('middle'), store.tokens.has('late')],
      [false, false, true],
    )
    assert.equal(store.tokens.size, 51)
  })

  it('sweeps at least twice as many grants and tokens as were saved since the last sweep, so it keeps pace', async () => {
    const store = new MemoryStore()
    for (let i = 0; i < 2_500; i++) await store.saveToken(`t${i}`, token(1000), 0)
    store.sweep(5000) // 5,000 steps: every entry, and the 64 shards
    assert.equal(store.tokens.size, 0)
  })

  it('walks at most 6,000 entries of a kind a sweep after a burst of saves, catching up over the next', async () => {
    const store = new MemoryStore()
    for (let i = 0; i < 30_000; i++) await store.saveToken(`t${i}`, token(1000), 0)
    store.sweep(5000) // not 60,000 steps at once: a replayed journal must not stall the server
    assert.ok(store.tokens.size >= 24_000, `${store.tokens.size} tokens left`)
    for (let i = 0; i < 5; i++) store.sweep(5000)
    assert.equal(store.tokens.size, 0)
  })

  it('sweeps the tokens of a grant revoked, however long they had left', async () => {
    const store = new MemoryStore()
    await store.saveGrant('g', grant(9000), 0)
    await store.saveToken('of-g', token(9000), 0)
    await store.saveToken('scripts', { ...token(9000), grantId: 'k' }, 0) // a token for scripts, its grant revoked…
    await store.saveGrant('k', grant(9000), 0)
    await store.revokeGrant('k', 0) // …and so gone from memory too, not only from every lookup
    store.sweep(3000)
    assert.deepEqual([...store.tokens.keys()], ['of-g'])
  })

  it('snapshots a refresh token used past any retry without its scope and resources, which are never read again', async () => {
    const store = new MemoryStore()
    const long = { scope: ['create', 'x'.repeat(100)], resource: ['https://api.example/'] }
    await store.saveGrant('g', { ...grant(9_000_000), ...long }, 0)
    const refresh = { ...token(9_000_000), ...long, kind: 'refresh' } as const
    await store.saveToken('used-long-ago', { ...refresh, usedAt: 1000 }, 0)
    await store.saveToken('used-just-now', { ...refresh, usedAt: 700_000 }, 0) // a retry may still come
    await store.saveToken('unused', refresh, 0)
    await store.saveToken('access', { ...token(9_000_000), ...long }, 0)
    const lists = new Map(
      [...store.records(702_000)].flatMap((record) =>
        'set' in record && record.set === 'token' ? [[record.key, [record.value.scope, record.value.resource]]] : [],
      ),
    )
    assert.deepEqual(lists.get('used-long-ago'), [[], []])
    for (const kept of ['used-just-now', 'unused', 'access'])
      assert.deepEqual(lists.get(kept), [long.scope, long.resource], kept)
  })

  it('sweeps the store of a handler every 100 ms on the handler clock, with no server around it', async (t) => {
    t.mock.timers.enable({ apis: ['setInterval'] })
    const store = new MemoryStore()
    await store.saveGrant('g', grant(9000), 0)
    await store.saveToken('expired', token(1000), 0)
    await store.saveToken('live', token(9000), 0)
    createHandler({ config: loadConfig({ DATA_FILE: 'memory' }), store, now: () => 5000, log: () => {} })
    assert.equal(store.tokens.size, 2)
    t.mock.timers.tick(100)
    assert.deepEqual([...store.tokens.keys()], ['live'])
  })

  it('stops sweeping once the signal given to the handler is aborted', async (t) => {
    t.mock.timers.enable({ apis: ['setInterval'] })
    const store = new MemoryStore()
    await store.saveToken('expired', token(1000), 0)
    const stopped = new AbortController()
    const config = loadConfig({ DATA_FILE: 'memory' })
    createHandler({ config, store, now: () => 5000, log: () => {}, signal: stopped.signal })
    stopped.abort()
    t.mock.timers.tick(1000)
    assert.equal(store.tokens.size, 1)
  })

  it('holds the signals of handlers weakly, for an app that makes a handler, and a signal, at each request', async () => {
    setFlagsFromString('--expose-gc')
    const gc = runInNewContext('gc') as () => void
    const store = new MemoryStore()
    const config = loadConfig({ DATA_FILE: 'memory' })
    const signals = Array.from({ length: 3 }, () => {
      const { signal } = new AbortController() // never aborted, and dropped with the request
      createHandler({ config, store, now: () => 5000, log: () => {}, signal })
      return new WeakRef(signal)
    })
    await new Promise((resolve) => setImmediate(resolve)) // a WeakRef keeps its target until the task ends
    gc()
    assert.deepEqual(
      signals.map((signal) => signal.deref()),
      [undefined, undefined, undefined],
    )
  })

  it('never starts sweeping when the signal given to the handler is aborted already', async (t) => {
    t.mock.timers.enable({ apis: ['setInterval'] })
    const store = new MemoryStore()
    await store.saveToken('expired', token(1000), 0)
    createHandler({ config: loadConfig({ DATA_FILE: 'memory' }), store, now: () => 5000, signal: AbortSignal.abort() })
    t.mock.timers.tick(1000)
    assert.equal(store.tokens.size, 1)
  })

  it('keeps times to the second: expiries rounded up, so nothing dies before its expires_in', async () => {
    const store = new MemoryStore()
    await store.saveToken('t', { ...token(2001), issuedAt: 1500 }, 0)
    assert.deepEqual(await store.findToken('t', 2001), { ...token(3000), issuedAt: 1000 })
    assert.equal(await store.findToken('t', 3000), undefined)
    await store.saveGrant('g', { ...grant(5500), approvedAt: 1250, lastUsedAt: 1999 }, 0)
    assert.deepEqual(await store.findGrant('g', 0), { ...grant(6000), approvedAt: 1000, lastUsedAt: 1000 })
  })

  it('keeps one copy of the client, me and scope that many grants share', async () => {
    const store = new MemoryStore()
    await store.saveGrant('g1', grant(9000), 0)
    await store.saveGrant('g2', grant(9000), 0)
    await store.saveGrant('g3', { ...grant(9000), client_name: 'Other' }, 0)
    await store.saveGrant('g4', grant(9000), 0) // the same as g1 again, after another
    assert.equal(store.grants.get('g1')?.app, store.grants.get('g2')?.app)
    assert.notEqual(store.grants.get('g1')?.app, store.grants.get('g3')?.app)
    assert.equal(store.grants.get('g1')?.app, store.grants.get('g4')?.app)
    assert.equal((await store.findGrant('g3', 0))?.client_name, 'Other')
  })

  it('redeems a refresh token once, atomically, saving the new tokens only the first time', async () => {
    const store = new MemoryStore()
    await store.saveGrant('g', grant(9000), 0)
    await store.saveToken('r', { ...token(9000), kind: 'refresh' }, 0)
    const issue = (tokenHash: string) => ({
      redeemed: { kind: 'refresh' as const, hash: 'r' },
      grantId: 'g',
      grant: grant(9000),
      tokens: [[tokenHash, token(9000)]] as [string, Token][],
    })
    assert.equal(await store.redeemForTokens(issue('first'), 1000), true)
    assert.equal(await store.redeemForTokens(issue('second'), 2000), false)
    assert.equal((await store.findToken('r', 3000))?.usedAt, 1000)
    assert.ok(store.tokens.has('first'))
    assert.equal(store.tokens.has('second'), false)
    assert.ok(store.grants.has('g'))
  })

  it('redeems no refresh token of a grant revoked since it was found', async () => {
    const store = new MemoryStore()
    await store.saveGrant('g', grant(9000), 0)
    await store.saveToken('r', { ...token(9000), kind: 'refresh' }, 0)
    await store.revokeGrant('g', 500)
    const issue = { redeemed: { kind: 'refresh' as const, hash: 'r' }, grantId: 'g', grant: grant(9000), tokens: [] }
    assert.equal(await store.redeemForTokens(issue, 1000), false)
    assert.equal(store.grants.has('g'), false)
  })

  it('keeps the refresh token rotated last, whatever order the grant copies of two rotations are saved in', async () => {
    const store = new MemoryStore()
    await store.saveGrant('g', grant(99_000), 0)
    await store.saveToken('r1', { ...token(99_000), kind: 'refresh' }, 0)
    await store.saveToken('r2', { ...token(99_000), kind: 'refresh' }, 0)
    const grace = (hash: string) => ({ kind: 'refresh' as const, hash, retriedSince: 0 })
    // r1's rotation is redeemed first, but its grant is saved after r2's rotation: as a slow write does
    assert.equal(store.redeem(grace('r1'), 1000), 'first')
    assert.equal(store.redeem(grace('r2'), 2000), 'first')
    store.keepIssued(
      { redeemed: grace('r2'), grantId: 'g', grant: { ...grant(99_000), lastRotated: 'r2' }, tokens: [] },
      'first',
    )
    store.keepIssued(
      { redeemed: grace('r1'), grantId: 'g', grant: { ...grant(99_000), lastRotated: 'r1' }, tokens: [] },
      'first',
    )
    assert.equal(store.redeem(grace('r2'), 3000), 'again')
    assert.equal(store.redeem(grace('r1'), 3000), undefined)
  })

  it('serves a retry within the grace of a grant saved before Latch kept which token it rotated last', async () => {
    const store = new MemoryStore()
    await store.saveGrant('g', grant(99_000), 0) // no lastRotated, as a journal of an earlier Latch has it
    await store.saveToken('r', { ...token(99_000), kind: 'refresh', usedAt: 1000 }, 0)
    assert.equal(store.redeem({ kind: 'refresh', hash: 'r', retriedSince: 0 }, 2000), 'again')
  })

  it('redeems a code once for a grant and its tokens, and never an expired code', async () => {
    const store = new MemoryStore()
    await store.saveCode('c', code(5000), 0)
    const issue = {
      redeemed: { kind: 'code' as const, hash: 'c' },
      grantId: 'c',
      grant: grant(9000),
      tokens: [['a', token(9000)]] as [string, Token][],
    }
    assert.equal(await store.redeemForTokens(issue, 5000), false) // expired
    assert.equal(store.grants.has('c'), false)
    assert.equal(await store.redeemForTokens(issue, 1000), true)
    assert.equal(await store.markCodeUsed('c', 1000), false)
    assert.deepEqual([store.grants.has('c'), store.tokens.has('a')], [true, true])
  })

  it('keeps a grant saved again with a later expiry, and lists only live grants', async () => {
    const store = new MemoryStore()
    await store.saveGrant('g1', grant(1000), 0)
    await store.saveGrant('g2', grant(1000), 0)
    await store.saveGrant('g1', grant(5000), 500) // extended by a refresh
    store.sweep(2000)
    assert.deepEqual([...store.grants.keys()], ['g1'])
    assert.deepEqual(
      (await store.listGrants(2000)).map(([id]) => id),
      ['g1'],
    )
    await store.revokeGrant('g1', 2000)
    assert.equal(await store.findGrant('g1', 2000), undefined)
    await store.saveGrant('g1', grant(9000), 2100) // a refresh that read it just before
    assert.equal(await store.findGrant('g1', 2200), undefined)
  })

  it('sweeps expired tokens in batches of a given size', async () => {
    const store = new MemoryStore()
    for (let i = 0; i < 25_000; i++) await store.saveToken(`t${i}`, token(1000 + (i % 100)), 0)
    store.sweep(5000, 10_000) // 10,000 steps: each looks at one entry, or moves on to the next of 64 shards
    assert.ok(store.tokens.size >= 15_000 && store.tokens.size <= 15_000 + 64, `${store.tokens.size} left`)
    store.sweep(5000, 20_000)
    assert.equal(store.tokens.size, 0)
  })

  it('caps pending requests and codes by dropping the oldest, with a log line', async () => {
    const logs: string[] = []
    const store = new MemoryStore({ maxCodes: 3, log: (line) => logs.push(line) })
    for (const hash of ['a', 'b', 'c', 'd', 'e']) await store.saveCode(hash, code(9000), 0)
    assert.deepEqual([...store.codes.keys()], ['c', 'd', 'e'])
    assert.equal(logs.length, 1)
  })

  it('logs the first drop of each kind, so that a dropped code is not hidden behind dropped requests', async () => {
    const logs: string[] = []
    const store = new MemoryStore({ maxPendingRequests: 2, maxCodes: 2, log: (line) => logs.push(line) })
    const request: PendingRequest = { ...code(9000), state: undefined, meHint: undefined, csrfHash: 'c' }
    for (const id of ['a', 'b', 'c', 'd']) await store.savePending(id, request, 0)
    for (const hash of ['a', 'b', 'c']) await store.saveCode(hash, code(9000), 0)
    assert.deepEqual(
      logs.map((line) => line.replace(/ was reached.*/, '')),
      ['store: the cap of 2 pending authorization requests', 'store: the cap of 2 authorization codes'],
    )
  })
})

// --- Endpoints ------------------------------------------------------------------------

describe('GET /.well-known/oauth-authorization-server (IndieAuth §4.1.1, RFC 8414)', () => {
  let latch: TestServer
  before(async () => (latch = await startLatch()))
  after(() => latch.close())

  it('lists every endpoint under the issuer and what the server supports', async () => {
    const response = await fetch(`${latch.base}/.well-known/oauth-authorization-server`)
    assert.equal(response.status, 200)
    assert.equal(response.headers.get('content-type'), 'application/json')
    const metadata = (await response.json()) as Record<string, unknown>
    assert.equal(metadata.issuer, latch.issuer)
    for (const [field, path] of [
      ['authorization_endpoint', '/auth'],
      ['token_endpoint', '/token'],
      ['introspection_endpoint', '/introspect'],
      ['revocation_endpoint', '/revoke'],
    ]) {
      assert.equal(metadata[field], `${latch.issuer}${path}`)
    }
    assert.deepEqual(metadata.response_types_supported, ['code'])
    assert.deepEqual(metadata.grant_types_supported, ['authorization_code', 'refresh_token'])
    assert.equal(metadata.userinfo_endpoint, `${latch.issuer}/userinfo`)
    assert.deepEqual(metadata.code_challenge_methods_supported, ['S256'])
    assert.deepEqual(metadata.introspection_endpoint_auth_methods_supported, ['none'])
    assert.deepEqual(metadata.revocation_endpoint_auth_methods_supported, ['none'])
    assert.equal(metadata.authorization_response_iss_parameter_supported, true)
    assert.ok(Array.isArray(metadata.scopes_supported))
  })

  it('names Bearer as the introspection auth method when a secret is set', async () => {
    const guarded = await startLatch({ INTROSPECTION_SECRET: 'a-long-introspection-secret' })
    const metadata = (await (await fetch(`${guarded.base}/.well-known/oauth-authorization-server`)).json()) as Record<
      string,
      unknown
    >
    assert.deepEqual(metadata.introspection_endpoint_auth_methods_supported, ['Bearer'])
    await guarded.close()
  })
})

describe('GET /auth (IndieAuth §5.2)', () => {
  let latch: TestServer
  before(async () => (latch = await startLatch()))
  after(() => latch.close())

  it("refuses an app that names itself by the client_id of the owner's tokens for scripts, as /apps would list it as one", async () => {
    for (const clientId of [`${latch.issuer}/apps`, `${latch.issuer.toUpperCase()}/apps`]) {
      const redirectUri = `${latch.issuer}/apps/callback`
      const response = await fetch(authorizationUrl(latch, { client_id: clientId, redirect_uri: redirectUri }), {
        redirect: 'manual',
      })
      assert.equal(response.status, 400, clientId)
      assert.match(await response.text(), /client_id names this server&#39;s own tokens for scripts, not an app/)
    }
  })

  it('keeps nothing for a request a browser makes for an image, a frame or a script, and shows a navigation the page', async () => {
    const store = new MemoryStore()
    const own = await startLatch({}, { store })
    try {
      for (const headers of [
        { 'Sec-Fetch-Mode': 'no-cors', 'Sec-Fetch-Dest': 'image' }, // another site's <img src=…/auth>
        { 'Sec-Fetch-Mode': 'navigate', 'Sec-Fetch-Dest': 'iframe' },
        { 'Sec-Fetch-Mode': 'no-cors', 'Sec-Fetch-Dest': 'empty' }, // a script's fetch
      ]) {
        const response = await fetch(authorizationUrl(own), { headers, redirect: 'manual' })
        assert.equal(response.status, 400, JSON.stringify(headers))
        assert.match(await response.text(), /opens only as a page of its own/)
      }
      assert.equal(store.pending.size, 0)
      const page = await fetch(authorizationUrl(own), {
        headers: { 'Sec-Fetch-Mode': 'navigate', 'Sec-Fetch-Dest': 'document' },
      })
      assert.equal(page.status, 200)
      assert.equal(store.pending.size, 1)
    } finally {
      await own.close()
    }
  })

  it('keeps nothing for a page a browser fetches ahead (speculation rules, rel=prefetch), which another port could ask for by the hundred', async () => {
    const store = new MemoryStore()
    const own = await startLatch({}, { store })
    try {
      const navigation = { 'Sec-Fetch-Mode': 'navigate', 'Sec-Fetch-Dest': 'document' }
      const aheads: Record<string, string>[] = [
        { 'Sec-Purpose': 'prefetch' }, // Chromium's speculation rules
        { 'Sec-Purpose': 'prefetch;prerender' },
        { Purpose: 'prefetch' }, // older browsers' <link rel=prefetch>
        { 'X-Moz': 'prefetch' },
      ]
      for (const ahead of aheads) {
        const response = await fetch(authorizationUrl(own), {
          headers: { ...navigation, ...ahead },
          redirect: 'manual',
        })
        assert.equal(response.status, 400, JSON.stringify(ahead))
        assert.match(response.headers.get('cache-control') ?? '', /no-store/)
      }
      assert.equal(store.pending.size, 0)
    } finally {
      await own.close()
    }
  })

  it('sends the redirect that carries a code uncached, and with no Referer for the app to pass on', async () => {
    const response = await submitConsent(latch, await openConsent(latch))
    assert.equal(response.status, 303)
    assert.ok(new URL(response.headers.get('location') ?? '').searchParams.get('code'))
    assert.equal(response.headers.get('cache-control'), 'no-store')
    assert.equal(response.headers.get('referrer-policy'), 'no-referrer')
  })

  it('shows the consent page with its security headers and a CSRF cookie', async () => {
    const response = await fetch(authorizationUrl(latch), { redirect: 'manual' })
    assert.equal(response.status, 200)
    assert.equal(response.headers.get('content-type'), 'text/html; charset=utf-8')
    const csp = response.headers.get('content-security-policy') ?? ''
    assert.match(csp, /default-src 'none'/)
    assert.match(csp, /frame-ancestors 'none'/)
    assert.doesNotMatch(csp, /form-action/)
    assert.equal(response.headers.get('x-frame-options'), 'DENY')
    assert.equal(response.headers.get('referrer-policy'), 'no-referrer')
    assert.equal(response.headers.get('x-content-type-options'), 'nosniff')
    assert.equal(response.headers.get('cache-control'), 'no-store')
    assert.equal(response.headers.get('pragma'), 'no-cache')
    const cookie = response.headers.get('set-cookie') ?? ''
    assert.match(cookie, /^latch_csrf=[A-Za-z0-9_-]{43};/)
    assert.match(cookie, /HttpOnly/)
    assert.match(cookie, /SameSite=Lax/)
    const html = await response.text()
    assert.match(html, new RegExp(`<form method="post" action="${latch.issuer}/auth/consent">`))
    assert.equal(html.match(/<form/g)?.length, 1)
    assert.match(html, /name="scope" value="profile" checked/)
    assert.match(html, /name="scope" value="create" checked/)
    assert.match(html, /name="decision" value="approve"/)
    assert.match(html, /name="decision" value="deny"/)
    assert.match(html, /http:\/\/127\.0\.0\.1:8080\//)
    assert.doesNotMatch(html, /type="password"/)
    assert.doesNotMatch(html, /<script/)
  })

  it("shows the host of the app's me hint, and no stranger's words in it", async () => {
    const expected = async (me: string) =>
      /The app expected <code><bdi>([^<]*)<\/bdi><\/code>/.exec((await openConsent(latch, { me })).html)?.[1]
    assert.equal(
      await expected('https://x.example/\nSECURITY NOTICE: this server has moved. Sign in at evil.example'),
      'x.example',
    )
    assert.equal(await expected('HAS-MOVED:sign-in-now-at-https://latch-moved.example/'), undefined)
    assert.equal(await expected('https://latch-moved.example@evil.example/'), undefined)
    assert.equal(await expected('this server has moved: sign in at evil.example'), undefined)
    assert.equal(await expected('javascript:alert(1)'), undefined)
    assert.equal(await expected('https://THIS-SERVER-HAS-MOVED!SIGN-IN-AT(evil.example)'), undefined)
    assert.equal(await expected('LATCH_MOVED,_USE_evil.example_INSTEAD'), undefined)
    assert.equal(await expected(`https://${'a'.repeat(250)}.example/`), undefined) // longer than DNS allows
    assert.equal(await expected('https://latch.example./'), 'latch.example')
    assert.equal(await expected('http://[::1]:8080/'), '[::1]:8080')
    assert.equal(await expected(' example.org '), 'example.org') // as a person types it
    assert.equal(await expected('https://Bücher.example/~jo/'), 'xn--bcher-kva.example')
    assert.equal(await expected(`${latch.issuer}/other/`), undefined) // the owner's own host: nothing to say
  })

  it('puts the csrf cookie value in the form, and keeps an existing cookie for a second tab', async () => {
    const first = await openConsent(latch)
    assert.equal(first.cookie, `latch_csrf=${first.csrf}`)
    const second = await openConsent(latch, {}, first.cookie)
    assert.equal(second.csrf, first.csrf)
    assert.notEqual(second.request, first.request)
  })

  it('treats a missing response_type and code_challenge_method as code and S256', async () => {
    await openConsent(latch, { response_type: undefined, code_challenge_method: undefined })
  })

  it('escapes what the client sent when showing it', async () => {
    const consent = await openConsent(latch, { scope: 'profile <script>alert(1)</script>' })
    assert.doesNotMatch(consent.html, /<script>/)
    assert.match(consent.html, /&#60;script&#62;/)
  })

  const pageErrors: [string, Record<string, string | undefined>][] = [
    ['a missing client_id', { client_id: undefined }],
    ['a client_id that is not a URL', { client_id: 'my-app' }],
    ['a client_id with a fragment', { client_id: 'http://127.0.0.1:8080/#x' }],
    ['a client_id with a dot segment', { client_id: 'http://127.0.0.1:8080/a/../' }],
    ['a client_id on a private IP address', { client_id: 'http://10.0.0.1/', redirect_uri: 'http://10.0.0.1/cb' }],
    ['a missing redirect_uri', { redirect_uri: undefined }],
    ['a redirect_uri on another host', { redirect_uri: 'http://evil.example/callback' }],
    ['a redirect_uri on another port', { redirect_uri: 'http://127.0.0.1:9090/callback' }],
    ['a redirect_uri on another scheme', { redirect_uri: 'https://127.0.0.1:8080/callback' }],
    ['a redirect_uri with a fragment', { redirect_uri: `${REDIRECT_URI}#x` }],
    ['a relative redirect_uri', { redirect_uri: '/callback' }],
    ['a redirect_uri without //', { redirect_uri: 'http:127.0.0.1:8080/callback' }],
    ['a client_id that URL() cannot parse', { client_id: 'http://xn--a.com/', redirect_uri: 'http://xn--a.com/cb' }],
  ]
  for (const [what, overrides] of pageErrors) {
    it(`answers ${what} with a 400 page, never a redirect`, async () => {
      const response = await fetch(authorizationUrl(latch, overrides), { redirect: 'manual' })
      assert.equal(response.status, 400)
      assert.equal(response.headers.get('location'), null)
      assert.equal(response.headers.get('content-type'), 'text/html; charset=utf-8')
      assert.match(await response.text(), /class="error"/)
    })
  }

  it('answers a repeated client_id or redirect_uri with a 400 page', async () => {
    for (const name of ['client_id', 'redirect_uri']) {
      const url = `${authorizationUrl(latch)}&${name}=${encodeURIComponent(name === 'client_id' ? CLIENT_ID : REDIRECT_URI)}`
      const response = await fetch(url, { redirect: 'manual' })
      assert.equal(response.status, 400)
      assert.equal(response.headers.get('location'), null)
    }
  })

  const redirectErrors: [string, Record<string, string | undefined>, string][] = [
    ['an unsupported response_type', { response_type: 'token' }, 'unsupported_response_type'],
    ['a missing code_challenge', { code_challenge: undefined }, 'invalid_request'],
    ['a code_challenge that is too short', { code_challenge: CHALLENGE.slice(1) }, 'invalid_request'],
    [
      'a code_challenge with characters outside base64url',
      { code_challenge: `${CHALLENGE.slice(1)}+` },
      'invalid_request',
    ],
    ['the plain code_challenge_method', { code_challenge_method: 'plain' }, 'invalid_request'],
    ['a response_mode of form_post', { response_mode: 'form_post' }, 'invalid_request'],
    ['a response_mode of fragment', { response_mode: 'fragment' }, 'invalid_request'],
    ['a scope with a quote', { scope: 'create "x"' }, 'invalid_scope'],
  ]
  it('takes response_mode=query, the one mode it lists', async () => {
    const response = await fetch(authorizationUrl(latch, { response_mode: 'query' }), { redirect: 'manual' })
    assert.equal(response.status, 200)
  })

  for (const [what, overrides, error] of redirectErrors) {
    it(`redirects ${what} back with ${error}, state and iss`, async () => {
      assertErrorRedirect(latch, await fetch(authorizationUrl(latch, overrides), { redirect: 'manual' }), error)
    })
  }

  it('redirects a repeated parameter back with invalid_request', async () => {
    const response = await fetch(`${authorizationUrl(latch)}&scope=media`, { redirect: 'manual' })
    assertErrorRedirect(latch, response, 'invalid_request')
  })

  const overLimits: [string, Record<string, string>, string, string | null][] = [
    [
      'more than 50 scopes',
      { scope: Array.from({ length: 51 }, (_, i) => `s${i}`).join(' ') },
      'invalid_scope',
      'state-1234',
    ],
    ['a scope longer than 100 characters', { scope: `create ${'x'.repeat(101)}` }, 'invalid_scope', 'state-1234'],
    [
      'a me longer than 2,048 characters',
      { me: 'https://example.com/'.padEnd(2_049, 'm') },
      'invalid_request',
      'state-1234',
    ],
    // sent back all the same: a client checks state before it reads the error (RFC 6749 §4.1.2.1)
    ['a state longer than 1,024 characters', { state: 's'.repeat(1_025) }, 'invalid_request', 's'.repeat(1_025)],
  ]
  for (const [what, overrides, error, state] of overLimits) {
    it(`redirects ${what} back with ${error}`, async () => {
      assertErrorRedirect(latch, await fetch(authorizationUrl(latch, overrides), { redirect: 'manual' }), error, state)
    })
  }

  it('accepts a request at every limit at once: 50 scopes of 100 characters and a state of 1,024, in 8,192 characters', async () => {
    const scope = Array.from({ length: 50 }, (_, i) => `${i}`.padStart(100, 'x')).join(' ')
    const me = `https://example.com/${'m'.repeat(1_500)}`
    const response = await fetch(authorizationUrl(latch, { scope, state: 's'.repeat(1_024), me }), {
      redirect: 'manual',
    })
    assert.equal(response.status, 200)
  })

  it('accepts a me of 2,048 characters', async () => {
    const me = 'https://example.com/'.padEnd(2_048, 'm')
    assert.equal((await fetch(authorizationUrl(latch, { me }), { redirect: 'manual' })).status, 200)
  })

  it('answers a request URL longer than 8,192 characters with 414 and a page, and takes one of 8,192', async () => {
    const url = new URL(authorizationUrl(latch))
    const target = (length: number) => `${url.pathname}${url.search}&padding=`.padEnd(length, 'p')
    const response = await fetch(`${latch.base}${target(8_193)}`, { redirect: 'manual' })
    assert.equal(response.status, 414)
    assert.equal(response.headers.get('content-type'), 'text/html; charset=utf-8')
    assert.equal((await fetch(`${latch.base}${target(8_192)}`, { redirect: 'manual' })).status, 200)
  })

  it('refuses at once a state and redirect_uri that would make the redirect with the code too long for a proxy', async () => {
    const redirect_uri = `${REDIRECT_URI}?${'p'.repeat(1_900)}` // a published one would do as well
    const state = '/'.repeat(600) // escaped, three times as long
    const response = await fetch(authorizationUrl(latch, { redirect_uri, state }), { redirect: 'manual' })
    assert.equal(response.status, 400)
    assert.match(await response.text(), /redirect_uri and state, escaped, make a redirect longer than 3584/)
    const fits = await fetch(authorizationUrl(latch, { redirect_uri, state: 's'.repeat(1_024) }), {
      redirect: 'manual',
    })
    assert.equal(fits.status, 200)
  })

  it('shows the error instead of redirecting when a state makes the redirect too long for a proxy to pass', async () => {
    const response = await fetch(authorizationUrl(latch, { state: 's'.repeat(4_000) }), { redirect: 'manual' })
    assert.equal(response.status, 400)
    assert.equal(response.headers.get('content-type'), 'text/html; charset=utf-8')
    assert.match(await response.text(), /state is longer than 1024 characters/)
  })

  it('sends no state back when state itself was repeated', async () => {
    const response = await fetch(`${authorizationUrl(latch)}&state=other`, { redirect: 'manual' })
    assertErrorRedirect(latch, response, 'invalid_request', null)
  })

  it('keeps the query redirect_uri already had, byte for byte, on an error redirect', async () => {
    const response = await fetch(
      authorizationUrl(latch, { redirect_uri: `${REDIRECT_URI}?app=a%20b&flag`, response_type: 'token' }),
      { redirect: 'manual' },
    )
    assert.match(
      response.headers.get('location') ?? '',
      /^http:\/\/127\.0\.0\.1:8080\/callback\?app=a%20b&flag&error=unsupported_response_type&/,
    )
  })

  it('refuses requests for a foreign host name while no password is set (DNS rebinding)', async () => {
    const status = (host: string) =>
      new Promise<number | undefined>((resolve) => {
        const url = new URL(authorizationUrl(latch))
        request(
          { host: '127.0.0.1', port: url.port, path: `${url.pathname}${url.search}`, headers: { Host: host } },
          (response) => {
            response.resume()
            resolve(response.statusCode)
          },
        ).end()
      })
    assert.equal(await status('evil.example'), 421)
    assert.equal(await status('evil.example:80'), 421)
    assert.equal(await status(`localhost:${new URL(latch.base).port}`), 307) // to the issuer's name: see below
    assert.equal(await status(`[::1]:${new URL(latch.base).port}`), 307)
  })

  it('sends a page asked for under another loopback name of the issuer to the issuer, and nothing else', async () => {
    const port = new URL(latch.base).port
    const answer = (host: string, path: string, method = 'GET') =>
      new Promise<{ status?: number; location?: string }>((resolve) => {
        request({ host: '127.0.0.1', port, path, method, headers: { Host: host } }, (response) => {
          response.resume()
          resolve({ status: response.statusCode, location: response.headers.location })
        }).end()
      })
    const auth = new URL(authorizationUrl(latch))
    const target = `${auth.pathname}${auth.search}`
    // its forms post to the issuer, where this browser's cookies are not: they would all be refused
    assert.deepEqual(await answer(`localhost:${port}`, target), { status: 307, location: `${latch.issuer}${target}` })
    assert.deepEqual(await answer(`[::1]:${port}`, '/apps'), { status: 307, location: `${latch.issuer}/apps` })
    assert.equal((await answer(`LOCALHOST:${port}`, '/', 'HEAD')).status, 307)
    assert.equal((await answer(`127.0.0.1:${port}`, target)).status, 200) // the issuer's own name
    assert.equal((await answer(`localhost:${Number(port) + 1}`, target)).status, 200) // another port: a proxy's, say
    assert.equal((await answer(`localhost:${port}`, '/.well-known/oauth-authorization-server')).status, 200) // no page
    assert.equal((await answer(`localhost:${port}`, '/token', 'POST')).status, 400)
  })

  it('refuses a request without a Host header while no password is set, even the first after a start', async () => {
    const fresh = await startLatch()
    try {
      const socket = connect(fresh.port, '127.0.0.1')
      socket.end('GET / HTTP/1.0\r\n\r\n') // HTTP/1.0 needs no Host: node:http lets it through
      let answer = ''
      socket.on('data', (chunk) => (answer += chunk))
      await once(socket, 'close')
      assert.match(answer, /^HTTP\/1\.1 421 /)
    } finally {
      await fresh.close()
    }
  })

  it('refuses a request that came through a proxy while no password is set: it may be anyone', async () => {
    const saidBy: [string, string][] = [
      ['X-Forwarded-For', '203.0.113.9'], // docs/nginx.conf, Debian's proxy_params
      ['Forwarded', 'for=203.0.113.9'],
      ['X-Real-IP', '203.0.113.9'],
      ['X-Forwarded-Proto', 'https'], // Caddy's, and any other X-Forwarded-
      ['Via', '1.1 caddy'],
      ['CF-Connecting-IP', '203.0.113.9'],
      ['X-Client-IP', '203.0.113.9'],
      ['True-Client-IP', '203.0.113.9'],
    ]
    for (const [name, value] of saidBy) {
      const page = await fetch(authorizationUrl(latch), { headers: { [name]: value } })
      assert.equal(page.status, 403, name)
      assert.match(await page.text(), /came through a proxy[^]*set PASSWORD_HASH/)
      const token = await post(`${latch.base}/token`, 'grant_type=authorization_code', { [name]: value })
      await assertError(token, 403, 'access_denied')
    }
    // nginx's plain proxy_pass adds no header, but speaks HTTP/1.0 to the server behind it
    const port = Number(new URL(latch.base).port)
    const statusAs = async (version: string) => {
      const socket = connect(port, '127.0.0.1')
      socket.end(`GET /apps HTTP/${version}\r\nHost: 127.0.0.1:${port}\r\n\r\n`)
      let answer = ''
      for await (const chunk of socket) answer += String(chunk)
      return answer.slice(0, 12)
    }
    assert.equal(await statusAs('1.0'), 'HTTP/1.1 403')
    assert.equal(await statusAs('2.0'), 'HTTP/1.1 200') // a minor version of 0 is not HTTP/1.0
    assert.equal((await fetch(authorizationUrl(latch))).status, 200)
    // nor is TRUST_PROXY offered as the fix: without a password, it refuses to start
    assert.deepEqual(
      latch.logs.filter((line) => /TRUST_PROXY/.test(line)),
      [],
    )
  })

  it('answers only this machine while no password is set, wherever an embedding app listens', async () => {
    // an app that embeds Latch may listen on every interface: a peer on the network, naming a
    // loopback host in its Host header, must not approve sign-ins without a password
    const handler = createHandler({ config: loadConfig({ DATA_FILE: 'memory' }), now: () => START })
    const from = (peer: string | undefined) =>
      createServer((req, res) => {
        Object.defineProperty(req.socket, 'remoteAddress', { value: peer, configurable: true })
        handler(req, res)
      })
    for (const [peer, expected] of [
      [undefined, 403], // a connection reset at once: node:http can no longer say whose it was
      ['192.0.2.2', 403],
      ['::ffff:192.0.2.2', 403],
      ['fd00::2', 403],
      ['127.0.0.2', 200],
      ['::ffff:127.0.0.1', 200],
      ['::1', 200],
    ] as const) {
      const server = from(peer)
      await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
      const base = `http://localhost:${(server.address() as AddressInfo).port}`
      try {
        const metadata = await fetch(`${base}/.well-known/oauth-authorization-server`)
        assert.equal(metadata.status, expected, String(peer))
        if (expected === 403) {
          assert.match(((await metadata.json()) as { error_description: string }).error_description, /PASSWORD_HASH/)
          const page = await fetch(`${base}/auth?client_id=x`)
          assert.equal(page.status, 403)
          assert.match(await page.text(), /no password/)
        }
      } finally {
        server.closeAllConnections()
        await new Promise((resolve) => server.close(resolve))
      }
    }
    // a Unix socket has no address, and only this machine can reach it
    const socketPath = join(await mkdtemp(join(tmpdir(), 'latch-unix-')), 'latch.sock')
    const unix = createServer(handler)
    await new Promise<void>((resolve) => unix.listen(socketPath, resolve))
    const status = await new Promise<number | undefined>((resolve, reject) =>
      request(
        { socketPath, path: '/.well-known/oauth-authorization-server', headers: { Host: 'localhost' } },
        (res) => {
          res.resume()
          resolve(res.statusCode)
        },
      )
        .on('error', reject)
        .end(),
    )
    await new Promise((resolve) => unix.close(resolve))
    assert.equal(status, 200)
  })

  it('refuses a request that names no host while no password is set, one that names two, and one of 1,001 header lines', async () => {
    const port = Number(new URL(latch.base).port)
    const statusOf = async (head: string) => {
      const socket = connect(port, '127.0.0.1')
      socket.end(`${head}\r\n\r\n`)
      let text = ''
      for await (const chunk of socket) text += String(chunk)
      return Number(/^HTTP\/1\.1 (\d{3})/.exec(text)?.[1])
    }
    assert.equal(await statusOf('GET /apps HTTP/1.0'), 421)
    assert.equal(await statusOf(`GET /apps HTTP/1.1\r\nHost: 127.0.0.1:${port}\r\nHost: evil.example`), 400)
    assert.equal(await statusOf(`GET /apps HTTP/1.1\r\nHost: 127.0.0.1:${port}`), 200)
    // node:http keeps 2,000 header lines and drops the rest unseen, a second Host among them
    const lines = (count: number) => 'a: 1\r\n'.repeat(count)
    assert.equal(
      await statusOf(`GET /apps HTTP/1.1\r\nHost: 127.0.0.1:${port}\r\n${lines(2000)}Host: evil.example`),
      431,
    )
    assert.equal(await statusOf(`GET /apps HTTP/1.1\r\nHost: 127.0.0.1:${port}\r\n${lines(1000)}`), 431)
    assert.equal(await statusOf(`GET /apps HTTP/1.1\r\nHost: 127.0.0.1:${port}\r\n${lines(999)}`), 200)
  })

  it("says why it refused headers too large to read: in a browser, other pages' cookies", async (t) => {
    // what a page on another port of this host name can make a browser send Latch: 24 KiB of cookies
    const cookie = Array.from({ length: 8 }, (_, i) => `c${i}=${'x'.repeat(3000)}`).join('; ')
    const { base, close } = await startLatch({}, { latchServer: true })
    t.after(close)
    const res = await fetch(`${base}/apps`, { headers: { Cookie: cookie } })
    assert.equal(res.status, 431)
    assert.equal(res.headers.get('content-type'), 'text/plain; charset=utf-8')
    assert.equal(res.headers.get('x-content-type-options'), 'nosniff')
    assert.equal(res.headers.get('connection'), 'close')
    assert.match(await res.text(), /cookies that other pages on this host name set: clear this site's cookies/)
    // to a HEAD, the same refusal, with no body: none may follow the head of an answer to one; nor
    // to one sent behind a GET, whose bytes came first
    const refusal = 'HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\n\r\n'
    const head = `HEAD /apps HTTP/1.1\r\nHost: 127.0.0.1\r\nCookie: ${cookie}\r\n\r\n`
    for (const sent of [head, `GET /nowhere HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n${head}`]) {
      const socket = connect(Number(new URL(base).port), '127.0.0.1')
      socket.end(sent)
      let answer = ''
      for await (const chunk of socket) answer += String(chunk)
      assert.ok(answer.endsWith(refusal), answer)
    }
    // a GET whose 24 KiB of headers came in pieces, as they do across a network: the last piece,
    // all node:http says it read, names no method, and the refusal still says why
    const server = createLatchServer()
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
    t.after(() => new Promise((resolve) => server.close(resolve)))
    const accepted = once(server, 'connection')
    const client = connect((server.address() as AddressInfo).port, '127.0.0.1')
    const [socket] = (await accepted) as [Socket]
    const piece = Buffer.from(`${'x'.repeat(8192)}; c7=${'x'.repeat(3000)}\r\n\r\n`)
    const overflow = Object.assign(new Error('Parse Error: Header overflow'), {
      code: 'HPE_HEADER_OVERFLOW',
      rawPacket: piece,
      bytesParsed: 8192,
    })
    server.emit('clientError', overflow, socket)
    let pieced = ''
    for await (const chunk of client) pieced += String(chunk)
    assert.match(pieced, /^HTTP\/1\.1 431 [^]*\r\n\r\nThe headers of the request are too large\. [^]*try again\.\n$/)
  })

  it('routes a target in absolute form by its path, and takes its authority for the host', async () => {
    const port = Number(new URL(latch.base).port)
    const answer = async (target: string, host: string) => {
      const socket = connect(port, '127.0.0.1')
      socket.end(`GET ${target} HTTP/1.1\r\nHost: ${host}\r\nConnection: close\r\n\r\n`)
      let text = ''
      for await (const chunk of socket) text += String(chunk)
      return text
    }
    const metadata = await answer(`http://localhost:${port}/.well-known/oauth-authorization-server`, 'evil.example')
    assert.match(metadata, /^HTTP\/1\.1 200[^]*"issuer"/)
    const consent = new URL(authorizationUrl(latch))
    const page = await answer(`HTTP://127.0.0.1:${port}${consent.pathname}${consent.search}`, 'evil.example')
    assert.match(page, /^HTTP\/1\.1 200/)
    const foreign = await answer(`http://evil.example${consent.pathname}${consent.search}`, `localhost:${port}`)
    assert.match(foreign, /^HTTP\/1\.1 421/) // the DNS-rebinding defence reads the target's host
    assert.match(await answer(`http://127.0.0.1:${port}`, 'x'), /^HTTP\/1\.1 200[^]*<a href/) // no path: the home page
  })

  it('answers a malformed query with a 400 page', async () => {
    const response = await fetch(`${latch.base}/auth?client_id=%zz`, { redirect: 'manual' })
    assert.equal(response.status, 400)
    assert.equal(response.headers.get('location'), null)
  })
})

describe('GET /auth under a flood', () => {
  it(
    'keeps the memory a flood of the largest and of over-limit requests costs to tens of MB',
    { timeout: 120_000 },
    async () => {
      // the young generation kept to Node 20's 16 MiB a half: Node 24's V8 lets it grow to four times
      // that under a flood, which the resident set shows though the heap in use stays flat
      const child = fork(fileURLToPath(new URL('./test/fixtures/flood-server.ts', import.meta.url)), [], {
        execArgv: ['--expose-gc', '--max-semi-space-size=16', '--import', 'tsx'],
      })
      const ask = <T>(message?: string) =>
        new Promise<T>((resolve) => {
          child.once('message', (answer) => resolve(answer as T))
          if (message !== undefined) child.send(message)
        })
      const { port } = await ask<{ port: number }>()
      const rss = async () => (await ask<{ rss: number }>('rss')).rss
      const query = (fields: Record<string, string>) =>
        new URLSearchParams({
          client_id: CLIENT_ID,
          redirect_uri: REDIRECT_URI,
          code_challenge: CHALLENGE,
          ...fields,
        }).toString()
      const largest = `/auth?${query({ scope: Array.from({ length: 50 }, (_, i) => `${i}`.padStart(100, 'x')).join(' '), state: 's'.repeat(1_024) })}`
      const hostile = `/auth?${query({ scope: Array.from({ length: 2_000 }, (_, i) => i.toString(36)).join(' ') })}` // 2,000 scopes in 8 KiB
      const flood = async (path: string, count: number) => {
        const agent = new Agent({ keepAlive: true, maxSockets: 16 })
        const one = () =>
          new Promise<void>((resolve, reject) => {
            const req = request({ host: '127.0.0.1', port, path, agent }, (res) => res.resume().on('end', resolve))
            req.on('error', reject).end()
          })
        for (let sent = 0; sent < count; sent += 16) await Promise.all(Array.from({ length: 16 }, one))
        agent.destroy()
      }
      try {
        await flood(largest, 200) // warm up: code compiled, pools allocated
        const before = await rss()
        await flood(largest, 2_000)
        await flood(hostile, 2_000)
        const grown = (await rss()) - before
        // 39 to 49 MiB over a dozen runs: the resident set moves with the allocator. What this
        // guards against, memory that grows with every request, would be hundreds.
        assert.ok(
          grown < 64 * 1024 * 1024,
          `the flood grew the server's memory by ${Math.round(grown / 1024 / 1024)} MiB`,
        )
      } finally {
        child.disconnect()
      }
    },
  )
})

describe('POST /auth/consent (IndieAuth §5.2.1)', () => {
  let latch: TestServer
  before(async () => (latch = await startLatch()))
  after(() => latch.close())

  it('redirects with a code, the state and iss on approval (RFC 9207)', async () => {
    const response = await submitConsent(latch, await openConsent(latch))
    assert.equal(response.status, 303)
    const location = new URL(response.headers.get('location') ?? '')
    assert.equal(`${location.origin}${location.pathname}`, REDIRECT_URI)
    assert.match(location.searchParams.get('code') ?? '', /^[A-Za-z0-9_-]{43}$/)
    assert.equal(location.searchParams.get('state'), 'state-1234')
    assert.equal(location.searchParams.get('iss'), latch.issuer)
  })

  it('keeps the query redirect_uri already had, and sends no state when none was sent', async () => {
    const consent = await openConsent(latch, { redirect_uri: `${REDIRECT_URI}?app=a%20b`, state: undefined })
    const location = (await submitConsent(latch, consent)).headers.get('location') ?? ''
    assert.match(location, /^http:\/\/127\.0\.0\.1:8080\/callback\?app=a%20b&code=[A-Za-z0-9_-]{43}&iss=/)
    assert.equal(new URL(location).searchParams.has('state'), false)
  })

  it('redirects with access_denied, the state and iss on denial', async () => {
    const response = await submitConsent(latch, await openConsent(latch), { decision: 'deny' })
    assert.equal(response.status, 303)
    const location = new URL(response.headers.get('location') ?? '')
    assert.equal(location.searchParams.get('error'), 'access_denied')
    assert.equal(location.searchParams.get('state'), 'state-1234')
    assert.equal(location.searchParams.get('iss'), latch.issuer)
    assert.equal(location.searchParams.has('code'), false)
  })

  it('grants only the checked scopes that were requested', async () => {
    const code = await obtainCode(latch, {}, { scope: ['create', 'delete'] })
    const body = (await (await exchange(latch, code)).json()) as Record<string, unknown>
    assert.equal(body.scope, 'create')
  })

  it('answers a request once: the same answer again only within a minute, as a double click sends it', async () => {
    const consent = await openConsent(latch)
    assert.equal((await submitConsent(latch, consent)).status, 303)
    const other = await submitConsent(latch, consent, { decision: 'deny' })
    assert.equal(other.status, 400)
    assert.equal(other.headers.get('location'), null)
    assert.equal((await submitConsent(latch, consent)).status, 303)
    latch.advance(61)
    const again = await submitConsent(latch, consent)
    assert.equal(again.status, 400)
    assert.equal(again.headers.get('location'), null)
  })

  it('answers an unknown request with a 400 page', async () => {
    const consent = await openConsent(latch)
    const response = await submitConsent(latch, { ...consent, request: createSecret() })
    assert.equal(response.status, 400)
    assert.equal(response.headers.get('content-type'), 'text/html; charset=utf-8')
  })

  it('lets a pending request expire after 10 minutes', async () => {
    const consent = await openConsent(latch)
    latch.advance(601)
    assert.equal((await submitConsent(latch, consent)).status, 400)
  })

  it('refuses with 403 when the csrf field and the cookie differ, and issues nothing', async () => {
    const consent = await openConsent(latch)
    const forged = await submitConsent(latch, { ...consent, csrf: createSecret() })
    assert.equal(forged.status, 403)
    assert.equal(forged.headers.get('location'), null)
    const noCookie = await submitConsent(latch, { ...consent, cookie: '' })
    assert.equal(noCookie.status, 403)
    const otherBrowser = await submitConsent(latch, {
      ...consent,
      csrf: 'x'.repeat(43),
      cookie: `latch_csrf=${'x'.repeat(43)}`,
    })
    assert.equal(otherBrowser.status, 403)
    assert.equal((await submitConsent(latch, consent)).status, 303) // the request itself is still usable
  })

  it('asks to choose approve or deny', async () => {
    const response = await submitConsent(latch, await openConsent(latch), { decision: 'maybe' })
    assert.equal(response.status, 400)
  })

  it('answers a body that is not a form with a 400 page', async () => {
    const response = await fetch(`${latch.base}/auth/consent`, {
      method: 'POST',
      headers: { 'Content-Type': 'text/plain' },
      body: 'x',
    })
    assert.equal(response.status, 400)
    assert.equal(response.headers.get('content-type'), 'text/html; charset=utf-8')
  })
})

describe('POST /auth/consent with a password', () => {
  let latch: TestServer
  before(async () => (latch = await startLatch({ PASSWORD_HASH: await hashPassword('correct horse', FAST_COST) })))
  after(() => latch.close())

  it('asks for the password on the consent page', async () => {
    const consent = await openConsent(latch)
    assert.match(consent.html, /<input type="password" name="password"/)
    assert.match(consent.html, /Answer within 10 minutes: after that, start again from the app\./)
  })

  it('names the owner beside the password, hidden, for password managers, and approves with it sent', async () => {
    const consent = await openConsent(latch)
    const me = `${latch.base}/` // ME is the issuer unless set
    assert.ok(consent.html.includes(`<input type="text" name="username" autocomplete="username" value="${me}" hidden>`))
    const answer = await submitConsent(latch, consent, { password: 'correct horse', username: me })
    assert.equal(answer.status, 303)
    assert.match(answer.headers.get('location') ?? '', /[?&]code=/)
  })

  it('says how long is left to answer when it shows the page again after a wrong password', async () => {
    const consent = await openConsent(latch)
    latch.advance(59) // 9 minutes and a second left: never more promised than is left
    const early = await submitConsent(latch, consent, { password: 'wrong horse' })
    assert.match(await early.text(), /Answer within 9 minutes: after that, start again from the app\./)
    latch.advance(9 * 60 - 29)
    const wrong = await submitConsent(latch, consent, { password: 'wrong horse' })
    latch.advance(-(9 * 60 + 30))
    assert.equal(wrong.status, 401)
    assert.match(await wrong.text(), /Answer within 1 minute: after that, start again from the app\./)
  })

  it('approves with the right password', async () => {
    const response = await submitConsent(latch, await openConsent(latch), { password: 'correct horse' })
    assert.equal(response.status, 303)
    assert.ok(new URL(response.headers.get('location') ?? '').searchParams.get('code'))
  })

  /** A Latch whose store holds 60 pending requests, behind a proxy on this machine that TRUST_PROXY names. */
  async function withFullStore(test: (latch: TestServer, store: MemoryStore) => Promise<void>) {
    const store = new MemoryStore({ maxPendingRequests: 60, log: () => {} })
    const proxied = await startLatch(
      { PASSWORD_HASH: await hashPassword('correct horse', FAST_COST), TRUST_PROXY: '127.0.0.1' },
      { store },
    )
    try {
      await test(proxied, store)
    } finally {
      await proxied.close()
    }
  }

  /** Opens `count` consent pages as the address, and returns the first one's request id. */
  async function flood(latch: TestServer, address: string, count: number): Promise<string | undefined> {
    let first: string | undefined
    for (let i = 0; i < count; i++) {
      const response = await fetch(authorizationUrl(latch), { headers: { 'X-Forwarded-For': address } })
      const html = await response.text()
      assert.equal(response.status, 200)
      first ??= /name="request" value="([^"]+)"/.exec(html)?.[1]
    }
    return first
  }

  it("keeps the owner's consent page through one stranger's flood of requests, which pushes out its own", async () => {
    await withFullStore(async (latch, store) => {
      const consent = await openConsent(latch) // the owner, on this machine
      const first = await flood(latch, '198.51.100.7', 100)
      assert.equal(store.pending.size, 60)
      assert.equal((await submitConsent(latch, consent, { password: 'correct horse' })).status, 303)
      assert.equal(await store.findPending(hashSecret(first ?? ''), START), undefined) // its own oldest went
    })
  })

  it('keeps a consent page as long as before when the owner shares an address with the flood', async () => {
    await withFullStore(async (latch) => {
      // a proxy on another machine, or a carrier's NAT: one address for the owner and the stranger
      const shared = '10.0.0.5'
      const response = await fetch(authorizationUrl(latch), { headers: { 'X-Forwarded-For': shared } })
      const html = await response.text()
      const consent: Consent = {
        request: /name="request" value="([^"]+)"/.exec(html)?.[1] ?? '',
        csrf: /name="csrf" value="([^"]+)"/.exec(html)?.[1] ?? '',
        cookie: (response.headers.get('set-cookie') ?? '').split(';')[0],
        html,
      }
      await flood(latch, shared, 59) // the store is full, nothing dropped yet
      const approved = await post(
        `${latch.base}/auth/consent`,
        form({ request: consent.request, csrf: consent.csrf, decision: 'approve', password: 'correct horse' }),
        { Cookie: consent.cookie, 'X-Forwarded-For': shared },
      )
      assert.equal(approved.status, 303)
    })
  })

  it('answers a second press of Approve (a double click) as the first: signed in, and a code the app can redeem', async () => {
    const consent = await openConsent(latch)
    const answers = await Promise.all([1, 2].map(() => submitConsent(latch, consent, { password: 'correct horse' })))
    assert.deepEqual(
      answers.map((answer) => answer.status),
      [303, 303],
    )
    for (const answer of answers) {
      assert.match(answer.headers.get('set-cookie') ?? '', /^latch_session=/)
      const code = new URL(answer.headers.get('location') ?? '').searchParams.get('code') ?? ''
      assert.equal((await exchange(latch, code)).status, 200) // the browser brings the app the second
    }
    const narrowed = await openConsent(latch)
    assert.equal((await submitConsent(latch, narrowed, { password: 'correct horse', scope: 'create' })).status, 303)
    const wider = await submitConsent(latch, narrowed, { password: 'correct horse' }) // both scopes ticked
    const code = new URL(wider.headers.get('location') ?? '').searchParams.get('code') ?? ''
    assert.equal(((await (await exchange(latch, code)).json()) as { scope: string }).scope, 'create') // the first's
    latch.advance(61)
    const late = await submitConsent(latch, consent, { password: 'correct horse' })
    assert.equal(late.status, 400)
    assert.match(await late.text(), /unknown or has expired/)
  })

  it('refuses the other decision after an answer, and still signs in a right password given with it', async () => {
    const consent = await openConsent(latch)
    assert.equal((await submitConsent(latch, consent, { decision: 'deny' })).status, 303)
    const changed = await submitConsent(latch, consent, { password: 'correct horse' })
    assert.equal(changed.status, 400)
    assert.match(await changed.text(), /answered already, or has expired meanwhile/)
    const session = /latch_session=([^;]+)/.exec(changed.headers.get('set-cookie') ?? '')?.[1]
    assert.ok(session, 'the right password signs the owner in')
    const signedIn = await fetch(`${latch.base}/apps`, { headers: { Cookie: `latch_session=${session}` } })
    assert.match(await signedIn.text(), /Sign out/)
  })

  it('answers no second press after Revoke all, and counts a double-clicked app as one app', async () => {
    const own = await startLatch({ PASSWORD_HASH: await hashPassword('correct horse', FAST_COST) })
    try {
      const consent = await openConsent(own)
      const [, second] = await Promise.all([1, 2].map(() => submitConsent(own, consent, { password: 'correct horse' })))
      const code = new URL(second.headers.get('location') ?? '').searchParams.get('code') ?? ''
      assert.equal((await exchange(own, code)).status, 200) // the first press's code is left unredeemed
      const session = /latch_session=([^;]+)/.exec(second.headers.get('set-cookie') ?? '')?.[1] ?? ''
      const cookie = `${consent.cookie}; latch_session=${session}`
      const apps = await (await fetch(`${own.base}/apps`, { headers: { Cookie: cookie } })).text()
      const csrf = /name="csrf" value="([^"]+)"/.exec(apps)?.[1] ?? ''
      const revoked = await post(`${own.base}/apps/revoke-all`, form({ csrf, confirm: 'yes' }), { Cookie: cookie })
      assert.match(await revoked.text(), /Revoked 1 app: it has lost its access/)
      assert.equal((await submitConsent(own, consent, { password: 'correct horse' })).status, 400)
    } finally {
      await own.close()
    }
  })

  it('answers no second press after Sign out everywhere', async () => {
    const consent = await openConsent(latch)
    const approved = await submitConsent(latch, consent, { password: 'correct horse' })
    const session = /latch_session=([^;]+)/.exec(approved.headers.get('set-cookie') ?? '')?.[1] ?? ''
    const cookie = `${consent.cookie}; latch_session=${session}`
    const apps = await (await fetch(`${latch.base}/apps`, { headers: { Cookie: cookie } })).text()
    const csrf = /name="csrf" value="([^"]+)"/.exec(apps)?.[1] ?? ''
    assert.equal((await post(`${latch.base}/sign-out-everywhere`, form({ csrf }), { Cookie: cookie })).status, 200)
    assert.equal((await submitConsent(latch, consent, { password: 'correct horse' })).status, 400)
  })

  it("remembers the owner's answer through a stranger's hundred answers, which push out their own", async () => {
    const own = await startLatch({
      PASSWORD_HASH: await hashPassword('correct horse', FAST_COST),
      TRUST_PROXY: '127.0.0.1',
    })
    try {
      const consent = await openConsent(own)
      assert.equal((await submitConsent(own, consent, { password: 'correct horse' })).status, 303)
      const stranger = { 'X-Forwarded-For': '198.51.100.7' }
      for (let i = 0; i < 100; i++) {
        const page = await fetch(authorizationUrl(own), { headers: stranger })
        const html = await page.text()
        const fields = {
          request: /name="request" value="([^"]+)"/.exec(html)?.[1] ?? '',
          csrf: /name="csrf" value="([^"]+)"/.exec(html)?.[1] ?? '',
          decision: 'deny',
        }
        const cookie = (page.headers.get('set-cookie') ?? '').split(';')[0]
        assert.equal(
          (await post(`${own.base}/auth/consent`, form(fields), { Cookie: cookie, ...stranger })).status,
          303,
        )
      }
      assert.equal((await submitConsent(own, consent, { password: 'correct horse' })).status, 303)
    } finally {
      await own.close()
    }
  })

  it('takes the password however its accents are encoded (NFC or NFD), as keyboards differ', async () => {
    const accented = await startLatch({ PASSWORD_HASH: await hashPassword('caf\u00e9 horse', FAST_COST) })
    try {
      const response = await submitConsent(accented, await openConsent(accented), { password: 'cafe\u0301 horse' })
      assert.equal(response.status, 303)
    } finally {
      await accented.close()
    }
  })

  it('answers a wrong or missing password with 401 and a challenge, and the page again, keeping the request usable', async () => {
    const consent = await openConsent(latch)
    const wrong = await submitConsent(latch, consent, { password: 'wrong horse' })
    assert.equal(wrong.status, 401)
    const html = await wrong.text()
    assert.match(html, /role="alert"/)
    assert.match(html, new RegExp(`name="request" value="${consent.request}"`))
    // the contract's 401, with the challenge RFC 9110 asks of one: the form, which no browser prompts for
    assert.equal(wrong.headers.get('www-authenticate'), `Form realm="${latch.issuer}"`)
    const missing = await submitConsent(latch, consent)
    assert.equal(missing.status, 401)
    assert.equal(missing.headers.get('www-authenticate'), `Form realm="${latch.issuer}"`)
    assert.equal((await submitConsent(latch, consent, { password: 'correct horse' })).status, 303)
  })

  it('shows the page again after a wrong password with the scopes and lifetime the owner chose', async () => {
    const consent = await openConsent(latch)
    assert.match(consent.html, /value="profile" checked>[^]*value="create" checked>/)
    assert.match(consent.html, /<option value="0" selected>/)
    const wrong = await submitConsent(latch, consent, { password: 'wrong horse', scope: 'create', lifetime: '86400' })
    assert.equal(wrong.status, 401)
    const html = await wrong.text()
    assert.match(html, /name="scope" value="profile">[^]*name="scope" value="create" checked>/)
    assert.match(html, /<option value="86400" selected>/)
    assert.doesNotMatch(html, /<option value="0" selected>/)
    latch.advance(86401) // a day of quiet: the next tests count wrong passwords from none
  })

  it('lets the owner deny without the password', async () => {
    const response = await submitConsent(latch, await openConsent(latch), { decision: 'deny' })
    assert.equal(response.status, 303)
    assert.equal(new URL(response.headers.get('location') ?? '').searchParams.get('error'), 'access_denied')
  })

  it('throttles repeated failures with 429 and Retry-After, and lets the owner in once the wait is over', async () => {
    latch.advance(3600) // forget the failures of earlier tests
    const consent = await openConsent(latch)
    for (let i = 0; i < 5; i++)
      assert.equal((await submitConsent(latch, consent, { password: `guess ${i}` })).status, 401)
    assert.equal((await submitConsent(latch, consent, { password: 'guess 5' })).status, 401) // locks for 2 seconds
    const throttled = await submitConsent(latch, consent, { password: 'correct horse' })
    assert.equal(throttled.status, 429)
    assert.equal(throttled.headers.get('retry-after'), '2')
    latch.advance(2)
    assert.equal((await submitConsent(latch, consent, { password: 'correct horse' })).status, 303)
  })

  it('keeps a lockout as long as it was, when the clock is set back meanwhile', async () => {
    latch.advance(86401) // a day of quiet: the counts of earlier tests are forgotten
    const consent = await openConsent(latch)
    for (let i = 0; i < 6; i++)
      assert.equal((await submitConsent(latch, consent, { password: `guess ${i}` })).status, 401)
    latch.advance(-3600) // the clock is set back an hour, as NTP may do to a clock that ran fast
    const throttled = await submitConsent(latch, consent, { password: 'correct horse' })
    assert.equal(throttled.status, 429)
    assert.equal(throttled.headers.get('retry-after'), '2') // not 3602
    latch.advance(2)
    assert.equal((await submitConsent(latch, consent, { password: 'correct horse' })).status, 303)
    latch.advance(3600)
  })

  it('counts guesses sent in parallel before their hashes are checked', async () => {
    latch.advance(86400)
    const consent = await openConsent(latch)
    const guesses = Array.from({ length: 20 }, (_, i) => submitConsent(latch, consent, { password: `parallel ${i}` }))
    const statuses = (await Promise.all(guesses)).map((response) => response.status)
    assert.equal(statuses.filter((status) => status === 401).length, 6)
    assert.equal(statuses.filter((status) => status === 429).length, 14)
  })

  it('locks every address once twenty guesses in total fail, from however many addresses', async () => {
    latch.advance(86401) // a day of quiet: the counts of earlier tests are forgotten
    const consent = await openConsent(latch)
    // Each address stays under its own five free guesses; 127.0.0.0/8 all reaches the server.
    const from = (host: number, password: string) => submitConsentFrom(latch, consent, `127.0.0.${host}`, password)
    for (let host = 10; host < 15; host++) {
      for (let i = 0; i < 4; i++) assert.equal(await from(host, `guess ${host}.${i}`), 401)
    }
    assert.equal(await from(20, 'guess 21'), 401) // the twenty-first locks them all for 2 seconds
    assert.equal(await from(21, 'correct horse'), 429)
    latch.advance(2)
    assert.equal(await from(21, 'correct horse'), 303)
  })
})

/** Submits the consent form from a given local address, for the per-address counts; answers the status. */
function submitConsentFrom(
  latch: TestServer,
  consent: Consent,
  localAddress: string,
  password: string,
): Promise<number> {
  const body = form({
    request: consent.request,
    csrf: consent.csrf,
    scope: ['profile', 'create'],
    decision: 'approve',
    password,
  }).toString()
  const headers = { 'Content-Type': 'application/x-www-form-urlencoded', Cookie: consent.cookie }
  return new Promise((resolve, reject) => {
    const req = request(
      {
        host: '127.0.0.1',
        port: latch.port,
        localAddress,
        method: 'POST',
        path: '/auth/consent',
        headers,
        agent: false,
      },
      (res) => {
        res.resume()
        res.on('end', () => resolve(res.statusCode ?? 0))
      },
    )
    req.on('error', reject)
    req.end(body)
  })
}

describe('POST /auth (IndieAuth §5.3.2)', () => {
  let latch: TestServer
  before(async () => (latch = await startLatch({ ME: 'https://example.com/' })))
  after(() => latch.close())

  const redeem = (code: string, fields: Record<string, string | undefined> = {}) =>
    post(`${latch.base}/auth`, form({ code, code_verifier: VERIFIER, ...fields }))

  it('redeems a code for the profile URL, with no-store headers', async () => {
    const response = await redeem(await obtainCode(latch))
    assert.equal(response.status, 200)
    assert.equal(response.headers.get('cache-control'), 'no-store')
    assert.equal(response.headers.get('pragma'), 'no-cache')
    assert.deepEqual(await response.json(), { me: 'https://example.com/', profile: { url: 'https://example.com/' } })
  })

  it('answers only me when the profile scope was not granted', async () => {
    const response = await redeem(await obtainCode(latch, {}, { scope: ['create'] }))
    assert.deepEqual(await response.json(), { me: 'https://example.com/' })
  })

  it('redeems a code issued without scope', async () => {
    const code = await obtainCode(latch, { scope: undefined }, { scope: undefined })
    assert.equal((await redeem(code)).status, 200)
  })

  it('accepts grant_type, client_id and redirect_uri when they match the code', async () => {
    const response = await redeem(await obtainCode(latch), {
      grant_type: 'authorization_code',
      client_id: CLIENT_ID,
      redirect_uri: REDIRECT_URI,
    })
    assert.equal(response.status, 200)
  })

  it('consumes the code, here and at the token endpoint', async () => {
    const code = await obtainCode(latch)
    assert.equal((await redeem(code)).status, 200)
    await assertError(await redeem(code), 400, 'invalid_grant')
    await assertError(await exchange(latch, code), 400, 'invalid_grant')
  })

  const failures: [string, Record<string, string | undefined>, number, string][] = [
    ['another grant_type', { grant_type: 'password' }, 400, 'unsupported_grant_type'],
    ['another client_id', { client_id: 'http://127.0.0.1:9999/' }, 400, 'invalid_grant'],
    ['another redirect_uri', { redirect_uri: `${REDIRECT_URI}/` }, 400, 'invalid_grant'],
    ['a wrong code_verifier', { code_verifier: 'b'.repeat(43) }, 400, 'invalid_grant'],
    ['a malformed code_verifier', { code_verifier: 'short' }, 400, 'invalid_request'],
    ['a missing code_verifier', { code_verifier: undefined }, 400, 'invalid_request'],
  ]
  for (const [what, fields, status, error] of failures) {
    it(`answers ${what} with ${error}`, async () =>
      assertError(await redeem(await obtainCode(latch), fields), status, error))
  }

  it('answers a missing code with invalid_request and an unknown one with invalid_grant', async () => {
    await assertError(await post(`${latch.base}/auth`, form({ code_verifier: VERIFIER })), 400, 'invalid_request')
    await assertError(await redeem(createSecret()), 400, 'invalid_grant')
  })
})

describe('POST /token (IndieAuth §5.3.3)', () => {
  let latch: TestServer
  before(async () => (latch = await startLatch({ ME: 'https://example.com/' })))
  after(() => latch.close())

  it('exchanges a code for a bearer token, with no-store headers', async () => {
    const response = await exchange(latch, await obtainCode(latch))
    assert.equal(response.status, 200)
    assert.equal(response.headers.get('content-type'), 'application/json')
    assert.equal(response.headers.get('cache-control'), 'no-store')
    assert.equal(response.headers.get('pragma'), 'no-cache')
    const body = (await response.json()) as Record<string, unknown>
    assert.match(body.access_token as string, /^[A-Za-z0-9_-]{43}$/)
    assert.equal(body.token_type, 'Bearer')
    assert.equal(body.scope, 'profile create')
    assert.equal(body.me, 'https://example.com/')
    assert.equal(body.expires_in, 604800)
  })

  it("takes an OAuth request's exchange without redirect_uri, as OAuth 2.1 clients send it, and checks one sent", async () => {
    // OAuth 2.1 §10.2 drops it from the token request: the PKCE verifier already binds the code
    const resource = { resource: 'https://mcp.example/' }
    const response = await exchange(latch, await obtainCode(latch, resource), { redirect_uri: undefined })
    assert.equal(response.status, 200)
    const other = await exchange(latch, await obtainCode(latch, resource), { redirect_uri: `${REDIRECT_URI}x` })
    await assertError(other, 400, 'invalid_grant')
  })

  it('compares client_id canonically and redirect_uri byte for byte', async () => {
    const response = await exchange(latch, await obtainCode(latch), { client_id: 'HTTP://127.0.0.1:8080' })
    assert.equal(response.status, 200)
    const slash = await exchange(latch, await obtainCode(latch), { redirect_uri: 'http://127.0.0.1:8080/callback/' })
    await assertError(slash, 400, 'invalid_grant')
  })

  const failures: [string, Record<string, string | undefined>, string][] = [
    ['a missing grant_type', { grant_type: undefined }, 'invalid_request'],
    ['another grant_type', { grant_type: 'client_credentials' }, 'unsupported_grant_type'],
    ['a missing client_id', { client_id: undefined }, 'invalid_request'],
    ['a missing redirect_uri', { redirect_uri: undefined }, 'invalid_request'],
    ['a missing code_verifier', { code_verifier: undefined }, 'invalid_request'],
    ['a code_verifier that is too short', { code_verifier: 'a'.repeat(42) }, 'invalid_request'],
    ['a code_verifier with a character outside the set', { code_verifier: `${'a'.repeat(42)}!` }, 'invalid_request'],
    ['a wrong code_verifier', { code_verifier: 'a'.repeat(43) }, 'invalid_grant'],
    ['another client_id', { client_id: 'http://127.0.0.1:8081/' }, 'invalid_grant'],
    ['an invalid client_id', { client_id: 'not a url' }, 'invalid_grant'],
    ['another redirect_uri', { redirect_uri: 'http://127.0.0.1:8080/other' }, 'invalid_grant'],
  ]
  for (const [what, overrides, error] of failures) {
    it(`answers ${what} with ${error}`, async () =>
      assertError(await exchange(latch, await obtainCode(latch), overrides), 400, error))
  }

  it('answers a missing code with invalid_request and an unknown one with invalid_grant', async () => {
    await assertError(await exchange(latch, ''), 400, 'invalid_request')
    await assertError(await exchange(latch, createSecret()), 400, 'invalid_grant')
  })

  it('keeps the code usable after a request with a wrong verifier', async () => {
    const code = await obtainCode(latch)
    await assertError(await exchange(latch, code, { code_verifier: 'a'.repeat(43) }), 400, 'invalid_grant')
    assert.equal((await exchange(latch, code)).status, 200)
  })

  it('rejects an expired code with invalid_grant', async () => {
    const code = await obtainCode(latch)
    latch.advance(300)
    await assertError(await exchange(latch, code), 400, 'invalid_grant')
  })

  it('rejects a replayed code and revokes the token issued from it (RFC 6749 §4.1.2)', async () => {
    const code = await obtainCode(latch)
    const first = (await (await exchange(latch, code)).json()) as { access_token: string }
    assert.equal((await introspect(latch, first.access_token)).active, true)
    await assertError(await exchange(latch, code), 400, 'invalid_grant')
    assert.deepEqual(await introspect(latch, first.access_token), { active: false })
  })

  it('does not revoke anything for a replay with a wrong verifier', async () => {
    const code = await obtainCode(latch)
    const first = (await (await exchange(latch, code)).json()) as { access_token: string }
    await assertError(await exchange(latch, code, { code_verifier: 'a'.repeat(43) }), 400, 'invalid_grant')
    assert.equal((await introspect(latch, first.access_token)).active, true)
  })

  it('never gives an access token for a code without scope, and leaves it for POST /auth', async () => {
    const code = await obtainCode(latch, {}, { scope: [] })
    await assertError(await exchange(latch, code), 400, 'invalid_grant')
    assert.equal((await post(`${latch.base}/auth`, form({ code, code_verifier: VERIFIER }))).status, 200)
  })

  it('answers a repeated parameter with invalid_request', async () => {
    const code = await obtainCode(latch)
    const body = form({
      grant_type: 'authorization_code',
      code,
      client_id: CLIENT_ID,
      redirect_uri: REDIRECT_URI,
      code_verifier: [VERIFIER, VERIFIER],
    })
    await assertError(await post(`${latch.base}/token`, body), 400, 'invalid_request')
  })

  it('answers a body that is not a form with invalid_request', async () => {
    await assertError(
      await post(`${latch.base}/token`, '{"code":"x"}', { 'Content-Type': 'application/json' }),
      400,
      'invalid_request',
    )
  })

  it('reads a form labelled with another charset if it is plain ASCII, and refuses it if not', async () => {
    const labelled = (charset: string) => ({ 'Content-Type': `application/x-www-form-urlencoded; charset=${charset}` })
    const token = await obtainToken(latch)
    const introspect = (body: string, headers: Record<string, string>) =>
      post(`${latch.base}/introspect`, body, headers)
    const ascii = await introspect(String(form({ token })), labelled('ISO-8859-1'))
    assert.equal(ascii.status, 200)
    assert.equal((await ascii.json()).active, true)
    const names = ['latin1', 'windows-1252', 'cp1252', 'us-ascii', 'iso_8859-1', 'ISO_8859-1:1987', 'ANSI_X3.4-1968']
    for (const charset of [...names, 'iso8859-15', 'l1', 'IBM819', 'x-cp1252', 'latin10', 'csASCII', 'koi8-r'])
      assert.equal((await introspect(String(form({ token })), labelled(charset))).status, 200, charset)
    for (const lookalike of ['iso-8859-0', 'iso-8859-12', 'latin0', 'windows-1259', 'csisolatin7', 'iso_8859-1:9999'])
      await assertError(await introspect(String(form({ token })), labelled(lookalike)), 400, 'invalid_request')
    // é in Latin-1, é in UTF-8 (which would be read as Ã©), and é in a name
    for (const extra of ['note=caf%E9', 'note=caf%C3%A9', 'caf%E9=1']) {
      const refused = await introspect(`${form({ token })}&${extra}`, labelled('ISO-8859-1'))
      assert.equal(refused.status, 400)
      assert.match(((await refused.json()) as { error_description: string }).error_description, /not plain ASCII/)
    }
    // é as a raw byte, and a raw control byte, which no form holds
    for (const byte of [0xe9, 0x01]) {
      const raw = await fetch(`${latch.base}/introspect`, {
        method: 'POST',
        headers: labelled('ISO-8859-1'),
        body: Buffer.concat([Buffer.from(`${form({ token })}&note=caf`), Buffer.from([byte])]),
      })
      await assertError(raw, 400, 'invalid_request')
    }
    // a charset in which ASCII is not ASCII, and two charsets in either order
    await assertError(await introspect(String(form({ token })), labelled('UTF-16LE')), 400, 'invalid_request')
    for (const two of ['utf-8; charset=iso-8859-1', 'iso-8859-1; charset=utf-8'])
      await assertError(await introspect(`${form({ token })}&note=caf%C3%A9`, labelled(two)), 400, 'invalid_request')
    const spaced = { 'Content-Type': 'application/x-www-form-urlencoded; charset = iso-8859-1' }
    await assertError(await introspect(`${form({ token })}&note=caf%C3%A9`, spaced), 400, 'invalid_request')
    assert.equal((await introspect(`${form({ token })}&note=caf%C3%A9`, labelled('"utf\\-8"'))).status, 200)
    assert.equal((await introspect(`${form({ token })}&note=caf%C3%A9`, labelled('utf8'))).status, 200)
    assert.equal((await introspect(`${form({ token })}&note=caf%C3%A9`, labelled('"UTF-8"'))).status, 200)
  })

  it('answers malformed percent-escapes and invalid UTF-8 with invalid_request', async () => {
    await assertError(await post(`${latch.base}/token`, 'grant_type=%zz'), 400, 'invalid_request')
    await assertError(await post(`${latch.base}/token`, 'grant_type=%C3%28'), 400, 'invalid_request')
    const rawBytes = await fetch(`${latch.base}/token`, {
      method: 'POST',
      headers: { 'Content-Type': 'application/x-www-form-urlencoded' },
      body: Buffer.from([0x63, 0x6f, 0x64, 0x65, 0x3d, 0xff, 0xfe]),
    })
    await assertError(rawBytes, 400, 'invalid_request')
  })

  it('answers a body over 64 KiB with 413, however it is sent', async () => {
    await assertError(await post(`${latch.base}/token`, `code=${'a'.repeat(1024 * 1024)}`), 413, 'invalid_request')
    const body = (length: number) => 'grant_type=authorization_code&code=x&code='.padEnd(length, 'a')
    await assertError(await post(`${latch.base}/token`, body(64 * 1024 + 1)), 413, 'invalid_request')
    await assertError(await post(`${latch.base}/token`, body(64 * 1024)), 400, 'invalid_request') // read, then refused
    const chunked = new ReadableStream({
      start(controller) {
        for (let i = 0; i < 32; i++) controller.enqueue(new Uint8Array(32 * 1024).fill(0x61))
        controller.close()
      },
    })
    const response = await fetch(`${latch.base}/token`, {
      method: 'POST',
      headers: { 'Content-Type': 'application/x-www-form-urlencoded' },
      body: chunked,
      duplex: 'half',
    } as RequestInit)
    await assertError(response, 413, 'invalid_request')
  })

  it('refuses a body in more than 256 pieces, each of which costs node:http a call, and closes the connection', async () => {
    const port = Number(new URL(latch.base).port)
    const inPieces = async (pieces: number) => {
      const form = 'grant_type=unknown&x='.padEnd(pieces, 'a')
      const socket = connect(port, '127.0.0.1')
      socket.end(
        `POST /token HTTP/1.1\r\nHost: 127.0.0.1:${port}\r\nTransfer-Encoding: chunked\r\n` +
          `Content-Type: application/x-www-form-urlencoded\r\n\r\n${[...form].map((one) => `1\r\n${one}\r\n`).join('')}0\r\n\r\n`,
      )
      let text = ''
      for await (const chunk of socket) text += String(chunk)
      return text
    }
    assert.match(await inPieces(256), /^HTTP\/1\.1 400[^]*"unsupported_grant_type"/)
    const refused = await inPieces(257)
    assert.match(refused, /^HTTP\/1\.1 400[^]*\r\nConnection: close\r\n[^]*more than 256 pieces/)
  })

  it('refuses a body in a coding it does not undo: 400 for a transfer coding, 415 for a content coding', async () => {
    const port = Number(new URL(latch.base).port)
    const answer = async (headers: string, body: string) => {
      const socket = connect(port, '127.0.0.1')
      socket.end(
        `POST /token HTTP/1.1\r\nHost: 127.0.0.1:${port}\r\nConnection: close\r\n` +
          `Content-Type: application/x-www-form-urlencoded\r\n${headers}\r\n\r\n${body}`,
      )
      let text = ''
      for await (const chunk of socket) text += String(chunk)
      return text
    }
    const form = 'grant_type=unknown'
    const chunks = `${form.length.toString(16)}\r\n${form}\r\n0\r\n\r\n`
    assert.match(await answer('Transfer-Encoding: chunked', chunks), /^HTTP\/1\.1 400[^]*"unsupported_grant_type"/)
    assert.match(await answer('Transfer-Encoding: gzip, chunked', chunks), /^HTTP\/1\.1 400[^]*Transfer-Encoding/)
    const compressed = await answer(`Content-Encoding: gzip\r\nContent-Length: ${form.length}`, form)
    assert.match(compressed, /^HTTP\/1\.1 415[^]*\r\nAccept-Encoding: identity\r\n[^]*"invalid_request"/)
  })
})

describe('POST /introspect (IndieAuth §6, RFC 7662)', () => {
  let latch: TestServer
  before(async () => (latch = await startLatch({ ME: 'https://example.com/' })))
  after(() => latch.close())

  it('describes a live token with integer times and a boolean active', async () => {
    const token = await obtainToken(latch)
    const response = await post(`${latch.base}/introspect`, form({ token, token_type_hint: 'access_token' }))
    assert.equal(response.headers.get('cache-control'), 'no-store')
    assert.deepEqual(await response.json(), {
      active: true,
      me: 'https://example.com/',
      scope: 'profile create',
      client_id: CLIENT_ID,
      exp: START / 1000 + 604800,
      iat: START / 1000,
    })
  })

  it('answers exactly {"active": false} for unknown, malformed and expired tokens', async () => {
    assert.deepEqual(await introspect(latch, createSecret()), { active: false })
    assert.deepEqual(await introspect(latch, 'not-a-token'), { active: false })
    const token = await obtainToken(latch)
    latch.advance(604800)
    assert.deepEqual(await introspect(latch, token), { active: false })
  })

  it('answers a missing token with invalid_request', async () => {
    await assertError(await post(`${latch.base}/introspect`, form({})), 400, 'invalid_request')
  })
})

describe('POST /introspect with INTROSPECTION_SECRET (IndieAuth §6.1)', () => {
  const secret = 'a-long-introspection-secret'
  let latch: TestServer
  before(async () => (latch = await startLatch({ INTROSPECTION_SECRET: secret })))
  after(() => latch.close())

  it('answers callers that send the secret as a Bearer credential', async () => {
    const token = await obtainToken(latch)
    assert.equal((await introspect(latch, token, { Authorization: `Bearer ${secret}` })).active, true)
  })

  it('answers 401 invalid_token with WWW-Authenticate before any other check, as the wire contract says', async () => {
    const attempts: [Record<string, string>, string][] = [
      [{}, ''], // no credentials: the challenge names no error (RFC 6750 §3.1); the body does, as the contract asks
      [{ Authorization: 'Bearer wrong-secret-of-some-length' }, ', error="invalid_token"'],
      [{ Authorization: `Basic ${secret}` }, ''],
      [{ Authorization: `Bearer ${secret} ${secret}` }, ''], // not one Bearer credential: the secret was not sent
      [{ Authorization: 'Bearer' }, ''],
    ]
    for (const [headers, error] of attempts) {
      const response = await post(`${latch.base}/introspect`, 'not a form', {
        'Content-Type': 'text/plain',
        ...headers,
      })
      await assertError(response, 401, 'invalid_token')
      assert.equal(response.headers.get('www-authenticate'), `Bearer realm="${latch.issuer}"${error}`)
    }
  })

  it('answers a malformed Bearer header at /userinfo with 400 invalid_request', async () => {
    const response = await fetch(`${latch.base}/userinfo`, { headers: { Authorization: `Bearer ${secret} ${secret}` } })
    await assertError(response, 400, 'invalid_request')
    assert.equal(response.headers.get('www-authenticate'), `Bearer realm="${latch.issuer}", error="invalid_request"`)
  })
})

describe('POST /revoke (IndieAuth §7, RFC 7009)', () => {
  let latch: TestServer
  before(async () => (latch = await startLatch()))
  after(() => latch.close())

  it('revokes a token before answering 200 with an empty body', async () => {
    const token = await obtainToken(latch)
    const response = await post(`${latch.base}/revoke`, form({ token }))
    assert.equal(response.status, 200)
    assert.equal(response.headers.get('content-length'), '0')
    assert.equal(await response.text(), '')
    assert.deepEqual(await introspect(latch, token), { active: false })
  })

  it('answers 200 for a token it does not know', async () => {
    assert.equal((await post(`${latch.base}/revoke`, form({ token: createSecret() }))).status, 200)
  })

  it('revokes a refresh token in one write, of its grant, so that a failed write revokes nothing', async () => {
    const store = new MemoryStore()
    const writes: string[] = []
    const revokeGrant = store.revokeGrant.bind(store)
    const deleteToken = store.deleteToken.bind(store)
    store.revokeGrant = async (id, now) => (writes.push('revokeGrant'), revokeGrant(id, now))
    store.deleteToken = async (hash) => (writes.push('deleteToken'), deleteToken(hash))
    const own = await startLatch({}, { store })
    const tokens = (await (await exchange(own, await obtainCode(own))).json()) as {
      access_token: string
      refresh_token: string
    }
    assert.equal((await post(`${own.base}/revoke`, form({ token: tokens.refresh_token }))).status, 200)
    assert.deepEqual(writes, ['revokeGrant']) // one journal line: on a full disk, all of it or nothing
    assert.deepEqual(await introspect(own, tokens.access_token), { active: false })
    const refreshed = await post(
      `${own.base}/token`,
      form({ grant_type: 'refresh_token', refresh_token: tokens.refresh_token, client_id: CLIENT_ID }),
    )
    await assertError(refreshed, 400, 'invalid_grant')
    await own.close()
  })

  it('answers a missing token with invalid_request', async () => {
    await assertError(
      await post(`${latch.base}/revoke`, form({ token_type_hint: 'access_token' })),
      400,
      'invalid_request',
    )
  })
})

describe('A revocation that comes between the checks of a redemption and the redemption', () => {
  it('refuses the code or refresh token as revoked, with no alarm of a replay', async () => {
    const store = new MemoryStore()
    const latch = await startLatch({}, { store })
    const redeem = store.redeemForTokens.bind(store)
    // the owner's "revoke all" lands while the request is on its way to the store
    const revokingAll = async (issue: TokenIssue, now: number) => (
      await store.revokeApprovedBy(now, now),
      redeem(issue, now)
    )
    try {
      const code = await obtainCode(latch)
      store.redeemForTokens = revokingAll
      const exchanged = await exchange(latch, code)
      store.redeemForTokens = redeem
      const { refresh_token } = (await (await exchange(latch, await obtainCode(latch))).json()) as Record<
        string,
        string
      >
      store.redeemForTokens = revokingAll
      const refreshed = await post(
        `${latch.base}/token`,
        form({ grant_type: 'refresh_token', refresh_token, client_id: CLIENT_ID }),
      )
      for (const response of [exchanged, refreshed]) {
        assert.equal(response.status, 400)
        const { error, error_description } = (await response.json()) as Record<string, string>
        assert.equal(error, 'invalid_grant')
        assert.match(error_description, /revoked/)
        assert.doesNotMatch(error_description, /already used/)
      }
      await until(() => latch.logs.filter((line) => line.includes('POST /token 400')).length === 2)
      assert.deepEqual(
        latch.logs.filter((line) => line.includes('security:')),
        [],
      )
    } finally {
      await latch.close()
    }
  })
})

describe('POST /token with grant_type=refresh_token (IndieAuth §5.5, RFC 6749 §6)', () => {
  let latch: TestServer
  before(async () => (latch = await startLatch({ ME: 'https://example.com/' })))
  after(() => latch.close())

  type Tokens = { access_token: string; refresh_token: string; scope: string; me: string; expires_in: number }
  const firstTokens = async (): Promise<Tokens> =>
    (await (await exchange(latch, await obtainCode(latch))).json()) as Tokens
  const refresh = (refreshToken: string, fields: Record<string, string | undefined> = {}) =>
    post(
      `${latch.base}/token`,
      form({ grant_type: 'refresh_token', refresh_token: refreshToken, client_id: CLIENT_ID, ...fields }),
    )

  it('rotates: a full token response with a new access token and a new refresh token', async () => {
    const first = await firstTokens()
    assert.match(first.refresh_token, /^[A-Za-z0-9_-]{43}$/)
    const response = await refresh(first.refresh_token)
    assert.equal(response.status, 200)
    assert.equal(response.headers.get('cache-control'), 'no-store')
    const second = (await response.json()) as Tokens & { profile: unknown }
    assert.notEqual(second.access_token, first.access_token)
    assert.notEqual(second.refresh_token, first.refresh_token)
    assert.equal(second.scope, 'profile create')
    assert.equal(second.me, 'https://example.com/')
    assert.equal(second.expires_in, 604800)
    assert.deepEqual(second.profile, { url: 'https://example.com/' })
    assert.equal((await introspect(latch, second.access_token)).active, true)
    assert.equal((await introspect(latch, first.access_token)).active, true) // access tokens live out their time
  })

  it("retries a refresh with its grant's scope and resources, which a snapshot keeps though the used token's may not", async () => {
    const store = new MemoryStore()
    const latch = await startLatch({ ME: 'https://example.com/' }, { store })
    try {
      const first = (await (await exchange(latch, await obtainCode(latch))).json()) as Tokens
      const body = form({ grant_type: 'refresh_token', refresh_token: first.refresh_token, client_id: CLIENT_ID })
      assert.equal((await post(`${latch.base}/token`, body)).status, 200)
      // as a snapshot taken with a clock ahead wrote it: the used token without its lists
      const hash = hashSecret(first.refresh_token)
      const used = (await store.findToken(hash, START)) as Token
      await store.saveToken(hash, { ...used, scope: [], resource: [] }, START)
      const retried = await post(`${latch.base}/token`, body) // within REFRESH_TOKEN_GRACE
      assert.equal(retried.status, 200)
      assert.equal(((await retried.json()) as Tokens).scope, 'profile create')
    } finally {
      await latch.close()
    }
  })

  it('gives an app approved until revoked tokens of ACCESS_TOKEN_TTL as set now, after a restart with a shorter one', async () => {
    const store = new MemoryStore()
    const before = await startLatch({ ME: 'https://example.com/' }, { store })
    const first = (await (await exchange(before, await obtainCode(before))).json()) as Tokens
    assert.equal(first.expires_in, 604800)
    await before.close()
    const after = await startLatch({ ME: 'https://example.com/', ACCESS_TOKEN_TTL: '1h' }, { store })
    let second = first
    try {
      const body = form({ grant_type: 'refresh_token', refresh_token: first.refresh_token, client_id: CLIENT_ID })
      const refreshed = await post(`${after.base}/token`, body)
      assert.equal(refreshed.status, 200)
      second = (await refreshed.json()) as Tokens
      assert.equal(second.expires_in, 3600)
    } finally {
      await after.close()
    }
    // a longer one is not given to a grant approved for less (an older version kept the owner's choice so)
    const longer = await startLatch({ ME: 'https://example.com/', ACCESS_TOKEN_TTL: '30d' }, { store })
    try {
      const body = form({ grant_type: 'refresh_token', refresh_token: second.refresh_token, client_id: CLIENT_ID })
      const refreshed = await post(`${longer.base}/token`, body)
      assert.equal(((await refreshed.json()) as Tokens).expires_in, 604800)
    } finally {
      await longer.close()
    }
  })

  it('refreshes a grant at most 1,000 times a day, then answers 429 slow_down until the day is over', async () => {
    let tokens = await firstTokens()
    for (let i = 0; i < 1000; i++) {
      const response = await refresh(tokens.refresh_token)
      assert.equal(response.status, 200)
      tokens = (await response.json()) as Tokens
    }
    const refused = await refresh(tokens.refresh_token)
    await assertError(refused, 429, 'slow_down')
    assert.equal(refused.headers.get('retry-after'), '86400')
    assert.equal(refused.headers.get('access-control-expose-headers'), 'Retry-After') // a browser app may read it
    await assertError(await refresh(tokens.refresh_token), 429, 'slow_down')
    const said = latch.logs.filter((line) => / security: .* refreshed a grant 1000 times in a day/.test(line))
    assert.equal(said.length, 1) // once, not at every refusal
    assert.equal((await refresh((await firstTokens()).refresh_token)).status, 200) // another grant is not held back
    latch.advance(86_400)
    assert.equal((await refresh(tokens.refresh_token)).status, 200) // not used by the refusal
  })

  it('does not count toward the 1,000 a day a refresh that could not be stored', async () => {
    const store = new MemoryStore()
    const own = await startLatch({ ME: 'https://example.com/' }, { store })
    try {
      const tokens = (await (await exchange(own, await obtainCode(own))).json()) as Tokens
      const roomAgain = fillDisk(store, 'redeemForTokens')
      const fields = { grant_type: 'refresh_token', refresh_token: tokens.refresh_token, client_id: CLIENT_ID }
      const again = () => post(`${own.base}/token`, form(fields))
      for (let i = 0; i < 1000; i++) assert.equal((await again()).status, 500)
      roomAgain()
      assert.equal((await again()).status, 200)
    } finally {
      await own.close()
    }
  })

  it('revokes the whole family when a rotated refresh token comes back (RFC 9700 §4.14.2)', async () => {
    const first = await firstTokens()
    const second = (await (await refresh(first.refresh_token)).json()) as Tokens
    latch.advance(31) // past REFRESH_TOKEN_GRACE
    await assertError(await refresh(first.refresh_token), 400, 'invalid_grant')
    assert.deepEqual(await introspect(latch, first.access_token), { active: false })
    assert.deepEqual(await introspect(latch, second.access_token), { active: false })
    await assertError(await refresh(second.refresh_token), 400, 'invalid_grant')
  })

  it('narrows the access token to a requested scope, keeping the grant for the next refresh', async () => {
    const first = await firstTokens()
    const narrowed = (await (await refresh(first.refresh_token, { scope: 'create' })).json()) as Tokens
    assert.equal(narrowed.scope, 'create')
    assert.equal((await introspect(latch, narrowed.access_token)).scope, 'create')
    const full = (await (await refresh(narrowed.refresh_token)).json()) as Tokens
    assert.equal(full.scope, 'profile create')
  })

  it('never widens the scope: invalid_scope, and the refresh token still works', async () => {
    const first = await firstTokens()
    await assertError(await refresh(first.refresh_token, { scope: 'create delete' }), 400, 'invalid_scope')
    await assertError(await refresh(first.refresh_token, { scope: ' ' }), 400, 'invalid_scope') // no scope is not a narrowing
    assert.equal((await refresh(first.refresh_token)).status, 200)
  })

  it('refuses another client_id without using up the refresh token', async () => {
    const first = await firstTokens()
    await assertError(await refresh(first.refresh_token, { client_id: 'http://127.0.0.1:9999/' }), 400, 'invalid_grant')
    await assertError(await refresh(first.refresh_token, { client_id: undefined }), 400, 'invalid_request')
    assert.equal((await refresh(first.refresh_token)).status, 200)
  })

  it('answers a missing refresh_token with invalid_request and an unknown one with invalid_grant', async () => {
    await assertError(await refresh(''), 400, 'invalid_request')
    await assertError(await refresh(createSecret()), 400, 'invalid_grant')
  })

  it('does not take an access token as a refresh token, nor a refresh token as an access token', async () => {
    const first = await firstTokens()
    await assertError(await refresh(first.access_token), 400, 'invalid_grant')
    assert.deepEqual(await introspect(latch, first.refresh_token), { active: false })
  })

  it('expires a refresh token after REFRESH_TOKEN_TTL without use, counted from its last rotation', async () => {
    const first = await firstTokens()
    latch.advance(29 * 86400)
    const second = (await (await refresh(first.refresh_token)).json()) as Tokens
    latch.advance(29 * 86400)
    const third = await refresh(second.refresh_token)
    assert.equal(third.status, 200)
    latch.advance(30 * 86400)
    await assertError(await refresh(((await third.json()) as Tokens).refresh_token), 400, 'invalid_grant')
  })

  it('takes a refresh token issued mid-second to the end of its REFRESH_TOKEN_TTL, and not past it', async () => {
    latch.advance(0.9)
    const [taken, late] = [await firstTokens(), await firstTokens()] // issued at .900 of a second
    latch.advance(30 * 86400 - 0.5)
    assert.equal((await refresh(taken.refresh_token)).status, 200)
    latch.advance(0.6) // 100 ms past its 30 days
    await assertError(await refresh(late.refresh_token), 400, 'invalid_grant')
  })

  it('ends refresh tokens issued before a shorter REFRESH_TOKEN_TTL once unused that long, as /apps then says', async () => {
    const store = new MemoryStore()
    const before = await startLatch({}, { store })
    const tokens = async () => (await (await exchange(before, await obtainCode(before))).json()) as Tokens
    const [unused, used] = [await tokens(), await tokens()]
    await before.close()
    const after = await startLatch({ REFRESH_TOKEN_TTL: '1d' }, { store }) // its clock starts where the first's did
    const refreshAt = (token: string) =>
      post(`${after.base}/token`, form({ grant_type: 'refresh_token', refresh_token: token, client_id: CLIENT_ID }))
    try {
      after.advance(86400 - 60)
      const renewed = (await (await refreshAt(used.refresh_token)).json()) as Tokens
      after.advance(120) // a day and a minute since the first was issued, a minute since the second's use
      await assertError(await refreshAt(unused.refresh_token), 400, 'invalid_grant') // 30 days when it was issued
      assert.equal((await refreshAt(renewed.refresh_token)).status, 200)
    } finally {
      await after.close()
    }
  })

  it('revokes the access tokens of the family when a refresh token is revoked (RFC 7009 §2.1)', async () => {
    const first = await firstTokens()
    assert.equal((await post(`${latch.base}/revoke`, form({ token: first.refresh_token }))).status, 200)
    assert.deepEqual(await introspect(latch, first.access_token), { active: false })
    await assertError(await refresh(first.refresh_token), 400, 'invalid_grant')
  })

  it('revokes only the access token when an access token is revoked', async () => {
    const first = await firstTokens()
    await post(`${latch.base}/revoke`, form({ token: first.access_token }))
    assert.deepEqual(await introspect(latch, first.access_token), { active: false })
    assert.equal((await refresh(first.refresh_token)).status, 200)
  })

  it('revokes the family when a rotated refresh token comes back, whatever else the request says', async () => {
    const first = await firstTokens()
    const second = (await (await refresh(first.refresh_token)).json()) as Tokens
    latch.advance(31) // past REFRESH_TOKEN_GRACE
    await assertError(await refresh(first.refresh_token, { scope: 'create follow' }), 400, 'invalid_grant')
    assert.deepEqual(await introspect(latch, second.access_token), { active: false })
    const third = await firstTokens()
    await refresh(third.refresh_token)
    latch.advance(31)
    await assertError(await refresh(third.refresh_token, { client_id: 'http://127.0.0.1:9999/' }), 400, 'invalid_grant')
    await assertError(await refresh(third.refresh_token), 400, 'invalid_grant')
  })

  it('answers two refreshes of one refresh token sent at once with tokens that both stay live, every time', async () => {
    for (let round = 0; round < 25; round++) {
      const first = await firstTokens()
      const answers = await Promise.all([refresh(first.refresh_token), refresh(first.refresh_token)])
      assert.deepEqual(
        answers.map((answer) => answer.status),
        [200, 200],
      )
      for (const answer of answers) {
        const tokens = (await answer.json()) as Tokens
        assert.equal((await introspect(latch, tokens.access_token)).active, true, `round ${round}`)
        assert.equal((await refresh(tokens.refresh_token)).status, 200, `round ${round}`)
      }
    }
  })

  it('serves a retry of a rotated refresh token within REFRESH_TOKEN_GRACE, revokes after it, and never with 0', async () => {
    const first = await firstTokens()
    const second = (await (await refresh(first.refresh_token)).json()) as Tokens
    latch.advance(29)
    const retried = await refresh(first.refresh_token) // the answer to the first refresh was lost on the way
    assert.equal(retried.status, 200)
    const third = (await retried.json()) as Tokens
    assert.equal((await introspect(latch, second.access_token)).active, true)
    assert.equal((await introspect(latch, third.access_token)).active, true)
    latch.advance(2) // 31 seconds after the rotation
    await assertError(await refresh(first.refresh_token), 400, 'invalid_grant')
    assert.deepEqual(await introspect(latch, third.access_token), { active: false })

    // REFRESH_TOKEN_GRACE=0: any reuse is theft, at once
    const strict = await startLatch({ REFRESH_TOKEN_GRACE: '0' })
    const original = (await (await exchange(strict, await obtainCode(strict))).json()) as Tokens
    const rotate = (token: string) =>
      post(`${strict.base}/token`, form({ grant_type: 'refresh_token', refresh_token: token, client_id: CLIENT_ID }))
    const rotated = (await (await rotate(original.refresh_token)).json()) as Tokens
    await assertError(await rotate(original.refresh_token), 400, 'invalid_grant')
    assert.deepEqual(await introspect(strict, rotated.access_token), { active: false })
    await strict.close()
  })

  it('keeps the grace for a clock set back by seconds; set back by more than the grace, no grace an hour long', async () => {
    const nudged = await firstTokens()
    await refresh(nudged.refresh_token)
    latch.advance(-5) // the clock corrected by a few seconds
    assert.equal((await refresh(nudged.refresh_token)).status, 200) // still a retry
    latch.advance(5)

    const first = await firstTokens()
    const second = (await (await refresh(first.refresh_token)).json()) as Tokens
    latch.advance(-3600) // the clock is set back an hour
    latch.advance(60)
    await assertError(await refresh(first.refresh_token), 400, 'invalid_grant')
    assert.deepEqual(await introspect(latch, second.access_token), { active: false })
    latch.advance(3540)
  })

  it('serves a retry only of the refresh token rotated last: an older one revokes the grant, even within the grace', async () => {
    const first = await firstTokens()
    const second = (await (await refresh(first.refresh_token)).json()) as Tokens
    const third = (await (await refresh(second.refresh_token)).json()) as Tokens
    latch.advance(5)
    // the client used what the first refresh answered, so its answer was not lost: this is not its retry
    await assertError(await refresh(first.refresh_token), 400, 'invalid_grant')
    assert.deepEqual(await introspect(latch, third.access_token), { active: false })
    await assertError(await refresh(third.refresh_token), 400, 'invalid_grant')
    assert.match(latch.logs.join('\n'), /security: a refresh token of .* was used again/)
  })

  it('serves a retry of either refresh token two refreshes at once gave, once both went on, until one was built on', async () => {
    const first = await firstTokens()
    const answers = await Promise.all([refresh(first.refresh_token), refresh(first.refresh_token)])
    const [a, b] = (await Promise.all(answers.map((answer) => answer.json()))) as Tokens[]
    // two tabs, each going on with its own; tab B's answer is lost on the way, and B sends it again
    assert.equal((await refresh(b.refresh_token)).status, 200)
    const fromA = (await (await refresh(a.refresh_token)).json()) as Tokens
    const retried = await refresh(b.refresh_token)
    assert.equal(retried.status, 200)
    assert.equal((await introspect(latch, fromA.access_token)).active, true)
    // the first token, which both went on from, is a reuse: the grant and every token of it go
    await assertError(await refresh(first.refresh_token), 400, 'invalid_grant')
    assert.deepEqual(await introspect(latch, fromA.access_token), { active: false })
  })

  /** A Latch on a journal in a folder of its own, which `restart` stops and starts again on the same file. */
  async function restartable() {
    const dir = await mkdtemp(join(tmpdir(), 'latch-rotated-'))
    const open = () => FileStore.open(join(dir, 'data.jsonl'), { log: () => {} })
    let store = await open()
    let server = await startLatch({}, { store })
    return {
      rotate: (token: string) =>
        post(`${server.base}/token`, form({ grant_type: 'refresh_token', refresh_token: token, client_id: CLIENT_ID })),
      firstTokens: async () => (await (await exchange(server, await obtainCode(server))).json()) as Tokens,
      restart: async () => {
        await server.close()
        await store.close()
        store = await open()
        server = await startLatch({}, { store })
      },
      close: async () => {
        await server.close()
        await store.close()
        await rm(dir, { recursive: true })
      },
    }
  }

  it('revokes a stolen token replayed after a restart once the client has gone on, as before the restart', async () => {
    const latch = await restartable()
    try {
      const stolen = await latch.firstTokens()
      const client = (await (await latch.rotate(stolen.refresh_token)).json()) as Tokens
      await latch.restart() // what each rotation issued is kept in memory only
      assert.equal((await latch.rotate(stolen.refresh_token)).status, 200) // the token rotated last: a retry
      assert.equal((await latch.rotate(client.refresh_token)).status, 200) // the client goes on
      await assertError(await latch.rotate(stolen.refresh_token), 400, 'invalid_grant')
    } finally {
      await latch.close()
    }
  })

  it('keeps the token rotated last in the journal as in memory when another is retried', async () => {
    const latch = await restartable()
    try {
      const first = await latch.firstTokens()
      const answers = await Promise.all([latch.rotate(first.refresh_token), latch.rotate(first.refresh_token)])
      const [a, b] = (await Promise.all(answers.map((answer) => answer.json()))) as Tokens[]
      assert.equal((await latch.rotate(a.refresh_token)).status, 200)
      assert.equal((await latch.rotate(b.refresh_token)).status, 200) // rotated last
      assert.equal((await latch.rotate(a.refresh_token)).status, 200) // a retry of tab A's, which moves nothing
      await latch.restart()
      assert.equal((await latch.rotate(b.refresh_token)).status, 200) // still the token rotated last
    } finally {
      await latch.close()
    }
  })

  it('keeps, across a restart, which refresh token was rotated last', async () => {
    const dir = await mkdtemp(join(tmpdir(), 'latch-rotated-'))
    const open = () => FileStore.open(join(dir, 'data.jsonl'), { log: () => {} })
    let store = await open()
    let server = await startLatch({}, { store })
    const rotate = async (token: string) =>
      post(`${server.base}/token`, form({ grant_type: 'refresh_token', refresh_token: token, client_id: CLIENT_ID }))
    const first = (await (await exchange(server, await obtainCode(server))).json()) as Tokens
    const second = (await (await rotate(first.refresh_token)).json()) as Tokens
    await rotate(second.refresh_token)
    await server.close()
    await store.close()
    store = await open()
    server = await startLatch({}, { store })
    assert.equal((await rotate(second.refresh_token)).status, 200) // rotated last: a retry
    await assertError(await rotate(first.refresh_token), 400, 'invalid_grant')
    await server.close()
    await store.close()
    await rm(dir, { recursive: true })
  })

  it('revokes refreshed tokens too when their code is replayed', async () => {
    const code = await obtainCode(latch)
    const first = (await (await exchange(latch, code)).json()) as Tokens
    const second = (await (await refresh(first.refresh_token)).json()) as Tokens
    await assertError(await exchange(latch, code), 400, 'invalid_grant')
    assert.deepEqual(await introspect(latch, second.access_token), { active: false })
    await assertError(await refresh(second.refresh_token), 400, 'invalid_grant')
  })
})

describe('Profile information (IndieAuth §5.3.4) and GET /userinfo', () => {
  const profileEnv = {
    ME: 'https://example.com/',
    PROFILE_NAME: 'Ada Lovelace',
    PROFILE_PHOTO: 'https://example.com/ada.jpg',
    PROFILE_EMAIL: 'ada@example.com',
  }
  let latch: TestServer
  before(async () => (latch = await startLatch(profileEnv)))
  after(() => latch.close())

  const tokenFor = async (scope: string[]) => {
    const response = await exchange(latch, await obtainCode(latch, { scope: 'profile email create' }, { scope }))
    return (await response.json()) as { access_token: string; profile?: unknown }
  }
  const userinfo = (headers: Record<string, string> = {}) => fetch(`${latch.base}/userinfo`, { headers })

  it('adds name, url and photo with profile, and email only with email too', async () => {
    assert.deepEqual((await tokenFor(['profile'])).profile, {
      name: 'Ada Lovelace',
      url: 'https://example.com/',
      photo: 'https://example.com/ada.jpg',
    })
    assert.deepEqual((await tokenFor(['profile', 'email'])).profile, {
      name: 'Ada Lovelace',
      url: 'https://example.com/',
      photo: 'https://example.com/ada.jpg',
      email: 'ada@example.com',
    })
    assert.equal((await tokenFor(['create', 'email'])).profile, undefined)
  })

  it('answers the profile to a token with the profile scope', async () => {
    const { access_token } = await tokenFor(['profile'])
    const response = await userinfo({ Authorization: `Bearer ${access_token}` })
    assert.equal(response.status, 200)
    assert.deepEqual(await response.json(), {
      sub: 'https://example.com/',
      name: 'Ada Lovelace',
      url: 'https://example.com/',
      photo: 'https://example.com/ada.jpg',
    })
  })

  it('answers 401 with a Bearer challenge and no error code when no token is sent', async () => {
    for (const response of [await userinfo(), await fetch(`${latch.base}/token`)]) {
      await assertError(response, 401, undefined)
      assert.equal(response.headers.get('www-authenticate'), `Bearer realm="${latch.issuer}"`)
    }
  })

  it('answers 401 invalid_token for a bad, expired or revoked token', async () => {
    const { access_token } = await tokenFor(['profile'])
    const bad = await userinfo({ Authorization: `Bearer ${createSecret()}` })
    await assertError(bad, 401, 'invalid_token')
    assert.equal(bad.headers.get('www-authenticate'), `Bearer realm="${latch.issuer}", error="invalid_token"`)
    await post(`${latch.base}/revoke`, form({ token: access_token }))
    await assertError(await userinfo({ Authorization: `Bearer ${access_token}` }), 401, 'invalid_token')
  })

  it('answers 403 insufficient_scope to a token without profile (RFC 6750 §3.1)', async () => {
    const { access_token } = await tokenFor(['create'])
    const response = await userinfo({ Authorization: `Bearer ${access_token}` })
    await assertError(response, 403, 'insufficient_scope')
    assert.match(response.headers.get('www-authenticate') ?? '', /error="insufficient_scope"/)
  })

  it('refuses a token sent two ways at once, the same one or two (RFC 6750 §2, §3.1)', async () => {
    const { access_token } = await tokenFor(['profile'])
    for (const inBody of [access_token, createSecret()]) {
      const twice = await post(`${latch.base}/userinfo`, form({ access_token: inBody }), {
        Authorization: `Bearer ${access_token}`,
      })
      await assertError(twice, 400, 'invalid_request')
      assert.equal(twice.headers.get('www-authenticate'), `Bearer realm="${latch.issuer}", error="invalid_request"`)
    }
    assert.equal((await userinfo({ Authorization: `Bearer ${access_token}` })).status, 200)
    // an empty field is as if unsent
    const header = { Authorization: `Bearer ${access_token}` }
    assert.equal((await post(`${latch.base}/userinfo`, 'access_token=', header)).status, 200)
    assert.equal((await post(`${latch.base}/userinfo`, `access_token=&access_token=${access_token}`)).status, 200)
    const repeated = await post(`${latch.base}/userinfo`, `access_token=${access_token}&access_token=${access_token}`)
    await assertError(repeated, 400, 'invalid_request')
    assert.equal(repeated.headers.get('www-authenticate'), `Bearer realm="${latch.issuer}", error="invalid_request"`)
  })

  it('answers a malformed Bearer header with 400 invalid_request and a challenge (RFC 6750 §3.1)', async () => {
    for (const authorization of ['Bearer a b', 'Bearer']) {
      const response = await userinfo({ Authorization: authorization })
      await assertError(response, 400, 'invalid_request')
      assert.equal(response.headers.get('www-authenticate'), `Bearer realm="${latch.issuer}", error="invalid_request"`)
    }
  })

  it('reads only a form body for a token: another body is left unread, and a bad form is challenged', async () => {
    const { access_token } = await tokenFor(['profile'])
    const json = await fetch(`${latch.base}/userinfo`, {
      method: 'POST',
      headers: { Authorization: `Bearer ${access_token}`, 'Content-Type': 'application/json' },
      body: '{}',
    })
    assert.equal(json.status, 200)
    const latin1 = await post(`${latch.base}/userinfo`, `${form({ access_token })}&note=caf%E9`, {
      'Content-Type': 'application/x-www-form-urlencoded; charset=iso-8859-1',
    })
    await assertError(latin1, 400, 'invalid_request')
    assert.equal(latin1.headers.get('www-authenticate'), `Bearer realm="${latch.issuer}", error="invalid_request"`)
  })
})

describe('Legacy IndieAuth', () => {
  let latch: TestServer
  before(async () => (latch = await startLatch({ ME: 'https://example.com/' })))
  after(() => latch.close())

  it('verifies a token with GET /token and Authorization: Bearer, as Micropub servers do', async () => {
    const token = await obtainToken(latch)
    const response = await fetch(`${latch.base}/token`, { headers: { Authorization: `Bearer ${token}` } })
    assert.equal(response.status, 200)
    assert.deepEqual(await response.json(), {
      me: 'https://example.com/',
      client_id: CLIENT_ID,
      scope: 'profile create',
    })
    const bad = await fetch(`${latch.base}/token`, { headers: { Authorization: `Bearer ${createSecret()}` } })
    await assertError(bad, 401, 'invalid_token')
    assert.match(bad.headers.get('www-authenticate') ?? '', /^Bearer realm=/)
  })

  it('answers GET /token as a form to a script that asks for a form alone, as tokens.indieauth.com did', async () => {
    const token = await obtainToken(latch)
    const verify = (accept: string, headers: Record<string, string> = {}) =>
      fetch(`${latch.base}/token`, { headers: { Authorization: `Bearer ${token}`, Accept: accept, ...headers } })
    const asForm = await verify('application/x-www-form-urlencoded')
    assert.equal(asForm.headers.get('content-type'), 'application/x-www-form-urlencoded')
    assert.equal(asForm.headers.get('cache-control'), 'no-store')
    assert.deepEqual(Object.fromEntries(new URLSearchParams(await asForm.text())), {
      me: 'https://example.com/',
      client_id: CLIENT_ID,
      scope: 'profile create',
    })
    for (const accept of ['*/*', 'application/json, application/x-www-form-urlencoded;q=0.5'])
      assert.equal((await verify(accept)).headers.get('content-type'), 'application/json')
    // the Micropub script copied from site to site: curl's */*, and the Content-Type of a form on its GET
    const copied = { 'Content-Type': 'application/x-www-form-urlencoded' }
    for (const [accept, headers] of [
      ['*/*', copied],
      ['Application/X-WWW-Form-Urlencoded', {}], // media types are not case-sensitive (RFC 9110 §8.3.1)
    ] as const)
      assert.equal((await verify(accept, headers)).headers.get('content-type'), 'application/x-www-form-urlencoded')
    assert.equal((await verify('application/json', copied)).headers.get('content-type'), 'application/json')
  })

  it('says why a request without PKCE, or with a plain challenge, is refused, as apps from before it send', async () => {
    const noPkce = await fetch(
      authorizationUrl(latch, { code_challenge: undefined, code_challenge_method: undefined }),
      {
        redirect: 'manual',
      },
    )
    const description = new URL(noPkce.headers.get('location') ?? '').searchParams.get('error_description')
    assert.match(description ?? '', /requires PKCE \(RFC 7636, S256\)/)
    // plain, its method left out: the challenge is the verifier itself
    const code = await obtainCode(latch, { code_challenge: VERIFIER, code_challenge_method: undefined })
    const plain = await exchange(latch, code)
    assert.equal(plain.status, 400)
    assert.match(((await plain.json()) as { error_description: string }).error_description, /plain is not supported/)
  })

  it('revokes with POST /token and action=revoke', async () => {
    const token = await obtainToken(latch)
    const response = await post(`${latch.base}/token`, form({ action: 'revoke', token }))
    assert.equal(response.status, 200)
    assert.deepEqual(await introspect(latch, token), { active: false })
    await assertError(await post(`${latch.base}/token`, form({ action: 'delete', token })), 400, 'invalid_request')
  })

  it('treats response_type=id as profile-only, ignoring a resource it names', async () => {
    const consent = await openConsent(latch, { response_type: 'id', resource: 'https://service.example/' })
    assert.doesNotMatch(consent.html, /name="scope"/)
    const response = await submitConsent(latch, consent)
    const code = new URL(response.headers.get('location') ?? '').searchParams.get('code') ?? ''
    await assertError(await exchange(latch, code), 400, 'invalid_grant')
    const redeemed = await post(`${latch.base}/auth`, form({ code, code_verifier: VERIFIER }))
    assert.deepEqual(await redeemed.json(), { me: 'https://example.com/' })
  })
})

describe('The log', () => {
  it("survives an app's log that throws, and a clock no date can be made of: the line is lost, not the process", async (t) => {
    const errors = t.mock.method(console, 'error', () => {})
    for (const [log, now, said] of [
      [() => assert.fail('a log that fails the test on any line'), Date.now, /^latch: a line could not be logged: /],
      [() => {}, () => NaN, /^latch: a request could not be logged: /],
    ] as const) {
      const server = createServer(createHandler({ config: loadConfig({ DATA_FILE: 'memory' }), log, now }))
      await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
      try {
        const port = (server.address() as AddressInfo).port
        const answer = await fetch(`http://127.0.0.1:${port}/.well-known/oauth-authorization-server`)
        assert.equal(answer.status, 200)
        await answer.arrayBuffer()
        await until(() => errors.mock.callCount() > 0)
        assert.match(String(errors.mock.calls.at(-1)?.arguments[0]), said)
        errors.mock.resetCalls()
      } finally {
        server.closeAllConnections()
        await new Promise((resolve) => server.close(resolve))
      }
    }
  })

  it("loses only the line when an app's log throws: a stranger is answered, and stores and limits go on", async (t) => {
    const errors = t.mock.method(console, 'error', () => {})
    const throwing = () => {
      throw new Error('EAGAIN: the log cannot be written')
    }
    const lost = () =>
      errors.mock.calls.filter((call) => /^latch: a line could not be logged/.test(String(call.arguments[0])))
    // a log that writes with fs/promises rejects instead; one may throw what cannot even be said
    const rejecting = async () => throwing()
    const unsayable = () => {
      throw Object.create(null)
    }
    // a stranger's consent form without its cookie: a security event, logged before the answer
    const server = createServer(createHandler({ config: loadConfig({ DATA_FILE: 'memory' }), log: rejecting }))
    // a connection past the limit, closed and logged from the server's own listener
    const limited = createLatchServer(undefined, { total: 1, perAddress: 100, groupOf: () => undefined }, unsayable)
    for (const listening of [server, limited])
      await new Promise<void>((resolve) => listening.listen(0, '127.0.0.1', resolve))
    try {
      const port = (server.address() as AddressInfo).port
      const latch = { base: `http://127.0.0.1:${port}`, port } as TestServer
      const consent = await openConsent(latch)
      const refused = await submitConsent(latch, consent, { csrf: 'not the one' })
      assert.equal(refused.status, 403)
      await refused.arrayBuffer()
      const limitedPort = (limited.address() as AddressInfo).port
      const held = connect(limitedPort, '127.0.0.1').on('error', () => {})
      await new Promise((resolve) => limited.once('connection', resolve))
      const past = connect(limitedPort, '127.0.0.1').on('error', () => {})
      await new Promise((resolve) => past.on('close', resolve))
      held.destroy()
      assert.ok(lost().length >= 2, String(errors.mock.calls.map((call) => call.arguments[0])))
    } finally {
      for (const listening of [server, limited]) {
        listening.closeAllConnections()
        await new Promise((resolve) => listening.close(resolve))
      }
    }
    // the stores: a code dropped for room, and a journal's torn last line, each logged
    const memory = new MemoryStore({ log: throwing, maxCodes: 1 })
    const saved = {
      ...{ client_id: CLIENT_ID, client_name: undefined, redirect_uri: REDIRECT_URI, code_challenge: CHALLENGE },
      ...{ scope: [], resource: [], me: 'https://example.com/', accessTokenTtlSeconds: 60 },
      ...{ issuedAt: 1, expiresAt: 2, usedAt: undefined },
    }
    for (const hash of ['a', 'b']) await memory.saveCode(hash, saved, 1)
    const dir = await mkdtemp(join(tmpdir(), 'latch-log-'))
    try {
      await writeFile(join(dir, 'data.jsonl'), '{"set":"co', { mode: 0o600 })
      await (await FileStore.open(join(dir, 'data.jsonl'), { log: throwing })).close()
    } finally {
      await rm(dir, { recursive: true, force: true })
    }
    assert.ok(lost().length >= 4)
  })

  it('logs the path a client asked for under an ISSUER with a path, as where an app mounts Latch', async () => {
    const server = createServer()
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
    const port = (server.address() as AddressInfo).port
    const lines: string[] = []
    const config = loadConfig({ DATA_FILE: 'memory', ISSUER: `http://127.0.0.1:${port}/latch` })
    const handler = createHandler({ config, log: (line) => lines.push(line) })
    server.on('request', (req: IncomingMessage, res: ServerResponse) => {
      req.url = (req.url ?? '/').slice('/latch'.length) || '/' // as Express's app.use('/latch', handler)
      handler(req, res)
    })
    try {
      for (const path of ['/.well-known/oauth-authorization-server', '/nothing-here'])
        await (await fetch(`http://127.0.0.1:${port}/latch${path}`)).arrayBuffer()
      const forged = await post(`http://127.0.0.1:${port}/latch/apps/revoke-all`, form({ csrf: 'x' }))
      assert.equal(forged.status, 403)
      await until(() => lines.length === 4)
      assert.match(lines[0], / GET \/latch\/\.well-known\/oauth-authorization-server 200 /)
      assert.match(lines[1], / GET \(unknown path\) 404 /)
      assert.match(lines[2], / security: a form sent to \/latch\/apps\/revoke-all was refused/)
      assert.match(lines[3], / POST \/latch\/apps\/revoke-all 403 /)
    } finally {
      server.closeAllConnections()
      await new Promise((resolve) => server.close(resolve))
    }
  })

  it('writes lines in batches: after the interval, or at once past 64 KiB', (t) => {
    t.mock.timers.enable({ apis: ['setTimeout'] })
    const writes: string[] = []
    const log = createLineWriter(
      { write: (text: string) => writes.push(text), on: () => {} } as unknown as Writable,
      100,
    )
    log('GET / 200 1ms')
    log('GET /apps 200 2ms')
    assert.deepEqual(writes, [])
    t.mock.timers.tick(100)
    assert.deepEqual(writes, ['GET / 200 1ms\nGET /apps 200 2ms\n'])
    log('x'.repeat(70_000))
    assert.equal(writes.length, 2)
  })

  it('lets go of its stream and of the process at close, having written what waited', () => {
    const written: string[] = []
    const stream = new Writable({
      write: (chunk: Buffer, _encoding, callback) => (written.push(`${chunk}`), callback()),
    })
    const exitListeners = process.listenerCount('exit')
    for (let i = 0; i < 20; i++) {
      const log = createLineWriter(stream, 100) // one for each Latch a test suite starts
      log(`line ${i}`)
      log.close()
      log('after its close')
    }
    assert.deepEqual(
      written,
      Array.from({ length: 20 }, (_, i) => `line ${i}\n`),
    )
    assert.equal(process.listenerCount('exit'), exitListeners)
    assert.equal(stream.listenerCount('drain'), 0)
    assert.equal(stream.listenerCount('error'), 0)
  })

  it('goes on without a log when the program reading it has gone (EPIPE), and drops the lines', async () => {
    let writes = 0
    const stream = new Writable({
      write(_chunk, _encoding, callback) {
        writes++
        callback(Object.assign(new Error('write EPIPE'), { code: 'EPIPE' })) // as `latch | head -1` does
      },
    })
    const log = createLineWriter(stream, 100)
    log('x'.repeat(70_000)) // past 64 KiB: written at once
    await new Promise((resolve) => setImmediate(resolve)) // the error comes on a later tick
    log('y'.repeat(70_000))
    await new Promise((resolve) => setImmediate(resolve))
    assert.equal(writes, 1)
  })

  it('keeps at most 16 million characters for a reader that is behind, then says at once how many lines it dropped', async () => {
    const written: string[] = []
    const done: (() => void)[] = []
    // a pipe whose reader stopped: each write waits until it reads again
    const stream = new Writable({
      write(chunk: Buffer, _encoding, callback) {
        written.push(chunk.toString())
        done.push(callback)
      },
    })
    const log = createLineWriter(stream, 100, (line) => `[${line}]`)
    for (let i = 0; i < 300; i++) log(`${i} ${'x'.repeat(70_000)}`) // 21 MB, each line past 64 KiB: written at once
    assert.ok(stream.writableLength < 17 * 1024 * 1024, `${stream.writableLength} bytes wait for the reader`)
    while (done.length > 0) {
      done.shift()?.() // the reader reads again
      await new Promise((resolve) => setImmediate(resolve))
    }
    const kept = written.length - 1 // one line a write, then the notice, with no other line to wait for
    assert.ok(kept > 1 && kept < 300, `${kept} lines written`)
    assert.equal(written.at(-1), `[log: ${300 - kept} lines dropped while the log's reader was behind]\n`)
  })
})

describe('The log: what a client sends', () => {
  it("writes a client_id that holds a line break as JSON, on the request's one line", async () => {
    const latch = await startLatch()
    try {
      const forged = 'https://app.example/\n2027-01-01T00:00:00.000Z 127.0.0.1 security: a line of my own'
      await (await fetch(authorizationUrl(latch, { client_id: forged }))).text()
      await new Promise((resolve) => setImmediate(resolve))
      assert.equal(latch.logs.length, 1)
      assert.ok(latch.logs[0].endsWith(`client_id=${JSON.stringify(forged)}`), latch.logs[0])
    } finally {
      await latch.close()
    }
  })

  it('logs no client_id that is not a URL: a script may send its token there, as curl -u TOKEN: does', async () => {
    const latch = await startLatch()
    try {
      const token = createSecret()
      const basic = `Basic ${Buffer.from(`${token}:`).toString('base64')}`
      await (await post(`${latch.base}/revoke`, form({ token }), { Authorization: basic })).text()
      await (
        await post(`${latch.base}/token`, form({ grant_type: 'refresh_token', refresh_token: 'x', client_id: token }))
      ).text()
      await until(() => latch.logs.length === 2)
      for (const line of latch.logs) {
        assert.ok(!line.includes(token), line)
        assert.match(line, /client_id="\(not a URL\)"$/)
      }
    } finally {
      await latch.close()
    }
  })

  it('writes what a client sends outside printable ASCII as escapes, so that no bidi control reorders a line', async () => {
    for (const LOG_FORMAT of ['text', 'json']) {
      const latch = await startLatch({ LOG_FORMAT })
      try {
        const clientId = 'https://app.example/\u202eexe.txt\u2066é😀'
        await (await fetch(authorizationUrl(latch, { client_id: clientId }))).text()
        await new Promise((resolve) => setImmediate(resolve))
        const line = latch.logs.at(-1) ?? ''
        assert.match(line, /^[\x20-\x7e]+$/)
        const logged = LOG_FORMAT === 'json' ? JSON.parse(line).client_id : JSON.parse(line.split('client_id=')[1])
        assert.equal(logged, clientId)
      } finally {
        await latch.close()
      }
    }
  })

  it('reads a client address with its port in X-Forwarded-For, as some proxies write it', async () => {
    const latch = await startLatch({ TRUST_PROXY: '127.0.0.1,::1', PASSWORD_HASH })
    try {
      for (const [hop, address] of [
        ['203.0.113.9:4711', '203.0.113.9'],
        ['[2001:db8::1]:4711', '2001:db8::1'],
      ]) {
        await (await fetch(`${latch.base}/nothing`, { headers: { 'X-Forwarded-For': hop } })).text()
        await new Promise((resolve) => setImmediate(resolve))
        assert.equal(latch.logs.at(-1)?.split(' ')[1], address)
      }
    } finally {
      await latch.close()
    }
  })

  it('believes X-Forwarded-For only from a proxy TRUST_PROXY names', async () => {
    const latch = await startLatch({ TRUST_PROXY: '10.0.0.5', PASSWORD_HASH }) // a proxy elsewhere: this request is not its
    try {
      await (await fetch(`${latch.base}/nothing`, { headers: { 'X-Forwarded-For': '203.0.113.9' } })).text()
      await new Promise((resolve) => setImmediate(resolve))
      assert.match(latch.logs.at(-1) ?? '', /^\S+ 127\.0\.0\.1 GET /)
    } finally {
      await latch.close()
    }
  })
})

describe('CORS for browser clients', () => {
  let latch: TestServer
  before(async () => (latch = await startLatch()))
  after(() => latch.close())

  const preflight = (path: string) =>
    fetch(`${latch.base}${path}`, {
      method: 'OPTIONS',
      headers: {
        Origin: 'https://app.example',
        'Access-Control-Request-Method': 'POST',
        'Access-Control-Request-Headers': 'authorization',
      },
    })

  for (const path of [
    '/token',
    '/introspect',
    '/revoke',
    '/userinfo',
    '/auth',
    '/.well-known/oauth-authorization-server',
  ]) {
    it(`answers a preflight to ${path}`, async () => {
      const response = await preflight(path)
      assert.equal(response.status, 204)
      assert.equal(response.headers.get('access-control-allow-origin'), '*')
      assert.match(response.headers.get('access-control-allow-headers') ?? '', /Authorization/)
      // every answer of /token, /auth and /introspect is uncached, the wire contract says: one rule for all
      assert.equal(response.headers.get('cache-control'), 'no-store')
      assert.equal(response.headers.get('pragma'), 'no-cache')
    })
  }

  it('lets an MCP client in a browser send its MCP-Protocol-Version header to the metadata', async () => {
    const response = await fetch(`${latch.base}/.well-known/oauth-authorization-server`, {
      method: 'OPTIONS',
      headers: {
        Origin: 'https://app.example',
        'Access-Control-Request-Method': 'GET',
        'Access-Control-Request-Headers': 'mcp-protocol-version',
      },
    })
    assert.equal(response.status, 204)
    assert.match(response.headers.get('access-control-allow-headers') ?? '', /\bMCP-Protocol-Version\b/i)
  })

  it('lets a preflight to /auth allow POST only, never the authorization request', async () => {
    assert.equal((await preflight('/auth')).headers.get('access-control-allow-methods'), 'POST')
  })

  it('allows any origin on the JSON endpoints, errors included', async () => {
    assert.equal(
      (await fetch(`${latch.base}/.well-known/oauth-authorization-server`)).headers.get('access-control-allow-origin'),
      '*',
    )
    assert.equal((await post(`${latch.base}/token`, form({}))).headers.get('access-control-allow-origin'), '*')
    assert.equal(
      (await post(`${latch.base}/introspect`, form({ token: 'x' }))).headers.get('access-control-allow-origin'),
      '*',
    )
    // a method the endpoint does not take: the app reads why, not a network error
    const wrong = await fetch(`${latch.base}/introspect?token=x`, { headers: { Origin: 'https://app.example' } })
    assert.equal(wrong.status, 405)
    assert.equal(wrong.headers.get('access-control-allow-origin'), '*')
    assert.equal((await wrong.json()).error, 'method_not_allowed')
  })

  it('lets a browser app read the Bearer and Basic challenges of a 401', async () => {
    const userinfo = await fetch(`${latch.base}/userinfo`, { headers: { Origin: 'https://app.example' } })
    assert.equal(userinfo.status, 401)
    assert.equal(userinfo.headers.get('access-control-expose-headers'), 'WWW-Authenticate')
    const basic = await post(`${latch.base}/token`, form({}), { Authorization: 'Basic eDp5' })
    assert.equal(basic.status, 401)
    assert.equal(basic.headers.get('access-control-expose-headers'), 'WWW-Authenticate')
    assert.equal((await post(`${latch.base}/token`, form({}))).headers.get('access-control-expose-headers'), null)
  })

  it('never allows other origins on the authorization request or the consent form', async () => {
    const page = await fetch(authorizationUrl(latch), { headers: { Origin: 'https://app.example' } })
    assert.equal(page.headers.get('access-control-allow-origin'), null)
    const consent = await preflight('/auth/consent')
    assert.equal(consent.status, 405)
    assert.equal(consent.headers.get('access-control-allow-origin'), null)
  })
})

describe('Password attempts', () => {
  it('lets the free attempts through, then doubles the wait up to 15 minutes, and forgets after a day', () => {
    let attempts: PasswordAttempts | undefined
    const waits: number[] = []
    for (let i = 0; i < 16; i++) {
      attempts = countAttempt(attempts, 1000, 5)
      waits.push((attempts.lockedUntil - 1000) / 1000)
    }
    assert.deepEqual(waits, [0, 0, 0, 0, 0, 2, 4, 8, 16, 32, 64, 128, 256, 512, 900, 900])
    assert.equal(countAttempt(attempts, 1000 + 86401_000, 5).count, 1)
  })

  it('forgets one attempt an hour, so that a stranger trying now and then never locks the owner out', () => {
    let attempts: PasswordAttempts | undefined
    let now = 0
    for (let i = 0; i < 1_000; i++) {
      attempts = countAttempt(attempts, (now += 3600_000), 20) // hourly, for six weeks
      assert.equal(attempts.lockedUntil, now)
    }
    for (let i = 0; i < 30; i++) attempts = countAttempt(attempts, (now += 600_000), 20) // every ten minutes
    assert.ok((attempts?.lockedUntil ?? 0) > now, 'a stranger guessing every ten minutes for five hours is not slowed')
  })

  it('runs two password checks at once, queues 32 in order, and answers 429 past that', async () => {
    const slots: PasswordSlots = { running: 0, waiting: [] }
    const started: number[] = []
    const finish: (() => void)[] = []
    const check = (i: number) => () => {
      started.push(i)
      return new Promise<number>((resolve) => finish.push(() => resolve(i)))
    }
    const checks = Array.from({ length: 34 }, (_, i) => withPasswordSlot(slots, check(i)))
    await assert.rejects(
      withPasswordSlot(slots, check(34)),
      (err: unknown) => err instanceof OAuthError && err.status === 429 && err.headers['Retry-After'] === '5',
    )
    await new Promise((resolve) => setImmediate(resolve))
    assert.deepEqual(started, [0, 1])
    assert.equal(slots.waiting.length, 32)
    for (let i = 0; i < 34; i++) {
      finish[i]()
      assert.equal(await checks[i], i)
    }
    assert.deepEqual(
      started,
      Array.from({ length: 34 }, (_, i) => i),
    )
    assert.deepEqual(slots, { running: 0, waiting: [] })
  })
})

describe('Sign-in sessions and connected apps', () => {
  const password = 'correct horse'
  let latch: TestServer
  before(
    async () =>
      (latch = await startLatch({
        PASSWORD_HASH: await hashPassword(password, FAST_COST),
        ME: 'https://example.com/',
      })),
  )
  after(() => latch.close())

  const sessionOf = (response: Response) =>
    /^(latch_session=[A-Za-z0-9_-]{43});/.exec(response.headers.get('set-cookie') ?? '')?.[1] ?? ''
  const signIn = async (csrf: string) => {
    const response = await post(`${latch.base}/sign-in`, form({ csrf, password }), { Cookie: `latch_csrf=${csrf}` })
    assert.equal(response.status, 303)
    return sessionOf(response)
  }
  const appsPage = async (cookie: string) => {
    const response = await fetch(`${latch.base}/apps`, { headers: { Cookie: cookie } })
    assert.equal(response.status, 200)
    return response.text()
  }
  /** The value the signed-in owner's forms carry: derived from the session, not the CSRF cookie. */
  const formTokenOf = async (cookie: string) => /name="csrf" value="([^"]+)"/.exec(await appsPage(cookie))?.[1] ?? ''
  /** POST /apps/tokens from the signed-in owner's apps page. */
  const makeScriptToken = async (cookie: string, fields: Record<string, string>) =>
    post(`${latch.base}/apps/tokens`, form({ csrf: await formTokenOf(cookie), ...fields }), { Cookie: cookie })

  it('starts a session when the password is accepted, so the next consent needs no password', async () => {
    const first = await openConsent(latch)
    const approved = await submitConsent(latch, first, { password })
    assert.equal(approved.status, 303)
    const setCookie = approved.headers.get('set-cookie') ?? ''
    assert.match(
      setCookie,
      /^latch_session=[A-Za-z0-9_-]{43}; Path=\/; Max-Age=604800; HttpOnly; SameSite=Lax; Priority=High$/,
    )
    const session = sessionOf(approved)
    const second = await openConsent(latch, {}, `${first.cookie}; ${session}`)
    assert.doesNotMatch(second.html, /type="password"/)
    const oneClick = await post(
      `${latch.base}/auth/consent`,
      form({ request: second.request, csrf: second.csrf, scope: 'create', decision: 'approve' }),
      {
        Cookie: `${first.cookie}; ${session}`,
      },
    )
    assert.equal(oneClick.status, 303)
    assert.ok(new URL(oneClick.headers.get('location') ?? '').searchParams.get('code'))
  })

  it('asks for the password again once SESSION_TTL has passed', async () => {
    const first = await openConsent(latch)
    const session = sessionOf(await submitConsent(latch, first, { password }))
    latch.advance(604800)
    const later = await openConsent(latch, {}, `${first.cookie}; ${session}`)
    assert.match(later.html, /type="password"/)
    assert.equal((await submitConsent(latch, { ...later, cookie: `${first.cookie}; ${session}` })).status, 401)
  })

  it('lists the 200 apps approved last on /apps and in Revoke all, and says how many more there are', async () => {
    const store = new MemoryStore()
    const latch = await startLatch({}, { store }) // no password: open to this machine
    try {
      for (let i = 0; i < 203; i++) {
        const approvedAt = START - (203 - i) * 1000
        const grant: Grant = {
          client_id: CLIENT_ID,
          client_name: `App ${i}`,
          me: `${latch.base}/`,
          scope: ['create'],
          resource: [],
          accessTokenTtlSeconds: 3600,
          approvedAt,
          lastUsedAt: approvedAt,
          endsAt: undefined,
          expiresAt: START + 3600_000,
          lastRotated: undefined,
        }
        await store.saveGrant(`g${i}`, grant, START)
      }
      const page = await fetch(`${latch.base}/apps`)
      const apps = await page.text()
      assert.equal(apps.split('<section class="app">').length - 1, 200)
      assert.match(
        apps,
        /The 200 approved last are listed; 3 approved before them are not, and "Revoke all" revokes them too\./,
      )
      assert.ok(apps.includes('App 202') && apps.includes('App 3<') && !apps.includes('App 2<'))
      const csrf = /name="csrf" value="([^"]+)"/.exec(apps)?.[1] ?? ''
      const cookie = (page.headers.get('set-cookie') ?? '').split(';')[0]
      const question = await (await post(`${latch.base}/apps/revoke-all`, form({ csrf }), { Cookie: cookie })).text()
      assert.match(question, /These 203 apps lose their/)
      assert.equal(question.split('<li>').length - 1, 201)
      assert.match(question, /<li>and 3 approved before them<\/li>/)
    } finally {
      await latch.close()
    }
  })

  it('names, on /apps, the ME an app approved before a new one knows the owner by', async () => {
    const store = new MemoryStore()
    const before = await startLatch({ ME: 'https://old.example/' }, { store })
    await exchange(before, await obtainCode(before))
    await before.close()
    const after = await startLatch({ ME: 'https://new.example/' }, { store })
    try {
      const apps = await (await fetch(`${after.base}/apps`)).text() // no password: open to this machine
      assert.match(apps, /<dt>Signs in as<\/dt><dd><code><bdi>https:\/\/old\.example\/<\/bdi><\/code><\/dd>/)
      await exchange(after, await obtainCode(after))
      const again = await (await fetch(`${after.base}/apps`)).text()
      assert.equal(again.split('<dt>Signs in as</dt>').length, 2) // the one approved since knows the new one
    } finally {
      await after.close()
    }
  })

  it('ends a session older than SESSION_TTL as set now, after a restart with a shorter one', async () => {
    const store = new MemoryStore()
    const passwordHash = await hashPassword(password, FAST_COST)
    const before = await startLatch({ PASSWORD_HASH: passwordHash }, { store })
    const first = await openConsent(before)
    const session = sessionOf(await submitConsent(before, first, { password }))
    await before.close()
    const after = await startLatch({ PASSWORD_HASH: passwordHash, SESSION_TTL: '1h' }, { store })
    try {
      after.advance(3599)
      const still = await fetch(`${after.base}/apps`, { headers: { Cookie: session } })
      assert.match(await still.text(), /<h1>Connected apps<\/h1>/)
      after.advance(1) // an hour to the millisecond; seven days were promised at sign-in: the setting of now ends it
      const ended = await fetch(`${after.base}/apps`, { headers: { Cookie: session } })
      assert.match(await ended.text(), /type="password"/)
    } finally {
      await after.close()
    }
  })

  it('says on the sign-in page that the password was changed, to a browser signed in with the one before', async () => {
    const store = new MemoryStore()
    const before = await startLatch({ PASSWORD_HASH: await hashPassword(password, FAST_COST) }, { store })
    const session = sessionOf(await submitConsent(before, await openConsent(before), { password }))
    await before.close()
    const after = await startLatch(
      { PASSWORD_HASH: await hashPassword('a new horse battery staple', FAST_COST) },
      { store },
    )
    try {
      const page = await (await fetch(`${after.base}/apps`, { headers: { Cookie: session } })).text()
      assert.match(page, /type="password"/)
      assert.match(page, /The password was changed since you signed in here: sign in with the new one\./)
      const stranger = await (await fetch(`${after.base}/apps`)).text()
      assert.doesNotMatch(stranger, /The password was changed/)
    } finally {
      await after.close()
    }
  })

  it('shows a sign-in form at /apps to anyone not signed in', async () => {
    const html = await appsPage('')
    assert.match(html, /action="[^"]*\/sign-in"/)
    assert.match(html, /type="password"/)
  })

  it('finds the session among cookies of the same name that a page on another port of this host set', async () => {
    const csrf = createSecret()
    const session = await signIn(csrf)
    // cookies do not keep ports apart, and the browser sends the one set for the longer path first
    const html = await appsPage(`latch_session=${createSecret()}; latch_csrf=${csrf}; ${session}`)
    assert.match(html, /action="[^"]*\/sign-out"/)
    assert.doesNotMatch(html, /type="password"/)
  })

  it('finds the session past as many session cookies as a page could plant for every domain and path', async () => {
    const csrf = createSecret()
    const session = await signIn(csrf)
    // malformed ones are passed over; a host of many labels takes a cookie for each, times each path
    const malformed = Array.from({ length: 20 }, () => 'latch_session=x').join('; ')
    const planted = Array.from({ length: 200 }, () => `latch_session=${createSecret()}`).join('; ')
    assert.match(await appsPage(`${malformed}; ${planted}; latch_csrf=${csrf}; ${session}`), /action="[^"]*\/sign-out"/)
  })

  it('reads at most 300 session cookies of the name, where an app lets in headers large enough for more', async () => {
    const large = await startLatch({ PASSWORD_HASH: await hashPassword(password, FAST_COST) }, { maxHeaderSize: 65536 })
    try {
      const csrf = createSecret()
      const signedIn = await post(`${large.base}/sign-in`, form({ csrf, password }), { Cookie: `latch_csrf=${csrf}` })
      const session = sessionOf(signedIn)
      const planted = (count: number) =>
        Array.from({ length: count }, () => `latch_session=${createSecret()}`).join('; ')
      const page = async (count: number) =>
        (
          await fetch(`${large.base}/apps`, {
            headers: { Cookie: `${planted(count)}; latch_csrf=${csrf}; ${session}` },
          })
        ).text()
      assert.match(await page(299), /action="[^"]*\/sign-out"/)
      assert.match(await page(300), /type="password"/)
    } finally {
      await large.close()
    }
  })

  it('looks the session cookies up in the store all at once, not one round trip after another', async () => {
    const store = new MemoryStore()
    let waiting = 0
    let most = 0
    const findSession = store.findSession.bind(store)
    store.findSession = async (hash, now) => {
      most = Math.max(most, ++waiting) // a store across the network: each lookup a round trip
      await new Promise((resolve) => setImmediate(resolve))
      waiting--
      return findSession(hash, now)
    }
    const own = await startLatch({ PASSWORD_HASH: await hashPassword(password, FAST_COST) }, { store })
    try {
      const planted = Array.from({ length: 40 }, () => `latch_session=${createSecret()}`).join('; ')
      await (await fetch(`${own.base}/apps`, { headers: { Cookie: planted } })).text()
      assert.equal(most, 40)
    } finally {
      await own.close()
    }
  })

  it('signs in and approves among CSRF cookies of the same name that a page on another port set for longer paths', async () => {
    const csrf = createSecret()
    // sent first, as the browser does for a longer path: each of Latch's posts would be refused
    const malformed = Array.from({ length: 16 }, () => 'latch_csrf=x').join('; ') // each passed over, not counted
    const cookie = `${malformed}; latch_csrf=${createSecret()}; latch_csrf=${createSecret()}; latch_csrf=${csrf}`
    const signedIn = await post(`${latch.base}/sign-in`, form({ csrf, password }), { Cookie: cookie })
    assert.equal(signedIn.status, 303)
    const consent = await openConsent(latch, {}, `latch_csrf=${csrf}`)
    const approved = await post(
      `${latch.base}/auth/consent`,
      form({ request: consent.request, csrf: consent.csrf, scope: 'create', decision: 'approve', password }),
      { Cookie: cookie },
    )
    assert.equal(approved.status, 303)
    assert.ok(new URL(approved.headers.get('location') ?? '').searchParams.get('code'))
  })

  it('answers a wrong password at sign-in with 401 and the form again', async () => {
    const csrf = createSecret()
    const response = await post(`${latch.base}/sign-in`, form({ csrf, password: 'wrong' }), {
      Cookie: `latch_csrf=${csrf}`,
    })
    assert.equal(response.status, 401)
    assert.equal(response.headers.get('set-cookie'), null)
    assert.match(await response.text(), /role="alert"/)
  })

  it('lists each live grant with its scopes, and revokes one at once', async () => {
    const csrf = createSecret()
    const session = await signIn(csrf)
    const code = await obtainCode(latch, { scope: 'create media' }, { scope: ['create', 'media'], password })
    const tokens = (await (await exchange(latch, code)).json()) as { access_token: string; refresh_token: string }
    const html = await appsPage(`latch_csrf=${csrf}; ${session}`)
    assert.match(html, /<h2><bdi>http:\/\/127\.0\.0\.1:8080\/<\/bdi><\/h2>/)
    assert.match(html, /<dd>create media<\/dd>/)
    const grant = [...html.matchAll(/name="grant" value="([^"]+)"/g)].map((match) => match[1]).at(-1) ?? ''
    const token = /name="csrf" value="([^"]+)"/.exec(html)?.[1] ?? ''
    const revoked = await post(`${latch.base}/apps/revoke`, form({ csrf: token, grant }), {
      Cookie: `latch_csrf=${csrf}; ${session}`,
    })
    assert.equal(revoked.status, 200)
    const confirmed = await revoked.text()
    assert.match(
      confirmed,
      /<p class="notice" role="status">Revoked <bdi>http:\/\/127\.0\.0\.1:8080\/<\/bdi>: its tokens/,
    )
    assert.doesNotMatch(confirmed, new RegExp(`value="${grant}"`))
    assert.deepEqual(await introspect(latch, tokens.access_token), { active: false })
    const again = await post(`${latch.base}/apps/revoke`, form({ csrf: token, grant }), {
      Cookie: `latch_csrf=${csrf}; ${session}`,
    })
    // a double click, or a reload: the first press revoked it
    assert.match(await again.text(), /class="notice" role="status">That app has no access any more: revoked already/)
    const refreshed = await post(
      `${latch.base}/token`,
      form({ grant_type: 'refresh_token', refresh_token: tokens.refresh_token, client_id: CLIENT_ID }),
    )
    await assertError(refreshed, 400, 'invalid_grant')
  })

  it('revokes every grant with Revoke all', async () => {
    const csrf = createSecret()
    const session = await signIn(csrf)
    const tokens = [await obtainToken(latch, { password }), await obtainToken(latch, { password })]
    const token = await formTokenOf(`latch_csrf=${csrf}; ${session}`)
    const asked = await post(`${latch.base}/apps/revoke-all`, form({ csrf: token }), {
      Cookie: `latch_csrf=${csrf}; ${session}`,
    })
    assert.equal(asked.status, 200)
    const question = await asked.text()
    assert.match(question, /<h1>Revoke all apps\?<\/h1>/)
    assert.match(question, /name="confirm" value="yes"/)
    for (const token of tokens) assert.equal((await introspect(latch, token)).active, true, 'nothing ends before yes')
    const response = await post(`${latch.base}/apps/revoke-all`, form({ csrf: token, confirm: 'yes' }), {
      Cookie: `latch_csrf=${csrf}; ${session}`,
    })
    assert.equal(response.status, 200)
    assert.match(await response.text(), /class="notice" role="status">Revoked \d+ apps: they have lost their access/)
    for (const token of tokens) assert.deepEqual(await introspect(latch, token), { active: false })
    assert.match(await appsPage(`latch_csrf=${csrf}; ${session}`), /No app holds a token/)
  })

  it('revokes with Revoke all only the apps it listed: not one approved since, when the answer is sent again', async () => {
    const csrf = createSecret()
    const cookie = `latch_csrf=${csrf}; ${await signIn(csrf)}`
    const listed = await obtainToken(latch, { password })
    const token = await formTokenOf(cookie)
    const question = await (
      await post(`${latch.base}/apps/revoke-all`, form({ csrf: token }), { Cookie: cookie })
    ).text()
    const asked = /name="asked" value="(\d+)"/.exec(question)?.[1] ?? ''
    assert.ok(asked, question)
    latch.advance(60)
    const later = await obtainToken(latch, { password }) // approved while the question was open
    const yes = form({ csrf: token, confirm: 'yes', asked })
    const answered = await post(`${latch.base}/apps/revoke-all`, yes, { Cookie: cookie })
    assert.match(await answered.text(), /class="notice" role="status">Revoked 1 app: it has lost its access/)
    assert.deepEqual(await introspect(latch, listed), { active: false })
    assert.equal((await introspect(latch, later)).active, true)
    const again = await post(`${latch.base}/apps/revoke-all`, yes, { Cookie: cookie }) // a reload
    assert.match(
      await again.text(),
      /Nothing was left to revoke: every app approved by then has lost its access already/,
    )
    assert.equal((await introspect(latch, later)).active, true)
  })

  it('revokes with Revoke all an app approved before it asked, whose code is redeemed only after', async () => {
    const csrf = createSecret()
    const cookie = `latch_csrf=${csrf}; ${await signIn(csrf)}`
    const listed = await obtainToken(latch, { password })
    const approved = await obtainCode(latch, {}, { password }) // the app has its code, and has not redeemed it yet
    const token = await formTokenOf(cookie)
    const question = await (
      await post(`${latch.base}/apps/revoke-all`, form({ csrf: token }), { Cookie: cookie })
    ).text()
    const asked = /name="asked" value="(\d+)"/.exec(question)?.[1] ?? ''
    assert.match(question, /So does an app you approved in the last 5 minutes that has not collected its access yet/)
    latch.advance(60)
    const yes = await post(`${latch.base}/apps/revoke-all`, form({ csrf: token, confirm: 'yes', asked }), {
      Cookie: cookie,
    })
    assert.match(await yes.text(), /class="notice" role="status">Revoked 2 apps: they have lost their access/)
    assert.deepEqual(await introspect(latch, listed), { active: false })
    await assertError(await exchange(latch, approved), 400, 'invalid_grant')
    assert.match(await appsPage(cookie), /No app holds a token/)
  })

  it('offers Revoke all while no app holds a token, for an approved app that has not redeemed its code yet', async () => {
    const own = await startLatch({ PASSWORD_HASH: await hashPassword(password, FAST_COST) })
    try {
      const csrf = createSecret()
      const signedIn = await post(`${own.base}/sign-in`, form({ csrf, password }), { Cookie: `latch_csrf=${csrf}` })
      const cookie = `latch_csrf=${csrf}; ${(signedIn.headers.get('set-cookie') ?? '').split(';')[0]}`
      const approved = await obtainCode(own, {}, { password }) // the app has its code, and no token yet
      const apps = await (await fetch(`${own.base}/apps`, { headers: { Cookie: cookie } })).text()
      assert.match(apps, /No app holds a token right now/)
      assert.match(apps, /action="[^"]*\/apps\/revoke-all"/) // the button is there all the same
      const token = /name="csrf" value="([^"]+)"/.exec(apps)?.[1] ?? ''
      const asked = await post(`${own.base}/apps/revoke-all`, form({ csrf: token }), { Cookie: cookie })
      const question = await asked.text()
      assert.match(
        question,
        /No app holds a token right now\. This would still stop an app you approved in the last 5 minutes/,
      )
      const sent = /name="asked" value="(\d+)"/.exec(question)?.[1] ?? ''
      const yes = form({ csrf: token, confirm: 'yes', asked: sent })
      assert.match(
        await (await post(`${own.base}/apps/revoke-all`, yes, { Cookie: cookie })).text(),
        /Revoked 1 app: it has lost its access/,
      )
      await assertError(await exchange(own, approved), 400, 'invalid_grant')
    } finally {
      await own.close()
    }
  })

  it('revokes with Revoke all every app it listed, though they were approved while the clock was ahead', async () => {
    const file = join(await mkdtemp(join(tmpdir(), 'latch-clock-')), 'data.jsonl')
    const settings = { PASSWORD_HASH: await hashPassword(password, FAST_COST) }
    for (const restarted of [false, true]) {
      let store = await FileStore.open(file, { log: () => {} })
      let own = await startLatch(settings, { store })
      own.advance(7200) // two hours ahead, as a box without a clock of its own may boot
      const ahead = await obtainToken(own, { password })
      if (restarted) {
        // NTP sets the clock right, and Latch restarts: its new clock never saw it ahead
        await own.close()
        await store.close()
        store = await FileStore.open(file, { log: () => {} })
        own = await startLatch(settings, { store })
      } else own.advance(-7200) // set right while Latch runs
      try {
        const csrf = createSecret()
        const signedIn = await post(`${own.base}/sign-in`, form({ csrf, password }), { Cookie: `latch_csrf=${csrf}` })
        const cookie = `latch_csrf=${csrf}; ${(signedIn.headers.get('set-cookie') ?? '').split(';')[0]}`
        const apps = await (await fetch(`${own.base}/apps`, { headers: { Cookie: cookie } })).text()
        const token = /name="csrf" value="([^"]+)"/.exec(apps)?.[1] ?? ''
        const asking = await post(`${own.base}/apps/revoke-all`, form({ csrf: token }), { Cookie: cookie })
        const asked = /name="asked" value="(\d+)"/.exec(await asking.text())?.[1] ?? ''
        const yes = form({ csrf: token, confirm: 'yes', asked })
        const answer = await (await post(`${own.base}/apps/revoke-all`, yes, { Cookie: cookie })).text()
        assert.match(answer, /Revoked 1 app: it has lost its access/, `restarted: ${restarted}`)
        assert.deepEqual(await introspect(own, ahead), { active: false })
      } finally {
        await own.close()
        await store.close()
      }
    }
  })

  it('refuses app revocation without the CSRF value or without a session, with 403', async () => {
    const csrf = createSecret()
    const session = await signIn(csrf)
    const token = await obtainToken(latch, { password })
    const forged = await post(`${latch.base}/apps/revoke-all`, form({ csrf: createSecret(), confirm: 'yes' }), {
      Cookie: `latch_csrf=${csrf}; ${session}`,
    })
    assert.equal(forged.status, 403)
    const anonymous = await post(`${latch.base}/apps/revoke-all`, form({ csrf, confirm: 'yes' }), {
      Cookie: `latch_csrf=${csrf}`,
    })
    assert.equal(anonymous.status, 403)
    assert.equal((await introspect(latch, token)).active, true)
  })

  it('ends the session on sign-out', async () => {
    const csrf = createSecret()
    const session = await signIn(csrf)
    const token = await formTokenOf(`latch_csrf=${csrf}; ${session}`)
    const response = await post(`${latch.base}/sign-out`, form({ csrf: token }), {
      Cookie: `latch_csrf=${csrf}; ${session}`,
    })
    assert.equal(response.status, 303)
    assert.match(response.headers.get('set-cookie') ?? '', /^latch_session=; Path=\/; Max-Age=0/)
    assert.match(await appsPage(`latch_csrf=${csrf}; ${session}`), /type="password"/) // the old cookie no longer signs in
  })

  it('tells a page of its own made before a sign-out that it is out of date, with 403 and no security line', async () => {
    const csrf = createSecret()
    const cookie = `latch_csrf=${csrf}; ${await signIn(csrf)}`
    const token = await formTokenOf(cookie) // an apps page left open
    assert.equal((await post(`${latch.base}/sign-out`, form({ csrf: token }), { Cookie: cookie })).status, 303)
    const logged = latch.logs.length
    const fields = form({ csrf: token, name: 'Hook', scope: 'create' })
    const stale = await post(`${latch.base}/apps/tokens`, fields, { Cookie: cookie, 'Sec-Fetch-Site': 'same-origin' })
    assert.equal(stale.status, 403)
    assert.match(
      await stale.text(),
      /This page is out of date: you signed in or out, or your session ended, since it was opened/,
    )
    assert.deepEqual(
      latch.logs.slice(logged).filter((line) => line.includes('security:')),
      [],
    )
    // a browser that does not say where the form came from is refused as before
    assert.equal((await post(`${latch.base}/apps/tokens`, fields, { Cookie: cookie })).status, 403)
  })

  it('approves a second consent page opened while signed out, with the password, after the first signed in', async () => {
    const first = await openConsent(latch)
    const second = await openConsent(latch, { state: 'other tab' }, first.cookie) // another tab, the same browser
    const approved = await submitConsent(latch, first, { password })
    assert.equal(approved.status, 303)
    const session = sessionOf(approved)
    const cookie = `${second.cookie}; ${session}`
    const send = (
      fields: Record<string, string>,
      headers: Record<string, string> = { 'Sec-Fetch-Site': 'same-origin' },
    ) =>
      post(
        `${latch.base}/auth/consent`,
        form({ request: second.request, csrf: second.csrf, scope: 'create', decision: 'approve', ...fields }),
        { Cookie: cookie, ...headers },
      )
    // a browser that says the form is this origin's: taken as the signed-out page it is, the password checked
    const wrong = await send({ password: 'wrong horse' })
    assert.equal(wrong.status, 401)
    assert.match(await wrong.text(), /Wrong password/)
    // one that does not say (an old browser, or a page on another port that set the cookie): refused unchecked
    assert.equal((await send({ password: 'wrong horse' }, {})).status, 403)
    assert.equal((await send({}, {})).status, 403)
    const right = await send({ password })
    assert.equal(right.status, 303)
    assert.equal(new URL(right.headers.get('location') ?? '').searchParams.get('state'), 'other tab')
    // the session this browser held ends, as at any sign-in: signing out then leaves none alive
    assert.match(await appsPage(`${first.cookie}; ${session}`), /type="password"/)
  })

  it('signs in from a sign-in page left open while another tab signed in', async () => {
    const csrf = createSecret()
    const session = await signIn(csrf) // the other tab
    const response = await post(`${latch.base}/sign-in`, form({ csrf, password }), {
      Cookie: `latch_csrf=${csrf}; ${session}`,
      'Sec-Fetch-Site': 'same-origin', // as browsers since 2023 say of a form of this server's own page
    })
    assert.equal(response.status, 303)
    assert.match(await appsPage(`latch_csrf=${csrf}; ${sessionOf(response)}`), /Connected apps/)
  })

  it('says that no cookie came when a browser refuses them, not that the page is out of date', async () => {
    const consent = await openConsent(latch)
    const response = await post(
      `${latch.base}/auth/consent`,
      form({ request: consent.request, csrf: consent.csrf, decision: 'approve', password }),
      { 'Sec-Fetch-Site': 'same-origin' }, // and no Cookie
    )
    assert.equal(response.status, 403)
    assert.match(await response.text(), /Your browser sent no cookie with this form: allow cookies for 127\.0\.0\.1/)
  })

  it('refuses a consent from a page on another port that planted its own CSRF cookie, though the owner is signed in', async () => {
    const planted = createSecret() // what a page on another port of 127.0.0.1 can set: cookies ignore ports
    const session = await signIn(createSecret())
    const forged = await openConsent(latch, {}, `latch_csrf=${planted}`) // the request, opened by that page's server
    assert.equal(forged.csrf, planted)
    const response = await post(
      `${latch.base}/auth/consent`,
      form({ request: forged.request, csrf: planted, scope: 'create', decision: 'approve' }),
      {
        Cookie: `latch_csrf=${planted}; ${session}`,
      },
    )
    assert.equal(response.status, 403)
    assert.equal(response.headers.get('location'), null)
  })

  it('names the address a refused form came from, and the issuer, when it came from a page under another name', async () => {
    const consent = await openConsent(latch)
    const sent = form({ request: consent.request, csrf: createSecret(), scope: 'create', decision: 'approve' })
    const page = async (origin: string, site = 'same-site') => {
      const headers = { Origin: origin, ...(site === '' ? {} : { 'Sec-Fetch-Site': site }) }
      const response = await post(`${latch.base}/auth/consent`, sent, headers)
      assert.equal(response.status, 403)
      return response.text()
    }
    const issuer = new URL(latch.issuer).origin
    const elsewhere = await page('https://auth.example.com') // a proxy's name, while ISSUER says another; or a forger's
    assert.match(
      elsewhere,
      new RegExp(`sent from a page at https://auth\\.example\\.com, but this server is at ${issuer}`),
    )
    assert.match(elsewhere, new RegExp(`start again from the app, or open the page at ${issuer}</p>`))
    assert.doesNotMatch(elsewhere, /reload/) // reloading that page cannot help
    const local = await page(`http://localhost:${latch.port}`) // a name of this machine
    assert.match(local, /, or set ISSUER to the address you use<\/p>/)
    // Latch's pages send no Referer, so Chromium says `Origin: null` for a form from one opened
    // under another name: only Sec-Fetch-Site says that it was elsewhere
    for (const origin of ['null', 'http://[::1', 'http://a:99999']) {
      // not an origin: not named
      const unnamed = await page(origin, 'cross-site')
      assert.match(unnamed, new RegExp(`sent from a page at another address, but this server is at ${issuer}`))
      assert.doesNotMatch(unnamed, /reload/)
    }
    // a browser that says nothing of where the form came from
    assert.match(await page(issuer, ''), /not sent from a page of this server in this browser/)
    assert.match(await page('null', ''), /not sent from a page of this server in this browser/)
  })

  it('refuses a form whose browser says it came from another origin (Sec-Fetch-Site), even with the right value', async () => {
    const csrf = createSecret()
    const session = await signIn(csrf)
    const token = await formTokenOf(`latch_csrf=${csrf}; ${session}`)
    const headers = { Cookie: `latch_csrf=${csrf}; ${session}` }
    assert.equal(
      (await post(`${latch.base}/sign-out`, form({ csrf: token }), { ...headers, 'Sec-Fetch-Site': 'same-site' }))
        .status,
      403,
    )
    assert.match(await appsPage(headers.Cookie), /Connected apps/)
    assert.equal(
      (await post(`${latch.base}/sign-out`, form({ csrf: token }), { ...headers, 'Sec-Fetch-Site': 'same-origin' }))
        .status,
      303,
    )
  })

  it('signs out everywhere: every session of the owner ends, in every browser', async () => {
    const [csrf, other] = [createSecret(), createSecret()]
    const [first, second] = [await signIn(csrf), await signIn(other)]
    const token = await formTokenOf(`latch_csrf=${csrf}; ${first}`)
    const response = await post(`${latch.base}/sign-out-everywhere`, form({ csrf: token }), {
      Cookie: `latch_csrf=${csrf}; ${first}`,
    })
    // the sign-in page at once, which says what happened, and can sign in again from this browser
    assert.equal(response.status, 200)
    const page = await response.text()
    assert.match(page, /<h1>Sign in<\/h1>\n<p class="notice" role="status">You are signed out here and in every other/)
    assert.match(page, new RegExp(`name="csrf" value="${csrf}"`))
    assert.deepEqual(response.headers.getSetCookie(), [
      'latch_session=; Path=/; Max-Age=0; HttpOnly; SameSite=Lax; Priority=High',
      `latch_csrf=${csrf}; Path=/; HttpOnly; SameSite=Lax; Priority=High`,
    ])
    assert.match(await appsPage(`latch_csrf=${csrf}; ${first}`), /type="password"/)
    assert.match(await appsPage(`latch_csrf=${other}; ${second}`), /type="password"/)
    assert.ok(latch.logs.some((line) => /^\S+Z 127\.0\.0\.1 security: .*every session ended/.test(line)))
  })

  it('takes a token for scripts off /apps when it is revoked at /revoke (RFC 7009), as its one token', async () => {
    const csrf = createSecret()
    const cookie = `latch_csrf=${csrf}; ${await signIn(csrf)}`
    const made = await makeScriptToken(cookie, { name: 'Webhook', scope: 'create', lifetime: '604800' })
    const token = /<pre class="token">([A-Za-z0-9_-]{43})<\/pre>/.exec(await made.text())?.[1] ?? ''
    assert.match(await appsPage(cookie), /<h2><bdi>Webhook<\/bdi><\/h2>/)
    assert.equal((await post(`${latch.base}/revoke`, form({ token }))).status, 200)
    assert.deepEqual(await introspect(latch, token), { active: false })
    assert.doesNotMatch(await appsPage(cookie), /Webhook/)
  })

  it('makes a token for scripts on /apps: shown once, listed, introspected like any, revoked from the list', async () => {
    const csrf = createSecret()
    const cookie = `latch_csrf=${csrf}; ${await signIn(csrf)}`
    const made = await makeScriptToken(cookie, { name: 'Deploy notes', scope: 'create update', lifetime: '604800' })
    const page = await made.text()
    assert.equal(made.status, 200, page)
    assert.equal(made.headers.get('cache-control'), 'no-store')
    const token = /<pre class="token">([A-Za-z0-9_-]{43})<\/pre>/.exec(page)?.[1] ?? ''
    assert.ok(token, page)
    const unused = await appsPage(cookie)
    assert.match(unused.slice(unused.indexOf('Deploy notes')), /^[^]*?<dt>Last used<\/dt><dd>Never<\/dd>/)
    const introspection = await introspect(latch, token)
    assert.equal(introspection.active, true)
    assert.equal(introspection.client_id, `${latch.issuer}/apps`)
    assert.equal(introspection.scope, 'create update')
    assert.equal(introspection.exp, (introspection.iat as number) + 604800)
    const apps = await appsPage(cookie)
    assert.match(apps, /<h2><bdi>Deploy notes<\/bdi><\/h2>/)
    assert.match(
      apps.slice(apps.indexOf('Deploy notes')),
      /^[^]*?<dt>Last used<\/dt><dd>\d{4}-\d\d-\d\d \d\d:\d\d UTC<\/dd>/,
    )
    assert.doesNotMatch(apps, new RegExp(token)) // shown once only
    const grant = /name="grant" value="([^"]+)"/.exec(apps.slice(apps.indexOf('Deploy notes')))?.[1] ?? ''
    const revoked = await post(`${latch.base}/apps/revoke`, form({ csrf: await formTokenOf(cookie), grant }), {
      Cookie: cookie,
    })
    assert.match(await revoked.text(), /Revoked <bdi>Deploy notes<\/bdi>/)
    assert.deepEqual(await introspect(latch, token), { active: false })
    assert.ok(
      latch.logs.some((line) => / security: the owner made a token for scripts named "Deploy notes"/.test(line)),
    )
  })

  it('shows a token to a second press of its form only while it lives: revoked at /revoke, it is said made', async () => {
    const csrf = createSecret()
    const cookie = `latch_csrf=${csrf}; ${await signIn(csrf)}`
    const once = /name="once" value="([A-Za-z0-9_-]{43})"/.exec(await appsPage(cookie))?.[1] ?? ''
    const fields = { name: 'Revoked hook', scope: 'create', once }
    const made = await makeScriptToken(cookie, fields)
    const token = /<pre class="token">([A-Za-z0-9_-]{43})<\/pre>/.exec(await made.text())?.[1] ?? ''
    assert.equal((await post(`${latch.base}/revoke`, form({ token }))).status, 200)
    const again = await makeScriptToken(cookie, fields)
    assert.equal(again.status, 409)
    assert.doesNotMatch(await again.text(), /class="token"/)
  })

  it('makes one token from one form, sent twice or sent again after its token was revoked', async () => {
    const csrf = createSecret()
    const cookie = `latch_csrf=${csrf}; ${await signIn(csrf)}`
    const page = await appsPage(cookie)
    const once = /name="once" value="([A-Za-z0-9_-]{43})"/.exec(page)?.[1] ?? ''
    assert.ok(once, page)
    const fields = { name: 'Reloaded hook', scope: 'create', once }
    const made = await makeScriptToken(cookie, fields)
    assert.equal(made.status, 200)
    const token = /<pre class="token">([A-Za-z0-9_-]{43})<\/pre>/.exec(await made.text())?.[1] ?? ''
    // a second press within seconds (a double click, whose first answer the browser never shows) shows the same token
    const doubled = await makeScriptToken(cookie, fields)
    assert.equal(doubled.status, 200)
    assert.match(await doubled.text(), new RegExp(`<pre class="token">${token}</pre>`))
    latch.advance(11)
    const again = await makeScriptToken(cookie, fields) // a reload of the page that showed the token
    assert.equal(again.status, 409)
    const text = await again.text()
    assert.match(text, /This token was made already/)
    assert.doesNotMatch(text, /class="token"/)
    const apps = await appsPage(cookie)
    assert.equal(apps.split('<h2><bdi>Reloaded hook</bdi></h2>').length, 2) // listed once
    const grant = /name="grant" value="([^"]+)"/.exec(apps.slice(apps.indexOf('Reloaded hook')))?.[1] ?? ''
    await post(`${latch.base}/apps/revoke`, form({ csrf: await formTokenOf(cookie), grant }), { Cookie: cookie })
    assert.deepEqual(await introspect(latch, token), { active: false })
    assert.equal((await makeScriptToken(cookie, fields)).status, 409) // not made again once revoked
    assert.doesNotMatch(await appsPage(cookie), /Reloaded hook/)
  })

  it('makes one token from one form sent three times at once, while the journal writes, and shows it to each', async () => {
    const dir = await mkdtemp(join(tmpdir(), 'latch-once-'))
    const store = await FileStore.open(join(dir, 'data.jsonl'), { log: () => {} })
    const open = await startLatch({}, { store }) // no password: the owner's pages are open on loopback
    try {
      const page = await fetch(`${open.base}/apps`)
      const html = await page.text()
      const cookie = (page.headers.get('set-cookie') ?? '').split(';')[0]
      const field = (name: string) => new RegExp(`name="${name}" value="([^"]+)"`).exec(html)?.[1] ?? ''
      const fields = form({ csrf: field('csrf'), once: field('once'), name: 'Double click', scope: 'create' })
      const sent = () => post(`${open.base}/apps/tokens`, fields, { Cookie: cookie })
      const answers = await Promise.all([sent(), sent(), sent()])
      assert.deepEqual(
        answers.map((response) => response.status),
        [200, 200, 200],
      )
      const tokens = await Promise.all(
        answers.map(async (answer) => /class="token">([^<]+)</.exec(await answer.text())?.[1]),
      )
      assert.equal(new Set(tokens).size, 1) // one token, shown by each: the browser shows the last answer
      assert.equal(store.memory.tokens.size, 1)
    } finally {
      await open.close()
      await store.close()
      await rm(dir, { recursive: true, force: true })
    }
  })

  it('says on /apps that a use before Latch started is not known, when the store kept none', async () => {
    const store = new MemoryStore()
    const made = { client_id: 'http://127.0.0.1:3000/apps', client_name: 'Old hook', me: 'http://127.0.0.1:3000/' }
    const times = { approvedAt: START - 86_400_000, lastUsedAt: 0, endsAt: undefined, expiresAt: START + 86_400_000 }
    await store.saveGrant(
      'old',
      { ...made, scope: ['create'], resource: [], accessTokenTtlSeconds: 86400, ...times },
      0,
    )
    const open = await startLatch({}, { store })
    try {
      const page = await (await fetch(`${open.base}/apps`)).text()
      assert.match(page.slice(page.indexOf('Old hook')), /^[^]*?<dt>Last used<\/dt><dd>Not since Latch last started</)
    } finally {
      await open.close()
    }
  })

  it('says on /apps when access until revoked ends: an app after its refresh token goes unused, a script token in ten years', async () => {
    const csrf = createSecret()
    const cookie = `latch_csrf=${csrf}; ${await signIn(csrf)}`
    const made = await makeScriptToken(cookie, { name: 'Forever hook', scope: 'create', lifetime: '0' })
    assert.equal(made.status, 200)
    const token = /<pre class="token">([A-Za-z0-9_-]{43})<\/pre>/.exec(await made.text())?.[1] ?? ''
    const { exp, iat } = (await introspect(latch, token)) as { exp: number; iat: number }
    assert.equal(exp - iat, 3650 * 86400) // no refresh token, and an access token of ten years
    await obtainToken(latch, { password, lifetime: '0' }) // an app's grant until revoked
    const apps = await appsPage(cookie)
    const cards = apps.split('<section class="app">').slice(1)
    const hook = cards.find((card) => card.includes('Forever hook')) ?? ''
    const tenYears = new Date((iat + 3650 * 86400) * 1000).toISOString().slice(0, 16).replace('T', ' ')
    assert.match(hook, new RegExp(`<dt>Access ends</dt><dd>When you revoke it, or on ${tenYears} UTC</dd>`))
    const app = cards.find((card) => card.includes(CLIENT_ID)) ?? ''
    assert.match(app, /<dt>Access ends<\/dt><dd>When you revoke it, or after 30 days unused<\/dd>/)
  })

  it('refuses a token for scripts without a sign-in, a name or a scope', async () => {
    const csrf = createSecret()
    const cookie = `latch_csrf=${csrf}; ${await signIn(csrf)}`
    for (const fields of [
      { name: '', scope: 'create' },
      { name: 'x'.repeat(101), scope: 'create' },
      { name: 'Hook', scope: '' },
      { name: 'Hook', scope: Array.from({ length: 51 }, (_, i) => `s${i}`).join(' ') },
      { name: 'Hook', scope: `create ${'x'.repeat(101)}` },
    ]) {
      const response = await makeScriptToken(cookie, fields)
      assert.equal(response.status, 400, JSON.stringify(fields))
      // the owner's own form: no app sent them here, so the page does not say to go back to one
      const html = await response.text()
      assert.match(html, /<h1>This form cannot be used<\/h1>/)
      assert.match(html, /Go back and correct what the line below names/)
    }
    const signedOut = await post(`${latch.base}/apps/tokens`, form({ csrf, name: 'Hook', scope: 'create' }), {
      Cookie: `latch_csrf=${csrf}`,
    })
    assert.equal(signedOut.status, 403)
  })

  it('names the session and CSRF cookies __Host- and marks them Secure on an https issuer', async () => {
    const secure = await startLatch({
      PASSWORD_HASH: await hashPassword(password, FAST_COST),
      ISSUER: 'https://auth.example.com',
    })
    after(() => secure.close())
    const page = await fetch(`${secure.base}/apps`)
    const csrf =
      /^__Host-latch_csrf=([A-Za-z0-9_-]{43}); Path=\/; HttpOnly; SameSite=Lax; Priority=High; Secure$/.exec(
        page.headers.get('set-cookie') ?? '',
      )?.[1] ?? ''
    assert.ok(csrf, 'the CSRF cookie is __Host- and Secure too')
    const response = await post(`${secure.base}/sign-in`, form({ csrf, password }), {
      Cookie: `__Host-latch_csrf=${csrf}`,
    })
    assert.match(
      response.headers.get('set-cookie') ?? '',
      /^__Host-latch_session=[A-Za-z0-9_-]{43}; Path=\/; Max-Age=604800; HttpOnly; SameSite=Lax; Priority=High; Secure$/,
    )
  })
})

describe('Session cookies a stranger sends on https', () => {
  it('looks up at most four __Host- session cookies, which no other page can plant more of', async () => {
    const store = new MemoryStore()
    let lookups = 0
    const findSession = store.findSession.bind(store)
    store.findSession = (hash, now) => (lookups++, findSession(hash, now))
    const secure = await startLatch({ PASSWORD_HASH, ISSUER: 'https://auth.example.com' }, { store })
    try {
      // a stranger's own request, not a browser's: each cookie would be a lookup in the store
      const cookie = Array.from({ length: 200 }, () => `__Host-latch_session=${createSecret()}`).join('; ')
      await (await fetch(`${secure.base}/apps`, { headers: { Cookie: cookie } })).text()
      assert.equal(lookups, 4)
    } finally {
      await secure.close()
    }
  })
})

describe('Two Latches under two paths of one https host', () => {
  it('give their __Host- cookies names of their own, so that signing in to one keeps the other', async () => {
    const password = 'correct horse'
    const passwordHash = await hashPassword(password, FAST_COST)
    const names = new Set<string>()
    for (const ISSUER of ['https://example.com/alice', 'https://example.com/bob', 'https://example.com']) {
      const latch = await startLatch({ PASSWORD_HASH: passwordHash, ISSUER })
      try {
        const page = await fetch(`${latch.base}/apps`)
        const [, name, csrf] = /^(__Host-[^=]+)=([^;]+); Path=\/;/.exec(page.headers.get('set-cookie') ?? '') ?? []
        assert.ok(name !== undefined, ISSUER)
        names.add(name)
        const signedIn = await post(`${latch.base}/sign-in`, form({ csrf, password }), { Cookie: `${name}=${csrf}` })
        const session = /^(__Host-latch_session[^=]*)=/.exec(signedIn.headers.get('set-cookie') ?? '')?.[1]
        assert.ok(session !== undefined, ISSUER)
        names.add(session)
      } finally {
        await latch.close()
      }
    }
    assert.equal(names.size, 6) // a CSRF and a session cookie each, all named apart
    assert.ok(names.has('__Host-latch_csrf') && names.has('__Host-latch_session')) // at the root, as before
  })
})

describe('A new PASSWORD_HASH', () => {
  it('ends every session started with the old password, across a restart', async () => {
    const file = join(await mkdtemp(join(tmpdir(), 'latch-password-')), 'data.jsonl')
    const newHash = await hashPassword('battery staple', FAST_COST)
    const serve = async (passwordHash: string) => {
      const store = await FileStore.open(file, { log: () => {} })
      const latch = await startLatch({ PASSWORD_HASH: passwordHash }, { store })
      return { latch, stop: async () => (await latch.close(), await store.close()) }
    }
    const apps = async (latch: TestServer, cookie: string) =>
      (await fetch(`${latch.base}/apps`, { headers: { Cookie: cookie } })).text()
    const first = await serve(PASSWORD_HASH)
    const csrf = createSecret()
    const signedIn = await post(`${first.latch.base}/sign-in`, form({ csrf, password: 'correct horse' }), {
      Cookie: `latch_csrf=${csrf}`,
    })
    const cookie = `latch_csrf=${csrf}; ${(signedIn.headers.get('set-cookie') ?? '').split(';')[0]}`
    assert.match(await apps(first.latch, cookie), /Connected apps/)
    await first.stop()
    const same = await serve(PASSWORD_HASH)
    assert.match(await apps(same.latch, cookie), /Connected apps/) // a restart alone keeps the owner signed in
    await same.stop()
    const changed = await serve(newHash)
    assert.match(await apps(changed.latch, cookie), /type="password"/)
    await changed.stop()
  })
})

describe('Passkeys only (PASSWORD_SIGN_IN=off), and passkeys in the journal', () => {
  const PHONE: Passkey = {
    name: 'Phone',
    publicKey: 'MCowBQYDK2VwAyEA', // never checked here: no signature is
    algorithm: -8,
    counter: 0,
    addedAt: START,
    lastUsedAt: undefined,
  }
  const onLocalhost = { PASSWORD_HASH, ISSUER: 'http://localhost:3000' }

  /** A store holding the passkey PHONE and a live session of the owner's password, whose cookie value it returns. */
  const storeWithPhoneAndSession = async () => {
    const store = new MemoryStore()
    await store.savePasskey('credential-1', PHONE, START)
    const session = createSecret()
    const passwordTag = hashSecret(`latch session ${PASSWORD_HASH}`)
    await store.saveSession(hashSecret(session), { createdAt: START, expiresAt: START + 3_600_000, passwordTag }, START)
    return { store, session }
  }

  it('is a setting that needs a password, a host name where passkeys work, and on or off', () => {
    assert.equal(loadConfig(onLocalhost).passwordSignIn, true)
    assert.equal(loadConfig({ ...onLocalhost, PASSWORD_SIGN_IN: 'off' }).passwordSignIn, false)
    assert.throws(
      () => loadConfig({ PASSWORD_SIGN_IN: 'off', ISSUER: 'http://localhost:3000' }),
      (err: Error) => err instanceof ConfigError && /needs|not set: set PASSWORD_HASH/.test(err.message),
    )
    assert.throws(
      () => loadConfig({ PASSWORD_HASH, PASSWORD_SIGN_IN: 'off' }),
      (err: Error) => err instanceof ConfigError && /need this server to be reached by a host name/.test(err.message),
    )
    // the name offered is this server's own, on its port and path
    for (const [issuer, offered] of [
      ['http://127.0.0.1:47123/latch', 'http://localhost:47123/latch'],
      ['http://[::1]', 'http://localhost'],
      ['https://192.0.2.7', 'https://auth.example.com'],
    ])
      assert.throws(
        () => loadConfig({ PASSWORD_HASH, PASSWORD_SIGN_IN: 'off', ISSUER: issuer }),
        (err: Error) => err instanceof ConfigError && err.message.includes(`such as ${offered}`),
        issuer,
      )
    // plain http on a name other than localhost: no browser offers passkeys there
    assert.throws(
      () => loadConfig({ PASSWORD_HASH, PASSWORD_SIGN_IN: 'off', ISSUER: 'http://latch.test:3000' }),
      (err: Error) => err instanceof ConfigError && /Passkeys need https, or http on localhost/.test(err.message),
    )
    for (const issuer of ['http://auth.localhost:3000', 'http://localhost.:3000', 'https://latch.test'])
      assert.equal(loadConfig({ PASSWORD_HASH, PASSWORD_SIGN_IN: 'off', ISSUER: issuer }).passwordSignIn, false, issuer)
    assert.throws(
      () => loadConfig({ ...onLocalhost, PASSWORD_SIGN_IN: 'no' }),
      (err: Error) => err instanceof ConfigError && /PASSWORD_SIGN_IN no is not a choice/.test(err.message),
    )
  })

  it('offers only the passkey on the sign-in and consent pages, and refuses the password', async () => {
    const store = new MemoryStore()
    await store.savePasskey('credential-1', PHONE, START)
    const latch = await startLatch({ ...onLocalhost, PASSWORD_SIGN_IN: 'off' }, { store })
    try {
      const page = await fetch(`${latch.base}/apps`)
      const html = await page.text()
      assert.doesNotMatch(html, /type="password"/)
      assert.match(html, />Sign in with a passkey</)
      assert.match(page.headers.get('content-security-policy') ?? '', /script-src http:\/\/localhost:3000\/passkey\.js/)
      const csrf = /name="csrf" value="([^"]+)"/.exec(html)?.[1] ?? ''
      const cookie = (page.headers.get('set-cookie') ?? '').split(';')[0]
      const refused = await post(`${latch.base}/sign-in`, form({ csrf, password: 'correct horse' }), { Cookie: cookie })
      assert.equal(refused.status, 403)
      assert.match(await refused.text(), /Password sign-in is off: sign in with a passkey/)
      assert.equal(refused.headers.get('set-cookie'), null)
      const consent = await openConsent(latch)
      assert.doesNotMatch(consent.html, /type="password"|value="approve">Approve</)
      assert.match(consent.html, /name="decision" value="approve" hidden>Approve with a passkey</)
      assert.equal((await submitConsent(latch, consent, { password: 'correct horse' })).status, 403)
    } finally {
      await latch.close()
    }
  })

  it('refuses every form of the owner to a visitor without a session with 403, and shows or changes nothing', async () => {
    const { store, session } = await storeWithPhoneAndSession()
    const latch = await startLatch(onLocalhost, { store })
    try {
      const token = await obtainToken(latch, { password: 'correct horse' })
      const [[grant]] = await store.listGrants(START)
      const csrf = createSecret() // the stranger's own CSRF cookie, and the form value that goes with it
      for (const [path, fields] of [
        ['/apps/revoke', { grant }],
        ['/apps/revoke', { grant: 'nonsense' }],
        ['/apps/revoke-all', { confirm: 'yes' }],
        ['/passkeys/remove', { credential: 'credential-1' }],
        ['/sign-out-everywhere', {}],
      ] as const) {
        const response = await post(`${latch.base}${path}`, form({ csrf, ...fields }), { Cookie: `latch_csrf=${csrf}` })
        assert.equal(response.status, 403, path)
        const page = await response.text()
        assert.doesNotMatch(page, new RegExp(`credential-1|${grant}`), path)
        assert.match(page, /sign in again on your apps page/, path) // where to go next
      }
      assert.equal((await introspect(latch, token)).active, true)
      assert.ok(await store.findPasskey('credential-1'))
      assert.ok(await store.findSession(hashSecret(session), START))
    } finally {
      await latch.close()
    }
  })

  it('keeps the last passkey while password sign-in is off', async () => {
    const { store, session } = await storeWithPhoneAndSession()
    const latch = await startLatch({ ...onLocalhost, PASSWORD_SIGN_IN: 'off' }, { store })
    try {
      const cookie = `latch_session=${session}`
      const apps = await (await fetch(`${latch.base}/apps`, { headers: { Cookie: cookie } })).text()
      assert.match(apps, /<h3><bdi>Phone<\/bdi><\/h3>/)
      const csrf = /name="csrf" value="([^"]+)"/.exec(apps)?.[1] ?? ''
      const removal = form({ csrf, credential: 'credential-1' })
      const refused = await post(`${latch.base}/passkeys/remove`, removal, { Cookie: cookie })
      assert.equal(refused.status, 409)
      assert.match(await refused.text(), /This is your last passkey, and password sign-in is off/)
      assert.equal((await store.findPasskey('credential-1'))?.name, 'Phone')
    } finally {
      await latch.close()
    }
  })

  it('keeps passkeys in the journal across restarts and compaction, and forgets a removed one', async () => {
    const file = join(await mkdtemp(join(tmpdir(), 'latch-passkeys-')), 'data.jsonl')
    const first = await FileStore.open(file, { log: () => {} })
    await first.savePasskey('credential-1', PHONE, START)
    await first.savePasskey('credential-2', { ...PHONE, name: 'Laptop' }, START)
    await first.savePasskey('credential-1', { ...PHONE, counter: 7, lastUsedAt: START + 1000 }, START)
    await first.deletePasskey('credential-2')
    await first.close()
    const second = await FileStore.open(file, { log: () => {} })
    assert.deepEqual(await second.listPasskeys(), [
      ['credential-1', { ...PHONE, counter: 7, lastUsedAt: START + 1000 }],
    ])
    const snapshot = [...second.memory.records(START)]
    assert.deepEqual(
      snapshot.filter((record) => 'set' in record && record.set === 'passkey').map((record) => record.key),
      ['credential-1'],
    )
    await second.close()
  })
})

describe('Token lifetime on the consent page', () => {
  let latch: TestServer
  before(async () => (latch = await startLatch({ ACCESS_TOKEN_TTL: '3d' })))
  after(() => latch.close())

  it('offers 1 day to 1 year with ACCESS_TOKEN_TTL added, and "until you revoke it", chosen by default', async () => {
    const { html } = await openConsent(latch)
    const options = [...html.matchAll(/<option value="(\d+)"( selected)?>([^<]+)<\/option>/g)].map((match) => [
      match[1],
      match[3],
      match[2] === ' selected',
    ])
    assert.deepEqual(options, [
      ['86400', '1 day', false],
      ['259200', '3 days', false],
      ['604800', '1 week', false],
      ['2592000', '1 month', false],
      ['7776000', '3 months', false],
      ['31536000', '1 year', false],
      ['0', 'until you revoke it', true],
    ])
  })

  it('refuses a code redeemed after the lifetime the owner chose has ended, though the code still lives', async () => {
    const short = await startLatch({ ACCESS_TOKEN_TTL: '100', CODE_TTL: '600' })
    try {
      const code = await obtainCode(short, {}, { lifetime: '100' })
      short.advance(200)
      await assertError(await exchange(short, code), 400, 'invalid_grant')
    } finally {
      await short.close()
    }
  })

  it('names an ACCESS_TOKEN_TTL of hours or minutes as people say them', async () => {
    for (const [ttl, label] of [
      ['1h', '1 hour'],
      ['90m', '90 minutes'],
      ['100', '100 seconds'],
    ]) {
      const other = await startLatch({ ACCESS_TOKEN_TTL: ttl })
      try {
        assert.match((await openConsent(other)).html, new RegExp(`<option value="\\d+">${label}</option>`))
      } finally {
        await other.close()
      }
    }
  })

  const refresh = (refreshToken: string) =>
    post(
      `${latch.base}/token`,
      form({ grant_type: 'refresh_token', refresh_token: refreshToken, client_id: CLIENT_ID }),
    )

  it('ends the whole grant when the chosen lifetime ends: refreshing too, and /apps shows the date', async () => {
    const code = await obtainCode(latch, {}, { lifetime: '86400' })
    const first = (await (await exchange(latch, code)).json()) as { expires_in: number; refresh_token: string }
    assert.equal(first.expires_in, 86400)
    latch.advance(12 * 3600)
    const second = (await (await refresh(first.refresh_token)).json()) as { expires_in: number; refresh_token: string }
    assert.equal(second.expires_in, 12 * 3600) // what is left of the day, not another day
    latch.advance(12 * 3600)
    const ended = await refresh(second.refresh_token)
    assert.equal(ended.status, 400)
    assert.equal(((await ended.json()) as { error: string }).error, 'invalid_grant')
  })

  it('rounds expires_in down where the approval’s end cuts a token short, and issues none with under a second left', async () => {
    latch.advance(0.9) // the approval begins, and so ends, at .900 of a second
    const code = await obtainCode(latch, {}, { lifetime: '86400' })
    const first = (await (await exchange(latch, code)).json()) as { refresh_token: string }
    latch.advance(86400 - 1.5) // 1.5 seconds before the day ends
    const last = (await (await refresh(first.refresh_token)).json()) as Record<string, string> & { expires_in: number }
    assert.equal(last.expires_in, 1)
    latch.advance(last.expires_in - 0.001)
    assert.equal((await introspect(latch, last.access_token)).active, true)
    // less than a second left: no token, rather than one whose expires_in of 0 says it is dead already
    const late = await refresh(last.refresh_token)
    assert.equal(late.status, 400)
    assert.equal(((await late.json()) as { error: string }).error, 'invalid_grant')
    latch.advance(0.601) // back to a whole second, for the tests after
  })

  it('gives "until you revoke it" tokens of ACCESS_TOKEN_TTL that refresh past any other choice', async () => {
    const code = await obtainCode(latch, {}, { lifetime: '0' })
    let tokens = (await (await exchange(latch, code)).json()) as { expires_in: number; refresh_token: string }
    assert.equal(tokens.expires_in, 259200)
    for (let day = 0; day < 400; day += 20) {
      latch.advance(20 * 86400)
      const response = await refresh(tokens.refresh_token)
      assert.equal(response.status, 200, `day ${day + 20}`)
      tokens = (await response.json()) as typeof tokens
    }
  })

  it('refuses a lifetime it did not offer', async () => {
    const response = await submitConsent(latch, await openConsent(latch), { lifetime: '999' })
    assert.equal(response.status, 400)
  })
})

describe('Pages that explain themselves', () => {
  const password = 'correct horse'
  let open: TestServer
  let locked: TestServer
  before(async () => {
    open = await startLatch()
    locked = await startLatch({ PASSWORD_HASH: await hashPassword(password, FAST_COST), ME: 'https://example.com/' })
  })
  after(async () => {
    await open.close()
    await locked.close()
  })

  it('names the app in the heading (its host without a name) and says when anyone could approve', async () => {
    const { html } = await openConsent(open)
    assert.match(html, /<h1>Sign in to <bdi>127\.0\.0\.1:8080<\/bdi><\/h1>/)
    assert.match(html, /class="warning">This server has no password: anyone who can open this page could approve/)
    assert.match(html, /href="[^"]*\/apps">your apps<\/a>/)
    assert.doesNotMatch((await openConsent(locked)).html, /has no password/)
  })

  it('shows the consent form again on a lockout, with the time to wait', async () => {
    const consent = await openConsent(locked)
    let response: Response | undefined
    for (let attempt = 0; attempt < 7; attempt++) {
      response = await submitConsent(locked, consent, { password: 'wrong guess' })
      if (response.status === 429) break
    }
    assert.equal(response?.status, 429)
    const html = await response.text()
    assert.match(html, /Too many wrong passwords: try again in \d+ seconds/)
    assert.match(html, /type="password"/) // the form is there again
    assert.match(response.headers.get('retry-after') ?? '', /^\d+$/)
    locked.advance(Number(response.headers.get('retry-after')) - 1)
    const last = await submitConsent(locked, consent, { password: 'wrong guess' })
    assert.equal(last.status, 429)
    assert.match(await last.text(), /try again in 1 second</)
  })

  it('counts the wrong passwords of an IPv6 /64 together, as one host may use any address in it', async () => {
    const proxied = await startLatch({
      PASSWORD_HASH: await hashPassword(password, FAST_COST),
      TRUST_PROXY: '127.0.0.1',
    })
    try {
      const consent = await openConsent(proxied)
      const from = (address: string) =>
        post(
          `${proxied.base}/auth/consent`,
          form({ request: consent.request, csrf: consent.csrf, decision: 'approve', password: 'wrong guess' }),
          { Cookie: consent.cookie, 'X-Forwarded-For': address },
        )
      const statuses: number[] = []
      for (let attempt = 1; attempt <= 7; attempt++) statuses.push((await from(`2001:db8:1:2::${attempt}`)).status)
      assert.deepEqual(statuses, [401, 401, 401, 401, 401, 401, 429]) // five free, the sixth locks
      assert.equal((await from('2001:db8:1:2:ffff::8')).status, 429)
      assert.equal((await from('2001:db8:1:3::1')).status, 401) // another /64: another host
      assert.match(proxied.logs.join('\n'), /security: too many wrong passwords from 2001:db8:1:2::\/64/)
    } finally {
      await proxied.close()
    }
  })

  it('answers a browser with a page for 404 and 405, and a program with JSON', async () => {
    const html = { Accept: 'text/html,application/xhtml+xml,*/*;q=0.8' }
    const missing = await fetch(`${open.base}/nothing-here`, { headers: html })
    assert.equal(missing.status, 404)
    assert.match(missing.headers.get('content-type') ?? '', /^text\/html/)
    const page = await missing.text()
    assert.ok(page.indexOf('There is nothing here') < page.indexOf('not_found'), 'the person first, the detail after')
    const wrongMethod = await fetch(`${open.base}/token`, { method: 'PUT', headers: html })
    assert.equal(wrongMethod.status, 405)
    assert.match(wrongMethod.headers.get('content-type') ?? '', /^text\/html/)
    assert.equal(wrongMethod.headers.get('allow'), 'GET, HEAD, POST')
    const program = await fetch(`${open.base}/nothing-here`)
    assert.equal(program.headers.get('content-type'), 'application/json')
  })
})

describe('closeLatchServer, as an embedding app stops', () => {
  it('closes idle connections at once, and cuts off after 5 s one that never sent a whole request', async (t) => {
    const server = createLatchServer() // Latch's own timeouts: such a connection may stay a minute
    server.on('request', createHandler({ config: loadConfig({ DATA_FILE: 'memory' }), log: () => {} }))
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
    const { port } = server.address() as AddressInfo
    const sockets = [0, 1, 2].map(() => connect(port, '127.0.0.1').on('error', () => {}))
    await Promise.all(sockets.map((socket) => once(socket, 'connect')))
    const [idle, silent, half] = sockets
    idle.write(`GET /.well-known/oauth-authorization-server HTTP/1.1\r\nHost: 127.0.0.1:${port}\r\n\r\n`)
    await once(idle, 'data') // answered, and kept alive
    half.write(`GET /.well-known/oauth-authorization-server HTTP/1.1\r\nHost: 127.0.0.1:${port}\r\n`)
    await new Promise((resolve) => setImmediate(resolve))
    t.mock.timers.enable({ apis: ['setTimeout', 'setInterval'] })
    let stopped = false
    const stopping = closeLatchServer(server).then(() => (stopped = true))
    await once(idle, 'close')
    assert.equal(stopped, false) // the silent and the half-sent connection still hold it
    assert.equal(silent.destroyed || half.destroyed, false)
    t.mock.timers.tick(5_000)
    await stopping
    await Promise.all([silent, half].map((socket) => socket.destroyed || once(socket, 'close')))
  })
})

describe('closeLatchServer: a request cut off', () => {
  it('resolves once the request of a connection cut off at 5 s is logged, as the command then exits', async (t) => {
    const logs: string[] = []
    const server = createLatchServer()
    server.on('request', createHandler({ config: loadConfig({ DATA_FILE: 'memory' }), log: (line) => logs.push(line) }))
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
    const socket = connect((server.address() as AddressInfo).port, '127.0.0.1').on('error', () => {})
    const requested = once(server, 'request')
    socket.write(
      'POST /token HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-www-form-urlencoded\r\n' +
        'Content-Length: 100\r\n\r\ngrant_type=auth', // the rest of its body never comes
    )
    await requested // the handler is reading the body
    t.mock.timers.enable({ apis: ['setTimeout', 'setInterval'] })
    const stopping = closeLatchServer(server)
    t.mock.timers.tick(5_000)
    await stopping
    assert.equal(
      logs.filter((line) => line.includes('POST /token closed before the answer')).length,
      1,
      logs.join('\n'),
    )
  })
})

describe('closeLatchServer: a request in flight', () => {
  it('answers a request in flight at the stop with Connection: close, and then closes its connection', async () => {
    const store = new MemoryStore()
    let release = () => {}
    let reached = () => {}
    const held = new Promise<void>((resolve) => (release = resolve))
    const asked = new Promise<void>((resolve) => (reached = resolve))
    const findToken = store.findToken.bind(store)
    store.findToken = async (...args) => (reached(), await held, findToken(...args)) // the answer is still being made
    const server = createLatchServer()
    server.on('request', createHandler({ config: loadConfig({ DATA_FILE: 'memory' }), store, log: () => {} }))
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
    const socket = connect((server.address() as AddressInfo).port, '127.0.0.1')
    const body = `token=${createSecret()}`
    socket.write(
      'POST /introspect HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-www-form-urlencoded\r\n' +
        `Content-Length: ${body.length}\r\n\r\n${body}`,
    )
    let answer = ''
    socket.on('data', (chunk) => (answer += chunk))
    await asked
    const stopping = closeLatchServer(server)
    release()
    await once(socket, 'close') // closed by the server once answered, not left waiting to be idle
    await stopping
    assert.match(answer, /^HTTP\/1\.1 200 /)
    assert.match(answer, /\r\nConnection: close\r\n/i)
  })
})

describe('Slow clients', () => {
  // Node's own timers close these connections, so these tests wait for real, briefly.
  const timeouts = { headersMs: 300, requestMs: 600, keepAliveMs: 200, checkEveryMs: 50, idleMs: 1_000 }

  const holdOpen = async (send: string): Promise<{ closedAfterMs: number; answer: string }> => {
    const server = createLatchServer(timeouts)
    server.on('request', createHandler({ config: loadConfig({ DATA_FILE: 'memory' }), log: () => {} }))
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
    const started = Date.now()
    const socket = connect((server.address() as AddressInfo).port, '127.0.0.1')
    socket.write(send)
    let answer = ''
    socket.on('data', (chunk) => (answer += chunk))
    await new Promise((resolve) => socket.on('close', resolve))
    await new Promise((resolve) => server.close(resolve))
    return { closedAfterMs: Date.now() - started, answer }
  }

  it(
    'takes at most so many connections from one address, and in all, and closes the next at once',
    { timeout: 30_000 },
    async () => {
      const limits = { total: 6, perAddress: 4, groupOf: (address: string) => address } // loopback too
      const logs: string[] = []
      const server = createLatchServer(undefined, limits, (line) => logs.push(line))
      server.on('request', createHandler({ config: loadConfig({ DATA_FILE: 'memory' }), log: () => {} }))
      await new Promise<void>((resolve) => server.listen(0, '::', resolve)) // both 127.0.0.1 and ::1
      const port = (server.address() as AddressInfo).port
      const sockets: Socket[] = []
      const open = (host: string) => {
        const socket = connect(port, host).on('error', () => {})
        sockets.push(socket)
        return socket
      }
      const closed = (socket: Socket) => new Promise((resolve) => socket.on('close', resolve))
      let count = 0
      const connections = async (expected: number) => {
        await until(() => (void server.getConnections((_err, now) => (count = now)), count === expected), 10_000)
        return count
      }
      try {
        const four = Array.from({ length: 4 }, () => open('127.0.0.1'))
        assert.equal(await connections(4), 4)
        await closed(open('127.0.0.1')) // a fifth from that address
        const other = [open('::1'), open('::1')] // another address, up to six in all
        assert.equal(await connections(6), 6)
        await closed(open('::1')) // a seventh in all
        // said at once; the second, within the minute, is counted for the line that ends it
        assert.deepEqual(logs, [
          'security: a connection from ::ffff:127.0.0.1 was closed at once, past 4 from one client',
        ])
        four[0].destroy()
        other[0].destroy()
        assert.equal(await connections(4), 4)
        const metadata = await fetch(`http://127.0.0.1:${port}/.well-known/oauth-authorization-server`)
        assert.equal(metadata.status, 200)
      } finally {
        for (const socket of sockets) socket.destroy()
        server.closeAllConnections()
        await new Promise((resolve) => server.close(resolve))
      }
    },
  )

  it('answers nine requests sent at once on one connection, and closes one that sends ten, answering none past them', async () => {
    const logs: string[] = []
    const store = new MemoryStore()
    const server = createLatchServer(undefined, CONNECTION_LIMITS, (line) => logs.push(line))
    server.on('request', createHandler({ config: loadConfig({ DATA_FILE: 'memory' }), store, log: () => {} }))
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
    const port = (server.address() as AddressInfo).port
    const consent = new URL(authorizationUrl({ base: `http://127.0.0.1:${port}` } as TestServer))
    const pipeline = async (count: number) => {
      const socket = connect(port, '127.0.0.1')
      let received = ''
      socket.on('data', (chunk: Buffer) => (received += chunk.toString('latin1')))
      const request = `GET ${consent.pathname}${consent.search} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n` // a page each
      socket.write(request.repeat(count)) // one write: node:http reads them all before answering one
      const closed = once(socket, 'close')
      await until(() => (received.match(/HTTP\/1\.1 200 /g) ?? []).length === count || socket.closed, 10_000)
      socket.destroy()
      await closed
      return (received.match(/HTTP\/1\.1 200 /g) ?? []).length
    }
    try {
      assert.equal(await pipeline(9), 9)
      assert.deepEqual(logs, [])
      assert.equal(store.pending.size, 9)
      assert.ok((await pipeline(200)) < 10)
      assert.deepEqual(logs, ['security: a connection from 127.0.0.1 was closed at once, past 8 answers waiting'])
      assert.equal(store.pending.size, 9 + 9, 'requests on the closed connection were opened all the same')
    } finally {
      server.closeAllConnections()
      await new Promise((resolve) => server.close(resolve))
    }
  })

  it('answers CONNECT, which asks for a tunnel, with 405 instead of closing the connection without a word', async () => {
    const server = createLatchServer()
    server.on('request', createHandler({ config: loadConfig({ DATA_FILE: 'memory' }), log: () => {} }))
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
    try {
      const socket = connect((server.address() as AddressInfo).port, '127.0.0.1')
      socket.end('CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n')
      let text = ''
      for await (const chunk of socket) text += String(chunk)
      assert.match(text, /^HTTP\/1\.1 405 Method Not Allowed\r\n/)
      assert.match(text, /\r\nAllow: GET, POST, OPTIONS\r\n/)
      // a client that keeps its side open: node:http no longer watches the socket, so Latch closes it
      const held = connect({ port: (server.address() as AddressInfo).port, host: '127.0.0.1', allowHalfOpen: true })
      held.write('CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n')
      held.resume()
      await once(held, 'end')
      let open = -1
      const closed = await until(() => (void server.getConnections((_err, count) => (open = count)), open === 0))
      held.destroy()
      assert.ok(closed, 'the tunnel asked for is still open on the server')
    } finally {
      await new Promise((resolve) => server.close(resolve))
    }
  })

  it('says the first connection closed for a limit at once, then how many a minute while more come', async (t) => {
    t.mock.timers.enable({ apis: ['setTimeout'] })
    const logs: string[] = []
    const limits = { total: 1, perAddress: 100, groupOf: () => undefined }
    const server = createLatchServer(undefined, limits, (line) => logs.push(line))
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
    const port = (server.address() as AddressInfo).port
    const open = () => connect(port, '127.0.0.1').on('error', () => {})
    const closed = (socket: Socket) => new Promise((resolve) => socket.on('close', resolve))
    const held = open()
    try {
      await new Promise((resolve) => server.once('connection', resolve))
      await closed(open())
      assert.deepEqual(logs, ['security: a connection from 127.0.0.1 was closed at once, past 1 in all'])
      await closed(open())
      await closed(open())
      assert.equal(logs.length, 1)
      t.mock.timers.tick(60_000)
      assert.deepEqual(logs.slice(1), [
        'security: connections closed at once in the last minute: 2 past 1 in all (the last from 127.0.0.1)',
      ])
      t.mock.timers.tick(60_000) // a quiet minute: nothing to say, and the next is said at once again
      assert.equal(logs.length, 2)
      await closed(open())
      assert.equal(logs.length, 3)
    } finally {
      held.destroy()
      server.closeAllConnections()
      await new Promise((resolve) => server.close(resolve))
    }
  })

  it('keeps the defaults every Latch in a process shares from being changed by one of them', () => {
    assert.throws(() => Object.assign(CONNECTION_LIMITS, { perAddress: 1 }), TypeError)
    assert.throws(() => Object.assign(SETTINGS[0], { default: '80' }), TypeError)
    assert.equal(loadConfig({}).port, 3000)
  })

  it('counts an IPv6 client by its /64, an IPv4 one by its address, and does not limit loopback', () => {
    const { groupOf } = CONNECTION_LIMITS
    assert.equal(groupOf('2001:db8:1:2::1'), groupOf('2001:db8:1:2:ffff:1:2:3'))
    assert.equal(groupOf('2001:db8:1:2::1'), '2001:db8:1:2::/64')
    assert.equal(groupOf('2001:db8::1'), '2001:db8::/64')
    assert.equal(groupOf('fe80::1%eth0'), 'fe80::/64')
    assert.notEqual(groupOf('2001:db8:1:2::1'), groupOf('2001:db8:1:3::1'))
    // an IPv4 client carried in IPv6 is that IPv4 client: NAT64 gives every one the same /64
    assert.equal(groupOf('64:ff9b::192.0.2.1'), '192.0.2.1')
    assert.notEqual(groupOf('64:ff9b::192.0.2.1'), groupOf('64:ff9b::198.51.100.7'))
    assert.equal(groupOf('::ffff:192.0.2.1'), '192.0.2.1')
    assert.equal(groupOf('192.0.2.1'), '192.0.2.1')
    for (const loopback of ['127.0.0.1', '127.1.2.3', '::1', '::ffff:127.0.0.1'])
      assert.equal(groupOf(loopback), undefined)
  })

  it('closes a connection whose headers never finish (slowloris)', async () => {
    const { closedAfterMs, answer } = await holdOpen('GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ')
    assert.ok(closedAfterMs < 3000, `closed after ${closedAfterMs} ms`)
    assert.match(answer, /^HTTP\/1\.1 408/)
  })

  it('closes a connection that never sends a byte', async () => {
    const { closedAfterMs } = await holdOpen('')
    assert.ok(closedAfterMs < 3000, `closed after ${closedAfterMs} ms`)
  })

  it('closes a connection whose body never finishes', async () => {
    const head =
      'POST /token HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: 100\r\n\r\ncode=abc'
    const { closedAfterMs } = await holdOpen(head)
    assert.ok(closedAfterMs < 3000, `closed after ${closedAfterMs} ms`)
  })

  it('closes a connection whose client stopped reading its answer', { timeout: 30_000 }, async () => {
    const server = createLatchServer(timeouts)
    // an answer larger than the buffers between the two, so that node:http waits to write the rest
    const size = 32 * 1024 * 1024
    server.on('request', (_req, res: ServerResponse) => res.end(Buffer.alloc(size)))
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
    let count = -1
    const connections = () => (void server.getConnections((_err, now) => (count = now)), count)
    const socket = connect((server.address() as AddressInfo).port, '127.0.0.1').on('error', () => {})
    try {
      socket.pause() // reads nothing
      socket.write('GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n')
      assert.ok(await until(() => connections() === 1, 10_000), 'the connection is open')
      // the request came whole, and the answer never finishes: no other timeout applies
      assert.ok(await until(() => connections() === 0, 20_000), `${count} connection still open`)
      // what the client finds once it reads again: the connection ended before the answer did
      let received = 0
      socket.on('data', (chunk: Buffer) => (received += chunk.length)).resume()
      await new Promise((resolve) => socket.on('close', resolve))
      assert.ok(received < size, `${received} bytes received`)
    } finally {
      socket.destroy()
      await new Promise((resolve) => server.close(resolve))
    }
  })

  it(
    'closes a connection that sent bytes which are no request and does not read its answer',
    { timeout: 20_000 },
    async () => {
      const server = createLatchServer(timeouts)
      const size = 32 * 1024 * 1024 // more than the buffers between the two hold: the answer waits on the client
      server.on('request', (_req, res: ServerResponse) => res.end(Buffer.alloc(size)))
      await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
      let count = -1
      const connections = () => (void server.getConnections((_err, now) => (count = now)), count)
      const socket = connect((server.address() as AddressInfo).port, '127.0.0.1').on('error', () => {})
      const trickle = setInterval(() => socket.write('X'), 50) // a byte now and then, as if still sending
      try {
        socket.pause() // reads nothing
        socket.write('GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nGARBAGE\0\r\n\r\n')
        assert.ok(await until(() => connections() === 1, 5_000), 'the connection is open')
        assert.ok(await until(() => connections() === 0, 5_000), `${count} connection still open`)
      } finally {
        clearInterval(trickle)
        socket.destroy()
        await new Promise((resolve) => server.close(resolve))
      }
    },
  )

  it('answers every request made before bytes that are no request, in order, then closes', async () => {
    const server = createLatchServer(timeouts)
    // the first answer comes later than the second, which waits behind it
    server.on('request', (req, res: ServerResponse) =>
      req.url === '/first' ? setTimeout(() => res.end('first'), 50) : res.end('second'),
    )
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
    try {
      const socket = connect((server.address() as AddressInfo).port, '127.0.0.1')
      const request = (path: string) => `GET ${path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n`
      socket.write(`${request('/first')}${request('/second')}GARBAGE\0\r\n\r\n`)
      let answer = ''
      socket.on('data', (chunk) => (answer += chunk))
      await new Promise((resolve) => socket.on('close', resolve))
      const statuses = answer.match(/HTTP\/1\.1 \d{3}/g) ?? []
      assert.deepEqual(statuses, ['HTTP/1.1 200', 'HTTP/1.1 200'], answer)
      assert.ok(answer.endsWith('second'), answer)
    } finally {
      await new Promise((resolve) => server.close(resolve))
    }
  })

  it('does not close a connection while the server is still making its answer', { timeout: 10_000 }, async () => {
    const server = createLatchServer(timeouts)
    // answers only once the connection has been idle for longer than the idle timeout
    server.on('request', (req, res: ServerResponse) => void once(req.socket, 'timeout').then(() => res.end('made')))
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
    try {
      const response = await fetch(`http://127.0.0.1:${(server.address() as AddressInfo).port}/`)
      assert.equal(response.status, 200)
      assert.equal(await response.text(), 'made')
    } finally {
      server.closeAllConnections()
      await new Promise((resolve) => server.close(resolve))
    }
  })

  it('closes an idle kept-alive connection', async () => {
    const { closedAfterMs, answer } = await holdOpen(
      'GET /.well-known/oauth-authorization-server HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n',
    )
    assert.match(answer, /^HTTP\/1\.1 200/)
    assert.ok(closedAfterMs < 3000, `closed after ${closedAfterMs} ms`)
  })
})

describe('GET / (home page)', () => {
  it('shows the link tags the owner pastes into their site', async () => {
    const latch = await startLatch()
    const response = await fetch(`${latch.base}/`)
    assert.equal(response.status, 200)
    assert.equal(response.headers.get('x-frame-options'), 'DENY')
    const html = await response.text()
    assert.ok(
      html.includes(
        `&#60;link rel=&#34;indieauth-metadata&#34; href=&#34;${latch.issuer}/.well-known/oauth-authorization-server&#34;&#62;`,
      ),
    )
    assert.ok(html.includes('rel=&#34;authorization_endpoint&#34;'))
    assert.ok(html.includes('rel=&#34;token_endpoint&#34;'))
    const head = await fetch(`${latch.base}/`, { method: 'HEAD' })
    assert.equal(head.status, 200) // IndieAuth discovery may start with HEAD
    assert.equal(head.headers.get('link'), response.headers.get('link'))
    assert.equal(
      response.headers.get('link'),
      `<${latch.issuer}/.well-known/oauth-authorization-server>; rel="indieauth-metadata", <${latch.issuer}/auth>; rel="authorization_endpoint", <${latch.issuer}/token>; rel="token_endpoint"`,
    )
    await latch.close()
  })
})

describe('Router and errors', () => {
  let latch: TestServer
  before(async () => (latch = await startLatch()))
  after(() => latch.close())

  it("says, at a path of its own under ISSUER's path, that the path must be taken off before Latch", async () => {
    const mounted = await startLatch({ ISSUER: 'http://127.0.0.1:3000/latch' }) // behind a proxy that should strip it
    try {
      const base = `http://127.0.0.1:${mounted.port}`
      for (const path of ['/latch/.well-known/oauth-authorization-server', '/latch', '/latch/token']) {
        const response = await fetch(`${base}${path}`)
        assert.equal(response.status, 404, path)
        const { error_description } = (await response.json()) as { error_description: string }
        assert.match(error_description, /begins with the path of ISSUER, \/latch, which must be taken off/, path)
      }
      const elsewhere = (await (await fetch(`${base}/latch/nothing`)).json()) as { error_description: string }
      assert.equal(elsewhere.error_description, 'There is no endpoint at this path')
    } finally {
      await mounted.close()
    }
  })

  it('answers an unknown path with 404 not_found', async () => {
    await assertError(await fetch(`${latch.base}/nope`), 404, 'not_found')
  })

  it("has the README's table of endpoints as its route table: the same rows, columns and order", async () => {
    const { readFile } = await import('node:fs/promises')
    const root = fileURLToPath(new URL('.', import.meta.url))
    const source = await readFile(join(root, 'server.ts'), 'utf8')
    const table = /const ROUTES: Route\[\] = \[\n([^]*?)\n\]/.exec(source)?.[1] ?? ''
    const routes = [...table.matchAll(/route\('([^']+)', +'([^']+)', +\w+, +'(\w+)', +'(\w*)', +'([^']*)'\)/g)].map(
      ([, path, methods, errors, cors, spec]) => [methods, path, errors, cors === 'CORS', spec],
    )
    assert.equal(routes.length, table.split('\n').length) // every row was read
    const readme = await readFile(join(root, 'README.md'), 'utf8')
    const section = readme.slice(readme.indexOf('## Endpoints'), readme.indexOf('\nErrors are'))
    const rows = [...section.matchAll(/^\| (`[^|]+`) \| [^\n]*? \| (page|JSON) \| (yes)? *\| *([^|]*?) *\|$/gm)].map(
      ([, target, errors, cors, spec]) => {
        const words = target.replaceAll('`', '').replaceAll(',', '').split(' ')
        return [words.slice(0, -1).join(' '), words.at(-1), errors.toLowerCase(), cors === 'yes', spec]
      },
    )
    assert.equal(rows.length, section.match(/^\| `/gm)?.length) // every row was read
    assert.deepEqual(rows, routes)
  })

  it('answers a known path with another method with 405 and Allow', async () => {
    const response = await fetch(`${latch.base}/introspect`)
    await assertError(response, 405, 'method_not_allowed')
    assert.equal(response.headers.get('allow'), 'POST')
    assert.equal((await fetch(`${latch.base}/auth`, { method: 'PUT' })).headers.get('allow'), 'GET, HEAD, POST')
  })

  it('hides the detail of an unexpected failure behind 500 server_error, and logs it', async () => {
    const store = new MemoryStore()
    store.findToken = async () => {
      throw new Error('disk on fire')
    }
    const broken = await startLatch({}, { store })
    const response = await post(`${broken.base}/introspect`, form({ token: createSecret() }))
    assert.equal(response.status, 500)
    assert.equal(await response.text(), '{"error":"server_error"}')
    assert.ok(broken.logs.some((line) => line.includes('disk on fire')))
    await broken.close()
  })

  it('answers a change the data file did not take with a 500 page that says so, and logs no failure of its own', async () => {
    const store = new MemoryStore()
    fillDisk(store, 'saveCode')
    const password = 'correct horse battery staple'
    const latch = await startLatch({ PASSWORD_HASH: await hashPassword(password, FAST_COST) }, { store })
    const refused = await submitConsent(latch, await openConsent(latch), { password })
    assert.equal(refused.status, 500)
    const page = await refused.text()
    assert.match(page, /The change could not be stored, so it did not happen: try again later/)
    assert.match(page, /server_error, HTTP 500/)
    assert.doesNotMatch(page, /ENOSPC/)
    assert.ok(!latch.logs.some((line) => line.includes('ENOSPC')), 'logged as a failure of Latch, not of the disk')
    await latch.close()
  })

  it('makes the token a form asked for when sent again, after its first try stored the grant but not the token', async () => {
    const store = new MemoryStore()
    const { latch, cookie, token, once } = await signedInAtApps(store)
    try {
      const roomAgain = fillDisk(store, 'saveToken')
      const sent = form({ csrf: token, once, name: 'Deploy', scope: 'create', lifetime: '604800' })
      assert.equal((await post(`${latch.base}/apps/tokens`, sent, { Cookie: cookie })).status, 500)
      roomAgain()
      const other = form({ csrf: token, once, name: 'Deploy', scope: 'read', lifetime: '86400' })
      const refused = await post(`${latch.base}/apps/tokens`, other, { Cookie: cookie }) // the same form, changed
      assert.equal(refused.status, 400)
      assert.match(await refused.text(), /This form was sent before with other values/)
      const again = await post(`${latch.base}/apps/tokens`, sent, { Cookie: cookie })
      assert.equal(again.status, 200)
      const made = /<pre class="token">([A-Za-z0-9_-]{43})<\/pre>/.exec(await again.text())?.[1] ?? ''
      assert.ok(made)
      const answer = await post(`${latch.base}/introspect`, form({ token: made }))
      assert.equal(((await answer.json()) as { active: boolean }).active, true)
      latch.advance(11) // past a double click's seconds
      assert.equal((await post(`${latch.base}/apps/tokens`, sent, { Cookie: cookie })).status, 409) // made, and shown
    } finally {
      await latch.close()
    }
  })

  it('answers a token form sent twice at once, while the disk is full, with two refusals and no token said made', async () => {
    const store = new MemoryStore()
    const { latch, cookie, token, once } = await signedInAtApps(store)
    try {
      // the first try's token write fails only once the second press has come in (its session is looked up)
      let pressed = 0
      const findSession = store.findSession.bind(store)
      store.findSession = (...args) => (pressed++, findSession(...args))
      store.saveToken = async () => {
        await until(() => pressed >= 2)
        throw new NotStored(new Error('ENOSPC: no space left on device'))
      }
      const sent = form({ csrf: token, once, name: 'Deploy', scope: 'create', lifetime: '604800' })
      const answers = await Promise.all([1, 2].map(() => post(`${latch.base}/apps/tokens`, sent, { Cookie: cookie })))
      assert.deepEqual(
        answers.map((answer) => answer.status),
        [500, 500],
      )
      // the grant the first try left, revoked on /apps: the form sent again says no token was made
      const [[grantId]] = await store.listGrants(START)
      await store.revokeGrant(grantId, START)
      const late = await post(`${latch.base}/apps/tokens`, sent, { Cookie: cookie })
      assert.equal(late.status, 400)
      assert.match(await late.text(), /could not be made when it was first sent, and what that left was revoked since/)
    } finally {
      await latch.close()
    }
  })

  for (const reopened of [true, false])
    it(
      reopened
        ? 'keeps a consent request open when its code could not be stored, to be approved once there is room'
        : 'approves a consent pressed again once there is room, when neither its code nor the request could be stored',
      async () => {
        const store = new MemoryStore()
        const password = 'correct horse battery staple'
        const latch = await startLatch({ PASSWORD_HASH: await hashPassword(password, FAST_COST) }, { store })
        try {
          const consent = await openConsent(latch)
          const roomForCode = fillDisk(store, 'saveCode')
          const roomForRequest = reopened ? () => {} : fillDisk(store, 'savePending')
          assert.equal((await submitConsent(latch, consent, { password })).status, 500)
          roomForCode()
          roomForRequest()
          // reopened, the request waits as any does; else its answer is remembered for the minute a second press has
          if (reopened) latch.advance(120)
          const approved = await submitConsent(latch, consent, { password })
          assert.equal(approved.status, 303)
          assert.ok(new URL(approved.headers.get('location') ?? '').searchParams.get('code'))
        } finally {
          await latch.close()
        }
      },
    )

  it('keeps one Latch in memory for a store and config, even with a handler made at each request', async () => {
    const store = new MemoryStore()
    const server = createServer()
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
    const port = (server.address() as AddressInfo).port
    const passwordHash = await hashPassword('correct horse', FAST_COST)
    const config = loadConfig({ DATA_FILE: 'memory', PASSWORD_HASH: passwordHash }, [], { boundPort: port })
    const stopped = new AbortController()
    let time = START
    const logs: string[] = []
    // a mistake an embedding app may make: a handler made for each request
    server.on('request', (req, res) =>
      createHandler({ config, store, now: () => time, log: (line) => logs.push(line), signal: stopped.signal })(
        req,
        res,
      ),
    )
    const close = () => {
      stopped.abort()
      server.closeAllConnections()
      return new Promise<void>((resolve) => server.close(() => resolve()))
    }
    const latch = { base: `http://127.0.0.1:${port}`, port, issuer: config.issuer, logs, advance: () => {}, close }
    try {
      const consent = await openConsent(latch)
      const statuses: number[] = []
      for (let i = 0; i < 7; i++)
        statuses.push((await submitConsent(latch, consent, { password: `guess ${i}` })).status)
      assert.deepEqual(statuses, [401, 401, 401, 401, 401, 401, 429])
      // on one steady clock: set back an hour, the lockout of 2 seconds still ends 2 seconds on
      time -= 3_600_000
      const throttled = await submitConsent(latch, consent, { password: 'correct horse' })
      assert.equal(throttled.status, 429)
      assert.equal(throttled.headers.get('retry-after'), '2') // not 3602
      time += 2_000
      assert.equal((await submitConsent(latch, consent, { password: 'correct horse' })).status, 303)
      // a proxy that TRUST_PROXY does not name is warned of once, not at each request
      for (let i = 0; i < 3; i++) await fetch(`${latch.base}/`, { headers: { 'X-Forwarded-For': '203.0.113.9' } })
      assert.equal(logs.filter((line) => line.includes('TRUST_PROXY does not name')).length, 1)
      assert.equal(getEventListeners(stopped.signal, 'abort').length, 1) // one for the signal, not one a request
    } finally {
      await close()
    }
  })

  it('counts wrong passwords once for handlers of one store whose configs differ only in where they listen', async () => {
    const store = new MemoryStore()
    const passwordHash = await hashPassword('correct horse', FAST_COST)
    const first = await startLatch({ PASSWORD_HASH: passwordHash, ISSUER: 'http://127.0.0.1:3000' }, { store })
    const second = await startLatch(
      { PASSWORD_HASH: passwordHash, ISSUER: 'http://127.0.0.1:3000', LOG_FORMAT: 'json' },
      { store },
    )
    try {
      // the same ISSUER: each answers the other's pages, as two listeners (IPv4, IPv6) of one Latch do
      const consent = await openConsent(first)
      for (let i = 0; i < 6; i++)
        assert.equal((await submitConsent(i % 2 ? first : second, consent, { password: `guess ${i}` })).status, 401)
      assert.equal((await submitConsent(second, consent, { password: 'correct horse' })).status, 429)
    } finally {
      await first.close()
      await second.close()
    }
  })

  it('keeps the counts of wrong passwords apart for two Latches with their own passwords on one store', async () => {
    const store = new MemoryStore()
    const alice = await startLatch({ PASSWORD_HASH: await hashPassword('alice horse staple', FAST_COST) }, { store })
    const bob = await startLatch({ PASSWORD_HASH: await hashPassword('bob horse staple', FAST_COST) }, { store })
    try {
      const atBob = await openConsent(bob)
      for (let i = 0; i < 6; i++)
        assert.equal((await submitConsent(bob, atBob, { password: `guess ${i}` })).status, 401)
      assert.equal((await submitConsent(bob, atBob, { password: 'bob horse staple' })).status, 429)
      // guesses of Bob's password lock Bob's Latch, not Alice's
      const atAlice = await openConsent(alice)
      assert.equal((await submitConsent(alice, atAlice, { password: 'alice horse staple' })).status, 303)
    } finally {
      await alice.close()
      await bob.close()
    }
  })

  it('sweeps a store once for configs that differ only in the order of their fields and proxies', (t) => {
    t.mock.timers.enable({ apis: ['setInterval'] })
    const store = new MemoryStore()
    const config = loadConfig({ DATA_FILE: 'memory', PROFILE_NAME: 'Ada', TRUST_PROXY: '127.0.0.1,::1', PASSWORD_HASH })
    const { name, url } = config.profile
    const reordered = { ...config, profile: { url, name }, trustProxy: ['::1', '127.0.0.1'] }
    let swept = 0
    const sweep = store.sweep.bind(store)
    store.sweep = (now) => {
      swept++
      sweep(now)
    }
    for (const one of [config, reordered]) createHandler({ config: one, store, now: () => 5000, log: () => {} })
    t.mock.timers.tick(100)
    assert.equal(swept, 1)
  })

  it('sweeps a store once however many handlers serve it, until the last of them stops', async (t) => {
    t.mock.timers.enable({ apis: ['setInterval'] })
    const store = new MemoryStore()
    const config = loadConfig({ DATA_FILE: 'memory' })
    const handlers = [new AbortController(), new AbortController()]
    for (const { signal } of handlers) createHandler({ config, store, now: () => 5000, log: () => {}, signal })
    const swept: number[] = []
    const sweep = store.sweep.bind(store)
    store.sweep = (now) => {
      swept.push(now)
      sweep(now)
    }
    t.mock.timers.tick(100)
    assert.equal(swept.length, 1)
    handlers[0].abort()
    t.mock.timers.tick(100)
    assert.equal(swept.length, 2) // the other handler still serves the store
    handlers[1].abort()
    t.mock.timers.tick(1000)
    assert.equal(swept.length, 2)
  })

  it('refuses at once a config whose DATA_FILE is a file, without the store that keeps it', () => {
    const config = loadConfig({ DATA_FILE: 'latch-data.jsonl' })
    assert.throws(
      () => createHandler({ config }),
      /DATA_FILE is latch-data\.jsonl, but no store was given: .*openStore/,
    )
    assert.doesNotThrow(() => createHandler({ config: { ...config, dataFile: 'memory' }, signal: AbortSignal.abort() }))
  })

  it('refuses at once a config whose issuer has port 0, which no client can reach: PORT 0 without the port bound', () => {
    const config = loadConfig({ PORT: '0', DATA_FILE: 'memory' })
    assert.throws(
      () => createHandler({ config }),
      /ISSUER is http:\/\/127\.0\.0\.1:0: with PORT 0, pass the port bound/,
    )
    const bound = loadConfig({ PORT: '0', DATA_FILE: 'memory' }, [], { boundPort: 4000 })
    assert.doesNotThrow(() => createHandler({ config: bound, signal: AbortSignal.abort() }))
  })

  it('refuses at once a store that is still a Promise: openStore not awaited', () => {
    const config = loadConfig({ PORT: '0', DATA_FILE: 'memory' })
    const store = openStore(config) as unknown as Store
    assert.throws(() => createHandler({ config, store }), /await openStore/)
  })

  it('closes the connection, and does not crash, when an embedding app makes writeHead throw', async () => {
    const handler = createHandler({ config: loadConfig({ DATA_FILE: 'memory' }), log: () => {} })
    const server = createServer((req, res) => {
      res.writeHead = () => {
        throw new Error('a hook of the embedding app')
      }
      handler(req, res)
    })
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve))
    const { port } = server.address() as AddressInfo
    await assert.rejects(
      fetch(`http://127.0.0.1:${port}/introspect`, {
        method: 'POST',
        headers: { 'Content-Type': 'application/x-www-form-urlencoded' },
        body: 'token=x',
      }),
    )
    server.closeAllConnections()
    await new Promise((resolve) => server.close(resolve))
  })

  it('logs one line per request: method, path without query, status, milliseconds', async () => {
    latch.logs.length = 0
    await fetch(`${latch.base}/.well-known/oauth-authorization-server?x=1`)
    await new Promise((resolve) => setImmediate(resolve))
    assert.match(
      latch.logs.at(-1) ?? '',
      /^2027-01-01T00:00:00\.000Z 127\.0\.0\.1 GET \/\.well-known\/oauth-authorization-server 200 \d+ms$/,
    )
  })

  it('never logs an unknown path, which could hold anything', async () => {
    const secret = createSecret()
    await fetch(`${latch.base}/token/${secret}`)
    await new Promise((resolve) => setImmediate(resolve))
    assert.match(
      latch.logs.at(-1) ?? '',
      /^2027-01-01T00:00:00\.000Z 127\.0\.0\.1 GET \(unknown path\) 404 \d+ms error=not_found$/,
    )
    assert.equal(latch.logs.join('\n').includes(secret), false)
  })

  it('logs a request whose connection closed before its answer as closed, not with the status written too late', async () => {
    latch.logs.length = 0
    // The body is one byte longer than Content-Length says: node:http reads the extra "=" as the
    // next request, answers 400 itself and closes the connection while Latch is still working.
    const socket = connect(latch.port, '127.0.0.1')
    socket.end(
      `POST /introspect HTTP/1.1\r\nHost: 127.0.0.1:${latch.port}\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: 5\r\n\r\ntoken=`,
    )
    let answer = ''
    socket.on('data', (chunk) => (answer += chunk))
    await new Promise((resolve) => socket.on('close', resolve))
    await new Promise((resolve) => setImmediate(resolve))
    assert.equal(answer, 'HTTP/1.1 400 Bad Request\r\nConnection: close\r\n\r\n') // node's answer alone
    assert.equal(latch.logs.length, 1)
    assert.match(
      latch.logs[0],
      /^2027-01-01T00:00:00\.000Z 127\.0\.0\.1 POST \/introspect closed before the answer \d+ms error=invalid_request$/,
    )
  })
})

/** Latch with a password on `store`, a browser signed in there, and the form values of its /apps page. */
async function signedInAtApps(store: MemoryStore) {
  const password = 'correct horse battery staple'
  const latch = await startLatch({ PASSWORD_HASH: await hashPassword(password, FAST_COST) }, { store })
  const csrf = createSecret()
  const signedIn = await post(`${latch.base}/sign-in`, form({ csrf, password }), { Cookie: `latch_csrf=${csrf}` })
  const cookie = `latch_csrf=${csrf}; ${(signedIn.headers.get('set-cookie') ?? '').split(';')[0]}`
  const apps = await (await fetch(`${latch.base}/apps`, { headers: { Cookie: cookie } })).text()
  const token = /name="csrf" value="([^"]+)"/.exec(apps)?.[1] ?? ''
  const once = /name="once" value="([^"]+)"/.exec(apps)?.[1] ?? ''
  return { latch, cookie, token, once }
}

/** Makes one method of `store` fail as on a full disk (`NotStored`); the function returned gives the room back. */
function fillDisk(
  store: MemoryStore,
  method: 'saveCode' | 'savePending' | 'saveToken' | 'redeemForTokens',
): () => void {
  const full = async () => {
    throw new NotStored(new Error('ENOSPC: no space left on device'))
  }
  Object.defineProperty(store, method, { value: full, configurable: true }) // over the class's own method
  return () => void Reflect.deleteProperty(store, method)
}

// --- A full flow ------------------------------------------------------------------------

describe('A full flow', () => {
  it('signs in, exchanges, introspects, revokes, and never logs a secret', async () => {
    const password = 'correct horse battery staple'
    const passwordHash = await hashPassword(password, FAST_COST)
    const latch = await startLatch({ PASSWORD_HASH: passwordHash, ME: 'https://example.com/' })
    const consent = await openConsent(latch)
    const approved = await submitConsent(latch, consent, { password })
    const code = new URL(approved.headers.get('location') ?? '').searchParams.get('code') ?? ''
    const tokenResponse = (await (await exchange(latch, code)).json()) as { access_token: string }
    const token = tokenResponse.access_token
    assert.equal((await introspect(latch, token)).active, true)
    assert.equal((await post(`${latch.base}/revoke`, form({ token }))).status, 200)
    assert.deepEqual(await introspect(latch, token), { active: false })
    await latch.close()

    const log = latch.logs.join('\n')
    assert.equal(latch.logs.length, 6)
    const hashes = [hashSecret(code), hashSecret(token), passwordHash]
    for (const secret of [code, token, VERIFIER, password, consent.csrf, consent.request, ...hashes])
      assert.equal(log.includes(secret), false)
  })
})

describe('The command line', () => {
  const run = (args: string[], env: Record<string, string>, input?: string) =>
    new Promise<{ code: number | null; stdout: string; stderr: string; child: ReturnType<typeof spawn> }>((resolve) => {
      const child = spawn(process.execPath, ['--import', 'tsx', 'server.ts', ...args], {
        env: { ...process.env, ...env },
      })
      let stdout = ''
      let stderr = ''
      child.stdout.on('data', (chunk) => {
        stdout += chunk
        if (stdout.includes('metadata') && child.signalCode === null && !child.killed) child.kill('SIGTERM')
      })
      child.stderr.on('data', (chunk) => (stderr += chunk))
      child.on('close', (code) => resolve({ code, stdout, stderr, child }))
      if (input !== undefined) child.stdin.end(input)
    })

  it('prints the start-up block and stops cleanly on SIGTERM', async () => {
    const result = await run([], { PORT: '0', DATA_FILE: 'memory' })
    assert.match(result.stdout, /Latch is listening on http:\/\/127\.0\.0\.1:\d+/)
    assert.match(result.stdout, /issuer {4}http:\/\/127\.0\.0\.1:\d+/)
    assert.match(result.stdout, /password {2}not set/)
    assert.match(result.stdout, /data {6}in memory only/)
    assert.equal(result.code, 0)
  })

  /** The command line with DATA_FILE=memory on a port of its own, and a request under way at it. */
  async function serveWithRequestUnderWay(body: string) {
    const child = spawn(process.execPath, ['--import', 'tsx', 'server.ts'], {
      env: { ...process.env, PORT: '0', DATA_FILE: 'memory' },
    })
    const exited = new Promise((resolve) => child.on('close', resolve))
    let stdout = ''
    const port = await new Promise<string>((resolve) => {
      child.stdout.on('data', (chunk) => {
        stdout += chunk
        const match = /listening on http:\/\/127\.0\.0\.1:(\d+)[\s\S]*metadata/.exec(stdout)
        if (match !== null) resolve(match[1])
      })
    })
    const socket = connect(Number(port), '127.0.0.1')
    const received = { text: '' }
    socket.setEncoding('utf8').on('data', (chunk) => (received.text += chunk))
    const closed = new Promise((resolve) => socket.on('close', resolve))
    socket.write(
      `POST /revoke HTTP/1.1\r\nHost: 127.0.0.1:${port}\r\nContent-Type: application/x-www-form-urlencoded\r\n` +
        `Content-Length: ${body.length}\r\nExpect: 100-continue\r\n\r\n`,
    )
    await until(() => received.text.includes('100 Continue')) // the request is under way at the server
    child.kill('SIGTERM')
    await new Promise((resolve) => child.stdout.once('data', resolve)) // it says it is stopping
    return { port, socket, received, closed, exited }
  }

  it('finishes a request in flight on SIGTERM, then exits 0', async () => {
    const body = 'token=not-a-real-token'
    const { socket, received, closed, exited } = await serveWithRequestUnderWay(body)
    socket.end(body)
    await closed
    assert.match(received.text, /^HTTP\/1\.1 100 Continue\r\n\r\nHTTP\/1\.1 200 /)
    assert.equal(await exited, 0)
  })

  it('on SIGTERM, answers what comes on a busy connection with Connection: close, and closes it', async () => {
    const body = 'token=not-a-real-token'
    const { port, socket, received, closed, exited } = await serveWithRequestUnderWay(body)
    // the rest of the body, and a second request behind it on the same connection
    socket.write(`${body}GET /.well-known/oauth-authorization-server HTTP/1.1\r\nHost: 127.0.0.1:${port}\r\n\r\n`)
    await closed // by the server, not by this test
    const answers = received.text.split(/(?=HTTP\/1\.1 )/)
    assert.deepEqual(
      answers.map((answer) => answer.slice(0, 12)),
      ['HTTP/1.1 100', 'HTTP/1.1 200', 'HTTP/1.1 200'],
    )
    assert.match(answers[2], /\r\nConnection: close\r\n/i)
    assert.equal(await exited, 0)
  })

  it('refuses to serve a non-loopback interface without a password, naming the fix', async () => {
    const result = await run([], { HOST: '0.0.0.0', PORT: '0' })
    assert.equal(result.code, 1)
    assert.match(result.stderr, /PASSWORD_HASH/)
    assert.match(result.stderr, /hash-password/)
  })

  it('hashes a password read from standard input', async () => {
    const result = await run(['hash-password'], {}, 'correct horse battery\n')
    assert.equal(result.code, 0)
    assert.equal(await verifyPassword('correct horse battery', result.stdout.trim()), true)
  })
})
