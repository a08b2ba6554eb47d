// OAuth 2.1 at Latch, beyond IndieAuth: its metadata (RFC 8414), HTTP Basic for public clients
// (RFC 6749 §2.3.1), resource indicators (RFC 8707) and `checkAccessToken`, loopback redirects
// (RFC 8252 §7.3) and Client ID Metadata Documents, caching by HTTP rules (RFC 9111), and a few
// points of conformance. Client sites are local servers reached through an injected resolver and
// agent; the https one has a self-signed certificate made here by openssl.

import { after, before, describe, it } from 'node:test'
import assert from 'node:assert/strict'
import { rm } from 'node:fs/promises'
import { Agent as HttpAgent, createServer } from 'node:http'
import type { IncomingMessage, Server, ServerResponse } from 'node:http'
import { Agent as HttpsAgent, createServer as createHttpsServer } from 'node:https'
import type { RequestOptions as HttpsRequestOptions } from 'node:https'
import { connect } from 'node:net'
import type { AddressInfo, Socket } from 'node:net'
import { connect as tlsConnect } from 'node:tls'
import type { TLSSocket } from 'node:tls'
import * as latchModule from '../server.ts'
import { MemoryStore, NotStored, buildMetadata, createHandler, loadConfig } from '../server.ts'
import type { ClientFetchOptions } from '../server.ts'
import { START, startLatch } from './harness.ts'
import { pageError, unescapeHtml } from './html.ts'
import { makeCertificate } from './tls.ts'
import type { TestServer } from './harness.ts'

// Read from the module at call time, so that a server without them fails those tests only.
const { cacheLifetime, checkAccessToken, createMetadataHandler, metadataPath } = latchModule

/** The PKCE example of RFC 7636 Appendix B. */
const VERIFIER = 'dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk'
const CHALLENGE = 'E9Melhoa2OwvFrEMTJguCHaoeK1t8URWbuGJSstw-cM'
/** A loopback client, which Latch never fetches. */
const CLIENT_ID = 'http://127.0.0.1:8080/'
const REDIRECT_URI = 'http://127.0.0.1:8080/callback'
const API = 'https://api.example/mcp'
const FILES = 'https://files.example/'
const ELSEWHERE = 'https://elsewhere.example/'
const PUBLIC_ADDRESS = '93.184.215.14'

// --- Helpers ----------------------------------------------------------------------------

type Fields = Record<string, string | string[] | undefined>

function params(fields: Fields): URLSearchParams {
  const query = new URLSearchParams()
  for (const [name, value] of Object.entries(fields)) for (const one of [value ?? []].flat()) query.append(name, one)
  return query
}

function authUrl(base: string, overrides: Fields = {}): string {
  const fields: Fields = {
    response_type: 'code',
    client_id: CLIENT_ID,
    redirect_uri: REDIRECT_URI,
    state: 'state-1',
    code_challenge: CHALLENGE,
    code_challenge_method: 'S256',
    ...overrides,
  }
  return `${base}/auth?${params(fields)}`
}

function post(url: string, fields: Fields, headers: Record<string, string> = {}): Promise<Response> {
  return fetch(url, {
    method: 'POST',
    redirect: 'manual',
    headers: { 'Content-Type': 'application/x-www-form-urlencoded', ...headers },
    body: params(fields).toString(),
  })
}

type Consent = { request: string; csrf: string; cookie: string; html: string }

/** Opens the consent page and reads its form. */
async function openConsent(base: string, overrides: Fields = {}): Promise<Consent> {
  const response = await fetch(authUrl(base, overrides), { redirect: 'manual' })
  const html = await response.text()
  assert.equal(response.status, 200, pageError(html))
  return {
    request: unescapeHtml(/name="request" value="([^"]+)"/.exec(html)?.[1] ?? ''),
    csrf: unescapeHtml(/name="csrf" value="([^"]+)"/.exec(html)?.[1] ?? ''),
    cookie: (response.headers.get('set-cookie') ?? '').split(';')[0],
    html,
  }
}

/** Approves a consent page, granting `scope`; returns where the browser goes. */
async function approve(base: string, consent: Consent, scope: string[] = []): Promise<URL> {
  const response = await post(
    `${base}/auth/consent`,
    { request: consent.request, csrf: consent.csrf, scope, decision: 'approve' },
    { Cookie: consent.cookie },
  )
  assert.equal(response.status, 303, pageError(await response.text()))
  return new URL(response.headers.get('location') ?? '')
}

/** Walks GET /auth and an approving consent that grants every scope asked for; returns the code. */
async function obtainCode(base: string, overrides: Fields = {}): Promise<string> {
  const scope = (overrides.scope as string | undefined)?.split(' ') ?? []
  const location = await approve(base, await openConsent(base, overrides), scope)
  const code = location.searchParams.get('code')
  assert.ok(code, location.href)
  return code
}

function exchange(base: string, code: string, overrides: Fields = {}, headers: Record<string, string> = {}) {
  const fields = {
    grant_type: 'authorization_code',
    code,
    client_id: CLIENT_ID,
    redirect_uri: REDIRECT_URI,
    code_verifier: VERIFIER,
    ...overrides,
  }
  return post(`${base}/token`, fields, headers)
}

function refresh(base: string, refreshToken: string, overrides: Fields = {}): Promise<Response> {
  return post(`${base}/token`, {
    grant_type: 'refresh_token',
    refresh_token: refreshToken,
    client_id: CLIENT_ID,
    ...overrides,
  })
}

type Tokens = { access_token: string; refresh_token: string; expires_in: number; scope?: string; token_type: string }

async function tokensOf(response: Response): Promise<Tokens> {
  const text = await response.text()
  assert.equal(response.status, 200, text)
  return JSON.parse(text) as Tokens
}

/** What /introspect says of a token to a resource server that names itself `resource` (or none, as IndieAuth's). */
async function introspect(base: string, token: string, resource?: string): Promise<Record<string, unknown>> {
  const response = await post(`${base}/introspect`, resource === undefined ? { token } : { token, resource })
  assert.equal(response.status, 200)
  return (await response.json()) as Record<string, unknown>
}

/** Asserts a JSON OAuth error by status and `error` code. */
async function assertError(response: Response, status: number, error: string): Promise<Record<string, unknown>> {
  const text = await response.text()
  assert.equal(response.status, status, text)
  assert.equal(response.headers.get('content-type'), 'application/json')
  const json = JSON.parse(text) as Record<string, unknown>
  assert.equal(json.error, error, text)
  return json
}

/** Asserts an error redirect from GET /auth to redirect_uri, with `error`, `iss` and `state`. */
function assertErrorRedirect(response: Response, issuer: string, error: string): void {
  assert.equal(response.status, 302)
  const location = new URL(response.headers.get('location') ?? '')
  assert.equal(`${location.origin}${location.pathname}`, REDIRECT_URI)
  assert.equal(location.searchParams.get('error'), error, location.href)
  assert.equal(location.searchParams.get('iss'), issuer)
  assert.equal(location.searchParams.get('state'), 'state-1')
}

function basic(user: string, password = ''): string {
  return `Basic ${Buffer.from(`${encodeURIComponent(user)}:${password}`).toString('base64')}`
}

function listen(server: Server): Promise<number> {
  return new Promise((resolve) => server.listen(0, '127.0.0.1', () => resolve((server.address() as AddressInfo).port)))
}

function closeServer(server: Server): Promise<void> {
  server.closeAllConnections()
  return new Promise((resolve) => server.close(() => resolve()))
}

// --- 1. Metadata ------------------------------------------------------------------------

describe('Metadata (RFC 8414)', () => {
  let latch: TestServer
  before(async () => (latch = await startLatch()))
  after(() => latch.close())

  it('advertises Client ID Metadata Documents, public clients only, and the query response mode', async () => {
    const response = await fetch(`${latch.base}/.well-known/oauth-authorization-server`)
    assert.equal(response.status, 200)
    const metadata = (await response.json()) as Record<string, unknown>
    assert.equal(metadata.client_id_metadata_document_supported, true)
    assert.deepEqual(metadata.token_endpoint_auth_methods_supported, ['none'])
    assert.deepEqual(metadata.revocation_endpoint_auth_methods_supported, ['none'])
    assert.deepEqual(metadata.response_modes_supported, ['query'])
  })

  it('serves an issuer with a path at the RFC 8414 §3.1 path, through a handler another server mounts', async () => {
    const server = createServer()
    const port = await listen(server)
    try {
      const config = loadConfig({ PORT: '0', ISSUER: `http://127.0.0.1:${port}/latch` }, [], { boundPort: port })
      const path = metadataPath(config)
      assert.equal(path, '/.well-known/oauth-authorization-server/latch')
      const handler = createMetadataHandler(config)
      server.on('request', (req: IncomingMessage, res: ServerResponse) => {
        if (req.url === path) return handler(req, res)
        res.writeHead(404)
        res.end()
      })
      const url = `http://127.0.0.1:${port}${path}`

      const got = await fetch(url)
      assert.equal(got.status, 200)
      assert.equal(got.headers.get('content-type'), 'application/json')
      assert.equal(got.headers.get('access-control-allow-origin'), '*')
      const metadata = (await got.json()) as Record<string, unknown>
      assert.equal(metadata.issuer, `http://127.0.0.1:${port}/latch`)
      assert.deepEqual(metadata, JSON.parse(JSON.stringify(buildMetadata(config))))

      const head = await fetch(url, { method: 'HEAD' })
      assert.equal(head.status, 200)
      assert.equal(head.headers.get('access-control-allow-origin'), '*')
      assert.equal(await head.text(), '')

      // a browser's MCP client asks first whether it may send its MCP-Protocol-Version header
      const preflight = await fetch(url, {
        method: 'OPTIONS',
        headers: {
          Origin: 'https://app.example',
          'Access-Control-Request-Method': 'GET',
          'Access-Control-Request-Headers': 'mcp-protocol-version',
        },
      })
      assert.equal(preflight.status, 204)
      assert.equal(preflight.headers.get('access-control-allow-origin'), '*')
      assert.match(preflight.headers.get('access-control-allow-headers') ?? '', /MCP-Protocol-Version/)

      for (const method of ['POST', 'PUT', 'DELETE']) {
        const refused = await fetch(url, { method })
        assert.equal(refused.status, 405, method)
        assert.equal(refused.headers.get('allow'), 'GET, HEAD')
        await refused.arrayBuffer()
      }
    } finally {
      await closeServer(server)
    }
  })
})

// --- 2. HTTP Basic for public clients --------------------------------------------------

describe('HTTP Basic with an empty password, for public clients (RFC 6749 §2.3.1)', () => {
  let latch: TestServer
  before(async () => (latch = await startLatch()))
  after(() => latch.close())

  it('exchanges and refreshes at /token with client_id only in the Authorization header', async () => {
    const code = await obtainCode(latch.base, { scope: 'create' })
    const headers = { Authorization: basic(CLIENT_ID) }
    const tokens = await tokensOf(await exchange(latch.base, code, { client_id: undefined }, headers))
    const introspection = await introspect(latch.base, tokens.access_token)
    assert.equal(introspection.active, true)
    assert.equal(introspection.client_id, CLIENT_ID)
    const fields = { grant_type: 'refresh_token', refresh_token: tokens.refresh_token }
    const refreshed = await tokensOf(await post(`${latch.base}/token`, fields, headers))
    assert.notEqual(refreshed.access_token, tokens.access_token)
  })

  it('checks the client_id of the header at POST /auth as if it were in the body', async () => {
    const code = await obtainCode(latch.base)
    const fields = { code, redirect_uri: REDIRECT_URI, code_verifier: VERIFIER }
    const other = await post(`${latch.base}/auth`, fields, { Authorization: basic('http://127.0.0.1:9999/') })
    await assertError(other, 400, 'invalid_grant')
    const own = await post(`${latch.base}/auth`, fields, { Authorization: basic(CLIENT_ID) })
    assert.equal(own.status, 200)
    assert.equal(((await own.json()) as { me: string }).me, `${latch.issuer}/`)
  })

  it('refuses a Basic password with 401 invalid_client and a Basic challenge at /token, /auth and /revoke', async () => {
    const code = await obtainCode(latch.base, { scope: 'create' })
    const withPassword = { Authorization: basic(CLIENT_ID, 'a-secret') }
    const cases: [string, Fields][] = [
      ['/token', { grant_type: 'authorization_code', code, redirect_uri: REDIRECT_URI, code_verifier: VERIFIER }],
      ['/auth', { code, redirect_uri: REDIRECT_URI, code_verifier: VERIFIER }],
      ['/revoke', { token: 'not-a-token' }],
    ]
    for (const [path, fields] of cases) {
      const response = await post(`${latch.base}${path}`, fields, withPassword)
      await assertError(response, 401, 'invalid_client')
      assert.equal(response.headers.get('www-authenticate'), `Basic realm="${latch.issuer}"`, path)
    }
    // Nothing was redeemed: the code still works.
    await tokensOf(await exchange(latch.base, code))
  })

  it('refuses a client secret or assertion in the body as it refuses a Basic password, and takes an empty one', async () => {
    const code = await obtainCode(latch.base, { scope: 'create' })
    const exchanged = { grant_type: 'authorization_code', code, redirect_uri: REDIRECT_URI, code_verifier: VERIFIER }
    const cases: [string, Fields][] = [
      ['/token', { ...exchanged, client_id: CLIENT_ID, client_secret: 'a-secret' }],
      ['/token', { ...exchanged, client_id: CLIENT_ID, client_assertion: 'eyJ.a.b', client_assertion_type: 'x' }],
      ['/auth', { code, redirect_uri: REDIRECT_URI, code_verifier: VERIFIER, client_secret: 'a-secret' }],
      ['/revoke', { token: 'not-a-token', client_secret: 'a-secret' }],
    ]
    for (const [path, fields] of cases) {
      const response = await post(`${latch.base}${path}`, fields)
      await assertError(response, 401, 'invalid_client')
      assert.equal(response.headers.get('www-authenticate'), `Basic realm="${latch.issuer}"`, path)
    }
    // nothing was redeemed, and an empty secret, as some libraries send for a public client, is none
    await tokensOf(await exchange(latch.base, code, { client_secret: '' }))
  })

  it('takes a client_id that was not form-encoded: a URL whose own colons come before the empty password', async () => {
    const code = await obtainCode(latch.base, { scope: 'create' })
    const raw = { Authorization: `Basic ${Buffer.from(`${CLIENT_ID}:`).toString('base64')}` }
    const tokens = await tokensOf(await exchange(latch.base, code, { client_id: undefined }, raw))
    assert.equal((await introspect(latch.base, tokens.access_token)).client_id, CLIENT_ID)
    const secret = { Authorization: `Basic ${Buffer.from(`${CLIENT_ID}:a-secret`).toString('base64')}` }
    await assertError(await exchange(latch.base, await obtainCode(latch.base), {}, secret), 401, 'invalid_client')
  })

  it('reads a client_id sent in Basic credentials as UTF-8 bytes once, as the same one in the body is read', async () => {
    const raw = (user: string) => ({ Authorization: `Basic ${Buffer.from(`${user}:`).toString('base64')}` })
    // not form-encoded, as a URL is often sent: its bytes are UTF-8, as in a body
    const accented = `${CLIENT_ID}caf\u00e9`
    const revoked = await post(`${latch.base}/revoke`, { token: 'not-a-token', client_id: accented }, raw(accented))
    assert.equal(revoked.status, 200)
    // and not twice over: "Ã©" is not read as "é"
    const twice = `${CLIENT_ID}caf\u00c3\u00a9`
    const again = await post(`${latch.base}/revoke`, { token: 'not-a-token', client_id: twice }, raw(twice))
    assert.equal(again.status, 200)
  })

  it('refuses malformed Basic credentials with 401 invalid_client', async () => {
    const code = await obtainCode(latch.base, { scope: 'create' })
    const base64 = (user: string | Buffer) =>
      `Basic ${Buffer.concat([Buffer.from(user), Buffer.from(':')]).toString('base64')}`
    const malformed = ['Basic !!!', `Basic ${Buffer.from('no-colon').toString('base64')}`, 'Basic a b c']
    malformed.push(base64('%zz'), base64(Buffer.from([0xff, 0xfe]))) // not form-encoded: a bad escape, not UTF-8
    for (const authorization of malformed) {
      const response = await exchange(latch.base, code, {}, { Authorization: authorization })
      await assertError(response, 401, 'invalid_client')
      assert.equal(response.headers.get('www-authenticate'), `Basic realm="${latch.issuer}"`, authorization)
    }
    await tokensOf(await exchange(latch.base, code))
  })

  it('reads a Basic header of many spaces before a wrong character as fast as one without them', async () => {
    // 16,000 spaces fit in node's 16 KiB of headers; the pattern once tried each way of sharing them
    const timed = async (authorization: string) => {
      let fastest = Infinity
      for (let run = 0; run < 5; run++) {
        const start = performance.now()
        await assertError(
          await post(`${latch.base}/revoke`, { token: 't' }, { Authorization: authorization }),
          401,
          'invalid_client',
        )
        fastest = Math.min(fastest, performance.now() - start)
      }
      return fastest
    }
    await timed('Basic !') // warm up
    const ratio = (await timed(`Basic${' '.repeat(16_000)}!`)) / (await timed(`Basic !${'a'.repeat(16_000)}`))
    assert.ok(ratio < 5, `the spaces took ${ratio.toFixed(1)} times as long`)
  })

  it('refuses a body client_id that differs from the header one with 400 invalid_request', async () => {
    const code = await obtainCode(latch.base, { scope: 'create' })
    const response = await exchange(latch.base, code, {}, { Authorization: basic('http://127.0.0.1:9999/') })
    await assertError(response, 400, 'invalid_request')
    await tokensOf(await exchange(latch.base, code, {}, { Authorization: basic(CLIENT_ID) })) // the same: fine
  })

  it('revokes with client_id in the header; with a password, refuses and the token stays live', async () => {
    const code = await obtainCode(latch.base, { scope: 'create' })
    const { access_token } = await tokensOf(await exchange(latch.base, code))
    const refused = await post(
      `${latch.base}/revoke`,
      { token: access_token },
      { Authorization: basic(CLIENT_ID, 'x') },
    )
    await assertError(refused, 401, 'invalid_client')
    assert.equal((await introspect(latch.base, access_token)).active, true)
    const revoked = await post(`${latch.base}/revoke`, { token: access_token }, { Authorization: basic(CLIENT_ID) })
    assert.equal(revoked.status, 200)
    assert.deepEqual(await introspect(latch.base, access_token), { active: false })
  })

  it('revokes nothing for a client that names another, in the body, the header or at the old /token, and answers 200', async () => {
    const code = await obtainCode(latch.base, { scope: 'create' })
    const { access_token, refresh_token } = await tokensOf(await exchange(latch.base, code))
    for (const [url, fields, headers] of [
      [`${latch.base}/revoke`, { token: refresh_token, client_id: ELSEWHERE }, {}],
      [`${latch.base}/revoke`, { token: access_token }, { Authorization: basic(ELSEWHERE) }],
      [`${latch.base}/token`, { action: 'revoke', token: refresh_token, client_id: ELSEWHERE }, {}],
      [`${latch.base}/token`, { action: 'revoke', token: refresh_token }, { Authorization: basic(ELSEWHERE) }],
    ] as const) {
      const response = await post(url, fields, headers)
      assert.equal(response.status, 200, url)
      assert.equal(await response.text(), '')
    }
    assert.equal((await introspect(latch.base, access_token)).active, true)
    // its own client_id, written without the trailing slash, revokes the grant
    const revoked = await post(`${latch.base}/revoke`, { token: refresh_token, client_id: 'http://127.0.0.1:8080' })
    assert.equal(revoked.status, 200)
    assert.deepEqual(await introspect(latch.base, access_token), { active: false })
  })
})

// --- 3. Resource indicators -------------------------------------------------------------

describe('Resource indicators (RFC 8707)', () => {
  let latch: TestServer
  before(async () => (latch = await startLatch()))
  after(() => latch.close())

  it('redirects with invalid_target for a resource that is not an absolute URI or has a fragment', async () => {
    // a backslash, which RFC 3986 has not, ends an http(s) URL's host for URL() (`a.example\\@b.example`
    // is a.example), while a person reads b.example; and http:///host or http:host, read as http://host/
    const unlike = ['https://api.example\\@evil.example/mcp', 'https://api.example\\docs', 'http:///api.example/x']
    for (const resource of ['/mcp', 'api.example/mcp', 'not a uri', `${API}#part`, ...unlike, 'https:api.example/']) {
      const response = await fetch(authUrl(latch.base, { scope: 'create', resource }), { redirect: 'manual' })
      assertErrorRedirect(response, latch.issuer, 'invalid_target')
    }
  })

  it('takes up to 10 resources, and redirects with invalid_target for 11', async () => {
    const resources = Array.from({ length: 11 }, (_, i) => `https://api${i}.example/`)
    const ten = await fetch(authUrl(latch.base, { resource: resources.slice(0, 10) }), { redirect: 'manual' })
    assert.equal(ten.status, 200, pageError(await ten.text()))
    const eleven = await fetch(authUrl(latch.base, { resource: resources }), { redirect: 'manual' })
    assertErrorRedirect(eleven, latch.issuer, 'invalid_target')
  })

  it('takes several resource parameters and lists each one on the consent page', async () => {
    const { html } = await openConsent(latch.base, { scope: 'create', resource: [API, FILES] })
    assert.ok(html.includes(`<code><bdi>${API}</bdi></code>`), html)
    assert.ok(html.includes(`<code><bdi>${FILES}</bdi></code>`), html)
  })

  it('issues a token for a resource without scope: an empty scope, and aud the resource; all scopes unticked gives an empty scope too', async () => {
    const code = await obtainCode(latch.base, { resource: API })
    const tokens = await tokensOf(await exchange(latch.base, code))
    assert.equal(tokens.token_type, 'Bearer')
    assert.equal(tokens.scope, '')
    const introspection = await introspect(latch.base, tokens.access_token, API)
    assert.equal(introspection.active, true)
    assert.equal(introspection.aud, API) // one resource: a string
    assert.equal(introspection.scope, '')
    assert.equal(introspection.client_id, CLIENT_ID)

    const two = await obtainCode(latch.base, { resource: [API, FILES] })
    const both = await tokensOf(await exchange(latch.base, two))
    assert.deepEqual((await introspect(latch.base, both.access_token, API)).aud, [API, FILES])

    // Asked for a scope the owner did not grant: the answer says so (RFC 6749 §5.1), not nothing.
    const unticked = await approve(latch.base, await openConsent(latch.base, { scope: 'create', resource: API }), [])
    const narrowed = await tokensOf(await exchange(latch.base, unticked.searchParams.get('code') ?? ''))
    assert.equal(narrowed.scope, '')

    // Neither scope nor resource: the code only proves identity, as IndieAuth says (not new).
    const identity = await obtainCode(latch.base)
    await assertError(await exchange(latch.base, identity), 400, 'invalid_grant')
  })

  it('answers a token for services active only to a resource server that names one of them (RFC 7662 §4)', async () => {
    const code = await obtainCode(latch.base, { scope: 'create', resource: [API, FILES] })
    const { access_token: token } = await tokensOf(await exchange(latch.base, code))
    // a Micropub server asks without naming itself, as IndieAuth's do: a token for other services is not for it
    assert.deepEqual(await introspect(latch.base, token), { active: false })
    assert.deepEqual(await introspect(latch.base, token, ELSEWHERE), { active: false })
    for (const resource of [API, 'HTTPS://files.example:443']) {
      const named = await introspect(latch.base, token, resource)
      assert.equal(named.active, true, resource)
      assert.deepEqual(named.aud, [API, FILES])
    }
    // and an IndieAuth token, which names no service, is not one for a server that names itself
    const plain = await tokensOf(await exchange(latch.base, await obtainCode(latch.base, { scope: 'create' })))
    assert.equal((await introspect(latch.base, plain.access_token)).active, true)
    assert.deepEqual(await introspect(latch.base, plain.access_token, API), { active: false })
    // named twice, it is refused as any parameter is
    const twice = await fetch(`${latch.base}/introspect`, {
      method: 'POST',
      body: new URLSearchParams([
        ['token', token],
        ['resource', API],
        ['resource', FILES],
      ]),
    })
    assert.equal(twice.status, 400)
  })

  it('lists a grant for resources on /apps with its services, and no empty scopes', async () => {
    const service = 'https://listed.example/mcp'
    await tokensOf(await exchange(latch.base, await obtainCode(latch.base, { resource: [service, FILES] })))
    const apps = await (await fetch(`${latch.base}/apps`)).text()
    assert.ok(
      apps.includes(`<dt>Services</dt><dd><code><bdi>${service}</bdi></code> <code><bdi>${FILES}</bdi></code></dd>`),
      apps,
    )
    assert.doesNotMatch(apps, /<dt>Scopes<\/dt><dd><\/dd>/)
  })

  it('refuses a resource at /token that was not authorized, and narrows aud to a subset', async () => {
    const code = await obtainCode(latch.base, { resource: [API, FILES] })
    await assertError(await exchange(latch.base, code, { resource: ELSEWHERE }), 400, 'invalid_target')
    await assertError(await exchange(latch.base, code, { resource: [API, ELSEWHERE] }), 400, 'invalid_target')
    const tokens = await tokensOf(await exchange(latch.base, code, { resource: FILES }))
    assert.equal((await introspect(latch.base, tokens.access_token, FILES)).aud, FILES)
  })

  it('narrows aud on refresh, refuses a resource not granted, and keeps the whole grant without one', async () => {
    const code = await obtainCode(latch.base, { scope: 'create', resource: [API, FILES] })
    const first = await tokensOf(await exchange(latch.base, code, { resource: API }))
    assert.equal((await introspect(latch.base, first.access_token, API)).aud, API)

    // The refresh token keeps the grant's audience, not the narrowed one of its access token.
    const second = await tokensOf(await refresh(latch.base, first.refresh_token))
    assert.deepEqual((await introspect(latch.base, second.access_token, API)).aud, [API, FILES])

    const third = await tokensOf(await refresh(latch.base, second.refresh_token, { resource: FILES }))
    const narrowed = await introspect(latch.base, third.access_token, FILES)
    assert.equal(narrowed.aud, FILES)
    assert.equal(narrowed.scope, 'create')

    await assertError(await refresh(latch.base, third.refresh_token, { resource: ELSEWHERE }), 400, 'invalid_target')
    const fourth = await tokensOf(await refresh(latch.base, third.refresh_token)) // not spent by the refusal
    assert.deepEqual((await introspect(latch.base, fourth.access_token, API)).aud, [API, FILES])
  })

  it("refuses a token for other services at Latch's own /userinfo and GET /token, unless it names /userinfo", async () => {
    const userinfo = `${latch.issuer}/userinfo`
    const code = await obtainCode(latch.base, { scope: 'profile create', resource: [API, userinfo] })
    const forApi = await tokensOf(await exchange(latch.base, code, { resource: API }))
    const wrongAudience = (response: Response) =>
      assert.equal(response.headers.get('www-authenticate'), `Bearer realm="${latch.issuer}", error="invalid_token"`)
    const bearer = (token: string) => ({ headers: { Authorization: `Bearer ${token}` } })
    for (const path of ['/userinfo', '/token']) {
      const response = await fetch(`${latch.base}${path}`, bearer(forApi.access_token))
      const body = await assertError(response, 401, 'invalid_token')
      assert.match(String(body.error_description), /another service/)
      wrongAudience(response)
    }
    const forUserinfo = await tokensOf(await refresh(latch.base, forApi.refresh_token, { resource: userinfo }))
    const profile = await fetch(`${latch.base}/userinfo`, bearer(forUserinfo.access_token))
    assert.equal(profile.status, 200)
    // the same URL, written otherwise: the scheme in capitals
    const spelled = userinfo.replace('http://127.0.0.1', 'HTTP://127.0.0.1')
    const other = await obtainCode(latch.base, { scope: 'profile', resource: spelled })
    const forSpelled = await tokensOf(await exchange(latch.base, other))
    assert.equal((await fetch(`${latch.base}/userinfo`, bearer(forSpelled.access_token))).status, 200)
    await assertError(await fetch(`${latch.base}/token`, bearer(forUserinfo.access_token)), 401, 'invalid_token')
    // an IndieAuth token, without an audience, is taken at both as before
    const indieAuth = await tokensOf(await exchange(latch.base, await obtainCode(latch.base, { scope: 'profile' })))
    for (const path of ['/userinfo', '/token'])
      assert.equal((await fetch(`${latch.base}${path}`, bearer(indieAuth.access_token))).status, 200, path)
  })
})

// --- 4. checkAccessToken ------------------------------------------------------------------

describe('checkAccessToken, for a resource server sharing the store', () => {
  const store = new MemoryStore()
  let latch: TestServer
  let elapsed = 0
  const now = () => START + elapsed
  before(async () => (latch = await startLatch({}, { store })))
  after(() => latch.close())

  it('describes a live token, and refuses one for another resource or without a scope', async () => {
    const code = await obtainCode(latch.base, { scope: 'create update', resource: API })
    const tokens = await tokensOf(await exchange(latch.base, code))
    assert.deepEqual(await checkAccessToken(store, tokens.access_token, { resource: API, scope: ['create'] }, now), {
      active: true,
      me: `${latch.issuer}/`,
      client_id: CLIENT_ID,
      scope: ['create', 'update'],
      aud: [API],
      expiresAt: now() + tokens.expires_in * 1000,
    })
    // a resource server that names none is not the one it was issued for, as at GET /token
    const unnamed = await checkAccessToken(store, tokens.access_token, { scope: ['create'] }, now)
    assert.equal(unnamed.active, false)
    assert.equal(!unnamed.active && unnamed.error, 'invalid_token')

    const unknown = await checkAccessToken(store, 'not-a-token', {}, now)
    assert.equal(unknown.active, false)
    assert.equal(!unknown.active && unknown.error, 'invalid_token')

    const elsewhere = await checkAccessToken(store, tokens.access_token, { resource: FILES }, now)
    assert.equal(elsewhere.active, false)
    assert.equal(!elsewhere.active && elsewhere.error, 'invalid_token')

    const lacking = await checkAccessToken(store, tokens.access_token, { resource: API, scope: ['delete'] }, now)
    assert.equal(lacking.active, false)
    assert.equal(!lacking.active && lacking.error, 'insufficient_scope')
  })

  it('compares resources as URLs, as /userinfo does: an MCP client sends the origin with its slash', async () => {
    const code = await obtainCode(latch.base, { scope: 'create', resource: 'https://mcp.example/' })
    const tokens = await tokensOf(await exchange(latch.base, code))
    for (const resource of ['https://mcp.example', 'HTTPS://MCP.example:443/']) {
      const check = await checkAccessToken(store, tokens.access_token, { resource }, now)
      assert.equal(check.active, true, resource)
    }
    for (const resource of ['https://mcp.example/x', 'https://user@mcp.example/', 'https://mcp.example/./']) {
      const check = await checkAccessToken(store, tokens.access_token, { resource }, now)
      assert.equal(check.active, false, resource)
    }
    // and so at the token endpoint, where the audience stays as the owner approved it
    const narrowed = await tokensOf(
      await refresh(latch.base, tokens.refresh_token, { resource: 'https://mcp.example' }),
    )
    assert.equal(
      (await introspect(latch.base, narrowed.access_token, 'https://mcp.example/')).aud,
      'https://mcp.example/',
    )
    // a path is compared as written, as the consent page showed it, not resolved as URLs do
    const dotted = await obtainCode(latch.base, { scope: 'create', resource: 'https://mcp.example/docs/%2e%2e/admin' })
    const forDocs = await tokensOf(await exchange(latch.base, dotted))
    const admin = await checkAccessToken(store, forDocs.access_token, { resource: 'https://mcp.example/admin' }, now)
    assert.equal(admin.active, false)
  })

  it('refuses an IndieAuth token, which has no audience, when a resource is required', async () => {
    const code = await obtainCode(latch.base, { scope: 'create' })
    const tokens = await tokensOf(await exchange(latch.base, code))
    const plain = await checkAccessToken(store, tokens.access_token, { scope: ['create'] }, now)
    assert.equal(plain.active, true)
    assert.deepEqual(plain.active && plain.aud, [])
    const forApi = await checkAccessToken(store, tokens.access_token, { resource: API }, now)
    assert.equal(forApi.active, false)
    assert.equal(!forApi.active && forApi.error, 'invalid_token')
  })

  it('answers for a store that cannot keep the last use: that is no reason to refuse the token', async () => {
    const failing = new MemoryStore()
    const own = await startLatch({}, { store: failing })
    try {
      const tokens = await tokensOf(await exchange(own.base, await obtainCode(own.base, { scope: 'create' })))
      Object.defineProperty(failing, 'touchGrant', {
        value: async () => {
          throw new NotStored(new Error('ENOSPC: no space left on device'))
        },
        configurable: true,
      })
      assert.equal((await checkAccessToken(failing, tokens.access_token, { scope: ['create'] }, now)).active, true)
      const introspected = await post(`${own.base}/introspect`, { token: tokens.access_token })
      assert.equal(introspected.status, 200)
      assert.equal(((await introspected.json()) as { active: boolean }).active, true)
      const verified = await fetch(`${own.base}/token`, { headers: { Authorization: `Bearer ${tokens.access_token}` } })
      assert.equal(verified.status, 200)
      // a store's own fault is not hidden: it goes on up, a 500 in Latch's log
      Object.defineProperty(failing, 'touchGrant', {
        value: async () => {
          throw new TypeError('a bug in the store')
        },
      })
      await assert.rejects(checkAccessToken(failing, tokens.access_token, { scope: ['create'] }, now), TypeError)
      assert.equal((await post(`${own.base}/introspect`, { token: tokens.access_token })).status, 500)
    } finally {
      await own.close()
    }
  })

  it('refuses an expired token with invalid_token', async () => {
    const code = await obtainCode(latch.base, { scope: 'create', resource: API })
    const tokens = await tokensOf(await exchange(latch.base, code))
    latch.advance(tokens.expires_in + 1)
    elapsed += (tokens.expires_in + 1) * 1000
    const expired = await checkAccessToken(store, tokens.access_token, { resource: API }, now)
    assert.equal(expired.active, false)
    assert.equal(!expired.active && expired.error, 'invalid_token')
  })
})

// --- 5 and 6. Client sites: loopback redirects, Client ID Metadata Documents, caching --------

/** What the sites serve, by `host/path`; a test may change it. */
const documents = new Map<string, { body: string; headers?: Record<string, string> }>()
const siteRequests: string[] = [] // `host/path` of every request the sites received

function serveDocument(url: string, document: unknown, headers: Record<string, string> = {}): void {
  const { host, pathname } = new URL(url)
  documents.set(`${host}${pathname}`, { body: JSON.stringify(document), headers })
}

function site(req: IncomingMessage, res: ServerResponse): void {
  const key = `${(req.headers.host ?? '').split(':')[0]}${req.url}`
  siteRequests.push(key)
  const document = documents.get(key)
  if (document === undefined) {
    res.writeHead(404)
    return void res.end()
  }
  res.writeHead(200, { 'Content-Type': 'application/json', ...document.headers })
  res.end(document.body)
}

function fetchesOf(url: string): number {
  const { host, pathname } = new URL(url)
  return siteRequests.filter((key) => key === `${host}${pathname}`).length
}

/** Carries every TLS connection to the local https site; the certificate is still checked against `ca`. */
class TlsSiteAgent extends HttpsAgent {
  sitePort = 0

  createConnection(options: HttpsRequestOptions): TLSSocket {
    return tlsConnect({ host: '127.0.0.1', port: this.sitePort, servername: options.servername, ca: this.options.ca })
  }
}

/** Carries every plain connection to the local http site. */
class PlainSiteAgent extends HttpAgent {
  sitePort = 0
  readonly opened = new Set<Socket>()

  createConnection(): Socket {
    const socket = connect(this.sitePort, '127.0.0.1')
    this.opened.add(socket)
    return socket
  }
}

type FetchingLatch = { base: string; advance: (seconds: number) => void; close: () => Promise<void> }

/** Latch with an injected resolver and agent, on a clock the test moves. */
async function startFetchingLatch(agent: HttpAgent): Promise<FetchingLatch> {
  const server = createServer()
  const port = await listen(server)
  const config = loadConfig({ PORT: '0', DATA_FILE: 'memory' }, [], { boundPort: port })
  let time = START
  const clientFetch: ClientFetchOptions = {
    lookup: async () => [{ address: PUBLIC_ADDRESS, family: 4 }],
    agent,
    timeoutMs: 2_000,
  }
  server.on('request', createHandler({ config, now: () => time, log: () => {}, clientFetch }))
  return {
    base: config.issuer,
    advance: (seconds) => {
      time += seconds * 1000
    },
    close: () => closeServer(server),
  }
}

function authorizeClient(latch: FetchingLatch, clientId: string, redirectUri: string): Promise<Response> {
  return fetch(authUrl(latch.base, { client_id: clientId, redirect_uri: redirectUri, scope: 'create' }), {
    redirect: 'manual',
  })
}

/** Asserts a 400 page, with no redirect, whose message matches each of `says`. */
async function assertRefusedPage(response: Response, ...says: RegExp[]): Promise<void> {
  const html = await response.text()
  assert.equal(response.status, 400, pageError(html))
  assert.equal(response.headers.get('location'), null)
  for (const pattern of says) assert.match(pageError(html), pattern)
}

describe('Loopback redirects and Client ID Metadata Documents', () => {
  let certificate: { dir: string; key: Buffer; cert: Buffer }
  let tlsSite: Server
  let plainSite: Server
  let tlsAgent: TlsSiteAgent
  let plainAgent: PlainSiteAgent
  let latch: FetchingLatch // fetches https sites
  let plainLatch: FetchingLatch // fetches http sites

  before(async () => {
    certificate = await makeCertificate('app.example')
    tlsSite = createHttpsServer({ key: certificate.key, cert: certificate.cert }, site)
    plainSite = createServer(site)
    tlsAgent = new TlsSiteAgent({ ca: certificate.cert })
    tlsAgent.sitePort = await listen(tlsSite)
    plainAgent = new PlainSiteAgent()
    plainAgent.sitePort = await listen(plainSite)
    latch = await startFetchingLatch(tlsAgent)
    plainLatch = await startFetchingLatch(plainAgent)
  })

  after(async () => {
    await latch?.close()
    await plainLatch?.close()
    tlsAgent?.destroy()
    for (const socket of plainAgent?.opened ?? []) socket.destroy()
    plainAgent?.destroy()
    if (tlsSite !== undefined) await closeServer(tlsSite)
    if (plainSite !== undefined) await closeServer(plainSite)
    if (certificate !== undefined) await rm(certificate.dir, { recursive: true, force: true })
  })

  /** Serves a valid document for `clientId`, with `extra` fields merged in. */
  function serveClient(clientId: string, extra: Record<string, unknown> = {}, headers: Record<string, string> = {}) {
    serveDocument(
      clientId,
      { client_id: clientId, client_name: 'Test app', redirect_uris: ['https://app.example/callback'], ...extra },
      headers,
    )
  }

  it('refuses a published http redirect off this machine: an answer there would cross the network in clear', async () => {
    const clientId = 'https://app.example/plain-redirect.json'
    const redirectUris = ['http://app.example/callback', 'com.example.app:/callback', 'http://127.0.0.1/callback']
    serveClient(clientId, { redirect_uris: redirectUris })
    await assertRefusedPage(
      await authorizeClient(latch, clientId, 'http://app.example/callback'),
      /redirect_uri uses http on a host other than this machine/,
    )
    // a native app's own scheme, and its loopback listener, are its to use
    for (const redirectUri of ['com.example.app:/callback', 'http://127.0.0.1:49152/callback']) {
      const accepted = await authorizeClient(latch, clientId, redirectUri)
      assert.equal(accepted.status, 200, `${redirectUri}: ${pageError(await accepted.text())}`)
    }
  })

  it('matches a published loopback redirect on any port, and nothing else about it', async () => {
    const clientId = 'https://app.example/loopback.json'
    serveClient(clientId, { redirect_uris: ['http://127.0.0.1/callback', 'http://localhost/cb', 'http://[::1]/cb'] })
    for (const [published, path] of [
      ['127.0.0.1', '/callback'],
      ['localhost', '/cb'],
      ['[::1]', '/cb'],
    ]) {
      const accepted = await authorizeClient(latch, clientId, `http://${published}:53124${path}`)
      assert.equal(accepted.status, 200, `${published}: ${pageError(await accepted.text())}`)
      for (const refused of [
        `http://${published}:53124/other`,
        `https://${published}:53124${path}`,
        `http://${published}:53124${path}?x=1`,
      ]) {
        await assertRefusedPage(await authorizeClient(latch, clientId, refused), /redirect_uri/)
      }
    }
    // Approved, the browser goes back to the port the app asked for.
    const consent = await openConsent(latch.base, {
      client_id: clientId,
      redirect_uri: 'http://127.0.0.1:53124/callback',
      scope: 'create',
    })
    const location = await approve(latch.base, consent, ['create'])
    assert.equal(`${location.origin}${location.pathname}`, 'http://127.0.0.1:53124/callback')
    assert.ok(location.searchParams.get('code'))
  })

  it('reads a document that begins with a byte order mark, as a browser would', async () => {
    // RFC 8259 §8.1: no sender may add one, a parser may ignore it; a Windows editor saves one
    const clientId = 'https://app.example/bom.json'
    serveClient(clientId)
    const served = documents.get('app.example/bom.json')
    if (served !== undefined) served.body = `\ufeff${served.body}`
    const accepted = await authorizeClient(latch, clientId, 'https://app.example/callback')
    assert.equal(accepted.status, 200, pageError(await accepted.text()))
  })

  it('refuses a document whose client_id is not the URL, exactly, and says why', async () => {
    const clientId = 'https://app.example/mismatch.json'
    serveDocument(clientId, { client_id: 'https://APP.example/mismatch.json', redirect_uris: [`${clientId}/cb`] })
    await assertRefusedPage(
      await authorizeClient(latch, clientId, 'https://app.example/callback'),
      /Client ID Metadata Document cannot be used/,
      /client_id/,
    )
  })

  it("takes a document's client_id spelt as the request's, or canonically; no other spelling", async () => {
    const withPort = 'https://app.example:443/port.json'
    serveDocument(withPort, { client_id: withPort, redirect_uris: ['https://app.example/callback'] })
    const asSent = await authorizeClient(latch, withPort, 'https://app.example/callback')
    assert.equal(asSent.status, 200, pageError(await asSent.text()))
    // canonically (IndieAuth §3.4): a path-less client_id, or another case of its host
    serveClient('https://app.example/')
    for (const spelling of ['https://app.example', 'https://APP.example/']) {
      const canonical = await authorizeClient(latch, spelling, 'https://app.example/callback')
      assert.equal(canonical.status, 200, `${spelling}: ${pageError(await canonical.text())}`)
    }
    // the document spells it otherwise: neither as sent nor canonical
    const spelt = 'https://app.example/spelt.json'
    serveDocument(spelt, {
      client_id: 'https://app.example:443/spelt.json',
      redirect_uris: ['https://app.example/callback'],
    })
    await assertRefusedPage(
      await authorizeClient(latch, spelt, 'https://app.example/callback'),
      /Client ID Metadata Document cannot be used/,
      /must be https:\/\/app\.example\/spelt\.json/,
    )
  })

  it('refuses a document without redirect_uris, even for a redirect on its own host', async () => {
    const clientId = 'https://app.example/no-redirects.json'
    serveDocument(clientId, { client_id: clientId, client_name: 'No redirects' })
    await assertRefusedPage(
      await authorizeClient(latch, clientId, 'https://app.example/callback'),
      /Client ID Metadata Document cannot be used/,
      /redirect_uris/,
    )
  })

  it('refuses a document with a client secret or a confidential auth method, and takes "none"', async () => {
    const cases: [string, Record<string, unknown>, RegExp][] = [
      ['secret', { client_secret: 'hunter2' }, /client_secret/],
      ['basic', { token_endpoint_auth_method: 'client_secret_basic' }, /client_secret_basic/],
      ['jwt', { token_endpoint_auth_method: 'private_key_jwt' }, /private_key_jwt/],
      ['prose', { token_endpoint_auth_method: 'x. NOTICE: reset your password at evil' }, /method is not none: /],
    ]
    for (const [name, extra, why] of cases) {
      const clientId = `https://app.example/${name}.json`
      serveClient(clientId, extra)
      await assertRefusedPage(
        await authorizeClient(latch, clientId, 'https://app.example/callback'),
        /Client ID Metadata Document cannot be used/,
        why,
      )
    }
    const clientId = 'https://app.example/none.json'
    serveClient(clientId, { token_endpoint_auth_method: 'none' })
    const accepted = await authorizeClient(latch, clientId, 'https://app.example/callback')
    assert.equal(accepted.status, 200, pageError(await accepted.text()))
  })

  it('refuses a document served as another type than JSON, and says so', async () => {
    for (const [type, bom] of [
      ['text/plain; charset=utf-8', ''],
      ['application/octet-stream', ''],
      ['text/plain', '\ufeff'], // as a Windows editor saves it
    ]) {
      const clientId = `https://app.example/typed-${type.split('/')[0]}${bom === '' ? '' : '-bom'}.json`
      serveClient(clientId, {}, { 'Content-Type': type })
      const served = documents.get(new URL(clientId).host + new URL(clientId).pathname)
      if (served !== undefined) served.body = `${bom}${served.body}`
      await assertRefusedPage(
        await authorizeClient(latch, clientId, 'https://app.example/callback'),
        /Client ID Metadata Document cannot be used/,
        new RegExp(`served as ${type.split(';')[0]}: it must be application/json`),
      )
    }
  })

  it('refuses a document larger than 5 KiB', async () => {
    const clientId = 'https://app.example/big.json'
    serveClient(clientId, { description: 'x'.repeat(5 * 1024) })
    await assertRefusedPage(
      await authorizeClient(latch, clientId, 'https://app.example/callback'),
      /Client ID Metadata Document cannot be used/,
      /larger than 5 KiB/,
    )
  })

  it('refuses an unlisted redirect on its own host for a document, and takes it for an http IndieAuth client', async () => {
    const clientId = 'https://app.example/listed.json'
    serveClient(clientId)
    const listed = await authorizeClient(latch, clientId, 'https://app.example/callback')
    assert.equal(listed.status, 200, pageError(await listed.text()))
    await assertRefusedPage(await authorizeClient(latch, clientId, 'https://app.example/unlisted'), /redirect_uri/)

    // IndieAuth's same-host rule still holds for JSON metadata at an http URL (not new).
    const plainId = 'http://plain.example/'
    serveDocument(plainId, { client_id: plainId, redirect_uris: ['https://other.example/callback'] })
    const sameHost = await authorizeClient(plainLatch, plainId, 'http://plain.example/unlisted')
    assert.equal(sameHost.status, 200, pageError(await sameHost.text()))
  })

  it('does not remember an invalid document: fixed, the very next request succeeds', async () => {
    const clientId = 'https://app.example/fixable.json'
    // A redirect on another host, so that only the document can allow it.
    const redirectUris = ['https://other.example/callback']
    serveClient(clientId, { client_id: 'https://app.example/other.json', redirect_uris: redirectUris })
    await assertRefusedPage(await authorizeClient(latch, clientId, redirectUris[0]))
    serveClient(clientId, { redirect_uris: redirectUris })
    const fixed = await authorizeClient(latch, clientId, redirectUris[0])
    assert.equal(fixed.status, 200, pageError(await fixed.text()))
    assert.equal(fetchesOf(clientId), 2)
  })

  it('keeps a document as long as Cache-Control max-age, or Expires less Date, says', async () => {
    const maxAge = 'https://app.example/cached.json'
    serveClient(maxAge, {}, { 'Cache-Control': 'max-age=60' })
    const date = new Date(Math.floor(Date.now() / 1000) * 1000)
    const expires = 'https://app.example/expires.json'
    serveClient(expires, {}, { Date: date.toUTCString(), Expires: new Date(date.getTime() + 60_000).toUTCString() })
    for (const clientId of [maxAge, expires]) {
      for (let i = 0; i < 2; i++) {
        const response = await authorizeClient(latch, clientId, 'https://app.example/callback')
        assert.equal(response.status, 200, pageError(await response.text()))
      }
      assert.equal(fetchesOf(clientId), 1, clientId)
    }
    latch.advance(61)
    for (const clientId of [maxAge, expires]) {
      const response = await authorizeClient(latch, clientId, 'https://app.example/callback')
      assert.equal(response.status, 200, pageError(await response.text()))
      assert.equal(fetchesOf(clientId), 2, clientId)
    }
  })
})

describe('cacheLifetime (RFC 9111 §4.2)', () => {
  const now = START

  it('takes max-age, less Age, capped at a day', () => {
    assert.equal(cacheLifetime({ 'cache-control': 'max-age=600' }, now), 600)
    assert.equal(cacheLifetime({ 'cache-control': 'max-age=600', age: '100' }, now), 500)
    assert.equal(cacheLifetime({ 'cache-control': 'public, max-age=999999' }, now), 86400)
  })

  it('keeps nothing for no-store or no-cache', () => {
    assert.equal(cacheLifetime({ 'cache-control': 'no-store' }, now), 0)
    assert.equal(cacheLifetime({ 'cache-control': 'no-cache' }, now), 0)
    assert.equal(cacheLifetime({ 'cache-control': 'no-cache, max-age=600' }, now), 0)
  })

  it('takes Expires less Date without Cache-Control; an invalid Expires keeps nothing', () => {
    const date = 'Fri, 01 Jan 2027 00:00:00 GMT'
    assert.equal(cacheLifetime({ date, expires: 'Fri, 01 Jan 2027 01:00:00 GMT' }, now), 3600)
    assert.equal(cacheLifetime({ date, expires: '0' }, now), 0)
    // what Date.parse reads as a year is no HTTP date (RFC 9110 §5.6.7)
    for (const expires of ['2030', '99999', '2030-01-01'])
      assert.equal(cacheLifetime({ date, expires }, now), 0, expires)
    // the two obsolete forms a recipient must still read
    for (const expires of ['Friday, 01-Jan-27 01:00:00 GMT', 'Fri Jan  1 01:00:00 2027'])
      assert.equal(cacheLifetime({ date, expires }, now), 3600, expires)
  })

  it('keeps a minute when neither says (a heuristic lifetime, §4.2.2)', () => {
    assert.equal(cacheLifetime({}, now), 60)
    assert.equal(cacheLifetime({ 'cache-control': 'public' }, now), 60)
    assert.equal(cacheLifetime({ 'cache-control': 'max-age=0' }, now), 0)
    // a minute from now whatever its Age, as a CDN's page would else be fetched at every request
    assert.equal(cacheLifetime({ 'cache-control': 'public, s-maxage=3600', age: '120' }, now), 60)
  })

  it('keeps nothing for a max-age that is no number of seconds, which makes it stale (§4.2.1)', () => {
    for (const cacheControl of ['max-age=-1', 'max-age=abc', 'max-age=', 'private, max-age=-30', 'max-age=5abc'])
      assert.equal(cacheLifetime({ 'cache-control': cacheControl }, now), 0, cacheControl)
  })

  it('reads directives split at commas outside quoted values, by their whole names', () => {
    for (const cacheControl of [
      'ext="a, no-store", max-age=600',
      'max-age-ext=1, max-age=600',
      'x="max-age=5", max-age=600',
    ])
      assert.equal(cacheLifetime({ 'cache-control': cacheControl }, now), 600, cacheControl)
  })
})

// --- 7. Conformance -------------------------------------------------------------------------

describe('Conformance', () => {
  let latch: TestServer
  before(async () => (latch = await startLatch()))
  after(() => latch.close())

  it('refuses a redirect_uri that already carries code, state, iss or error, with a page', async () => {
    for (const name of ['code', 'state', 'iss', 'error']) {
      const response = await fetch(
        authUrl(latch.base, { scope: 'create', redirect_uri: `${REDIRECT_URI}?${name}=x` }),
        {
          redirect: 'manual',
        },
      )
      assert.equal(response.headers.get('content-type')?.split(';')[0], 'text/html', name)
      await assertRefusedPage(response, new RegExp(name))
    }
  })

  it('answers HEAD /auth for a valid request with 200 and no body', async () => {
    const head = await fetch(authUrl(latch.base, { scope: 'create' }), { method: 'HEAD', redirect: 'manual' })
    assert.equal(head.status, 200)
    assert.equal(await head.text(), '')
    await openConsent(latch.base, { scope: 'create' }) // a GET still works
  })

  it('answers HEAD /userinfo and HEAD /token without credentials with a bare Bearer challenge', async () => {
    for (const path of ['/userinfo', '/token']) {
      const response = await fetch(`${latch.base}${path}`, { method: 'HEAD' })
      assert.equal(response.status, 401, path)
      assert.equal(response.headers.get('www-authenticate'), `Bearer realm="${latch.issuer}"`, path)
      assert.equal(await response.text(), '')
    }
    // GET says the same, with no error code in the body either (RFC 6750 §3.1).
    const get = await fetch(`${latch.base}/userinfo`)
    assert.equal(get.status, 401)
    assert.doesNotMatch(get.headers.get('www-authenticate') ?? '', /error=/)
    assert.equal(((await get.json()) as Record<string, unknown>).error, undefined)
  })

  it('answers HEAD /apps with 200', async () => {
    const response = await fetch(`${latch.base}/apps`, { method: 'HEAD' })
    assert.equal(response.status, 200)
    assert.equal(await response.text(), '')
  })
})

describe('Token lifetimes', () => {
  let latch: TestServer
  before(async () => (latch = await startLatch()))
  after(() => latch.close())

  it('never lets an access token die before expires_in, issued half a second past a whole second', async () => {
    latch.advance(0.5)
    const code = await obtainCode(latch.base, { scope: 'create' })
    const issuedAt = START + 500
    const tokens = await tokensOf(await exchange(latch.base, code))
    latch.advance(tokens.expires_in - 0.001)
    const live = await introspect(latch.base, tokens.access_token)
    assert.equal(live.active, true)
    assert.ok((live.exp as number) * 1000 >= issuedAt + tokens.expires_in * 1000, `exp ${live.exp}`)
    latch.advance(1)
    assert.deepEqual(await introspect(latch.base, tokens.access_token), { active: false })
  })
})
